"""Compile the Triton attention kernels for sm_90 (H100/H200) on a machine without a GPU.

Run by tests/test_triton_attention.py in a fresh process (the interpreter, which the numeric
tests use, is process-wide in Triton). Triton asks its driver only for the target, the device and
the stream before compiling; a stand-in answers for an H200, and every launch is turned into
`warmup` (compile, do not run). The wrappers of `tandem.ops.triton_attention` and
`triton_elementwise` (and `triton_gemm`, over bf16 and over e4m3 codes) are called as the engine
calls them (over KV caches of the model's dtype and of fp8), so the kernels get the
specializations a real launch would. Prints one JSON
line per compiled kernel: name, dtype case, shared memory, whether its PTX uses tensor cores,
and whether it waits for the previous kernel (programmatic dependent launch, as on an H200).
"""

from __future__ import annotations

import json
import os
import re
import sys

assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "compile with the real compiler"

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

from tandem.ops import triton_attention as ta  # noqa: E402
from tandem.ops import triton_elementwise as te  # noqa: E402
from tandem.ops import triton_gemm as tg  # noqa: E402
from tandem.ops import triton_lora as tl  # noqa: E402
from tandem.ops.attention_metadata import PrefillSegment  # noqa: E402
from tandem.ops.fp8 import FP8_DTYPE, quantize_fp8  # noqa: E402
from tandem.ops.kv_quant import row_width  # noqa: E402

CASES = {
    # dtype, head_dim, heads, kv_heads, window, decode splits, compile a prefill
    "llama8b-bf16": (torch.bfloat16, 128, 32, 8, None, 4, True),
    "llama1b-bf16": (torch.bfloat16, 64, 32, 8, None, 1, True),
    "group7-window-fp16": (torch.float16, 128, 28, 4, 4096, 1, True),
    "fp32-dim48": (torch.float32, 48, 4, 2, None, 2, False),  # an fp32 prefill takes ~7 s
    # fp8 KV caches (`kv_quant`: uint8 rows of codes and a scale): the kernels that read or write
    # the cache only, since the others do not depend on it
    "llama8b-bf16-fp8kv": (torch.bfloat16, 128, 32, 8, None, 4, True),
    "group7-window-fp16-fp8kv": (torch.float16, 128, 28, 4, 4096, 1, True),
    "fp32-dim48-fp8kv": (torch.float32, 48, 4, 2, None, 2, False),
}
FP8_KV = "-fp8kv"  # the suffix of the fp8 cache's cases


def h200_launch(device: torch.device) -> dict:
    """`triton_launch.pdl_options` as it answers on an H200 (these tensors are on the CPU)."""
    return {"PDL": True, "launch_pdl": True}


class CompileOnlyDriver:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0


def main(names: list[str]) -> None:
    driver.set_active(CompileOnlyDriver())
    ta.pdl_options = te.pdl_options = tg.pdl_options = tl.pdl_options = h200_launch
    built = []
    kernels = (ta._decode_kernel, ta._prefill_kernel,
               te._rms_norm_kernel, te._rotary_kernel, te._silu_and_mul_kernel,
               te._quantize_rows_fp8_kernel, tg._few_rows_gemm_kernel,
               tl._lora_shrink_kernel, tl._lora_expand_kernel)  # fmt: skip
    for kernel in kernels:

        def compile_only(*args, grid, warmup, _run=kernel.run, **kwargs):
            built.append(_run(*args, grid=grid, warmup=True, **kwargs))
            return built[-1]

        kernel.run = compile_only
    for name in names:
        dtype, dim, heads, kv_heads, window, splits, prefill = CASES[name]
        bs, r = 16, 8
        fp8_kv = name.endswith(FP8_KV)
        cache_dtype = torch.uint8 if fp8_kv else dtype
        k_cache = torch.zeros(64, bs, kv_heads, row_width(dim, cache_dtype), dtype=cache_dtype)
        v_cache = torch.zeros_like(k_cache)
        q = torch.zeros(r + 24, heads, dim, dtype=dtype)
        tables = torch.zeros(r + 1, 16, dtype=torch.int64)
        context = torch.zeros(r + 1, dtype=torch.int64)
        built.clear()
        ta.decode_attention(
            q[:r], k_cache, v_cache, tables, context, bs, 0.1, window, num_splits=splits
        )
        rotating = set()  # the decode kernel that rotates and caches a plain step's keys
        new_k = q[:r, :kv_heads]
        if ta.fuses_new_keys(q, new_k, new_k):
            before = len(built)
            table = torch.zeros(64, dim)
            new = ta.NewKeys(new_k, new_k, context[:r], table, table, context[:r])
            ta.decode_attention(q[:r], k_cache, v_cache, tables, context, bs, 0.1, window,
                                num_splits=splits, new_keys=new)  # fmt: skip
            rotating = {id(k) for k in built[before:] if k.name == "_decode_kernel"}
        if prefill:
            seg = PrefillSegment(r, 24, 40, r)
            ta.prefill_attention(
                q, k_cache, v_cache, tables, seg, bs, 0.1, window, out=torch.empty_like(q)
            )
        qkv = torch.zeros(r, (heads + 2 * kv_heads) * dim, dtype=dtype)
        q, k, v = (t.view(r, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim,
                                                           kv_heads * dim], dim=-1))  # fmt: skip
        table = torch.zeros(64, dim)
        te.rotary_and_cache(q, k, v, context[:r], table, table, k_cache, v_cache, context[:r])
        scaled, gated = set(), set()  # the GEMM over e4m3 codes (FP8), the gate/up one
        if not fp8_kv:  # the kernels that do not touch the cache: once per model dtype
            te.rotary(q, k, context[:r], table, table)
            hidden = heads * dim
            x = torch.zeros(r, hidden, dtype=dtype)
            te.add_rms_norm(x, x.clone(), torch.ones(hidden, dtype=dtype), 1e-6)
            te.silu_and_mul(torch.zeros(r, 2 * 4 * hidden, dtype=dtype))
            te.quantize_rows_fp8(x)
            slots, parts = 4, torch.tensor([hidden, hidden + 256, hidden + 512])  # a q/k/v group
            tl.lora_add_triton_(
                torch.zeros(r, hidden + 512, dtype=dtype), x, torch.zeros(r, dtype=torch.int64),
                torch.zeros(slots, 3, hidden, 16), torch.zeros(slots, 16, hidden + 512),
                torch.zeros(slots, 3, dtype=torch.int64), parts,
            )  # fmt: skip
            if dtype in tg.DTYPES:  # a decode step's GEMM at its rows, with a bias
                tg.few_rows_linear(
                    x, torch.zeros(512, hidden, dtype=dtype), torch.zeros(512, dtype=dtype)
                )
                before = len(built)
                tg.gated_few_rows(x, torch.zeros(2 * 512, hidden, dtype=dtype))
                gated = {id(k) for k in built[before:]}
                before = len(built)
                codes = torch.zeros(r, hidden, dtype=FP8_DTYPE)
                weight = quantize_fp8(torch.zeros(512, hidden))
                tg.scaled_few_rows(codes, torch.ones(r, 1), weight, dtype)
                scaled = {id(k) for k in built[before:]}
        for k in built:
            ptx = k.asm["ptx"]
            record = {
                "case": name,
                "kernel": k.name,
                "fp8_kv": fp8_kv,
                "rotates": id(k) in rotating,
                "scaled": id(k) in scaled,
                "gated": id(k) in gated,
                "cubin_bytes": len(k.asm["cubin"]),
                "shared": k.metadata.shared,
                "num_warps": k.metadata.num_warps,
                "mma": "mma" in ptx,
                "fma": "fma.rn.f32" in ptx,  # a contracted a*b + c (or libdevice's)
                "e4m3": "e4m3" in ptx,  # a conversion to or from FP8
                "to_e4m3": "cvt.rn.satfinite.e4m3x2" in ptx,  # to FP8 (codes written)
                "from_e4m3": "cvt.rn.f16x2.e4m3x2" in ptx,  # from FP8 (codes read)
                # loads of one byte each (an fp8 cache's codes read without their alignment)
                "byte_loads": re.search(r"ld\.global(\.[\w:]+)*\.[bsu]8\b", ptx) is not None,
                "pdl": k.metadata.launch_pdl and "griddepcontrol.wait" in ptx,
                "lets_next_launch": "griddepcontrol.launch_dependents" in ptx,
                # the last split's merge: a counted arrival, partials read past L1
                "counts_splits": "atom.global.gpu.acq_rel.add" in ptx and "ld.global.cg" in ptx,
            }
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(CASES))
