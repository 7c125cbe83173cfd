"""The sampler's inputs for one step, typed: built on the host as numpy arrays, moved to the
device as tensors of the same dataclasses (`execution/transfer.py` walks their fields).

Each group is built only when some request of the step uses it, so a plain step carries the
sampling rows alone. Flags are host facts about the arrays (computed before the upload), so the
device skips unused work without a sync. A new stage (a grammar's bitmask, draft tokens to
verify) is one more optional group here and one more stage in `Sampler`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np
import torch

from tandem.reasoning import MAY_OPEN
from tandem.request import Request
from tandem.scheduling.scheduler import ScheduledRequest

A = TypeVar("A", np.ndarray, torch.Tensor)  # host arrays, or their device tensors
# temperature, top_k, top_p, min_p at the values that leave a row as it is (validated ranges:
# temperature and min_p >= 0, top_k >= 0, top_p <= 1).
_NEUTRAL = np.array([0.0, 0.0, 1.0, 0.0], dtype=np.float32)


@dataclass(frozen=True)
class SamplingFlags:
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool


@dataclass
class SamplingRows(Generic[A]):
    """Per sampled row: the request's settings and where its noise comes from."""

    temperature: A  # [S] float32, 0 = greedy
    top_k: A  # [S] int64, 0 = off
    top_p: A  # [S] float32
    min_p: A  # [S] float32
    seed_keys: A  # [S] int64, a 32-bit hash of the request's seed
    output_index: A  # [S] int64
    flags: SamplingFlags


@dataclass(frozen=True)
class ProcessingFlags:
    count_tokens: bool
    use_penalties: bool
    use_repetition: bool
    use_frequency: bool
    use_presence: bool
    use_bias: bool
    use_mask: bool


@dataclass
class ProcessingRows(Generic[A]):
    """Penalties, logit_bias and min_tokens (see penalties.py); empty arrays: not this step."""

    # Token counts: clear these table rows, then count these flat token-table indices into them.
    reset_rows: A  # [Z] table rows
    prompt_tokens: A  # [A] flat token-table index of prompt tokens entering a row
    prompt_rows: A  # [A] their table row
    output_tokens: A  # [B] the same for output tokens
    output_rows: A  # [B]
    # Penalties, for these sampling rows (indices into the step's logits) and their table rows.
    penalty_rows: A  # [P]
    penalty_table_rows: A  # [P]
    presence: A  # [P] float32
    frequency: A  # [P]
    repetition: A  # [P]
    # logit_bias: logits[bias_rows, bias_ids] += bias_values
    bias_rows: A
    bias_ids: A
    bias_values: A  # float32
    # min_tokens: logits[mask_rows, mask_ids] = -inf
    mask_rows: A
    mask_ids: A
    flags: ProcessingFlags
    # Penalized verifications (their inputs are counted only once accepted): the input tokens
    # (batch offsets) each of their penalty rows counts on top of the row's counts, its own
    # position's and earlier ones; and every input with its table row, request (index among
    # the step's verifications) and offset, counted after the step if that request kept it.
    pair_rows: A = None  # [Q] penalty rows
    pair_batch: A = None  # [Q]
    accept_rows: A = None  # [U] table rows
    accept_batch: A = None  # [U]
    accept_item: A = None  # [U]
    accept_offset: A = None  # [U]


@dataclass
class LogprobRows(Generic[A]):
    """Which sampling rows want logprobs, and prompt positions (batch offsets) with the prompt
    token each one predicts."""

    rows: A  # [L] sampling rows
    prompt_index: A  # [Q] batch offsets of prompt positions
    prompt_targets: A  # [Q] the next prompt token of each
    num_top: int
    num_top_prompt: int
    # Host only: whose prompt logprobs these are, in order: (request, first position, count).
    prompt_spans: list[tuple[Request, int, int]] = field(default_factory=list)

    @property
    def output_groups(self) -> list[tuple[int, int]]:
        """(rows, top k) of each logprobs group packed after the sampled ids (logprobs.pack)."""
        groups = []
        if len(self.rows):
            groups.append((len(self.rows), self.num_top))
        if len(self.prompt_index):
            groups.append((len(self.prompt_index), self.num_top_prompt))
        return groups


@dataclass
class GrammarRows(Generic[A]):
    """A step with grammar-constrained rows samples in two parts: the free rows at once, the
    constrained ones once the host has built their bitmask (`Sampler.finish`)."""

    rows: A  # [G] sampling rows under a grammar, in the bitmask's row order
    free_rows: A  # [S - G] the others
    sampling: SamplingRows[A]  # the settings of `rows`
    free_sampling: SamplingRows[A]  # of `free_rows`
    # Host: the step's items these rows belong to (indices, in order), decided as the step is
    # built: the bitmask, built later, must have exactly these rows whatever retires meanwhile.
    items: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class ReasoningFlags:
    use_masks: bool  # a row's answer is under a grammar: its first token takes the initial mask


@dataclass
class ReasoningRows(Generic[A]):
    """Rows whose thinking may still be open on the device (`sampler/reasoning.py`), and the
    rows a step admits: their state as the host knows it, and their grammar's initial mask."""

    rows: A  # [R] sampling rows
    table_rows: A  # [R] their token-table rows
    reset_rows: A  # [Z] token-table rows of requests admitted in this step
    reset_phase: A  # [Z]
    reset_budget: A  # [Z]
    reset_grammar: A  # [Z] 1 where the answer is under a grammar
    mask_rows: A  # [M] token-table rows that get an initial mask
    masks: A  # [M, words / 2] int64: the int32 words of each mask, two to an element
    start_token: int
    end_token: int
    flags: ReasoningFlags


@dataclass
class VerifyRows(Generic[A]):
    """Requests whose position only the device knows (drafts of theirs were in flight when the
    step was built) and the drafts they verify. Each such request's tokens are its last one and
    its drafts; every one of them is a sampling row predicting the next position."""

    table_rows: A  # [V] token-table row of each verifying request
    num_drafts: A  # [V]
    prompt_lens: A  # [V] (the output index of a position is position - prompt length)
    token_item: A  # [Tv] which request (0..V-1) each of their tokens belongs to
    token_offset: A  # [Tv] 0 for the request's last token, j for its j-th draft
    token_batch: A  # [Tv] the token's offset in the packed batch
    sample_rows: A  # [Tv] its sampling row
    # The drafts: batch offset of each, its request, its index (0..k-1), and the sampling row
    # whose token must equal it for it to be accepted (the row of the token before it).
    draft_batch: A  # [D]
    draft_item: A  # [D]
    draft_index: A  # [D]
    check_rows: A  # [D]
    # A draft model drafts in passes, the j-th for the requests with more than j drafts: their
    # indices (0..V-1), pass after pass, and where each request's first token and row are.
    pass_items: A  # [sum of pass sizes]
    item_batch: A  # [V] batch offset of each request's first token
    item_row: A  # [V] its first sampling row
    pass_sizes: list[int]  # host
    max_drafts: int  # host: the most drafts of one request
    history_len: int  # host: an upper bound of every verifying request's length
    method: str  # host: how the drafts are made ("ngram", "suffix" or "draft_model")
    lookup: tuple[int, int]  # host: ngram sizes tried, longest first (max, min)
    # suffix: each request's proposal (`scheduling/suffix_proposer.py`), padded; the position of
    # its first token and its length (0: none, the row drafts by ngram).
    proposals: A | None = None  # [V, longest proposal]
    proposal_start: A | None = None  # [V]
    proposal_len: A | None = None  # [V]


@dataclass
class SamplerInputs(Generic[A]):
    sampling: SamplingRows[A]
    processing: ProcessingRows[A] | None = None  # None unless a request uses it
    logprobs: LogprobRows[A] | None = None
    grammar: GrammarRows[A] | None = None  # None unless a request is constrained
    verify: VerifyRows[A] | None = None  # None unless a request verifies drafts
    reasoning: ReasoningRows[A] | None = None  # None unless a request's thinking may be open

    @property
    def drafts_to_host(self) -> bool:
        """Whether the host needs the step's drafts: a grammar row's bitmask after a draft is
        its matcher's state past that draft."""
        return self.grammar is not None and self.verify is not None and self.verify.max_drafts > 0

    @property
    def plain(self) -> bool:
        """Sampling alone: no penalties, bias, min_tokens, logprobs, grammar or reasoning in this
        step."""
        return (
            self.processing is None
            and self.logprobs is None
            and self.grammar is None
            and self.verify is None
            and self.reasoning is None
        )


def build_sampler_inputs(
    items: list[ScheduledRequest], offsets: np.ndarray, max_len: int, extras: bool
) -> SamplerInputs[np.ndarray]:
    """The step's sampler inputs; `offsets`: each item's first token in the batch; `extras`:
    whether some request of the step needs processing or logprobs. Drafts to verify are added
    by the batch builder (`SamplerInputs.verify`), which knows where their tokens are."""
    rows = [it for it in items for _ in range(it.num_rows)]  # one per sampling row
    sampling = sampling_rows(rows)
    grammar = _grammar_rows(items)
    reasoning = _reasoning_rows(items)
    if not extras:
        return SamplerInputs(sampling, grammar=grammar, reasoning=reasoning)
    processing, logprobs = _build_extras(items, offsets, max_len)
    return SamplerInputs(sampling, processing, logprobs, grammar, reasoning=reasoning)


def sampling_rows(rows: list[ScheduledRequest]) -> SamplingRows[np.ndarray]:
    """The settings of each sampling row (an item once per row: a verification has several;
    their output index, known on the device only, is set there)."""
    params = np.array([it.request.sampling_row for it in rows], dtype=np.float64).reshape(-1, 5)
    # Which settings any row uses, in one pass: each is off at its neutral value.
    used = (params[:, :4].astype(np.float32) != _NEUTRAL).any(axis=0).tolist()
    return SamplingRows(
        temperature=params[:, 0].astype(np.float32),
        top_k=params[:, 1].astype(np.int64),
        top_p=params[:, 2].astype(np.float32),
        min_p=params[:, 3].astype(np.float32),
        seed_keys=params[:, 4].astype(np.int64),
        output_index=np.fromiter((it.output_index for it in rows), np.int64, len(rows)),
        flags=SamplingFlags(
            all_greedy=not used[0], use_top_k=used[1], use_top_p=used[2], use_min_p=used[3]
        ),
    )


def select_rows(
    rows: SamplingRows[torch.Tensor], index: torch.Tensor
) -> SamplingRows[torch.Tensor]:
    """Some rows' settings (the flags stay the step's: a row a filter does not use is left
    as it is by it, so a superset of flags samples the same tokens)."""
    return SamplingRows(
        temperature=rows.temperature[index], top_k=rows.top_k[index], top_p=rows.top_p[index],
        min_p=rows.min_p[index], seed_keys=rows.seed_keys[index],
        output_index=rows.output_index[index], flags=rows.flags,
    )  # fmt: skip


def is_constrained(item: ScheduledRequest) -> bool:
    """Whether the host samples the item's row under a bitmask it builds once the step before
    has retired. A reasoning sample's thinking is free and its answer's first token is the
    device's (under the grammar's initial mask, `sampler/reasoning.py`): the host's bitmask
    takes over from the answer's second token, once it knows where the answer starts; and a
    sample that may still open its block (MAY_OPEN) with its first token in flight, which that
    token decides: the bitmask is then open (it opened the block) or the matcher's."""
    request = item.request
    if request.compiled_grammar is None:
        return False
    tracker = request.reasoning
    if tracker is None:
        return True
    if tracker.content_start is not None:
        return item.output_index > tracker.content_start
    return tracker.phase == MAY_OPEN and item.output_index > tracker.retired


def _reasoning_rows(items: list[ScheduledRequest]) -> ReasoningRows[np.ndarray] | None:
    """None for a step without a request whose thinking may be open or that is admitted with
    a reasoning state to set."""
    rows, table_rows, resets, masks = [], [], [], []
    tokens = None
    s = 0
    use_masks = False
    for it in items:
        tracker = it.request.reasoning
        acts = tracker is not None and tracker.device_acts_at(it.output_index)
        if tracker is not None and (acts or it.admitted):
            tokens = tracker.tokens
            if it.admitted:
                resets.append((it.slot, tracker.phase, tracker.budget, tracker.grammar))
                if tracker.grammar and tracker.active and tracker.initial_mask is not None:
                    masks.append((it.slot, tracker.initial_mask))
            if acts and it.num_rows:
                rows.extend(range(s, s + it.num_rows))
                table_rows.extend([it.slot] * it.num_rows)
                use_masks |= tracker.grammar
        s += it.num_rows
    if tokens is None:
        return None
    reset = np.array(resets, dtype=np.int64).reshape(-1, 4)
    return ReasoningRows(
        rows=_ints(rows),
        table_rows=_ints(table_rows),
        reset_rows=np.ascontiguousarray(reset[:, 0]),
        reset_phase=np.ascontiguousarray(reset[:, 1]),
        reset_budget=np.ascontiguousarray(reset[:, 2]),
        reset_grammar=np.ascontiguousarray(reset[:, 3]),
        mask_rows=_ints([slot for slot, _ in masks]),
        masks=_mask_words([mask for _, mask in masks]),
        start_token=tokens.start,
        end_token=tokens.end,
        flags=ReasoningFlags(use_masks=use_masks),
    )


def _mask_words(masks: list[np.ndarray]) -> np.ndarray:
    """int32 masks as int64 pairs (a step's integer arrays travel as int64: `transfer.py`)."""
    if not masks:
        return np.zeros((0, 0), np.int64)
    words = np.stack(masks).astype(np.int32, copy=False)
    if words.shape[1] % 2:
        words = np.pad(words, ((0, 0), (0, 1)), constant_values=-1)
    return np.ascontiguousarray(words).view(np.int64)


def _grammar_rows(items: list[ScheduledRequest]) -> GrammarRows[np.ndarray] | None:
    """None for a step whose rows no grammar constrains."""
    chosen = [i for i, it in enumerate(items) if it.num_rows and is_constrained(it)]
    if not chosen:
        return None
    rows = [it for it in items for _ in range(it.num_rows)]
    picked = set(chosen)
    under = np.fromiter(
        (i in picked for i, it in enumerate(items) for _ in range(it.num_rows)), bool, len(rows)
    )
    constrained, free = np.flatnonzero(under), np.flatnonzero(~under)
    return GrammarRows(
        rows=constrained,
        free_rows=free,
        sampling=sampling_rows([rows[i] for i in constrained.tolist()]),
        free_sampling=sampling_rows([rows[i] for i in free.tolist()]),
        items=chosen,
    )


def uses_penalties(request: Request) -> bool:
    return request.processing is not None and request.processing.uses_penalties


def first_counted(item: ScheduledRequest) -> int:
    """First position whose token a step counts for penalties (and so must find in the table).

    On admission the row's counts start afresh, from position 0, even if the request skips
    computing a prefix; afterwards each step counts the positions it computes.
    """
    return 0 if item.admitted and uses_penalties(item.request) else item.start


def _build_extras(
    items: list[ScheduledRequest], offsets: np.ndarray, max_len: int
) -> tuple[ProcessingRows[np.ndarray] | None, LogprobRows[np.ndarray] | None]:
    """Penalties, logit_bias, min_tokens and logprobs arrays; None for a group nobody uses.

    One pass over the items collects scalars into columns; numpy builds the per-token arrays.
    """
    # Token counts, per item of a penalized request: table row, first counted position, end,
    # prompt length, admitted now.
    c_row, c_first, c_end, c_prompt, c_admitted = [], [], [], [], []
    # Penalties per sampling row: row, table row, presence, frequency, repetition.
    p_row, p_table_row, p_presence, p_frequency, p_repetition = [], [], [], [], []
    bias, mask = [], []  # (sampling row, ids[, values])
    logprob_rows: list[int] = []
    prompt_lp: list[tuple[Request, int, int, int]] = []  # request, first, end, batch offset shift
    pair_rows, pair_batch, accepts = [], [], []  # penalized verifications' inputs
    top_k = 0
    s = 0  # index among sampling rows
    v = -1  # index among verifications
    for it, offset in zip(items, offsets.tolist(), strict=True):
        request, end = it.request, it.start + it.num_tokens
        proc = request.processing
        v += it.verify
        if it.verify and proc is not None and proc.uses_penalties:
            for j in range(it.num_tokens):  # row j sees inputs 0..j; input j counts if kept
                pair_rows.extend([len(p_row) + j] * (j + 1))
                pair_batch.extend(range(offset, offset + j + 1))
                accepts.append((it.slot, offset + j, v, j))
        elif proc is not None and proc.uses_penalties:
            c_row.append(it.slot)
            c_first.append(first_counted(it))
            c_end.append(end)
            c_prompt.append(len(request.prompt_token_ids))
            c_admitted.append(it.admitted)
        if request.prompt_logprobs is not None:
            lo = max(it.start, len(request.prompt_logprobs) - 1)  # retired ones are not redone
            hi = min(end, len(request.prompt_token_ids) - 1)
            if hi > lo:
                prompt_lp.append((request, lo, hi, offset - it.start))
        # A verification's rows (never with min_tokens pending: draft_policy.can_draft) each
        # get the request's penalties, bias and logprobs.
        for _ in range(it.num_rows):
            if proc is not None:
                if proc.uses_penalties:
                    p_row.append(s)
                    p_table_row.append(it.slot)
                    p_presence.append(proc.presence)
                    p_frequency.append(proc.frequency)
                    p_repetition.append(proc.repetition)
                if len(proc.bias_ids):
                    bias.append((s, proc.bias_ids, proc.bias_values))
                # Under a grammar, min_tokens is folded into its bitmask (engine/grammar.py).
                pending = it.output_index < proc.min_tokens and len(proc.min_tokens_ids)
                if pending and not is_constrained(it):
                    mask.append((s, proc.min_tokens_ids))
            if request.logprobs is not None:
                logprob_rows.append(s)
                top_k = max(top_k, request.params.logprobs)
            s += 1

    # A group nobody in the step uses is left out (None): its stages do nothing anyway.
    processing = logprobs = None
    if c_row or p_row or bias or mask:
        accept = np.array(accepts, dtype=np.int64).reshape(-1, 4)
        rows, first, end = _ints(c_row), _ints(c_first), _ints(c_end)
        split = np.minimum(np.maximum(first, _ints(c_prompt)), end)
        repetition = np.array(p_repetition, dtype=np.float32)
        frequency = np.array(p_frequency, dtype=np.float32)
        presence = np.array(p_presence, dtype=np.float32)
        reset_rows = rows[np.array(c_admitted, dtype=bool)]
        prompt_tokens = ragged_arange(rows * max_len + first, split - first)
        output_tokens = ragged_arange(rows * max_len + split, end - split)
        processing = ProcessingRows(
            reset_rows=reset_rows,
            prompt_tokens=prompt_tokens,
            prompt_rows=np.repeat(rows, split - first),
            output_tokens=output_tokens,
            output_rows=np.repeat(rows, end - split),
            penalty_rows=_ints(p_row),
            penalty_table_rows=_ints(p_table_row),
            presence=presence,
            frequency=frequency,
            repetition=repetition,
            bias_rows=_repeat_rows(bias),
            bias_ids=_concat([b[1] for b in bias], np.int64),
            bias_values=_concat([b[2] for b in bias], np.float32),
            mask_rows=_repeat_rows(mask),
            mask_ids=_concat([m[1] for m in mask], np.int64),
            pair_rows=_ints(pair_rows),
            pair_batch=_ints(pair_batch),
            accept_rows=np.ascontiguousarray(accept[:, 0]),
            accept_batch=np.ascontiguousarray(accept[:, 1]),
            accept_item=np.ascontiguousarray(accept[:, 2]),
            accept_offset=np.ascontiguousarray(accept[:, 3]),
            flags=ProcessingFlags(
                count_tokens=bool(len(reset_rows) + len(prompt_tokens) + len(output_tokens)),
                use_penalties=bool(p_row),
                use_repetition=bool((repetition != 1).any()),
                use_frequency=bool(frequency.any()),
                use_presence=bool(presence.any()),
                use_bias=bool(bias),
                use_mask=bool(mask),
            ),
        )
    if logprob_rows or prompt_lp:
        lp_first = _ints([x[1] for x in prompt_lp])
        logprobs = LogprobRows(
            rows=_ints(logprob_rows),
            prompt_index=ragged_arange(
                lp_first + _ints([x[3] for x in prompt_lp]),
                _ints([x[2] for x in prompt_lp]) - lp_first,
            ),
            prompt_targets=_concat(
                [np.asarray(r.prompt_token_ids[lo + 1 : hi + 1]) for r, lo, hi, _ in prompt_lp],
                np.int64,
            ),
            num_top=top_k,
            num_top_prompt=max((r.params.prompt_logprobs for r, *_ in prompt_lp), default=0),
            prompt_spans=[(r, lo, hi - lo) for r, lo, hi, _ in prompt_lp],
        )
    return processing, logprobs


def ragged_arange(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """concat(arange(s, s + c) for s, c in zip(starts, counts)), without a Python loop."""
    total = int(counts.sum())
    offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + offsets


def _ints(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _concat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)


def _repeat_rows(pairs: list[tuple]) -> np.ndarray:
    """Each pair's sampling row, once per id it lists."""
    return np.repeat(_ints([x[0] for x in pairs]), _ints([len(x[1]) for x in pairs]))
