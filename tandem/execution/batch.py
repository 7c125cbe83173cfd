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
from tandem.sampler.inputs import SamplerInputs, build_sampler_inputs, first_counted, ragged_arange
from tandem.scheduling.scheduler import ScheduledBatch


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
    num_decodes: int
    decode_max_blocks: int
    prefills: list[PrefillSegment]
    sampler: SamplerInputs  # sampling rows; penalties and logprobs only when a request asks

    @property
    def num_tokens(self) -> int:
        return len(self.positions)

    @property
    def num_sampled(self) -> int:
        return len(self.logits_index)


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

        positions = ragged_arange(starts, counts)
        token_rows = np.repeat(rows, counts)
        bs = self.block_size
        slot_mapping = self.block_table[token_rows, positions // bs] * bs + positions % bs

        # Tokens the host knows (prompt, or outputs being recomputed): written to the table first.
        # In flight ones are already there, put by the step that sampled them.
        extras_needed = any(it.request.needs_extras for it in items)
        known_starts = (
            np.fromiter((first_counted(it) for it in items), np.int64, r)
            if extras_needed
            else starts
        )
        ends = starts + counts
        retired = np.fromiter(  # tokens the host has read back: prompt and retired outputs
            (len(it.request.prompt_token_ids) + len(it.request.output_token_ids) for it in items),
            np.int64,
            r,
        )
        known_counts = np.maximum(np.minimum(ends, retired) - known_starts, 0)
        known_positions = ragged_arange(known_starts, known_counts)
        known_tokens = np.fromiter(
            chain.from_iterable(
                it.request.known_token_ids(k, k + c)
                for it, k, c in zip(
                    items, known_starts.tolist(), known_counts.tolist(), strict=True
                )
                if c
            ),
            np.int64,
            int(known_counts.sum()),
        )

        cu = np.cumsum(counts)
        sample_mask = np.fromiter((it.sample for it in items), bool, r)
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
            num_decodes=d,
            decode_max_blocks=int(-(-ends[:d].max() // bs)) if d else 0,
            prefills=[
                PrefillSegment(int(cu[i] - counts[i]), int(counts[i]), int(ends[i]), i)
                for i in range(d, r)
            ],
            sampler=build_sampler_inputs(items, cu - counts, self.max_model_len, extras_needed),
        )
