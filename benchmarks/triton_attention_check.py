"""The Triton attention kernels on a GPU: correctness, no hidden sync, CUDA graphs, timings.

What the CPU suite cannot check (tests/test_triton_attention.py runs the kernels' logic in
Triton's interpreter and compiles them for sm_90 without running them):
1. Decodes and mixed prefill batches against the portable path computed in float64, for bf16
   and fp32 caches, several GQA shapes, sliding windows and padding rows (context 0).
2. Eager launches under `torch.cuda.set_sync_debug_mode("error")`.
3. Decode captured once in a CUDA graph for a padded batch, replayed with other contexts
   (longer than at capture too), block tables and queries written into its static inputs.
4. Decode and prefill timings against the portable path (Llama-3.1-8B attention shapes, bf16);
   decodes replayed from a CUDA graph under the split rule and under others, to tune it.
Prints one table last. About a minute on one H200.

    python benchmarks/triton_attention_check.py            # CUDA
    python benchmarks/triton_attention_check.py --interpret  # part 1 only, tiny, on the CPU
"""

from __future__ import annotations

import argparse
import os
import random
import sys

if "--interpret" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402

from tandem.ops import attention  # noqa: E402
from tandem.ops import triton_attention as ta  # noqa: E402
from tandem.ops.attention import write_kv  # noqa: E402
from tandem.ops.attention_metadata import AttentionMetadata, PrefillSegment  # noqa: E402

ROWS: list[tuple[str, str]] = []


def report(name: str, result: str) -> None:
    ROWS.append((name, result))
    print(f"{name}: {result}", flush=True)


class Batch:
    """A mixed step on random caches: decodes, padding rows (context 0), then prefill chunks.

    The caches hold random K/V everywhere; padding rows' block tables are garbage ids, and their
    tokens' K/V go to a scratch block no request owns."""

    def __init__(self, device, dtype, heads, kv_heads, dim, bs, decode_lens, chunks, pad, seed):
        g = torch.Generator().manual_seed(seed)
        ends = list(decode_lens) + [0] * pad + [p + n for p, n in chunks]
        starts = [n - 1 for n in decode_lens] + [0] * pad + [p for p, _ in chunks]
        width = max(-(-n // bs) for n in ends) + 1
        num_blocks = sum(-(-n // bs) for n in ends) + 1
        scratch = num_blocks - 1
        perm = torch.randperm(scratch, generator=g)
        tables = torch.full((len(ends), width), 10**9, dtype=torch.int64)
        used = 0
        for i, n in enumerate(ends):
            tables[i, : -(-n // bs)] = perm[used : used + -(-n // bs)]
            used += -(-n // bs)
        d = len(decode_lens) + pad
        slots, prefills, token = [], [], d
        for i, (start, end) in enumerate(zip(starts, ends, strict=True)):
            pos = torch.arange(start, end)
            slots.append(tables[i, pos // bs] * bs + pos % bs)
            if len(decode_lens) <= i < d:
                slots[-1] = torch.tensor([scratch * bs])
            if i >= d:
                prefills.append(PrefillSegment(token, end - start, end, i))
                token += end - start
        gd = torch.Generator(device=device).manual_seed(seed)

        def randn(*shape):
            return torch.randn(shape, generator=gd, device=device).to(dtype)

        self.k_cache = randn(num_blocks, bs, kv_heads, dim)
        self.v_cache = randn(num_blocks, bs, kv_heads, dim)
        self.q, self.k, self.v = (
            randn(token, heads, dim),
            randn(token, kv_heads, dim),
            randn(token, kv_heads, dim),
        )
        self.meta = AttentionMetadata(
            torch.cat(slots).to(device), tables.to(device), torch.tensor(ends, device=device),
            d, max(-(-n // bs) for n in ends[:d]) if d else 0, prefills, bs,
        )  # fmt: skip
        self.real = [i for i in range(token) if not len(decode_lens) <= i < d]  # not padding
        self.pads = list(range(len(decode_lens), d))

    def reference(self, scale, window) -> torch.Tensor:
        """The portable path in float64, on copies made before this step's K/V are written."""
        m = self.meta
        meta = AttentionMetadata(
            m.slot_mapping, m.block_tables.clamp(max=self.k_cache.shape[0] - 1),
            m.context_lens, m.num_decodes, m.decode_max_blocks, m.prefills, m.block_size,
        )  # fmt: skip
        q, k, v = self.q.double(), self.k.double(), self.v.double()
        k_cache, v_cache = self.k_cache.double(), self.v_cache.double()
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = attention.portable_attention(q, k, v, k_cache, v_cache, meta, scale, window)
        return out[self.real]


def _error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |out - ref| / (1 + |ref|): bf16 rounds an output near 4 by up to 1.6e-2."""
    return ((out.double() - ref).abs() / (1 + ref.abs())).max().item()


CASES = [  # dtype, heads, kv_heads, head_dim, sliding window
    (torch.bfloat16, 32, 8, 128, None),  # Llama 3.1 8B
    (torch.bfloat16, 32, 8, 128, 1000),
    (torch.bfloat16, 32, 8, 64, None),  # Llama 3.2 1B
    (torch.bfloat16, 28, 4, 128, 1000),  # a group of 7
    (torch.bfloat16, 8, 2, 48, None),  # head_dim padded to 64
    (torch.float32, 32, 8, 128, None),
    (torch.float32, 8, 2, 48, 200),
]
SMALL_CASES = [(torch.bfloat16, 4, 2, 32, None), (torch.float32, 6, 3, 48, 37)]


def check_correctness(device, small: bool) -> None:
    """Mixed batches (decodes, 2 padding rows, a first chunk and a chunk after a prefix)."""
    rng = random.Random(0)
    max_ctx, max_chunk = (80, 40) if small else (2000, 600)
    worst: dict[torch.dtype, float] = {}
    for case, (dtype, heads, kv_heads, dim, window) in enumerate(SMALL_CASES if small else CASES):
        decode_lens = [rng.randint(1, max_ctx) for _ in range(rng.randint(1, 4 if small else 14))]
        chunks = [
            (0, rng.randint(1, max_chunk)),
            (rng.randint(1, max_ctx), rng.randint(1, max_chunk)),
        ]
        b = Batch(device, dtype, heads, kv_heads, dim, 16, decode_lens, chunks, pad=2, seed=case)
        ref = b.reference(dim**-0.5, window)
        write_kv(b.k, b.v, b.k_cache, b.v_cache, b.meta.slot_mapping)
        out = ta.paged_attention(b.q, b.k_cache, b.v_cache, b.meta, dim**-0.5, window)
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        errors = [_error(out[b.real], ref)]
        assert not out[b.pads].any(), "padding rows are not zeros"
        d, n = b.meta.num_decodes, len(decode_lens)
        for splits in (1, 5):
            out_s = ta.decode_attention(
                b.q[:d], b.k_cache, b.v_cache, b.meta.block_tables, b.meta.context_lens, 16,
                dim**-0.5, window, num_splits=splits,
            )  # fmt: skip
            errors.append(_error(out_s[:n], ref[:n]))
            assert not out_s[n:].any(), "padding rows are not zeros"
        assert max(errors) < tol, f"{dtype} {heads}/{kv_heads}x{dim} window {window}: {errors}"
        worst[dtype] = max(worst.get(dtype, 0.0), *errors)
    for dtype, err in worst.items():
        report(f"correctness {str(dtype)[6:]}", f"relative error vs float64 {err:.1e}")


def check_no_sync() -> None:
    b = Batch("cuda", torch.bfloat16, 32, 8, 128, 16, [100, 2000, 5], [(0, 300), (700, 200)], 2, 1)
    write_kv(b.k, b.v, b.k_cache, b.v_cache, b.meta.slot_mapping)
    ta.paged_attention(b.q, b.k_cache, b.v_cache, b.meta, 0.1, None)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ta.paged_attention(b.q, b.k_cache, b.v_cache, b.meta, 0.1, None)
        ta.paged_attention(b.q, b.k_cache, b.v_cache, b.meta, 0.1, 64)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    report("no hidden sync", "decode + prefill launches pass set_sync_debug_mode('error')")


def check_cuda_graph() -> None:
    """Capture one padded decode batch; replay with new contexts written into static inputs."""
    heads, kv_heads, dim, bs, batch, width = 32, 8, 128, 16, 32, 256  # up to 4096 tokens
    num_blocks = batch * width
    g = torch.Generator(device="cuda").manual_seed(0)
    k_cache = torch.randn(num_blocks, bs, kv_heads, dim, device="cuda", generator=g).bfloat16()
    v_cache = torch.randn(num_blocks, bs, kv_heads, dim, device="cuda", generator=g).bfloat16()
    k64, v64 = k_cache.double(), v_cache.double()
    q = torch.zeros(batch, heads, dim, dtype=torch.bfloat16, device="cuda")
    tables = torch.zeros(batch, width, dtype=torch.int64, device="cuda")
    context = torch.zeros(batch, dtype=torch.int64, device="cuda")
    rng = random.Random(2)
    for splits in (None, 4):  # None: the default for this shape
        out = torch.empty_like(q)

        def step(splits=splits, out=out):
            ta.decode_attention(
                q, k_cache, v_cache, tables, context, bs, dim**-0.5, out=out, num_splits=splits
            )

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # warm-up: compiles and loads the kernels outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        worst = 0.0
        for trial, max_len in enumerate((50, 1000, 4096)):  # captured with every context at 0
            n = batch - 3  # three padding rows
            lens = [rng.randint(1, max_len) for _ in range(n)] + [0, 0, 0]
            tables.copy_(torch.randperm(num_blocks, device="cuda").view(batch, width))
            context.copy_(torch.tensor(lens))
            q.copy_(torch.randn(batch, heads, dim, device="cuda").bfloat16())
            out.fill_(float("nan"))
            graph.replay()
            meta = AttentionMetadata(
                torch.zeros(0), tables[:n], context[:n], n, -(-max(lens) // bs), [], bs
            )
            ref = attention._decode_attention(q[:n].double(), k64, v64, meta, dim**-0.5, None)
            err = _error(out[:n], ref)
            assert err < 1e-2, f"splits {splits}, replay {trial}: {err}"
            assert not out[n:].any(), "padding rows are not zeros"
            worst = max(worst, err)
        used = splits or ta.default_num_splits(batch, kv_heads, q.device)
        report(
            f"cuda graph, {used} split(s)",
            f"3 replays (contexts up to 4096, 3 padding rows), error {worst:.1e}",
        )


def _time(fn, iters=20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3  # microseconds


def _time_graph(fn, calls=10, replays=5) -> float:
    """Microseconds per call of `fn` replayed from a CUDA graph of `calls` calls, as a decode
    step runs it: the host's launch cost left out."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (replays * calls) * 1e3


# (requests, context): the blog's batch along its length, and the shapes between.
DECODE_TIMINGS = ((32, 1024), (32, 2048), (32, 4096), (32, 8192), (8, 4096), (8, 8192),
                  (1, 1024), (1, 8192))  # fmt: skip


def check_timings() -> None:
    """One layer's decode attention from a CUDA graph: the engine's split rule, every context
    split alike (1-16 splits, `split_tokens=0`), and the rule with other long-context steps."""
    heads, kv_heads, dim, bs = 32, 8, 128, 16
    for batch, ctx in DECODE_TIMINGS:
        b = Batch("cuda", torch.bfloat16, heads, kv_heads, dim, bs, [ctx] * batch, [], 0, 3)
        m = b.meta
        kv_bytes = 2 * batch * ctx * kv_heads * dim * 2

        def decode(m=m, b=b, **options):
            ta.decode_attention(
                b.q, b.k_cache, b.v_cache, m.block_tables, m.context_lens, bs, 0.1, **options
            )

        rule = _time_graph(decode)
        fixed = [_time_graph(lambda s=s: decode(num_splits=s, split_tokens=0))
                 for s in (1, 2, 4, 8, 16)]  # fmt: skip
        steps = [_time_graph(lambda t=t: decode(split_tokens=t)) for t in (1024, 4096)]
        portable = _time(
            lambda m=m, b=b: attention._decode_attention(b.q, b.k_cache, b.v_cache, m, 0.1, None)
        )
        fill = ta.default_num_splits(batch, kv_heads, torch.device("cuda"))
        report(
            f"decode {batch}x{ctx} (one layer)",
            f"{rule:.1f} us ({kv_bytes / rule / 1e3:.0f} GB/s; fill {fill}, a split per "
            f"{ta.SPLIT_TOKENS} keys); every context in 1/2/4/8/16 splits: "
            f"{'/'.join(f'{t:.1f}' for t in fixed)} us; a split per 1024/4096 keys: "
            f"{'/'.join(f'{t:.1f}' for t in steps)} us; portable {portable:.0f} us",
        )
    for prefix, n in ((0, 2048), (6144, 2048)):
        b = Batch("cuda", torch.bfloat16, heads, kv_heads, dim, bs, [], [(prefix, n)], 0, 4)
        write_kv(b.k, b.v, b.k_cache, b.v_cache, b.meta.slot_mapping)
        triton_us = _time(lambda b=b: ta.paged_attention(b.q, b.k_cache, b.v_cache, b.meta, 0.1))
        portable = _time(lambda b=b: _portable_prefill(b))
        flops = 4 * n * (prefix + n / 2) * heads * dim
        report(
            f"prefill {n} after {prefix} (one layer)",
            f"triton {triton_us:.0f} us ({flops / triton_us / 1e6:.0f} TFLOP/s), "
            f"portable {portable:.0f} us",
        )


def _portable_prefill(b: Batch) -> torch.Tensor:
    """The portable path's attention of the chunks alone (no K/V write), for timing."""
    out = torch.empty_like(b.q)
    for seg in b.meta.prefills:
        rows = slice(seg.token_start, seg.token_start + seg.num_tokens)
        if seg.context_len == seg.num_tokens:
            keys, values = b.k[rows], b.v[rows]
        else:
            keys, values = attention._gather_context(b.k_cache, b.v_cache, b.meta, seg, 0)
        out[rows] = attention._chunk_attention(b.q[rows], keys, values, seg, 0.1, None)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interpret", action="store_true", help="tiny shapes, CPU, interpreter")
    args = parser.parse_args()
    if args.interpret:
        check_correctness("cpu", small=True)
    elif not torch.cuda.is_available():
        print("no CUDA device (use --interpret for the CPU smoke run)", file=sys.stderr)
        return 2
    else:
        report("device", torch.cuda.get_device_name())
        check_correctness("cuda", small=False)
        check_no_sync()
        check_cuda_graph()
        check_timings()
    print("\n| check | result |\n| --- | --- |")
    for name, result in ROWS:
        print(f"| {name} | {result} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
