"""CUDA graphs for decode steps: one replay instead of hundreds of kernel launches.

An eager decode step of an 8B model launches several hundred kernels; on an H200 at batch 32 they
can finish faster than the host launches them, so the device idles inside every step, a gap that
overlapping the scheduler cannot hide. A captured graph replays the whole step (token-table
gather, forward, sampler, scatter of the sampled ids into the token table) with one launch.

Graphs are captured once, at start-up, for a set of padded batch sizes and three sampler
variants (all greedy; sampling; sampling with top-k / top-p), into one memory pool. A step is
replayed when it is decode-only, plain (no penalties, no logprobs) and fits the largest size;
anything else runs eagerly. Its inputs are packed on the host in the graph's fixed layout,
uploaded in one copy, and copied on the compute stream into the static buffers the graph reads,
so a replay never races the previous one. The block tables go as wide as the step's longest
request needs, not as the context limit: a step writes those columns of the static table and
the kernels read no further (a request's later columns keep what an earlier step wrote there,
unread). So the copy stays small however long the context limit (at 128K tokens a full table
of 32 rows is 2 MB a step). Every array of that layout has one entry past the padded size, and
padded entries point there or at spare places: the spare cache block for K/V, the token table's
spare row and the lengths' spare entry. So padded rows touch nothing real.
The variant a step uses gives the same tokens as the eager sampler: a row that does not use a
filter is left exactly as it is (see `sampling._top_k_top_p`).

Under ngram speculation (the method chosen at start-up) verification steps replay graphs too:
the same variants at sizes of their own, counted in tokens (a request verifies its drafts and
one token more) up to `VERIFY_MAX_TOKENS`, once per band of history the drafts are searched in
(a band fixes the search's shape), each placing the verified tokens by the device's lengths,
drafting, sampling and counting what is kept as the eager step does (`drafting`,
`sampler.verify`). A step without drafts in flight writes its rows' lengths in its graph. A
draft model's steps run eagerly (its passes are as many as the step's most drafts, chosen on the
host), and so do verifications of more than `VERIFY_MAX_TOKENS` tokens, or all of them if one
of their graphs fails to capture (with a warning: the engine still starts).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from tandem.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from tandem.execution.batch import StepInputs
from tandem.ops.attention import triton_kernels
from tandem.sampler.inputs import SamplerInputs, SamplingFlags, SamplingRows, VerifyRows

logger = logging.getLogger(__name__)

MAX_CAPTURE_BATCH = 256
MODES = ("greedy", "sample", "sample-filtered")
_INTS = ("token_index", "positions", "slot_mapping", "context_lens", "sample_index", "top_k",
         "seed_keys", "output_index", "length_rows", "lengths")  # fmt: skip
_FLOATS = ("temperature", "top_p", "min_p")
# A verification's arrays (`VerifyRows`): its requests', their tokens' and their drafts'.
_VERIFY_INTS = ("table_rows", "prompt_lens", "token_item", "token_offset", "token_batch",
                "sample_rows", "draft_batch", "draft_item", "draft_index",
                "check_rows")  # fmt: skip
SHORTEST_HISTORY = 1024  # the first band of history a verification graph searches; x4 per band
# The longest band: the search holds [requests, history, ngram size] int64 (at 256 rows, 135 MB
# here), in the graphs' pool; verifications of longer requests run eagerly.
LONGEST_HISTORY = 16384
# Verifications of more tokens run eagerly: drafts pay in small steps (a large one is bound by
# compute, and the draft policy gives it few), and every size costs a graph per band at start-up.
VERIFY_MAX_TOKENS = 64
GraphKey = tuple[int, str, int | None]  # padded size, sampler variant, history band (verifying)


@dataclass(frozen=True)
class VerifyShape:
    """What a captured verification fixes on the host's side: the ngram sizes, the padded
    token counts and the bands of history (each an upper bound of the verifying requests'
    lengths) there are graphs for, and room for the most drafts any request may have."""

    lookup: tuple[int, int]
    histories: tuple[int, ...]
    sizes: tuple[int, ...]
    max_drafts: int = MAX_SPECULATIVE_TOKENS


def verify_shape(
    spec: SpeculativeConfig | None, max_model_len: int, max_num_seqs: int
) -> VerifyShape | None:
    """The verification graphs to capture: ngram's only (a draft model drafts in host-counted
    passes); bands of 1024, 4096, ... tokens up to the context limit or `LONGEST_HISTORY`; sizes
    up to every request verifying its full drafts, or `VERIFY_MAX_TOKENS`."""
    if spec is None or spec.method != "ngram":
        return None
    longest = min(max_model_len, LONGEST_HISTORY)
    bands, history = [], SHORTEST_HISTORY
    while history < longest:
        bands.append(history)
        history *= 4
    bands.append(longest)
    tokens = min(max_num_seqs * (1 + spec.num_speculative_tokens), VERIFY_MAX_TOKENS)
    return VerifyShape(
        (spec.prompt_lookup_max, spec.prompt_lookup_min), tuple(bands), tuple(capture_sizes(tokens))
    )


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to the most requests a step can hold (at most 256)."""
    cap = min(max_num_seqs, MAX_CAPTURE_BATCH)
    return sorted({s for s in (1, 2, 4, 8) if s < cap} | set(range(16, cap, 16)) | {cap})


def smallest_holding(sizes: Iterable[int], rows: int) -> int | None:
    """The smallest of the ascending `sizes` that holds `rows` (None: none does)."""
    return next((s for s in sizes if s >= rows), None)


def graph_sizes(device: torch.device, enforce_eager: bool, max_num_seqs: int) -> list[int]:
    """The sizes to capture here; none on a CPU, with enforce_eager, or where the decode
    attention is not capturable (the portable one gathers contexts of host-chosen length)."""
    if device.type != "cuda" or enforce_eager or triton_kernels() is None:
        return []
    return capture_sizes(max_num_seqs)


def table_width(x: StepInputs) -> int:
    """The block-table columns a step sends to its graph: its longest request's (at least one:
    a padded row reads its first)."""
    return max(x.block_tables.shape[1], 1)


def graph_mode(x: StepInputs) -> str | None:
    """The sampler variant whose graphs run step `x` exactly as the eager path would, or None
    (a verification also needs its band: `DecodeGraphs.key_for`)."""
    s = x.sampler
    decode = (
        s.processing is None
        and s.logprobs is None
        and s.grammar is None
        and s.reasoning is None  # a row's phase moves on: eager (no graph holds its stage)
        and not x.prefills
        and x.num_tokens == x.num_decodes == x.num_sampled
        # A draft model's forward over the step's tokens (and its passes) is not captured.
        and not x.draft_kv
    )
    if not decode or x.num_tokens == 0:
        return None
    flags = x.sampler.sampling.flags
    if flags.all_greedy:
        return "greedy"
    if flags.use_top_k or flags.use_top_p:
        return "sample-filtered"
    return "sample"


@dataclass
class GraphInputs:
    """Views of the static buffers in the layout of one padded batch size: `size` rows, and
    one entry more in every array (where padded verification entries write)."""

    size: int
    ints: dict[str, torch.Tensor]  # [size + 1] each
    floats: dict[str, torch.Tensor]  # [size + 1] each
    block_tables: torch.Tensor  # [size + 1, width]
    verify: dict[str, torch.Tensor]  # [size + 1] each: a verification's arrays, padded

    def sampling(self, mode: str, rows: int | None = None) -> SamplingRows[torch.Tensor]:
        """The sampling rows (the first `rows`; all `size + 1` by default)."""
        filtered = mode == "sample-filtered"
        end = self.size + 1 if rows is None else rows
        return SamplingRows(
            temperature=self.floats["temperature"][:end],
            top_k=self.ints["top_k"][:end],
            top_p=self.floats["top_p"][:end],
            min_p=self.floats["min_p"][:end],
            seed_keys=self.ints["seed_keys"][:end],
            output_index=self.ints["output_index"][:end],
            flags=SamplingFlags(
                all_greedy=mode == "greedy",
                use_top_k=filtered,
                use_top_p=filtered,
                use_min_p=mode != "greedy",  # min_p = 0 leaves a row exactly as it is
            ),
        )

    def verify_rows(self, shape: VerifyShape, history: int) -> VerifyRows[torch.Tensor]:
        """The verification at this size, in the captured shape (`history`: its band)."""
        none = self.verify["table_rows"][:0]
        return VerifyRows(
            **self.verify, num_drafts=none, pass_items=none, item_batch=none, item_row=none,
            pass_sizes=[], max_drafts=shape.max_drafts, history_len=history, method="ngram",
            lookup=shape.lookup,
        )  # fmt: skip

    def step(self, mode: str, verify: VerifyRows[torch.Tensor] | None) -> StepInputs:
        """The arrays as a step's device inputs, whole (what `drafting.place_tokens` writes)."""
        i, none = self.ints, self.ints["token_index"][:0]
        return StepInputs(
            step_id=-1, token_index=i["token_index"], positions=i["positions"],
            slot_mapping=i["slot_mapping"], known_index=none, known_tokens=none,
            logits_index=none, sample_index=i["sample_index"], block_tables=self.block_tables,
            context_lens=i["context_lens"], num_decodes=self.size,
            decode_max_blocks=self.block_tables.shape[1], prefills=[],
            sampler=SamplerInputs(sampling=self.sampling(mode), verify=verify),
        )  # fmt: skip


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
        verify: VerifyShape | None = None,
    ):
        """`token_sink`: the token table's spare row's first entry; `length_sink`: that row's
        index (its length entry is spare too); `verify`: the verification graphs, if any."""
        self.sizes = sizes
        self.width = width  # block-table columns: the longest sequence's blocks
        self.verify = verify
        self.pad = {  # what a padded row holds: harmless, and finite through every kernel
            "token_index": token_sink, "positions": 0, "slot_mapping": pad_block * block_size,
            "context_lens": 1, "sample_index": token_sink, "top_k": 0, "seed_keys": 0,
            "output_index": 0, "length_rows": length_sink, "temperature": 0.0, "top_p": 1.0,
            "min_p": 0.0,
            # A verification's padded length rows set the spare row's length to 1 before its
            # tokens are placed: a padded token sits at position 0 of the spare row.
            "lengths": 1, "table_rows": length_sink, "prompt_lens": 0, "token_offset": 0,
            "draft_index": 0, "check_rows": 0,
        }  # fmt: skip
        # Padded entries that index the step's own arrays point one past its padded size.
        self.past_end = ("token_item", "token_batch", "sample_rows", "draft_batch", "draft_item")
        self.pad_block = pad_block
        largest = max(sizes + list(verify.sizes if verify else ()))
        # Every array but the block tables, the floats' words after the ints'.
        self.buffer = torch.zeros(self._num_words(largest), dtype=torch.int64, device=device)
        self.block_tables = torch.full(
            (largest + 1, width), pad_block, dtype=torch.int64, device=device
        )
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays: dict[GraphKey, int] = {}  # replays by graph, for benchmarks' reports

    @staticmethod
    def _float_words(size: int) -> int:
        """The int64 words the float32 arrays of `size` take (two floats to a word)."""
        return -(-len(_FLOATS) * (size + 1) // 2)

    def _num_words(self, size: int) -> int:
        """The static buffer's words in the layout of `size`: the ints, then the floats."""
        return (len(_INTS) + len(_VERIFY_INTS)) * (size + 1) + self._float_words(size)

    def views(self, size: int) -> GraphInputs:
        n = size + 1
        ints, verify, floats = self.buffer[: self._num_words(size)].split(
            [len(_INTS) * n, len(_VERIFY_INTS) * n, self._float_words(size)]
        )
        floats = floats.view(torch.float32)[: len(_FLOATS) * n].split(n)
        return GraphInputs(
            size=size,
            ints=dict(zip(_INTS, ints.split(n), strict=True)),
            floats=dict(zip(_FLOATS, floats, strict=True)),
            block_tables=self.block_tables[:n],
            verify=dict(zip(_VERIFY_INTS, verify.split(n), strict=True)),
        )

    def key_for(self, x: StepInputs) -> GraphKey | None:
        """The graph that runs step `x` as the eager path would; None: it runs eagerly."""
        mode = graph_mode(x)
        if mode is None:
            return None
        v = x.sampler.verify
        if v is None:
            size = smallest_holding(self.sizes, x.num_tokens)
            return None if size is None else (size, mode, None)
        shape = self.verify
        if shape is None or v.lookup != shape.lookup or v.max_drafts > shape.max_drafts:
            return None
        size = smallest_holding(shape.sizes, x.num_tokens)
        history = next((h for h in shape.histories if h >= v.history_len), None)
        return None if size is None or history is None else (size, mode, history)

    def _pad_value(self, name: str, size: int) -> int | float:
        return size if name in self.past_end else self.pad[name]

    def pack(self, x: StepInputs, size: int) -> np.ndarray:
        """The step's arrays padded to `size` rows (and the one past), in the static buffer's
        layout, then its block tables (`size + 1` rows of `table_width(x)` columns), then its
        host-known tokens (index, then value: the sync loop's last samples), which the runner
        writes into the token table before the replay."""
        rows = x.sampler.sampling  # the sampling settings; the rest are the step's own arrays
        v = x.sampler.verify
        arrays = {name: getattr(rows if hasattr(rows, name) else x, name) for name in _INTS}
        arrays |= {name: getattr(rows, name) for name in _FLOATS}
        if v is not None:
            arrays |= {name: getattr(v, name) for name in _VERIFY_INTS}
        known = np.concatenate([x.known_index, x.known_tokens])
        return self._layout(size, arrays, x.block_tables[: x.num_tokens], known)

    def _layout(
        self, size: int, arrays: dict[str, np.ndarray], tables_in: np.ndarray, tail: np.ndarray
    ) -> np.ndarray:
        """`arrays` (any left out: none) in the layout of `size`, each padded, then the block
        tables (`tables_in`'s columns, at least one), then `tail`."""
        cap, none = size + 1, np.zeros(0, np.int64)
        words, width = self._num_words(size), max(tables_in.shape[1], 1)
        out = np.empty(words + cap * width + len(tail), dtype=np.int64)
        per_row = out[: (len(_INTS) + len(_VERIFY_INTS)) * cap].reshape(-1, cap)
        for name, part in zip((*_INTS, *_VERIFY_INTS), per_row, strict=True):
            # The step's rows, or fewer: plain rows' lengths, a verification's parts.
            values = arrays.get(name, none)
            part[: len(values)] = values
            part[len(values) :] = self._pad_value(name, size)
        float_words = out[words - self._float_words(size) : words]
        float_words[-1] = 0  # an odd count leaves half a word spare
        floats = float_words.view(np.float32)[: len(_FLOATS) * cap].reshape(-1, cap)
        for name, part in zip(_FLOATS, floats, strict=True):
            values = arrays.get(name, none)
            part[: len(values)] = values
            part[len(values) :] = self.pad[name]
        tables = out[words : words + cap * width].reshape(cap, width)
        tables[:] = self.pad_block
        tables[: len(tables_in), : tables_in.shape[1]] = tables_in
        out[words + cap * width :] = tail
        return out

    def capture_keys(self) -> list[GraphKey]:
        """Every graph to capture: the decode steps' and the verifications', largest size first
        (its allocations seed the shared pool), a decode before a verification of its size."""
        shape = self.verify
        decodes = [(size, mode, None) for size in self.sizes for mode in MODES]
        verifications = [
            (size, mode, history)
            for size in (shape.sizes if shape else ())
            for history in shape.histories
            for mode in MODES
        ]
        return sorted(decodes + verifications, key=lambda k: (-k[0], k[2] is not None))

    def capture(self, body: Callable[[GraphInputs, str, int | None], torch.Tensor]) -> None:
        """Capture every graph of `capture_keys()`.

        `body` runs one decode step (a verification, given a band) from the static buffers and
        returns what the step sends to the host. It is run twice on a side stream first:
        kernels compile and the allocator warms up outside the capture. Padded inputs fill the
        buffers, so these runs write nothing real. A verification graph that fails to capture
        (out of memory, say) leaves verifications eager, with a warning, not the engine down."""
        pool = torch.cuda.graph_pool_handle()
        for key in self.capture_keys():
            try:
                self.graphs[key] = self._capture_one(key, body, pool)
            except RuntimeError as exc:  # torch.OutOfMemoryError is one
                if key[2] is None:  # a decode step's graph
                    raise
                logger.warning("ngram verifications run eagerly: capturing %s failed: %s", key, exc)
                self.graphs = {k: g for k, g in self.graphs.items() if k[2] is None}
                self.verify = None
                break
        torch.cuda.synchronize()

    def _capture_one(
        self, key: GraphKey, body: Callable[[GraphInputs, str, int | None], torch.Tensor], pool
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        size, mode, history = key
        inputs = self.padded(size)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                body(inputs, mode, history)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = body(inputs, mode, history)
        return graph, out

    def padded(self, size: int) -> GraphInputs:
        """The static buffers filled as for a step with no rows at all (what capture runs),
        every block table column too."""
        tables, tail = np.zeros((0, self.width), np.int64), np.zeros(0, np.int64)
        self.load(size, torch.from_numpy(self._layout(size, {}, tables, tail)), self.width)
        return self.views(size)

    def known_tokens(
        self, words: torch.Tensor, size: int, x: StepInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The (token-table index, token) pairs packed after the block tables."""
        index, tokens = words[self._num_words(size) + (size + 1) * table_width(x) :].chunk(2)
        return index, tokens

    def load(self, size: int, words: torch.Tensor, width: int) -> None:
        """A packed step (on the device) into the static buffers: the arrays in one copy, the
        block tables' first `width` columns in another."""
        n, cap = self._num_words(size), size + 1
        self.buffer[:n].copy_(words[:n])
        self.block_tables[:cap, :width].copy_(words[n : n + cap * width].view(cap, width))

    def replay(self, key: GraphKey, words: torch.Tensor, x: StepInputs) -> torch.Tensor:
        """On the compute stream: inputs into the static buffers, replay; the real rows' ids
        (a verification: then the kept counts of its requests, as the eager step sends)."""
        size = key[0]
        self.load(size, words, table_width(x))
        graph, out = self.graphs[key]
        graph.replay()
        self.replays[key] = self.replays.get(key, 0) + 1
        return self.output(out, size, x)

    @staticmethod
    def output(out: torch.Tensor, size: int, x: StepInputs) -> torch.Tensor:
        """What the step sends to the host, from a graph's output at `size`."""
        v = x.sampler.verify
        if v is None:
            return out[: x.num_tokens]
        return torch.cat([out[: x.num_tokens], out[size : size + len(v.table_rows)]])
