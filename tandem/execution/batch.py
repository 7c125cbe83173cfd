"""ScheduledBatch -> the packed host arrays of one step (ragged, no padding), built with numpy.

The per-request Python work is a handful of attribute reads; everything per token is vectorized.
Token values that only a launched step knows are not here at all: the device gathers every input
id from its token table by (row, position), and the host supplies only tokens it already knows
(prompt chunks, and recomputed outputs after preemption).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from itertools import chain

import numpy as np

from tandem.config import SpeculativeConfig
from tandem.ops.attention_metadata import PrefillSegment
from tandem.sampler.inputs import (
    SamplerInputs,
    VerifyRows,
    build_sampler_inputs,
    first_counted,
    ragged_arange,
)
from tandem.scheduling.scheduler import ScheduledBatch, ScheduledRequest


def kept_runs(
    num_rows: Sequence[int], verify: Sequence[bool], kept_counts: Iterable[int]
) -> list[tuple[int, int]]:
    """Where each sampled item's kept tokens lie among a step's output rows, (start, end): all its
    rows, or as many as a verification kept (the counts follow the ids, one per verifying item)."""
    counts = iter(kept_counts)
    runs, start = [], 0
    for rows, verifies in zip(num_rows, verify, strict=True):
        runs.append((start, start + (next(counts) if verifies else rows)))
        start += rows
    return runs


# What a skipped step hands the host instead of tokens (`StopCheck`).
SKIPPED_STEP = "skipped"


@dataclass(frozen=True)
class StopCheck:
    """Whether a step is dead before it starts: every one of its requests stopped in the step
    just before it.

    Why: the asynchronous loop launches step N+1 before step N's tokens are known, on the bet
    that N's requests go on. Where every request of N+1 ends in N (one chat request, the last
    of a batch), N+1 is a whole step of wasted work; on a CPU the device thread has N's tokens
    before it starts N+1, so it reads them and skips the step (on CUDA that would be a sync).
    Only stop ids are checked: a request they end is certain to end on the host too (stop
    strings and grammars end others, whose next step then runs and is discarded, as before).
    """

    previous_rows: tuple[int, ...]  # each sampled item of the step before: its sampling rows
    previous_verify: tuple[bool, ...]  # ... and whether it verifies (its kept count follows)
    items: tuple[int, ...]  # each sampled item of this step: its request's item in the step before
    stop_ids: tuple[frozenset[int], ...]  # ... and the ids that stop that request

    def all_stopped(self, previous: np.ndarray) -> bool:
        """`previous`: the step before's output as the host reads it (ids, then kept counts)."""
        total = sum(self.previous_rows)
        if len(previous) != total + sum(self.previous_verify):  # not that step's output
            return False
        runs = kept_runs(self.previous_rows, self.previous_verify, previous[total:].tolist())
        ids = previous[:total].tolist()
        return all(
            not stops.isdisjoint(ids[slice(*runs[i])])
            for i, stops in zip(self.items, self.stop_ids, strict=True)
        )


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
    # With speculative decoding: the device's length of each sampled row whose position the
    # host knows (verified rows' lengths grow on the device by what they accept).
    length_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    draft_kv: bool = False  # a draft model drafts: it computes the KV of every token too
    # Further groups of layers with blocks of their own (`scheduling/kv_groups.py`): their
    # slots [G - 1, T] and block tables [G - 1, R, W]; empty for a model of one group.
    group_slot_mapping: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    group_block_tables: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    stop_check: StopCheck | None = None  # skip this step if its requests all stopped (CPU)
    # With LoRA: each token's adapter slot (-1: the base model), empty when none runs an
    # adapter; the adapters (slot, weights) to copy into their slots before the forward.
    lora_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    lora_loads: list = field(default_factory=list)
    # Pipeline parallelism: the newest earlier step whose sampled ids the first stage must
    # have from the last before this step starts (`ScheduledBatch.reads_through`: every retired
    # step, whose rows may be reused, and the steps before this one's decodes).
    reads_through: int = -1

    @property
    def num_tokens(self) -> int:
        return len(self.positions)

    @property
    def num_sampled(self) -> int:
        return len(self.logits_index)

    def for_ranks(self) -> StepInputs:
        """The step as a tensor-parallel rank is sent it: without the host's own records (the
        requests whose prompt logprobs it computes), which no rank reads and which need not
        pickle (a grammar's compiled form does not)."""
        logprobs = self.sampler.logprobs
        if logprobs is None or not logprobs.prompt_spans:
            return self
        sampler = replace(self.sampler, logprobs=replace(logprobs, prompt_spans=[]))
        return replace(self, sampler=sampler)


class BatchBuilder:
    def __init__(self, block_table: np.ndarray, block_size: int, max_model_len: int):
        # The scheduler's, [groups of layers, table rows, max blocks per sequence].
        self.block_table = block_table
        self.block_size = block_size
        self.max_model_len = max_model_len
        # Speculative decoding, when on (Engine.configure): the drafting method and ngram sizes.
        self.speculative: SpeculativeConfig | None = None

    def build(self, batch: ScheduledBatch) -> StepInputs:
        items = batch.items
        r = len(items)
        rows = np.fromiter((it.slot for it in items), np.int64, r)
        starts = np.fromiter((it.start for it in items), np.int64, r)
        counts = np.fromiter((it.num_tokens for it in items), np.int64, r)

        positions = ragged_arange(starts, counts)
        token_rows = np.repeat(rows, counts)
        bs = self.block_size
        slot_mapping = self.block_table[:, token_rows, positions // bs] * bs + positions % bs

        # Tokens the host knows (prompt, or outputs being recomputed): written to the table first.
        # In flight ones are already there, put by the step that sampled them. Drafts look up
        # a request's whole history in its row, so with speculation an admission writes it all.
        extras_needed = any(it.request.needs_extras for it in items)
        spec = self.speculative
        if extras_needed or spec is not None:
            known_starts = np.fromiter(
                (0 if it.admitted and spec is not None else first_counted(it) for it in items),
                np.int64,
                r,
            )
        else:
            known_starts = starts
        ends = starts + counts
        retired = np.fromiter(  # tokens the host has read back: prompt and retired outputs
            (len(it.request.prompt_token_ids) + len(it.request.output_token_ids) for it in items),
            np.int64,
            r,
        )
        verify = np.fromiter((it.verify for it in items), bool, r)
        # A verification's tokens are all in the table already (its positions are the device's).
        known_counts = np.where(verify, 0, np.maximum(np.minimum(ends, retired) - known_starts, 0))
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
        # Sampling rows: the last token of a sampled item, or every token of a verification
        # (its positions and where its samples go are placeholders the device replaces).
        num_rows = np.fromiter((it.num_rows for it in items), np.int64, r)
        width = int(-(-ends.max() // bs))
        d = batch.num_decodes
        decode_tokens = int(cu[d - 1]) if d else 0  # a verification's tokens are decode rows
        sampler = build_sampler_inputs(items, cu - counts, self.max_model_len, extras_needed)
        tables = self.block_table[:, :, :width]
        block_tables = np.concatenate(
            [np.repeat(tables[:, rows[:d]], counts[:d], axis=1), tables[:, rows[d:]]], axis=1
        )
        step = StepInputs(
            step_id=batch.step_id,
            reads_through=batch.reads_through,
            token_index=token_rows * self.max_model_len + positions,
            positions=positions,
            slot_mapping=slot_mapping[0],
            known_index=np.repeat(rows, known_counts) * self.max_model_len + known_positions,
            known_tokens=known_tokens,
            logits_index=ragged_arange(cu - num_rows, num_rows),
            sample_index=np.repeat(rows * self.max_model_len, num_rows)
            + ragged_arange(ends - num_rows + 1, num_rows),
            block_tables=block_tables[0],
            context_lens=np.concatenate([positions[:decode_tokens] + 1, ends[d:]]),
            num_decodes=decode_tokens,
            decode_max_blocks=int(-(-ends[:d].max() // bs)) if d else 0,
            prefills=[
                PrefillSegment(
                    int(cu[i] - counts[i]), int(counts[i]), int(ends[i]), decode_tokens + i - d
                )
                for i in range(d, r)
            ],
            sampler=sampler,
        )
        if any(it.request.lora_slot >= 0 for it in items):
            step.lora_slots = np.repeat(
                np.fromiter((it.request.lora_slot for it in items), np.int64, r), counts
            )
        if len(tables) > 1:
            step.group_slot_mapping, step.group_block_tables = slot_mapping[1:], block_tables[1:]
        if spec is not None:
            step.draft_kv = spec.method == "draft_model"
            plain = ~verify & (num_rows > 0)
            step.length_rows, step.lengths = rows[plain], ends[plain] + 1
            if verify.any():
                sampler.verify = self._verify_rows(items, verify, counts, cu, num_rows, ends)
        return step

    def _verify_rows(
        self,
        items: list,
        verify: np.ndarray,
        counts: np.ndarray,
        cu: np.ndarray,
        num_rows: np.ndarray,
        ends: np.ndarray,
    ) -> VerifyRows[np.ndarray]:
        """Where the step's verifying requests' tokens and drafts are (batch offsets, sampling
        rows); their positions are the device's."""
        spec = self.speculative
        which = np.flatnonzero(verify)
        n = counts[which]
        token_item = np.repeat(np.arange(len(which)), n)
        token_offset = ragged_arange(np.zeros(len(which), np.int64), n)
        row_starts = np.cumsum(num_rows) - num_rows
        sample_rows = ragged_arange(row_starts[which], n)
        is_draft = token_offset > 0
        num_drafts = n - 1
        passes = [np.flatnonzero(num_drafts > j) for j in range(int(num_drafts.max()))]
        verifying = [items[i] for i in which]
        return VerifyRows(
            table_rows=np.fromiter((items[i].slot for i in which), np.int64, len(which)),
            num_drafts=num_drafts,
            prompt_lens=np.fromiter(
                (items[i].request.num_prompt_tokens for i in which), np.int64, len(which)
            ),
            token_item=token_item,
            token_offset=token_offset,
            token_batch=ragged_arange(cu[which] - n, n),
            sample_rows=sample_rows,
            draft_batch=ragged_arange(cu[which] - n, n)[is_draft],
            draft_item=token_item[is_draft],
            draft_index=token_offset[is_draft] - 1,
            check_rows=sample_rows[is_draft] - 1,
            pass_items=np.concatenate(passes) if passes else np.zeros(0, np.int64),
            item_batch=cu[which] - n,
            item_row=row_starts[which],
            pass_sizes=[len(p) for p in passes],
            max_drafts=int(n.max()) - 1,
            history_len=int(ends[which].max()),
            method=spec.method,
            lookup=(spec.prompt_lookup_max, spec.prompt_lookup_min),
            **(proposal_arrays(verifying) if spec.method == "suffix" else {}),
        )


def proposal_arrays(items: list[ScheduledRequest]) -> dict[str, np.ndarray]:
    """VerifyRows' proposal fields: each item's proposal padded to the longest (none: empty)."""
    proposals = [it.proposal for it in items]
    lens = np.fromiter((len(p.tokens) if p else 0 for p in proposals), np.int64, len(items))
    padded = np.zeros((len(items), max(int(lens.max()), 1)), np.int64)
    for row, p in enumerate(proposals):
        if p is not None:
            padded[row, : len(p.tokens)] = p.tokens
    starts = np.fromiter((p.start if p else 0 for p in proposals), np.int64, len(items))
    return {"proposals": padded, "proposal_start": starts, "proposal_len": lens}
