"""The sampler: everything that happens to a step's logits, as one component the runner calls.

Stages, in order: count the step's input tokens (penalties' counts, kept on the device); the raw
logprobs (before any processing: vLLM's default "raw_logprobs"); logit_bias and min_tokens;
penalties; a reasoning row's grammar mask for the answer's first token; sampling; a reasoning
row's forced end and its phase (`reasoning.py`); then the logprobs of the sampled tokens and of
prompt positions. Each stage runs only when its inputs are present, so a plain step is just the
sampling. A grammar's bitmask is one more stage between processing and sampling, for its rows
only: `begin` runs everything up to it (the free rows, reasoning rows among them, are sampled
there), `finish` applies the bitmask the host built meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from tandem.sampler.grammar import apply_token_bitmask
from tandem.sampler.inputs import LogprobRows, SamplerInputs, SamplingRows
from tandem.sampler.logprobs import TokenLogprobsTensors, score_tokens
from tandem.sampler.penalties import TokenCounts, apply_bias_and_mask
from tandem.sampler.reasoning import ThinkingState
from tandem.sampler.sampling import sample
from tandem.sampler.verify import count_accepted

PROMPT_LOGPROBS_CHUNK = 256  # prompt positions per log_softmax: bounds its [rows, vocab] memory


class Sampler:
    """Owns the device state sampling needs beyond a step: per table row token counts, and
    reasoning rows' phases and budgets."""

    def __init__(self, table_rows: int, vocab_size: int, device: torch.device):
        self.token_counts = TokenCounts(table_rows, vocab_size, device)
        self.thinking = ThinkingState(table_rows, vocab_size, device)
        self.device = device

    def sample(self, logits: torch.Tensor, rows: SamplingRows[torch.Tensor]) -> torch.Tensor:
        """The plain stage alone (what a captured decode graph replays)."""
        return sample(logits, rows)

    def begin(
        self,
        hidden: torch.Tensor,
        logits_index: torch.Tensor,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        x: SamplerInputs[torch.Tensor],
        token_table: torch.Tensor,
        input_ids: torch.Tensor,
    ) -> PendingSample:
        """Every stage up to the grammar's: logits of the rows `logits_index` picks from
        `hidden`, raw logprobs, processing, and the ids of rows no grammar constrains (all rows
        in a step without grammar rows). `finish` completes it."""
        p, lp, g, r = x.processing, x.logprobs, x.grammar, x.reasoning
        if p is not None and p.flags.count_tokens:  # this step's inputs count for its own sample
            self.token_counts.record(token_table, p)
        if r is not None:
            self.thinking.reset(r)
        reasoning = r is not None and len(r.rows) > 0
        pending = PendingSample(x, torch.empty(0, dtype=torch.int64, device=self.device))
        if len(logits_index):
            logits = compute_logits(hidden[logits_index])
            if lp is not None and len(lp.rows):
                pending.raw = logits[lp.rows].log_softmax(dim=-1)
            if p is not None:
                apply_bias_and_mask(logits, p)
                if p.flags.use_penalties:
                    self.token_counts.apply_penalties(logits, p, input_ids)
            if reasoning:
                self.thinking.constrain(logits, r)
            if g is None:
                pending.ids = sample(logits, x.sampling)
            else:
                pending.ids = torch.empty(len(logits), dtype=torch.int64, device=self.device)
                if len(g.free_rows):
                    pending.ids[g.free_rows] = sample(logits[g.free_rows], g.free_sampling)
                pending.constrained = logits[g.rows]
        if lp is not None and len(lp.prompt_index):
            pending.prompt = _prompt_logprobs(hidden, compute_logits, lp)
        return pending

    def keep_verified(
        self, ids: torch.Tensor, input_ids: torch.Tensor, x: SamplerInputs[torch.Tensor]
    ) -> torch.Tensor:
        """The tokens each verification keeps ([V]: 1 + its accepted drafts); penalized ones
        count their kept inputs now."""
        v, p = x.verify, x.processing
        kept = count_accepted(ids, input_ids, v, v.max_drafts)
        if p is not None and p.accept_rows is not None and len(p.accept_rows):
            self.token_counts.record_accepted(p, input_ids, kept)
        return kept

    def finish(
        self, pending: PendingSample, bitmask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[TokenLogprobsTensors]]:
        """Sample the grammar rows under `bitmask` ([G, words] int32, a bit per token id), then
        the logprobs of the sampled tokens: the step's ids and the logprobs groups it asked for
        (see `LogprobRows.output_groups`)."""
        ids, x = pending.ids, pending.x
        if pending.constrained is not None:
            logits = pending.constrained
            apply_token_bitmask(logits, bitmask.to(logits.device, non_blocking=True))
            ids[x.grammar.rows] = sample(logits, x.grammar.sampling)
        r = x.reasoning
        if r is not None and len(r.rows) and len(ids):  # every row's id is known now
            self.thinking.advance(ids, r)
        groups = []
        if pending.raw is not None:
            groups.append(score_tokens(pending.raw, ids[x.logprobs.rows], x.logprobs.num_top))
        if pending.prompt is not None:
            groups.append(pending.prompt)
        return ids, groups


@dataclass
class PendingSample:
    """A step's sampling between `Sampler.begin` and `finish`: device tensors only."""

    x: SamplerInputs[torch.Tensor]
    ids: torch.Tensor  # [S]; grammar rows are filled by finish
    raw: torch.Tensor | None = None  # raw logprobs of the rows that want them
    constrained: torch.Tensor | None = None  # processed logits of the grammar rows
    prompt: TokenLogprobsTensors | None = None


def _prompt_logprobs(
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    lp: LogprobRows[torch.Tensor],
) -> TokenLogprobsTensors:
    """Each prompt position's logits score the next prompt token, a bounded chunk at a time."""
    index, targets = lp.prompt_index, lp.prompt_targets
    parts = []
    for lo in range(0, len(index), PROMPT_LOGPROBS_CHUNK):
        hi = lo + PROMPT_LOGPROBS_CHUNK
        logprobs = compute_logits(hidden[index[lo:hi]]).log_softmax(dim=-1)
        parts.append(score_tokens(logprobs, targets[lo:hi], lp.num_top_prompt))
    if len(parts) == 1:
        return parts[0]
    return TokenLogprobsTensors(
        *(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(TokenLogprobsTensors))
    )
