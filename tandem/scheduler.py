"""Continuous batching: which requests run in the next step, with how many tokens, in which KV slots.

The scheduler owns every request's KV blocks and token-table row, and frees them in one place
(`_release`). It works the same whether or not a step is still in flight: positions and KV slots of
in-flight tokens are allocated in advance, and memory that an in-flight step may still write is
returned only when that step retires.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from tandem.kv_cache import FreeList
from tandem.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    slot: int
    start: int  # first position computed in this step
    num_tokens: int
    sample: bool  # does this step sample the request's next token?
    output_index: int  # index of that token among the request's outputs (keys seeded sampling)
    admitted: bool = False  # first step in this table row (the row's device state starts here)


@dataclass
class ScheduledBatch:
    step_id: int
    items: list[ScheduledRequest]  # decodes (one token each) first, then prefill chunks
    num_decodes: int

    @property
    def num_tokens(self) -> int:
        return sum(item.num_tokens for item in self.items)

    @property
    def sampled(self) -> list[ScheduledRequest]:
        return [item for item in self.items if item.sample]


@dataclass
class _PendingFree:
    after_step: int  # freed once this step has retired
    owner: str
    blocks: list[int]
    slot: int | None


class Scheduler:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ):
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.blocks = FreeList(num_blocks, "KV block")
        # Twice max_num_seqs rows: rows of just-finished requests stay reserved until their last
        # step retires, and new requests must not wait for that.
        self.slots = FreeList(2 * max_num_seqs, "token-table row")
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.block_table = np.zeros((self.slots.size, self.max_blocks_per_seq), dtype=np.int64)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._pending: list[_PendingFree] = []
        self.next_step_id = 0
        self.last_retired_step = -1
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_pending_blocks(self) -> int:
        return sum(len(p.blocks) for p in self._pending)

    # --------------------------------------------------------------- schedule
    def schedule(self) -> ScheduledBatch | None:
        step_id = self.next_step_id
        budget = self.max_num_batched_tokens
        items: list[ScheduledRequest] = []
        scheduled: set[str] = set()

        # Running requests, decodes first so they keep streaming while long prompts prefill.
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for group in (decodes, prefills):
            for request in group:
                if budget == 0:
                    break
                if request.status is not RequestStatus.RUNNING or not request.can_sample_more:
                    continue  # preempted earlier in this pass, or at its length limit
                n = min(request.num_tokens - request.num_computed_tokens, budget)
                if not self._reserve_blocks(request, n, scheduled):
                    continue
                items.append(self._schedule(request, n, step_id))
                scheduled.add(request.request_id)
                budget -= n
            if group is decodes:
                num_decodes = len(items)

        # Waiting requests, first come first served; admission never preempts.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.num_inflight or self.slots.num_free == 0:
                break  # a preempted request waits until its in-flight token is known
            n = min(request.num_tokens, budget)
            if self._blocks_needed(request, n) > self.blocks.num_free:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.slot = self.slots.allocate(1, request.request_id)[0]
            self.running.append(request)
            self._allocate_blocks(request, n)
            items.append(self._schedule(request, n, step_id, admitted=True))
            budget -= n

        if not items:
            return None
        self.next_step_id += 1
        return ScheduledBatch(step_id, items, num_decodes)

    def _schedule(
        self, request: Request, n: int, step_id: int, admitted: bool = False
    ) -> ScheduledRequest:
        start = request.num_computed_tokens
        sample = start + n == request.num_tokens
        item = ScheduledRequest(
            request, request.slot, start, n, sample, request.num_scheduled_outputs, admitted
        )
        request.num_computed_tokens += n
        request.num_inflight += int(sample)
        request.last_step = step_id
        return item

    def _blocks_needed(self, request: Request, n: int) -> int:
        return -(-(request.num_computed_tokens + n) // self.block_size) - len(request.block_ids)

    def _reserve_blocks(self, request: Request, n: int, scheduled: set[str]) -> bool:
        """Find blocks for n more tokens, preempting the newest unscheduled requests if needed.

        Returns False when the request must sit this step out (preempted, or waiting for blocks
        that an in-flight step is about to release).
        """
        need = self._blocks_needed(request, n)
        while need > self.blocks.num_free:
            if need <= self.blocks.num_free + self.num_pending_blocks:
                return False  # blocks come back when the in-flight step retires
            victims = [
                r for r in self.running if r.request_id not in scheduled and r is not request
            ]
            victim = victims[-1] if victims else request
            self.preempt(victim)
            if victim is request:
                return False
        self._allocate_blocks(request, n)
        return True

    def _allocate_blocks(self, request: Request, n: int) -> None:
        need = self._blocks_needed(request, n)
        if need > 0:
            first = len(request.block_ids)
            new = self.blocks.allocate(need, request.request_id)
            request.block_ids.extend(new)
            self.block_table[request.slot, first : first + need] = new

    # ------------------------------------------------------------ lifecycle
    def preempt(self, request: Request) -> None:
        """Recompute later: drop the KV and requeue at the front of the waiting queue."""
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request, reason: str) -> bool:
        """Ends a request once; False if it had already ended (finish and abort can race)."""
        if request.status is RequestStatus.FINISHED:
            return False
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._release(request)
        return True

    def retire_step(self, step_id: int) -> None:
        """Called after a step's outputs are processed: memory it could write is now free."""
        self.last_retired_step = step_id
        still_pending = []
        for pending in self._pending:
            if pending.after_step <= step_id:
                self._free(pending)
            else:
                still_pending.append(pending)
        self._pending = still_pending

    def _release(self, request: Request) -> None:
        """The one place a request's blocks and table row are given up (now or after its step)."""
        pending = _PendingFree(
            request.last_step, request.request_id, request.block_ids, request.slot
        )
        request.block_ids = []
        request.slot = None
        if pending.after_step <= self.last_retired_step:
            self._free(pending)
        else:
            self._pending.append(pending)

    def _free(self, pending: _PendingFree) -> None:
        self.blocks.free(pending.blocks, pending.owner)
        if pending.slot is not None:
            self.slots.free([pending.slot], pending.owner)
