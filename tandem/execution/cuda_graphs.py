"""CUDA graphs for decode steps: one replay instead of hundreds of kernel launches.

An eager decode step of an 8B model launches several hundred kernels; on an H200 at batch 32 they
can finish faster than the host launches them, so the device idles inside every step, a gap that
overlapping the scheduler cannot hide. A captured graph replays the whole step (token-table
gather, forward, sampler, scatter of the sampled ids into the token table) with one launch.

Graphs are captured once, at start-up, for a set of padded batch sizes and three sampler
variants (all greedy; sampling; sampling with top-k / top-p), into one memory pool. A step is
replayed when it is decode-only, plain (no penalties, no logprobs, nothing to verify) and fits
the largest size; anything else runs eagerly. Under speculative decoding a step without drafts
in flight replays too, and writes its rows' lengths where the next verification reads them.
Its inputs are packed on the host in the graph's fixed layout (padded rows write their K/V into
a spare cache block, their sampled id into a spare token-table entry and their length into a
spare entry, so they touch nothing real), uploaded in one copy, and copied on the compute
stream into the static buffers the graph reads, so a replay never races the previous one.
The variant a step uses gives the same tokens as the eager sampler: a row that does not use a
filter is left exactly as it is (see `sampling._top_k_top_p`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tandem.execution.batch import StepInputs
from tandem.ops.attention import triton_kernels
from tandem.sampler.inputs import SamplingFlags, SamplingRows

MAX_CAPTURE_BATCH = 256
MODES = ("greedy", "sample", "sample-filtered")
_INTS = ("token_index", "positions", "slot_mapping", "context_lens", "sample_index", "top_k",
         "seed_keys", "output_index", "length_rows", "lengths")  # fmt: skip
_FLOATS = ("temperature", "top_p", "min_p")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to the most requests a step can hold (at most 256)."""
    cap = min(max_num_seqs, MAX_CAPTURE_BATCH)
    return sorted({s for s in (1, 2, 4, 8) if s < cap} | set(range(16, cap, 16)) | {cap})


def graph_sizes(device: torch.device, enforce_eager: bool, max_num_seqs: int) -> list[int]:
    """The sizes to capture here; none on a CPU, with enforce_eager, or where the decode
    attention is not capturable (the portable one gathers contexts of host-chosen length)."""
    if device.type != "cuda" or enforce_eager or triton_kernels() is None:
        return []
    return capture_sizes(max_num_seqs)


def graph_mode(x: StepInputs) -> str | None:
    """The captured variant that runs step `x` exactly as the eager path would, or None."""
    plain_decode = (
        x.sampler.plain  # verifications run eagerly: their rows' lengths are the device's
        and not x.prefills
        and x.num_tokens == x.num_decodes == x.num_sampled
        and not x.draft_kv  # a draft model's forward over the step's tokens is not captured
    )
    if not plain_decode or x.num_tokens == 0:
        return None
    flags = x.sampler.sampling.flags
    if flags.all_greedy:
        return "greedy"
    if flags.use_top_k or flags.use_top_p:
        return "sample-filtered"
    return "sample"


@dataclass
class GraphInputs:
    """Views of the static buffers in the layout of one padded batch size."""

    ints: dict[str, torch.Tensor]
    floats: dict[str, torch.Tensor]
    block_tables: torch.Tensor  # [size, width]

    def sampling(self, mode: str) -> SamplingRows[torch.Tensor]:
        filtered = mode == "sample-filtered"
        return SamplingRows(
            temperature=self.floats["temperature"],
            top_k=self.ints["top_k"],
            top_p=self.floats["top_p"],
            min_p=self.floats["min_p"],
            seed_keys=self.ints["seed_keys"],
            output_index=self.ints["output_index"],
            flags=SamplingFlags(
                all_greedy=mode == "greedy",
                use_top_k=filtered,
                use_top_p=filtered,
                use_min_p=mode != "greedy",  # min_p = 0 leaves a row exactly as it is
            ),
        )


class DecodeGraphs:
    """The captured decode graphs of one runner, and the static buffers they read."""

    def __init__(
        self,
        sizes: list[int],
        width: int,
        pad_block: int,
        block_size: int,
        token_sink: int,
        length_sink: int,
        device: torch.device,
    ):
        self.sizes = sizes
        self.width = width  # block-table columns: the longest sequence's blocks
        self.pad = {  # what a padded row holds: harmless, and finite through every kernel
            "token_index": token_sink, "positions": 0, "slot_mapping": pad_block * block_size,
            "context_lens": 1, "sample_index": token_sink, "top_k": 0, "seed_keys": 0,
            "output_index": 0, "length_rows": length_sink, "lengths": 0, "temperature": 0.0,
            "top_p": 1.0, "min_p": 0.0,
        }  # fmt: skip
        self.pad_block = pad_block
        largest = max(sizes)
        self.int_buffer = torch.zeros(self._num_ints(largest), dtype=torch.int64, device=device)
        self.float_buffer = torch.zeros(len(_FLOATS) * largest, dtype=torch.float32, device=device)
        self.graphs: dict[tuple[int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _num_ints(self, size: int) -> int:
        return len(_INTS) * size + size * self.width

    def views(self, size: int) -> GraphInputs:
        ints = dict(zip(_INTS, self.int_buffer[: len(_INTS) * size].split(size), strict=True))
        tables = self.int_buffer[len(_INTS) * size : self._num_ints(size)].view(size, self.width)
        floats = dict(
            zip(_FLOATS, self.float_buffer[: len(_FLOATS) * size].split(size), strict=True)
        )
        return GraphInputs(ints, floats, tables)

    def size_for(self, batch: int) -> int | None:
        return next((s for s in self.sizes if s >= batch), None)

    def pack(self, x: StepInputs, size: int) -> tuple[np.ndarray, np.ndarray]:
        """The step's arrays padded to `size` rows, in the static buffers' layout, followed by
        its host-known tokens (index, then value: the sync loop's last samples), which the
        runner writes into the token table before the replay."""
        n, k = x.num_tokens, len(x.known_index)
        rows = x.sampler.sampling  # the sampling settings; the rest are the step's own arrays
        arrays = {
            name: getattr(rows if hasattr(rows, name) else x, name) for name in _INTS + _FLOATS
        }
        ints = np.empty(self._num_ints(size) + 2 * k, dtype=np.int64)
        ints[self._num_ints(size) :] = np.concatenate([x.known_index, x.known_tokens])
        for i, name in enumerate(_INTS):
            part = ints[i * size : (i + 1) * size]
            m = len(arrays[name])  # n, or 0: row lengths are sent only under speculation
            part[:m] = arrays[name]
            part[m:] = self.pad[name]
        tables = ints[len(_INTS) * size : self._num_ints(size)].reshape(size, self.width)
        tables[:] = self.pad_block
        tables[:n, : x.block_tables.shape[1]] = x.block_tables[:n]
        floats = np.empty(len(_FLOATS) * size, dtype=np.float32)
        for i, name in enumerate(_FLOATS):
            floats[i * size : i * size + n] = arrays[name]
            floats[i * size + n : (i + 1) * size] = self.pad[name]
        return ints, floats

    def capture(self, body: Callable[[GraphInputs, str], torch.Tensor]) -> None:
        """Capture every (size, mode), largest first (its allocations seed the shared pool).

        `body` runs one decode step from the static buffers and returns the sampled ids. It is
        run twice on a side stream first: kernels compile and the allocator warms up outside
        the capture. Padded inputs fill the buffers, so these runs write nothing real."""
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(self.sizes, reverse=True):
            ints, floats = self._padding(size)
            self.int_buffer[: len(ints)].copy_(torch.from_numpy(ints))
            self.float_buffer[: len(floats)].copy_(torch.from_numpy(floats))
            inputs = self.views(size)
            for mode in MODES:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        body(inputs, mode)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = body(inputs, mode)
                self.graphs[size, mode] = (graph, out)
        torch.cuda.synchronize()

    def _padding(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        ints = np.empty(self._num_ints(size), dtype=np.int64)
        for i, name in enumerate(_INTS):
            ints[i * size : (i + 1) * size] = self.pad[name]
        ints[len(_INTS) * size :] = self.pad_block
        floats = np.repeat(np.array([self.pad[n] for n in _FLOATS], np.float32), size)
        return ints, floats

    def known_tokens(self, ints: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (token-table index, token) pairs packed after the static layout."""
        index, tokens = ints[self._num_ints(size) :].chunk(2)
        return index, tokens

    def replay(
        self, size: int, mode: str, ints: torch.Tensor, floats: torch.Tensor, batch: int
    ) -> torch.Tensor:
        """On the compute stream: inputs into the static buffers, replay; the real rows' ids."""
        self.int_buffer[: self._num_ints(size)].copy_(ints[: self._num_ints(size)])
        self.float_buffer[: floats.numel()].copy_(floats)
        graph, out = self.graphs[size, mode]
        graph.replay()
        return out[:batch]
