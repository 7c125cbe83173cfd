"""ScheduledBatch -> the packed host arrays of one step (ragged, no padding), built with numpy.

The per-request Python work is a handful of attribute reads; everything per token is vectorized.
Token values that only a launched step knows are not here at all: the device gathers every input
id from its token table by (row, position), and the host supplies only tokens it already knows
(prompt chunks, and recomputed outputs after preemption).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

from tandem.ops.attention_metadata import PrefillSegment
from tandem.request import Request
from tandem.scheduling.scheduler import ScheduledBatch, ScheduledRequest


@dataclass
class StepInputs:
    step_id: int
    token_index: np.ndarray  # [T] flat token-table index (row * max_len + position) of each input
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T] flat KV-cache slot
    known_index: np.ndarray  # [K] flat token-table index of host-known tokens to write first
    known_tokens: np.ndarray  # [K]
    logits_index: np.ndarray  # [S] batch offset of each sampling row's last token
    sample_index: np.ndarray  # [S] flat token-table index where the sampled id goes
    block_tables: np.ndarray  # [R, W]
    context_lens: np.ndarray  # [R]
    temperature: np.ndarray  # [S] float32
    top_p: np.ndarray
    min_p: np.ndarray
    top_k: np.ndarray  # [S] int64
    seed_keys: np.ndarray
    output_index: np.ndarray
    num_decodes: int
    decode_max_blocks: int
    prefills: list[PrefillSegment]
    extras: StepExtras | None = None  # None unless a request needs penalties or logprobs

    @property
    def num_tokens(self) -> int:
        return len(self.positions)

    @property
    def num_sampled(self) -> int:
        return len(self.logits_index)


@dataclass
class StepExtras:
    """What a step needs beyond plain sampling: logits processing (see penalties.py) and logprobs.

    Built only when some request in the step asks, so the common step carries none of it.
    """

    # Token counts: rows cleared at admission; tokens entering the KV cache, by token-table index.
    reset_rows: np.ndarray
    prompt_tokens: np.ndarray
    prompt_rows: np.ndarray
    output_tokens: np.ndarray
    output_rows: np.ndarray
    # Per sampling row that uses them: penalties, logit_bias pairs, min_tokens masked pairs.
    penalty_rows: np.ndarray
    penalty_table_rows: np.ndarray
    bias_rows: np.ndarray
    bias_ids: np.ndarray
    mask_rows: np.ndarray
    mask_ids: np.ndarray
    # Logprobs: which sampling rows, and prompt positions (batch offsets) with their next token.
    logprob_rows: np.ndarray
    prompt_logprob_index: np.ndarray
    prompt_logprob_targets: np.ndarray
    presence: np.ndarray  # float32, per penalty row
    frequency: np.ndarray
    repetition: np.ndarray
    bias_values: np.ndarray  # float32, per bias pair
    num_top_logprobs: int
    num_top_prompt_logprobs: int
    # Host only: whose prompt logprobs these are, in order: (request, first position, count).
    prompt_logprob_spans: list[tuple[Request, int, int]]

    INT_FIELDS = (
        "reset_rows", "prompt_tokens", "prompt_rows", "output_tokens", "output_rows",
        "penalty_rows", "penalty_table_rows", "bias_rows", "bias_ids", "mask_rows", "mask_ids",
        "logprob_rows", "prompt_logprob_index", "prompt_logprob_targets",
    )  # fmt: skip
    FLOAT_FIELDS = ("presence", "frequency", "repetition", "bias_values")

    @property
    def output_groups(self) -> list[tuple[int, int]]:
        """(rows, top k) of each logprobs group packed after the sampled ids (logprobs.pack)."""
        groups = []
        if len(self.logprob_rows):
            groups.append((len(self.logprob_rows), self.num_top_logprobs))
        if len(self.prompt_logprob_index):
            groups.append((len(self.prompt_logprob_index), self.num_top_prompt_logprobs))
        return groups


def _ragged_arange(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """concat(arange(s, s + c) for s, c in zip(starts, counts)), without a Python loop."""
    total = int(counts.sum())
    offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + offsets


class BatchBuilder:
    def __init__(self, block_table: np.ndarray, block_size: int, max_model_len: int):
        self.block_table = block_table  # the scheduler's, [table rows, max blocks per sequence]
        self.block_size = block_size
        self.max_model_len = max_model_len

    def build(self, batch: ScheduledBatch) -> StepInputs:
        items = batch.items
        r = len(items)
        rows = np.fromiter((it.slot for it in items), np.int64, r)
        starts = np.fromiter((it.start for it in items), np.int64, r)
        counts = np.fromiter((it.num_tokens for it in items), np.int64, r)
        sampled = [it for it in items if it.sample]

        positions = _ragged_arange(starts, counts)
        token_rows = np.repeat(rows, counts)
        bs = self.block_size
        slot_mapping = self.block_table[token_rows, positions // bs] * bs + positions % bs

        # Tokens the host knows (prompt, or outputs being recomputed): written to the table first.
        # In flight ones are already there, put by the step that sampled them.
        extras_needed = any(it.request.needs_extras for it in items)
        known_starts = (
            np.fromiter((_first_counted(it) for it in items), np.int64, r)
            if extras_needed
            else starts
        )
        known_counts = np.fromiter(
            (
                max(
                    0,
                    min(
                        it.start + it.num_tokens,
                        len(it.request.prompt_token_ids) + len(it.request.output_token_ids),
                    )
                    - int(k),
                )
                for it, k in zip(items, known_starts, strict=True)
            ),
            np.int64,
            r,
        )
        known_positions = _ragged_arange(known_starts, known_counts)
        known_tokens = np.fromiter(
            chain.from_iterable(
                it.request.known_token_ids(int(k), int(k + c))
                for it, k, c in zip(items, known_starts, known_counts, strict=True)
                if c
            ),
            np.int64,
            int(known_counts.sum()),
        )

        ends = starts + counts
        cu = np.cumsum(counts)
        sample_mask = np.fromiter((it.sample for it in items), bool, r)
        params = np.array([it.request.sampling_row for it in sampled], dtype=np.float64).reshape(
            -1, 5
        )
        width = int(-(-ends.max() // bs))
        d = batch.num_decodes
        return StepInputs(
            step_id=batch.step_id,
            token_index=token_rows * self.max_model_len + positions,
            positions=positions,
            slot_mapping=slot_mapping,
            known_index=np.repeat(rows, known_counts) * self.max_model_len + known_positions,
            known_tokens=known_tokens,
            logits_index=cu[sample_mask] - 1,
            sample_index=rows[sample_mask] * self.max_model_len + ends[sample_mask],
            block_tables=self.block_table[rows, :width],
            context_lens=ends,
            temperature=params[:, 0].astype(np.float32),
            top_k=params[:, 1].astype(np.int64),
            top_p=params[:, 2].astype(np.float32),
            min_p=params[:, 3].astype(np.float32),
            seed_keys=params[:, 4].astype(np.int64),
            output_index=np.fromiter((it.output_index for it in sampled), np.int64, len(sampled)),
            num_decodes=d,
            decode_max_blocks=int(-(-ends[:d].max() // bs)) if d else 0,
            prefills=[
                PrefillSegment(int(cu[i] - counts[i]), int(counts[i]), int(ends[i]), i)
                for i in range(d, r)
            ],
            extras=_build_extras(items, cu - counts, self.max_model_len) if extras_needed else None,
        )


def _uses_penalties(request: Request) -> bool:
    return request.processing is not None and request.processing.uses_penalties


def _first_counted(item: ScheduledRequest) -> int:
    """First position whose token a step counts for penalties (and so must find in the table).

    On admission the row's counts start afresh, from position 0, even if the request skips
    computing a prefix; afterwards each step counts the positions it computes.
    """
    return 0 if item.admitted and _uses_penalties(item.request) else item.start


def _build_extras(items: list[ScheduledRequest], offsets: np.ndarray, max_len: int) -> StepExtras:
    """The per-step arrays of penalties, logit_bias, min_tokens and logprobs (see StepExtras).

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
    top_k = 0
    s = 0  # index among sampling rows
    for it, offset in zip(items, offsets.tolist(), strict=True):
        request, end = it.request, it.start + it.num_tokens
        proc = request.processing
        if proc is not None and proc.uses_penalties:
            c_row.append(it.slot)
            c_first.append(_first_counted(it))
            c_end.append(end)
            c_prompt.append(len(request.prompt_token_ids))
            c_admitted.append(it.admitted)
        if request.prompt_logprobs is not None:
            lo = max(it.start, len(request.prompt_logprobs) - 1)  # retired ones are not redone
            hi = min(end, len(request.prompt_token_ids) - 1)
            if hi > lo:
                prompt_lp.append((request, lo, hi, offset - it.start))
        if not it.sample:
            continue
        if proc is not None:
            if proc.uses_penalties:
                p_row.append(s)
                p_table_row.append(it.slot)
                p_presence.append(proc.presence)
                p_frequency.append(proc.frequency)
                p_repetition.append(proc.repetition)
            if len(proc.bias_ids):
                bias.append((s, proc.bias_ids, proc.bias_values))
            if it.output_index < proc.min_tokens and len(proc.min_tokens_ids):
                mask.append((s, proc.min_tokens_ids))
        if request.logprobs is not None:
            logprob_rows.append(s)
            top_k = max(top_k, request.params.logprobs)
        s += 1

    rows, first, end = _ints(c_row), _ints(c_first), _ints(c_end)
    split = np.minimum(np.maximum(first, _ints(c_prompt)), end)
    lp_first = _ints([x[1] for x in prompt_lp])
    return StepExtras(
        reset_rows=rows[np.array(c_admitted, dtype=bool)],
        prompt_tokens=_ragged_arange(rows * max_len + first, split - first),
        prompt_rows=np.repeat(rows, split - first),
        output_tokens=_ragged_arange(rows * max_len + split, end - split),
        output_rows=np.repeat(rows, end - split),
        penalty_rows=_ints(p_row),
        penalty_table_rows=_ints(p_table_row),
        presence=np.array(p_presence, dtype=np.float32),
        frequency=np.array(p_frequency, dtype=np.float32),
        repetition=np.array(p_repetition, dtype=np.float32),
        bias_rows=_repeat_rows(bias),
        bias_ids=_concat([b[1] for b in bias], np.int64),
        bias_values=_concat([b[2] for b in bias], np.float32),
        mask_rows=_repeat_rows(mask),
        mask_ids=_concat([m[1] for m in mask], np.int64),
        logprob_rows=_ints(logprob_rows),
        prompt_logprob_index=_ragged_arange(
            lp_first + _ints([x[3] for x in prompt_lp]), _ints([x[2] for x in prompt_lp]) - lp_first
        ),
        prompt_logprob_targets=_concat(
            [np.asarray(r.prompt_token_ids[lo + 1 : hi + 1]) for r, lo, hi, _ in prompt_lp],
            np.int64,
        ),
        num_top_logprobs=top_k,
        num_top_prompt_logprobs=max((r.params.prompt_logprobs for r, *_ in prompt_lp), default=0),
        prompt_logprob_spans=[(r, lo, hi - lo) for r, lo, hi, _ in prompt_lp],
    )


def _ints(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _concat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)


def _repeat_rows(pairs: list[tuple]) -> np.ndarray:
    """Each pair's sampling row, once per id it lists."""
    return np.repeat(_ints([x[0] for x in pairs]), _ints([len(x[1]) for x in pairs]))
