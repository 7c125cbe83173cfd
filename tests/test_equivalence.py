"""Invariants 1 and 2: greedy output equals Hugging Face generate (up to near ties, see
conftest.follow_near_ties); async equals sync."""

from __future__ import annotations

import random

import pytest

from tandem.models.default_model import build_checkpoint

from conftest import hf_greedy_reference_allowing_near_ties, random_prompts
from helpers import assert_idle_and_balanced, greedy, make_llm, run_both_loops

ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]


def _check_against_hf(path, prompts, max_tokens, **options):
    llm = make_llm(path, **options)
    outputs = llm.generate(prompts, [greedy(n) for n in max_tokens])
    for i, (prompt, n, out) in enumerate(zip(prompts, max_tokens, outputs, strict=True)):
        reference = hf_greedy_reference_allowing_near_ties(path, prompt, out.token_ids, n)
        assert out.token_ids == reference, f"request {i} ({len(prompt)} tokens)"
        assert out.finish_reason == "length"
    assert_idle_and_balanced(llm.engine)
    return llm, outputs


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_each_architecture_matches_hf(tiny_checkpoints, arch, async_scheduling):
    rng = random.Random(hash(arch) % 1000)
    prompts = random_prompts(rng, 24, 1024, 1, 300)
    max_tokens = [rng.randint(1, 24) for _ in prompts]
    _check_against_hf(
        tiny_checkpoints[arch], prompts, max_tokens,
        async_scheduling=async_scheduling, max_num_batched_tokens=256,
    )  # fmt: skip


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
def test_chunked_prefill_and_block_sizes(tiny_llama, block_size, async_scheduling):
    """A 40-token budget splits most prompts into chunks that share steps with decodes."""
    rng = random.Random(block_size)
    prompts = random_prompts(rng, 20, 1024, 1, 200)
    _check_against_hf(
        tiny_llama, prompts, [16] * len(prompts),
        block_size=block_size, max_num_batched_tokens=40, async_scheduling=async_scheduling,
    )  # fmt: skip


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preemption_by_recompute(tiny_llama, async_scheduling):
    """So few blocks that requests must be preempted and recomputed, repeatedly."""
    rng = random.Random(7)
    prompts = random_prompts(rng, 16, 1024, 20, 120)
    llm, _ = _check_against_hf(
        tiny_llama, prompts, [32] * len(prompts),
        block_size=8, num_kv_blocks=30, max_num_batched_tokens=128,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    assert llm.engine.scheduler.num_preemptions > 0


def test_sliding_window_matches_hf(tmp_path):
    """Mistral's sliding window bites when the context is longer than the window."""
    path = build_checkpoint(
        tmp_path / "mistral-window", "MistralForCausalLM", extra_config={"sliding_window": 24}
    )
    rng = random.Random(3)
    prompts = random_prompts(rng, 6, 1024, 10, 90)
    _check_against_hf(path, prompts, [20] * len(prompts), block_size=8, max_num_batched_tokens=32)


@pytest.mark.parametrize(
    "options",
    [
        {"max_num_batched_tokens": 2048},
        {"max_num_batched_tokens": 24, "block_size": 4},
        {"num_kv_blocks": 40, "block_size": 8, "max_num_batched_tokens": 96},
        {"max_num_seqs": 3},
    ],
    ids=["big-budget", "chunked", "preemption", "few-seqs"],
)
def test_async_equals_sync_seeded_sampling(tiny_llama, options):
    rng = random.Random(11)
    prompts = random_prompts(rng, 16, 1024, 1, 150)
    from tandem import SamplingParams

    params = [
        SamplingParams(
            max_tokens=rng.randint(1, 30), temperature=rng.choice([0.0, 0.7, 1.0, 1.5]),
            top_k=rng.choice([0, 5, 50]), top_p=rng.choice([1.0, 0.9, 0.5]),
            min_p=rng.choice([0.0, 0.05]), seed=i, ignore_eos=True,
        )
        for i in range(len(prompts))
    ]  # fmt: skip
    runs = run_both_loops(tiny_llama, prompts, params, **options)
    results = {mode: [o.token_ids for o in outputs] for mode, (outputs, _) in runs.items()}
    assert results[False] == results[True]
    assert [len(t) for t in results[True]] == [p.max_tokens for p in params]
