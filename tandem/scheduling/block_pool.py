"""KV-cache accounting: the allocators of blocks and table rows (exact ownership), the prefix
cache's block pool and its hash chain. The tensors themselves are the execution layer's."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np


class FreeList:
    """Hands out integer ids (token-table rows) and records each id's owner.

    Ownership makes the accounting checkable: an id is never handed out while owned, and freeing an
    id its caller does not own raises instead of corrupting another request. Last freed is first
    reused (a stack), which keeps the working set small and makes reuse hazards show at once.
    """

    def __init__(self, size: int, what: str):
        self.size = size
        self.what = what
        self._free: list[int] = list(range(size - 1, -1, -1))
        self._owner: dict[int, Hashable] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    def allocate(self, n: int, owner: Hashable) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} {self.what}s with {len(self._free)} free")
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self._owner[i] = owner
        return ids

    def free(self, ids: list[int], owner: Hashable) -> None:
        for i in ids:
            if self._owner.get(i) != owner:
                raise RuntimeError(
                    f"{self.what} {i} freed by {owner!r}, owned by {self._owner.get(i)!r}"
                )
            del self._owner[i]
        self._free.extend(ids)

    def owners(self) -> dict[int, Hashable]:
        return dict(self._owner)


ROOT_HASH = hashlib.blake2b(b"tandem-prefix-cache-v1", digest_size=16).digest()


def chain_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The identity of a full KV block: its parent block's hash and its own token ids.

    A block's K/V depend on every token before it, and the chain makes its hash do the same.
    blake2b rather than Python's `hash`, which is salted per process: the chain must mean the
    same in every process (tensor-parallel workers, a restarted server).
    """
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


def group_root(group: str) -> bytes:
    """A chain root private to one request's samples (n > 1 with prefix caching off)."""
    return hashlib.blake2b(b"tandem-group:" + group.encode(), digest_size=16).digest()


def adapter_root(key: str) -> bytes:
    """The chain root of a LoRA adapter's requests: its blocks are found by its requests only."""
    return hashlib.blake2b(b"tandem-lora:" + key.encode(), digest_size=16).digest()


@dataclass(frozen=True)
class BlockStored:
    """A full block joined the prefix cache: its key, its parent's (None: the chain's first),
    its tokens, its group of layers, its LoRA adapter (id and name; None: the base model)."""

    key: bytes
    parent: bytes | None
    token_ids: tuple[int, ...]
    group: int
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """A block left the prefix cache: evicted for another, or the cache was reset."""

    key: bytes


@dataclass
class BlockAccounting:
    """What `BlockPool.check` found: every block is in exactly one of these states."""

    used: int  # referenced by at least one owner
    free_plain: int  # free, no cached content
    free_cached: int  # free, still holding a cached full block (evicted least recently used first)
    hashed: int  # blocks with a registered hash, used or free


class BlockPool:
    """KV blocks: reference counted, with a cache of full blocks keyed by their chained hash.

    Each used block records the set of its owners (requests), so its reference count is exact
    and checkable, and freeing a block its caller does not own raises instead of corrupting
    another request. A block whose last owner frees it keeps its contents and hash: a later
    request with the same prefix takes it back (`share`). New blocks come from the blocks without
    cached content first, then by evicting the least recently freed cached block. The pool knows
    nothing of steps: callers free only once no in-flight step can touch a block, and register a
    hash only once the step that wrote its last slot has retired.

    Among blocks without cached content, a sequence's next block is the one after its last where
    that one is free; otherwise its blocks are centred in the longest free run, leaving room on
    both sides (at the run's start only at block 0, where nothing grows into it). So requests
    that grow together still keep their K/V in long runs in memory, which a CPU's hardware
    prefetcher streams faster than blocks handed out in turn, which interleave lockstep
    requests block by block.
    """

    def __init__(self, size: int):
        self.size = size
        self._owners: dict[int, set[Hashable]] = {}
        self._plain = np.ones(size, dtype=bool)  # free, no cached content
        self._num_plain = size
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.num_evictions = 0
        self.events: list[BlockStored | BlockRemoved] | None = None  # recorded when a list

    @property
    def num_free(self) -> int:
        """Blocks no request holds, cached or not: all can be handed out."""
        return self._num_plain + len(self._free_cached)

    @property
    def num_used(self) -> int:
        return len(self._owners)

    @property
    def num_free_cached(self) -> int:
        """Free blocks that still hold a cached full block."""
        return len(self._free_cached)

    @property
    def num_cached(self) -> int:
        """Blocks holding a registered full block (in use or free)."""
        return len(self._hash_of)

    def refcount(self, block: int) -> int:
        return len(self._owners.get(block, ()))

    def allocate(self, n: int, owner: Hashable, after: int | None = None) -> list[int]:
        """n blocks with no cached content, owned by `owner` alone, to follow block `after`
        (the sequence's last block; None for its first)."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} KV blocks with {self.num_free} free")
        ids = []
        for _ in range(n):
            if self._num_plain:
                block = self._next_plain(after, n - len(ids))
                self._plain[block] = False
                self._num_plain -= 1
                after = block
            else:  # evict the least recently freed cached block
                block, _ = self._free_cached.popitem(last=False)
                self._forget(block)
                self.num_evictions += 1
            self._owners[block] = {owner}
            ids.append(block)
        return ids

    def _next_plain(self, after: int | None, want: int) -> int:
        """The free block after `after`, else the first of `want` centred in the longest free
        run: the sequence before the run and the new one get equal room to grow."""
        if after is not None and after + 1 < self.size and self._plain[after + 1]:
            return after + 1
        edges = np.flatnonzero(np.diff(self._plain, prepend=False, append=False))
        starts, ends = edges[0::2], edges[1::2]
        longest = int(np.argmax(ends - starts))
        start, end = int(starts[longest]), int(ends[longest])
        return start if start == 0 else start + max(0, end - start - want) // 2

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Blocks of the longest cached prefix of `hashes` (nothing is taken)."""
        blocks = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_free_among(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` are free now (sharing them takes them out of the free pool)."""
        return sum(1 for b in blocks if b not in self._owners)

    def share(self, blocks: Sequence[int], owner: Hashable) -> None:
        """Add `owner` to cached blocks found by `lookup`."""
        for block in blocks:
            owners = self._owners.get(block)
            if owners is None:
                del self._free_cached[block]
                self._owners[block] = {owner}
            elif owner in owners:
                raise RuntimeError(f"KV block {block} shared twice with {owner!r}")
            else:
                owners.add(owner)

    def free(self, blocks: Sequence[int], owner: Hashable) -> None:
        """Drop `owner`'s reference. The last blocks of a sequence are the first evicted."""
        for block in reversed(blocks):
            owners = self._owners.get(block)
            if owners is None or owner not in owners:
                raise RuntimeError(
                    f"KV block {block} freed by {owner!r}, owned by {sorted(owners or (), key=str)}"
                )
            owners.discard(owner)
            if not owners:
                del self._owners[block]
                if block in self._hash_of:
                    self._free_cached[block] = None
                else:
                    self._plain[block] = True
                    self._num_plain += 1

    def register(self, block: int, block_hash: bytes) -> bool:
        """Make a used, full block findable. False if another block already holds this content
        (two requests computed the same prefix at once): this one stays private."""
        if block not in self._owners:
            raise RuntimeError(f"KV block {block} registered while free")
        if block in self._hash_of:
            raise RuntimeError(f"KV block {block} registered twice")
        if block_hash in self._block_of:
            return False
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
        return True

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def hash_of(self, block: int) -> bytes | None:
        return self._hash_of.get(block)

    def reset_cache(self) -> None:
        """Forget every free cached block (used blocks keep their hashes)."""
        for block in self._free_cached:
            self._forget(block)
            self._plain[block] = True
        self._num_plain += len(self._free_cached)
        self._free_cached.clear()

    def _forget(self, block: int) -> None:
        key = self._hash_of.pop(block)
        del self._block_of[key]
        if self.events is not None:
            self.events.append(BlockRemoved(key))

    def owners(self) -> dict[int, set[Hashable]]:
        """Every used block and its owners (a copy)."""
        return {block: set(owners) for block, owners in self._owners.items()}

    def check(self) -> BlockAccounting:
        """Verify the pool's invariants (raises RuntimeError) and return its accounting."""
        plain, cached = set(np.flatnonzero(self._plain).tolist()), set(self._free_cached)
        used = set(self._owners)
        problems = []
        if len(plain) != self._num_plain:
            problems.append("the count of free blocks is wrong")
        if plain & cached or (plain | cached) & used:
            problems.append("a block is both free and used, or free twice")
        if len(plain) + len(cached) + len(used) != self.size:
            problems.append("blocks went missing")
        if any(not owners for owners in self._owners.values()):
            problems.append("a used block has no owner")
        if plain & set(self._hash_of):
            problems.append("a plain free block has a hash")
        if not cached <= set(self._hash_of):
            problems.append("a cached free block has no hash")
        if any(self._block_of.get(h) != b for b, h in self._hash_of.items()) or len(
            self._block_of
        ) != len(self._hash_of):
            problems.append("the hash table is inconsistent")
        if problems:
            raise RuntimeError("KV block pool: " + "; ".join(problems))
        return BlockAccounting(len(used), len(plain), len(cached), len(self._hash_of))
