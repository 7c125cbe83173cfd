"""Which layers share a block table: the KV cache of models whose layers attend differently.

A layer with a sliding window needs only its window's keys, so its blocks before the window can
go back to the pool while the request runs; a full-attention layer needs every block. Layers are
split into groups of one kind each, every group the same number of layers (the smallest kind's
count; a kind that does not divide evenly has a last group with unused places), so that one
block id means the same bytes in every group and one pool serves them all (vLLM's hybrid KV
cache has this shape). Each group has its own block table; a pool block id holds the K/V of the
group's layers, one per cache tensor ("place"). A model whose layers all attend alike is one
group: a block holds every layer, as in a plain paged cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DROPPED = -1  # a block table entry whose block went back to the pool (before a window)


@dataclass(frozen=True)
class KVGroup:
    layers: tuple[int, ...]  # model layer indices, in place order
    window: int | None  # keys a query sees (itself included); None: every earlier key


@dataclass(frozen=True)
class KVGroups:
    groups: tuple[KVGroup, ...]
    places: int  # cache tensors: layers per group (the most any group has)
    layer_group: tuple[int, ...]  # per model layer: its group
    layer_place: tuple[int, ...]  # per model layer: its cache tensor

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def windowed(self) -> bool:
        """Whether some layers drop blocks before their window."""
        return any(g.window is not None for g in self.groups)

    def first_needed_block(self, group: int, position: int, block_size: int) -> int:
        """The first block that a query at `position` (and every later one) reads in `group`."""
        window = self.groups[group].window
        if window is None:
            return 0
        return max(0, position - window + 1) // block_size

    def max_blocks(self, length: int, block_size: int, chunk: int) -> int:
        """The most blocks one request of `length` tokens needs at once, computing up to
        `chunk` tokens a step (a windowed group: the window before the chunk, and the chunk)."""
        full = -(-length // block_size)
        return sum(
            full if g.window is None else min(full, -(-(g.window - 1 + chunk) // block_size) + 1)
            for g in self.groups
        )

    def max_length(self, num_blocks: int, block_size: int, chunk: int, limit: int) -> int:
        """The longest request (at most `limit` tokens) that `num_blocks` blocks hold."""
        low, high = 0, limit
        while low < high:
            mid = (low + high + 1) // 2
            if self.max_blocks(mid, block_size, chunk) <= num_blocks:
                low = mid
            else:
                high = mid - 1
        return low


def kv_groups(layer_windows: Sequence[int | None], max_model_len: int) -> KVGroups:
    """Group layers by their window. A window as long as the context is no window at all."""
    windows = [w if w is not None and w < max_model_len else None for w in layer_windows]
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        kinds.setdefault(window, []).append(layer)
    places = min(len(layers) for layers in kinds.values())
    groups = [
        KVGroup(tuple(layers[i : i + places]), window)
        for window, layers in kinds.items()
        for i in range(0, len(layers), places)
    ]
    layer_group, layer_place = [0] * len(windows), [0] * len(windows)
    for g, group in enumerate(groups):
        for place, layer in enumerate(group.layers):
            layer_group[layer], layer_place[layer] = g, place
    return KVGroups(tuple(groups), places, tuple(layer_group), tuple(layer_place))
