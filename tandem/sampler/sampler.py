"""The sampler: everything that happens to a step's logits, as one component the runner calls.

Stages, in order: count the step's input tokens (penalties' counts, kept on the device); the raw
logprobs (before any processing: vLLM's default "raw_logprobs"); logit_bias and min_tokens;
penalties; sampling; then the logprobs of the sampled tokens and of prompt positions. Each stage
runs only when its inputs are present, so a plain step is just the sampling. A grammar's bitmask
or a draft-token verification is one more stage between processing and sampling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields

import torch

from tandem.sampler.inputs import LogprobRows, SamplerInputs, SamplingRows
from tandem.sampler.logprobs import TokenLogprobsTensors, score_tokens
from tandem.sampler.penalties import TokenCounts, apply_bias_and_mask
from tandem.sampler.sampling import sample

PROMPT_LOGPROBS_CHUNK = 256  # prompt positions per log_softmax: bounds its [rows, vocab] memory


class Sampler:
    """Owns the device state sampling needs beyond a step: per table row token counts."""

    def __init__(self, table_rows: int, vocab_size: int, device: torch.device):
        self.token_counts = TokenCounts(table_rows, vocab_size, device)
        self.device = device

    def sample(self, logits: torch.Tensor, rows: SamplingRows[torch.Tensor]) -> torch.Tensor:
        """The plain stage alone (what a captured decode graph replays)."""
        return sample(logits, rows)

    def __call__(
        self,
        hidden: torch.Tensor,
        logits_index: torch.Tensor,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        x: SamplerInputs[torch.Tensor],
        token_table: torch.Tensor,
    ) -> tuple[torch.Tensor, list[TokenLogprobsTensors]]:
        """Sampled ids of the rows `logits_index` picks from `hidden`, and the logprobs groups
        the step asked for (see `LogprobRows.output_groups`)."""
        p, lp = x.processing, x.logprobs
        if p is not None and p.flags.count_tokens:  # this step's inputs count for its own sample
            self.token_counts.record(token_table, p)
        groups: list[TokenLogprobsTensors] = []
        ids = torch.empty(0, dtype=torch.int64, device=self.device)
        if len(logits_index):
            logits = compute_logits(hidden[logits_index])
            raw = logits[lp.rows].log_softmax(dim=-1) if lp is not None and len(lp.rows) else None
            if p is not None:
                apply_bias_and_mask(logits, p)
                if p.flags.use_penalties:
                    self.token_counts.apply_penalties(logits, p)
            ids = sample(logits, x.sampling)
            if raw is not None:
                groups.append(score_tokens(raw, ids[lp.rows], lp.num_top))
        if lp is not None and len(lp.prompt_index):
            groups.append(_prompt_logprobs(hidden, compute_logits, lp))
        return ids, groups


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
