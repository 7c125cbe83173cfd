"""KV-cache tensors: how many blocks a memory budget holds, and their allocation (huge pages)."""

from __future__ import annotations

import torch

from tandem.models.spec import LlamaSpec
from tandem.ops import huge_pages
from tandem.ops.kv_quant import row_width
from tandem.scheduling.kv_groups import KVGroups, kv_groups


def layer_groups(spec: LlamaSpec, max_model_len: int | None) -> KVGroups:
    """The model's groups of layers that share block tables (one unless windows differ)."""
    return kv_groups(spec.layer_windows(), max_model_len or spec.max_position_embeddings)


def kv_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of one block in every cache tensor: K and V rows, their scales where quantized."""
    return 2 * num_layers * block_size * num_kv_heads * row_width(head_dim, dtype) * dtype.itemsize


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
    num_layers: int,  # cache tensors: the model's layers, or its groups' places
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """One tensor per layer, [2 (k, v), blocks, block_size, kv_heads, head_dim], or head_dim + 4
    bytes a row in a cache of one byte a value (`ops/kv_quant.py`)."""
    shape = (2, num_blocks, block_size, num_kv_heads, row_width(head_dim, dtype))
    return [huge_pages.zeros(shape, dtype, device) for _ in range(num_layers)]
