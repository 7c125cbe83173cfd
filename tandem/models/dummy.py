"""Dummy weights: a model built from its config.json alone, with seeded random values.

`load_format="dummy"` runs a model's shapes (an 8B on a GPU, say) without its download, as vLLM's
option of that name does. Every value is a counter-based hash of (engine seed, checkpoint tensor
name, row, column), computed on the target device for exactly the rows and columns asked for:

- a tensor-parallel rank makes only its own slices, and the slices of any split put together are
  the one-rank model bit for bit, so outputs at two ranks equal one rank's (a seeded
  `torch.Generator` would have to draw each whole tensor on every rank and keep a slice: N times
  the work, and a whole tensor's transient memory on each rank);
- nothing passes through the host: no CPU copy of the model, ever;
- the values are integer arithmetic, then exact float steps, so CPU and CUDA make the same ones.

The values go through `LlamaModel.load_weight`, the very code that places a checkpoint's tensors:
`DummyTensor` answers the slicing a safetensors slice answers (`t[:]`, `t[rows]`, `t[:, cols]`).
Matrices and biases are uniform with the standard deviation of the config's `initializer_range`
(0.02 for Llama, as its own initialisation), norm weights are 1: an 8B's bf16 logits stay finite.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from tandem.models.llama import LlamaModel
from tandem.ops.hashing import MASK32, mix32

# Elements hashed at once: bounds the int64 temporaries. A GPU wants few, large launches (128 MB
# temporaries); a CPU wants them in its cache (512 KB of temporaries).
_CHUNK = {"cuda": 1 << 24, "cpu": 1 << 16}


@dataclass(frozen=True)
class DummyTensor:
    """A checkpoint tensor that is never stored: slicing it computes that part on `device`."""

    name: str
    shape: tuple[int, ...]  # the whole tensor's
    key: int  # 32-bit hash of (seed, name)
    std: float  # 0: a norm weight (all ones)
    dtype: torch.dtype
    device: torch.device

    def __getitem__(self, index) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > len(self.shape):
            raise IndexError(f"{self.name}: {len(index)} indices for {len(self.shape)} dims")
        index += (slice(None),) * (2 - len(index))
        rows = _range(index[0], self.shape[0])
        cols = _range(index[1], self.shape[1] if len(self.shape) == 2 else 1)
        out_shape = (len(rows), len(cols)) if len(self.shape) == 2 else (len(rows),)
        if self.std == 0:
            return torch.ones(out_shape, dtype=self.dtype, device=self.device)
        out = torch.empty(len(rows), len(cols), dtype=self.dtype, device=self.device)
        col_ids = torch.arange(cols.start, cols.stop, dtype=torch.int64, device=self.device)
        chunk = _CHUNK.get(self.device.type, _CHUNK["cuda"])
        step = max(1, chunk // max(1, len(cols)))
        for first in range(0, len(rows), step):
            row_ids = torch.arange(
                rows.start + first, rows.start + min(first + step, len(rows)),
                dtype=torch.int64, device=self.device,
            )  # fmt: skip
            out[first : first + len(row_ids)] = dummy_values(self.key, row_ids, col_ids, self.std)
        return out.view(out_shape)


def dummy_values(key: int, rows: torch.Tensor, cols: torch.Tensor, std: float) -> torch.Tensor:
    """float32 [len(rows), len(cols)]: uniform in [-std * sqrt(3), std * sqrt(3)], a pure
    function of (key, row, column), the scheme of the sampler's noise (`sampling.uniform_noise`)."""
    r = mix32(mix32((rows + 0x9E3779B9) & MASK32) ^ key)
    c = mix32((cols + 0x85EBCA6B) & MASK32)
    bits = mix32(mix32(r[:, None] ^ c[None, :]) ^ r[:, None])
    unit = ((bits >> 8).to(torch.float32) + 0.5) * (2.0 / (1 << 24)) - 1.0  # (-1, 1), exact
    return unit * (std * math.sqrt(3.0))


def tensor_key(seed: int, name: str) -> int:
    """A stable 32-bit key per (seed, tensor name): the same in every process and run."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def dummy_tensors(
    model: LlamaModel, seed: int, std: float, dtype: torch.dtype, device: torch.device
) -> dict[str, DummyTensor]:
    """Every checkpoint tensor `model` needs, as a DummyTensor."""
    tensors = {}
    for name, shape in model.checkpoint_shapes().items():
        is_norm = len(shape) == 1 and not name.endswith("bias")
        tensors[name] = DummyTensor(
            name, shape, tensor_key(seed, name), 0.0 if is_norm else std, dtype, device
        )
    return tensors


@torch.no_grad()
def load_dummy_weights(model: LlamaModel, seed: int, std: float) -> None:
    """Fill this rank's parameters with its part of the dummy checkpoint, on their device."""
    weight = model.embed.weight
    for name, tensor in dummy_tensors(model, seed, std, weight.dtype, weight.device).items():
        if not model.load_weight(name, tensor):
            raise AssertionError(f"the model does not place its own tensor {name}")


def _range(index, size: int) -> range:
    if not isinstance(index, slice):
        raise IndexError(f"dummy tensors take slices, got {index!r}")
    start, stop, step = index.indices(size)
    if step != 1:
        raise IndexError("dummy tensors take contiguous slices")
    return range(start, stop)
