"""Continuous batching: which requests run in the next step, with how many tokens, in which KV slots.

The scheduler owns every request's KV blocks and token-table row, and frees them in one place
(`_release`). It works the same whether or not a step is still in flight: positions and KV slots of
in-flight tokens are allocated in advance, and memory that an in-flight step may still write is
returned only when that step retires.

Prefix caching: a request admitted with a prefix whose full blocks are cached shares those blocks
(reference counts) and computes only the rest. A full block joins the cache when the step that
wrote its last slot retires (`retire_step`), never earlier: until then its K/V may not exist yet.
Shared blocks are never written again: a request writes only positions past its cached prefix,
and at least its last token is always computed, so its first output has logits.

Sliding windows: layers with a window keep their blocks in groups of their own
(`kv_groups.py`). A block that no query from the step being scheduled on can see is given back
(after the request's previous step, which may still read it), so a long request holds only its
window's blocks in those layers. A cached prefix is reused where every group has the blocks its
first computed position reads.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

import numpy as np

from tandem.request import Request, RequestStatus
from tandem.scheduling.block_pool import (
    ROOT_HASH,
    BlockPool,
    BlockRemoved,
    BlockStored,
    FreeList,
    adapter_root,
    chain_hash,
    group_root,
)
from tandem.scheduling.draft_policy import DraftPolicy, can_draft
from tandem.scheduling.kv_groups import DROPPED, KVGroups, kv_groups
from tandem.scheduling.lora_slots import LoraSlots
from tandem.scheduling.suffix_proposer import Proposal, SuffixProposer


@dataclass
class ScheduledRequest:
    request: Request
    slot: int
    start: int  # first position computed in this step
    num_tokens: int
    sample: bool  # does this step sample the request's next token?
    output_index: int  # index of that token among the request's outputs (keys seeded sampling)
    # First step in this table row (the row's device state starts here). Every admission sets it:
    # first arrival, a cached prefix (start > 0), an n > 1 sample, re-admission after preemption.
    admitted: bool = False
    # Speculative decoding: tokens drafted after the request's last one (num_tokens is 1 + this),
    # and whether the device places the step's tokens: the request had drafts in flight, so its
    # position is known on the device only (`start` is then the host's upper bound).
    num_drafts: int = 0
    verify: bool = False
    proposal: Proposal | None = None  # suffix decoding: where the device takes the drafts from

    @property
    def num_rows(self) -> int:
        """Sampling rows: one per token of a verification (each predicts the next), else one."""
        return self.num_tokens if self.verify else int(self.sample)


@dataclass
class ScheduledBatch:
    step_id: int
    items: list[ScheduledRequest]  # decodes (one token each) first, then prefill chunks
    num_decodes: int
    # The newest earlier step whose sampled tokens this one may read, and every retired one (a
    # row they sampled into may be another request's now): a pipeline's first stage takes
    # their ids from the last stage before it starts this step.
    reads_through: int = -1

    @property
    def num_tokens(self) -> int:
        return sum(item.num_tokens for item in self.items)

    @property
    def sampled(self) -> list[ScheduledRequest]:
        return [item for item in self.items if item.sample]


@dataclass
class _PendingFree:
    after_step: int  # freed once this step has retired
    owner: tuple[str, int]
    blocks: list[int]
    slot: int | None


@dataclass
class CacheStats:
    """Admissions and the prefix cache, counted since the scheduler started (tokens unless named).

    Every admission (a re-admission after preemption included) looks up its known tokens;
    `query_tokens - hit_tokens` is the prefill work done, `hit_tokens` the work saved.
    """

    queries: int = 0  # admissions
    hits: int = 0  # admissions that reused at least one cached block
    query_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class Scheduler:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        drafts: DraftPolicy | None = None,
        groups: KVGroups | None = None,
        pipeline_stages: int = 1,
    ):
        """`num_blocks`: the pool's, shared by every group of layers (`groups`; default one)."""
        self.pipeline_stages = pipeline_stages
        self.block_size = block_size
        self.groups = groups or kv_groups([None], max_model_len)
        self.drafts = drafts  # None: no speculative decoding
        self.proposer: SuffixProposer | None = None  # suffix decoding's trees
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.blocks = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        # Twice max_num_seqs rows: rows of just-finished requests stay reserved until their last
        # step retires, and new requests must not wait for that.
        self.slots = FreeList(2 * max_num_seqs, "token-table row")
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        # [groups, table rows, blocks]: each group of layers has its own blocks.
        self.block_table = np.zeros(
            (self.groups.num_groups, self.slots.size, self.max_blocks_per_seq), dtype=np.int64
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._pending: list[_PendingFree] = []
        self.next_step_id = 0
        self.last_retired_step = -1
        self.micro_batches = 1  # steps of different requests in flight at once (`use_loop`)
        self.num_preemptions = 0
        self.stats = CacheStats()
        # Hashes of full blocks that launched steps are computing (they join the cache when their
        # step retires), counted, and which step computes which.
        self._in_progress: Counter[bytes] = Counter()
        self._in_progress_by_step: dict[int, list[bytes]] = {}
        self.lora_slots: LoraSlots | None = None  # with LoRA: which adapter each slot holds

    def record_cache_events(self) -> None:
        """From now on, record every block that joins or leaves the prefix cache."""
        self.blocks.events = []

    def take_cache_events(self) -> list[BlockStored | BlockRemoved]:
        """The blocks that joined or left the cache since the last call, in order (none unless
        recording)."""
        events = self.blocks.events
        if not events:
            return []
        self.blocks.events = []
        return events

    # ------------------------------------------------------------------ queue
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_pending_blocks(self) -> int:
        """Blocks that come back to the pool when the in-flight step retires (shared ones whose
        other owners keep running do not)."""
        counts = Counter(b for p in self._pending for b in p.blocks)
        return sum(1 for b, c in counts.items() if self.blocks.refcount(b) == c)

    def use_loop(self, asynchronous: bool) -> int:
        """Schedule for the engine's loop; returns how many steps it keeps in flight: none
        (synchronous), one, or one per pipeline stage, each a micro-batch of other requests (a
        request's next token must leave the last stage before the first can read it, so
        consecutive steps of one request would leave the stages idle)."""
        self.micro_batches = self.pipeline_stages if asynchronous else 1
        return self.micro_batches if asynchronous else 0

    # --------------------------------------------------------------- schedule
    def schedule(self) -> ScheduledBatch | None:
        step_id = self.next_step_id
        budget = self.max_num_batched_tokens
        items: list[ScheduledRequest] = []
        scheduled: set[Request] = set()  # by identity
        # A decode reads the token of its request's previous step: it waits for one that is
        # retired, or the oldest of the micro-batches in flight, which leaves the last stage as
        # this step enters the first. Each micro-batch takes its share of the requests.
        ready = max(self.last_retired_step, step_id - self.micro_batches)
        reads_through = self.last_retired_step
        room = -(-self.num_unfinished // self.micro_batches)

        # Running requests, decodes first so they keep streaming while long prompts prefill.
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        drafts, proposals = self._allot_drafts(decodes, budget)
        for group in (decodes, prefills):
            for request in group:
                if budget == 0 or len(items) == room:
                    break
                if request.status is not RequestStatus.RUNNING or not request.can_sample_more:
                    continue  # preempted earlier in this pass, or at its length limit
                if group is decodes:
                    if request.last_step > ready:
                        continue  # its token is still on its way through the pipeline
                    reads_through = max(reads_through, request.last_step)
                n = min(request.num_tokens - request.num_computed_tokens, budget)
                if self.groups.windowed:
                    self._drop_passed_blocks(request)
                if not self._reserve_blocks(request, n, scheduled):
                    continue
                k = self._fit_drafts(request, n, drafts.get(request, 0), budget - n)
                items.append(self._schedule(request, n + k, step_id, drafts=k))
                if k and proposals:
                    items[-1].proposal = proposals[request]
                scheduled.add(request)
                budget -= n + k
            if group is decodes:
                num_decodes = len(items)

        # Waiting requests, first come first served; admission never preempts. A request whose
        # next uncached block a launched step is computing waits for it (passed over, not in the
        # way): that block is in the cache once the step retires.
        i = 0
        while (
            i < len(self.waiting)
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and len(items) < room
        ):
            request = self.waiting[i]
            if request.num_inflight or self.slots.num_free == 0:
                break  # a preempted request waits until its in-flight token is known
            if request.lora_key is not None and not self.lora_slots.can_take(request.lora_key):
                i += 1  # every slot holds another adapter that runs: passed over, not blocking
                continue
            hits = self._cached_prefix(request)
            if hits is None:
                i += 1
                continue
            num_hits = len(hits[0])
            cached = num_hits * self.block_size
            n = min(request.num_tokens - cached, budget)
            need = (-(-(cached + n) // self.block_size) - num_hits) * self.groups.num_groups
            shared = [b for ids in hits for b in ids if b != DROPPED]
            if need > self.blocks.num_free - self.blocks.num_free_among(shared):
                break
            del self.waiting[i]
            self._admit(request, hits)
            self._allocate_blocks(request, n)
            items.append(self._schedule(request, n, step_id, admitted=True))
            budget -= n

        if not items:
            return None
        self.next_step_id += 1
        return ScheduledBatch(step_id, items, num_decodes, reads_through)

    def _admit(self, request: Request, hits: list[list[int]]) -> None:
        """`hits`: per group, the cached blocks of the prefix it reuses (DROPPED before a
        window)."""
        request.status = RequestStatus.RUNNING
        request.slot = self.slots.allocate(1, request.key)[0]
        if request.lora_key is not None:
            request.lora_slot = self.lora_slots.take(request.lora_key)
        request.sampled_in_row = False
        self.running.append(request)
        num_hits = len(hits[0])
        request.block_ids = [list(ids) for ids in hits]
        for g, ids in enumerate(hits):
            self.blocks.share([b for b in ids if b != DROPPED], request.key)
            # A dropped entry is never read (kernels start at the window); 0 keeps it in range.
            self.block_table[g, request.slot, :num_hits] = [max(b, 0) for b in ids]
        request.num_registered_blocks = num_hits
        request.num_computed_tokens = num_hits * self.block_size
        if request.num_cached_tokens is None:  # a re-admission after preemption keeps the first
            request.num_cached_tokens = request.num_computed_tokens
        stats = self.stats
        stats.queries += 1
        stats.query_tokens += request.num_tokens
        if num_hits:
            stats.hits += 1
            stats.hit_tokens += request.num_computed_tokens

    # ------------------------------------------------------------ prefix cache
    def _cache_root(self, request: Request) -> bytes | None:
        """Where the request's hash chain starts; None: it takes no part in caching.

        With caching off, the samples of an n > 1 request still share their prompt, through a
        chain private to them.
        """
        if self.enable_prefix_caching:  # an adapter's blocks hold its own K/V: a chain of its own
            return ROOT_HASH if request.lora_key is None else adapter_root(request.lora_key)
        return group_root(request.request_id) if request.params.n > 1 else None

    def _hash_blocks(self, request: Request, num_blocks: int, root: bytes) -> None:
        """Extend the request's chain of block hashes to its first `num_blocks` blocks."""
        hashes, bs = request.block_hashes, self.block_size
        parent = hashes[-1] if hashes else root
        for j in range(len(hashes), num_blocks):
            parent = chain_hash(parent, request.known_token_ids(j * bs, (j + 1) * bs))
            hashes.append(parent)

    def _cached_prefix(self, request: Request) -> list[list[int]] | None:
        """Per group, the cached blocks of the request's longest cached prefix, short of its
        last token (a windowed group: those its first computed position reads, DROPPED before
        them); None if a launched step is computing the block after them (better wait for it).

        A request that still needs prompt logprobs reuses nothing: they come from the hidden
        states of computed positions, so every prompt position must be computed (as in vLLM).
        Its own blocks still join the cache for others.
        """
        groups = self.groups.groups
        root = self._cache_root(request)
        if root is None or request.needs_prompt_logprobs:
            return [[] for _ in groups]
        num_blocks = (request.num_tokens - 1) // self.block_size
        self._hash_blocks(request, num_blocks, root)
        hashes = request.block_hashes
        found = num_blocks
        for g, group in enumerate(groups):
            if group.window is None:  # a full group's hits are a prefix: none is longer
                found = min(found, len(self._group_hits(g, hashes, found)))
        while True:
            hits = [self._group_hits(g, hashes, found) for g in range(len(groups))]
            if all(len(ids) == found for ids in hits):
                break
            found -= 1  # a windowed group lacks a block its window reads
        if found < num_blocks and hashes[found] in self._in_progress:
            return None
        return hits

    def _group_hits(self, g: int, hashes: list[bytes], num_blocks: int) -> list[int]:
        """Group g's cached blocks of the first `num_blocks`, from the first one that position
        num_blocks * block_size reads (DROPPED before it); shorter where one is missing."""
        first = self.groups.first_needed_block(g, num_blocks * self.block_size, self.block_size)
        return [DROPPED] * first + self.blocks.lookup(_keys(g, hashes[first:num_blocks]))

    def _mark_in_progress(self, request: Request, start: int, end: int, step_id: int) -> None:
        """Record the full blocks of known tokens that this step completes for the request."""
        root = self._cache_root(request)
        if root is None:
            return
        bs = self.block_size
        known = request.num_prompt_tokens + len(request.output_token_ids)
        first, last = max(start // bs, request.num_registered_blocks), min(end, known) // bs
        if last <= first:
            return
        self._hash_blocks(request, last, root)
        hashes = request.block_hashes[first:last]
        self._in_progress.update(hashes)
        self._in_progress_by_step.setdefault(step_id, []).extend(hashes)

    def _register_full_blocks(self, item: ScheduledRequest) -> None:
        """After `item`'s step retired: its request's blocks now full and written join the cache."""
        request = item.request
        # The same incarnation only: a request preempted after this step was scheduled has
        # given up these blocks, and one re-admitted since holds a new token-table row (the old
        # row stays reserved until this step retires).
        if request.status is not RequestStatus.RUNNING or request.slot != item.slot:
            return
        known = request.num_prompt_tokens + len(request.output_token_ids)
        full = min(item.start + item.num_tokens, known) // self.block_size
        if full <= request.num_registered_blocks:
            return
        root = self._cache_root(request)
        if root is None:
            return
        self._hash_blocks(request, full, root)
        hashes = request.block_hashes
        for g, ids in enumerate(request.block_ids):
            for j in range(request.num_registered_blocks, full):
                # DROPPED: not held, before the window of a cached prefix
                stored = ids[j] != DROPPED and self.blocks.register(ids[j], _key(g, hashes[j]))
                if stored and self.blocks.events is not None:
                    self.blocks.events.append(self._stored(request, g, j))
        request.num_registered_blocks = full

    def _stored(self, request: Request, group: int, j: int) -> BlockStored:
        bs, hashes, lora = self.block_size, request.block_hashes, request.lora
        return BlockStored(
            _key(group, hashes[j]), _key(group, hashes[j - 1]) if j else None,
            tuple(request.known_token_ids(j * bs, (j + 1) * bs)), group,
            lora.lora_int_id if lora else None, lora.lora_name if lora else None,
        )  # fmt: skip

    def reset_prefix_cache(self) -> None:
        """Forget every cached block no request holds (the benchmark's cold start)."""
        self.blocks.reset_cache()

    def _schedule(
        self, request: Request, n: int, step_id: int, admitted: bool = False, drafts: int = 0
    ) -> ScheduledRequest:
        start = request.num_computed_tokens
        sample = start + n - drafts == request.num_tokens
        verify = bool(drafts or request.num_speculative)
        item = ScheduledRequest(
            request, request.slot, start, n, sample, request.num_scheduled_outputs, admitted,
            drafts, verify,
        )  # fmt: skip
        if not verify and (start + n) // self.block_size > start // self.block_size:
            self._mark_in_progress(request, start, start + n, step_id)  # a block fills up
        request.num_computed_tokens += n
        request.num_inflight += item.num_rows
        request.num_speculative += drafts
        request.sampled_in_row |= sample
        request.last_step = step_id
        return item

    # ------------------------------------------------------------ speculation
    def _allot_drafts(
        self, decodes: list[Request], budget: int
    ) -> tuple[dict[Request, int], dict[Request, Proposal]]:
        """Drafts each decoding request gets this step (the policy's allotment), and under
        suffix decoding the proposals they come from (each cuts its request's drafts)."""
        if self.drafts is None or not decodes:
            return {}, {}
        # Only a request whose row's length is on the device (a step since its admission
        # sampled it) drafts: a last prefill chunk of one token is no decode yet.
        drafting = [r for r in decodes if r.sampled_in_row and can_draft(r)]
        if not drafting:
            return {}, {}
        base = min(len(decodes), budget)
        allotted = self.drafts.allot(drafting, base, budget - base)
        drafts = {r: k for r, k in zip(drafting, allotted, strict=True) if k}
        if self.proposer is None:
            return drafts, {}
        # Only the requests the policy lets draft ask the trees (a large batch that drafts
        # nothing pays nothing), each cut to its proposal past the tokens in flight.
        proposals = {r: self.proposer.propose(r, k) for r, k in drafts.items()}
        for r, proposal in proposals.items():
            drafts[r] = max(min(drafts[r], len(proposal.tokens) - r.num_inflight), 0)
        return {r: k for r, k in drafts.items() if k}, proposals

    def _fit_drafts(self, request: Request, n: int, k: int, budget: int) -> int:
        """Drafts the request can take after its `n` tokens (their blocks reserved): within the
        step's budget, short of max_tokens, in blocks it holds or free ones (drafts never
        preempt anyone); their blocks are allocated here."""
        k = min(k, budget, request.max_tokens - request.num_scheduled_outputs - 1)
        while k > 0 and self._blocks_needed(request, n + k) > self.blocks.num_free:
            k -= 1
        if k > 0:
            self._allocate_blocks(request, n + k)
        return max(k, 0)

    def settle(self, item: ScheduledRequest, num_sampled: int) -> None:
        """At retirement: the item's step kept `num_sampled` of its sampled tokens (a
        verification: its accepted drafts plus one). The bounds become exact again, and blocks
        held only for rejected drafts are given back (after the request's last launched step)."""
        request = item.request
        request.num_inflight -= item.num_rows
        if not item.verify:
            return
        request.num_speculative -= item.num_drafts
        rejected = item.num_rows - num_sampled
        if rejected and request.status is RequestStatus.RUNNING and request.slot == item.slot:
            request.num_computed_tokens -= rejected
            keep = -(-request.num_computed_tokens // self.block_size)
            if _num_blocks(request) > keep:
                spare = [b for ids in request.block_ids for b in ids[keep:] if b != DROPPED]
                request.block_ids = [ids[:keep] for ids in request.block_ids]
                self._defer_free(_PendingFree(request.last_step, request.key, spare, None))

    def _blocks_needed(self, request: Request, n: int) -> int:
        """New blocks for n more tokens, over every group."""
        return self._new_blocks_per_group(request, n) * self.groups.num_groups

    def _new_blocks_per_group(self, request: Request, n: int) -> int:
        return -(-(request.num_computed_tokens + n) // self.block_size) - _num_blocks(request)

    def _drop_passed_blocks(self, request: Request) -> None:
        """Give back the blocks of windowed groups that no query of the step being scheduled,
        or of any later one, reads: once the request's last launched step, which may still
        read them, retires. Positions are the host's lower bound (drafts may be rejected). A
        block that is to join the prefix cache stays until it has (its step retired), so that
        a later request with the same prefix finds the window before its first position."""
        position = request.num_computed_tokens - request.num_speculative
        caching = self._cache_root(request) is not None
        dropped = []
        for g, ids in enumerate(request.block_ids):
            end = self.groups.first_needed_block(g, position, self.block_size)
            if caching:
                end = min(end, request.num_registered_blocks)
            j = min(end, len(ids)) - 1
            while j >= 0 and ids[j] != DROPPED:  # the dropped blocks are a prefix
                dropped.append(ids[j])
                ids[j] = DROPPED
                j -= 1
        if dropped:
            self._defer_free(_PendingFree(request.last_step, request.key, dropped, None))

    def _reserve_blocks(self, request: Request, n: int, scheduled: set[Request]) -> bool:
        """Find blocks for n more tokens, preempting the newest unscheduled requests if needed.

        Returns False when the request must sit this step out (preempted, or waiting for blocks
        that an in-flight step is about to release).
        """
        need = self._blocks_needed(request, n)
        while need > self.blocks.num_free:
            if need <= self.blocks.num_free + self.num_pending_blocks:
                return False  # blocks come back when the in-flight step retires
            victims = [r for r in self.running if r not in scheduled and r is not request]
            if not victims and request.last_step > self.last_retired_step:
                # Its own step is in flight: preempted now, it would free nothing before that
                # step retires, and the retirement may free enough (a windowed group's blocks
                # leave once registered in the prefix cache); preempted each time, it never would.
                return False
            victim = victims[-1] if victims else request
            self.preempt(victim)
            if victim is request:
                return False
        self._allocate_blocks(request, n)
        return True

    def _allocate_blocks(self, request: Request, n: int) -> None:
        need = self._new_blocks_per_group(request, n)
        if need <= 0:
            return
        if not request.block_ids:
            request.block_ids = [[] for _ in self.groups.groups]
        for g, ids in enumerate(request.block_ids):
            first = len(ids)
            last = ids[-1] if ids and ids[-1] != DROPPED else None
            new = self.blocks.allocate(need, request.key, after=last)
            ids.extend(new)
            self.block_table[g, request.slot, first : first + need] = new

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
        if self.proposer is not None:
            self.proposer.finish(request)
        return True

    def retire_step(self, batch: ScheduledBatch) -> None:
        """Called once a step has finished, before its sampled tokens are processed: the blocks
        it filled become shareable, and memory it could write is now free."""
        step_id = batch.step_id
        self.last_retired_step = step_id
        bs, caching = self.block_size, self.enable_prefix_caching
        for item in batch.items:  # the cheap checks first: most decodes fill no block
            request = item.request
            if (item.start + item.num_tokens) // bs > request.num_registered_blocks and (
                caching or request.params.n > 1
            ):
                self._register_full_blocks(item)
        for h in self._in_progress_by_step.pop(step_id, ()):
            self._in_progress[h] -= 1
            if not self._in_progress[h]:
                del self._in_progress[h]
        still_pending = []
        for pending in self._pending:
            if pending.after_step <= step_id:
                self._free(pending)
            else:
                still_pending.append(pending)
        self._pending = still_pending

    def _release(self, request: Request) -> None:
        """The one place a request's blocks and table row are given up (now or after its step)."""
        blocks = [b for ids in request.block_ids for b in ids if b != DROPPED]
        pending = _PendingFree(request.last_step, request.key, blocks, request.slot)
        request.block_ids = []
        request.num_registered_blocks = 0
        request.slot = None
        if request.lora_slot >= 0:
            self.lora_slots.give_back(request.lora_slot)
            request.lora_slot = -1
        self._defer_free(pending)

    def _defer_free(self, pending: _PendingFree) -> None:
        if pending.after_step <= self.last_retired_step:
            self._free(pending)
        else:
            self._pending.append(pending)

    def _free(self, pending: _PendingFree) -> None:
        self.blocks.free(pending.blocks, pending.owner)
        if pending.slot is not None:
            self.slots.free([pending.slot], pending.owner)


def _num_blocks(request: Request) -> int:
    """Blocks of positions the request holds (in every group alike, DROPPED ones included)."""
    return len(request.block_ids[0]) if request.block_ids else 0


def _key(group: int, block_hash: bytes) -> bytes:
    """A block's cache key in its group of layers (group 0's is the plain chain hash)."""
    return block_hash + bytes([group]) if group else block_hash


def _keys(group: int, hashes: list[bytes]) -> list[bytes]:
    return [_key(group, h) for h in hashes]
