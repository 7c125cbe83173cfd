"""KV-cache memory: the block allocator (exact accounting) and the cache tensors."""

from __future__ import annotations

import torch


class FreeList:
    """Hands out integer ids (KV blocks, token-table rows) and records each id's owner.

    Ownership makes the accounting checkable: an id is never handed out while owned, and freeing an
    id its caller does not own raises instead of corrupting another request. Last freed is first
    reused (a stack), which keeps the working set small and makes reuse hazards show at once.
    """

    def __init__(self, size: int, what: str):
        self.size = size
        self.what = what
        self._free: list[int] = list(range(size - 1, -1, -1))
        self._owner: dict[int, str] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    def allocate(self, n: int, owner: str) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} {self.what}s with {len(self._free)} free")
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self._owner[i] = owner
        return ids

    def free(self, ids: list[int], owner: str) -> None:
        for i in ids:
            if self._owner.get(i) != owner:
                raise RuntimeError(
                    f"{self.what} {i} freed by {owner!r}, owned by {self._owner.get(i)!r}"
                )
            del self._owner[i]
        self._free.extend(ids)

    def owners(self) -> dict[int, str]:
        return dict(self._owner)


def kv_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def num_blocks_for_budget(
    bytes_per_block: int, device: torch.device, gib: float, fraction: float
) -> int:
    """CPU: a fixed size in GiB. CUDA: a fraction of the memory still free after loading weights."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * fraction)
    else:
        budget = int(gib * 1024**3)
    return max(1, budget // bytes_per_block)


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """One tensor per layer, [2 (k, v), blocks, block_size, kv_heads, head_dim]."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
