"""`kv_cache_dtype`: the option, the bytes it holds, and the portable path's rule that attention
reads K/V as the cache stores them, so outputs with a cache of one byte a value are the same
whether a prefix was cached, the prefill was chunked, or the request was preempted, in both
loops."""

from __future__ import annotations

import random

import pytest
import torch

from tandem import EngineConfig
from tandem.execution.kv_cache import allocate_kv_cache, kv_bytes_per_block
from tandem.ops import kv_quant

from conftest import random_prompts
from helpers import assert_idle_and_balanced, greedy, make_llm


def test_the_option_is_checked() -> None:
    assert EngineConfig(device="cpu", kv_cache_dtype="int8").kv_storage_dtype == torch.int8
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8"):
        EngineConfig(device="cpu", kv_cache_dtype="q8_0")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' runs on CUDA only"):
        EngineConfig(device="cpu", kv_cache_dtype="fp8")


def test_a_row_is_codes_and_its_scales() -> None:
    """Bytes: head_dim codes and a float32 scale per block of 32 (int8) or per row (fp8) a
    (token, head) row; 72 / 256 of float32 at head size 64 in int8, 68 in fp8. Values come back
    within half a step of their block's scale (int8) or the row's (fp8), so a large value in
    one block leaves the other block's steps fine."""
    assert (
        kv_bytes_per_block(2, 16, 3, 64, torch.int8) * 256
        == kv_bytes_per_block(2, 16, 3, 64, torch.float32) * 72
    )
    (cache,) = allocate_kv_cache(1, 4, 16, 3, 64, torch.int8, torch.device("cpu"))
    assert cache.shape == (2, 4, 16, 3, 72) and cache.dtype == torch.int8
    x = torch.randn(5, 3, 64) * torch.tensor([0.0, 1.0, 30.0])[None, :, None]
    x[:, 1, 40] = 1000.0  # the second block's outlier
    for dtype, steps, width in ((torch.int8, 127.0, 72), (torch.uint8, 448.0, 68)):
        rows = kv_quant.quantize(x, dtype)
        back = kv_quant.dequantize(rows)
        if dtype == torch.int8:
            scale = x.unflatten(-1, (2, 32)).abs().amax(-1).repeat_interleave(32, -1) / steps
        else:
            scale = x.abs().amax(-1, keepdim=True) / steps
        assert rows.shape == (5, 3, width) and (back[:, 0] == 0).all()
        tolerance = 0.5 if dtype == torch.int8 else 16.0  # e4m3: 3 mantissa bits at 448
        assert ((back - x).abs() <= tolerance * scale + 1e-12).all()
    for dim in (1, 8, 31, 32, 33, 48, 64, 68, 128, 256):  # the width says the head size
        for dtype in (torch.int8, torch.uint8, torch.float32):
            assert kv_quant.head_dim_of(kv_quant.row_width(dim, dtype), dtype) == dim


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_outputs_do_not_depend_on_cache_hits_chunks_or_preemption(tiny_llama, async_scheduling):
    """Eager ops: one engine's outputs alone, with a cold cache and big steps, are the reference;
    a second run of the same prompts hits the prefix cache; small steps chunk every prefill; a
    small cache preempts. All give the same tokens as the reference."""
    rng = random.Random(3)
    head = random_prompts(rng, 1, 1024, 40, 40)[0]
    prompts = [head + p for p in random_prompts(rng, 6, 1024, 3, 30)]
    params = greedy(24)
    common = {"enforce_eager": True, "kv_cache_dtype": "int8", "async_scheduling": async_scheduling}

    def run(twice: bool = False, **options) -> list[list[int]]:
        llm = make_llm(tiny_llama, **{**common, **options})
        try:
            outs = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            if twice:
                outs = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
                assert llm.engine.stats().prefix_cache.hit_tokens >= 5 * 32
            assert_idle_and_balanced(llm.engine)
            return outs
        finally:
            llm.close()

    reference = run(enable_prefix_caching=False, max_num_batched_tokens=2048)
    assert run(twice=True, num_kv_blocks=256) == reference
    assert run(max_num_batched_tokens=16, enable_prefix_caching=False) == reference
    assert run(num_kv_blocks=14, max_num_seqs=6, enable_prefix_caching=False) == reference
