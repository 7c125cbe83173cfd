"""Penalties and logprobs on requests that share KV blocks: a cached prefix, the samples of an
n > 1 request, a re-admission that finds its own blocks cached.

A request admitted partway into its sequence computes only the rest, but its penalties count
every token from position 0 (the skipped ones are written to its table row and counted on the
admission step); each sample of n > 1 has its own row, so its own counts; and a request that
asks for prompt logprobs reuses no cached prefix, since they come from computed positions.
"""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
from test_logprobs import check_against_hf as check_logprobs_against_hf
from test_logprobs import mixed_params
from test_penalties import hf_processed_greedy_allowing_near_ties
from test_prefix_cache import prefill_of, record_items, shared_prefix_prompts

from tandem import SamplingParams
from tandem.engine.fan_out import sample_seed

from conftest import hf_greedy_reference, random_prompts
from helpers import assert_idle_and_balanced, greedy
from helpers import make_llm as _make_llm

MODES = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


def make_llm(path, **options):
    options.setdefault("num_kv_blocks", 256)
    return _make_llm(path, **options)


def admitted_past_zero(items, *, penalized: bool = True) -> list:
    """Admission items that skipped a cached prefix (of requests with penalties)."""
    return [
        it
        for _, it in items
        if it.admitted
        and it.start > 0
        and (not penalized or (it.request.processing and it.request.processing.uses_penalties))
    ]


def assert_same_logprobs(a: list[dict] | None, b: list[dict] | None) -> None:
    assert (a is None) == (b is None)
    for x, y in zip(a or [], b or [], strict=True):
        assert list(x) == list(y)  # same tokens, same order (sampled first, then by rank)
        assert [v.rank for v in x.values()] == [v.rank for v in y.values()]
        assert [v.logprob for v in x.values()] == pytest.approx(
            [v.logprob for v in y.values()], abs=1e-5
        )


# ------------------------------------------------------------ a cached prefix
@MODES
def test_penalties_over_a_cached_prefix_match_hf(tiny_checkpoints, async_scheduling):
    """Repetition counts prompt tokens: a request whose prompt is mostly cached must still see
    every one of them. The same tokens as transformers, with the cache on and off."""
    path = tiny_checkpoints["MistralForCausalLM"]  # repeats itself: the penalties bite
    prompts = shared_prefix_prompts(11, 3, 12, 40)
    rng = random.Random(12)
    choices = [
        {"repetition_penalty": 1.6},
        {"repetition_penalty": 0.7},
        {"repetition_penalty": 1.3, "presence_penalty": 0.6, "frequency_penalty": 0.9},
        {"presence_penalty": 1.5},
        {"frequency_penalty": 2.0},
    ]
    params = [greedy(rng.randint(8, 20), **choices[i % len(choices)]) for i in range(len(prompts))]
    for caching in (True, False):
        llm = make_llm(
            path, block_size=8, max_num_batched_tokens=96, max_num_seqs=4,
            async_scheduling=async_scheduling, enable_prefix_caching=caching,
        )  # fmt: skip
        items = record_items(llm.engine)
        outs = llm.generate(prompts, params)
        changed = 0
        for i, (prompt, p, out) in enumerate(zip(prompts, params, outs, strict=True)):
            reference = hf_processed_greedy_allowing_near_ties(path, prompt, p, out.token_ids)
            assert out.token_ids == reference, f"request {i}: {p}"
            changed += out.token_ids != hf_greedy_reference(path, prompt, p.max_tokens)
        assert changed >= len(prompts) // 2, "the penalties should change most outputs"
        skipped = admitted_past_zero(items)
        assert (len(skipped) >= 6) == caching, [it.start for it in skipped]
        assert_idle_and_balanced(llm.engine)


@MODES
def test_readmission_over_its_own_cached_outputs_keeps_exact_counts(
    tiny_checkpoints, async_scheduling
):
    """Preempted, a request's blocks (prompt and outputs) stay cached; re-admitted, it skips
    them, and its output counts (presence, frequency) must be rebuilt from the host's tokens."""
    path = tiny_checkpoints["MistralForCausalLM"]
    rng = random.Random(13)
    prompts = random_prompts(rng, 8, 1024, 10, 30)
    params = [
        greedy(40, presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.2)
        for _ in prompts
    ]
    llm = make_llm(
        path, num_kv_blocks=28, block_size=4, max_num_batched_tokens=64,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    items = record_items(llm.engine)
    outs = llm.generate(prompts, params)
    for i, (prompt, p, out) in enumerate(zip(prompts, params, outs, strict=True)):
        reference = hf_processed_greedy_allowing_near_ties(path, prompt, p, out.token_ids)
        assert out.token_ids == reference, f"request {i}"
    assert llm.engine.scheduler.num_preemptions > 0
    # Some re-admission skipped cached blocks that hold generated tokens.
    assert any(it.start > it.request.num_prompt_tokens for it in admitted_past_zero(items))
    assert_idle_and_balanced(llm.engine)


# ------------------------------------------------------------------- n > 1
def sampled(n: int, seed: int, favoured: list[int] = ()) -> SamplingParams:
    return SamplingParams(
        n=n, max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True,
        repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.5, logprobs=2,
        logit_bias=dict.fromkeys(favoured, 4.0),
    )  # fmt: skip


def _n_prompts() -> tuple[list[list[int]], list[list[int]]]:
    """Prompts whose first 32 tokens (four blocks of 8, skipped by samples 1 and 2) cycle over
    a few tokens that a logit_bias favours and no later token repeats: only the repetition
    penalty over the skipped prefix holds them back."""
    rng = random.Random(14)
    prompts, favoured = [], []
    for tail in random_prompts(rng, 3, 1024, 5, 20):
        few = rng.sample(sorted(set(range(3, 1024)) - set(tail)), 6)
        prompts.append([few[k % 6] for k in range(32)] + tail)
        favoured.append(few)
    return prompts, favoured


N_PROMPTS, N_FAVOURED = _n_prompts()
N_SEEDS = [3, 4, 5]
_singles: list = []


def n_params(n: int) -> list[SamplingParams]:
    return [sampled(n, s, f) for s, f in zip(N_SEEDS, N_FAVOURED, strict=True)]


def single_requests(path) -> list:
    """Each sample as its own n = 1 request, seeded sample_seed(seed, i), in an engine that
    shares nothing (no prefix cache, so no skipped prefix anywhere): the reference."""
    if not _singles:
        llm = make_llm(path, enable_prefix_caching=False, async_scheduling=False)
        params = [
            dataclasses.replace(p, seed=sample_seed(p.seed, i))
            for p in n_params(1)
            for i in range(3)
        ]
        _singles.extend(llm.generate([p for p in N_PROMPTS for _ in range(3)], params))
        for k, out in enumerate(_singles):
            check_logprobs_against_hf(path, N_PROMPTS[k // 3], out, params[k])
    return _singles


@MODES
@pytest.mark.parametrize("caching", [True, False], ids=["cache", "no-cache"])
def test_each_sample_equals_its_single_request(tiny_llama, async_scheduling, caching):
    """Sample i of n = 3 equals the n = 1 request seeded sample_seed(seed, i) (sample 0: seed),
    tokens and logprobs (right against transformers), though samples 1 and 2 compute only the
    prompt's last block: each sample's penalty counts are its own, and complete."""
    singles = single_requests(tiny_llama)
    options = {
        "block_size": 8, "max_num_batched_tokens": 64, "async_scheduling": async_scheduling,
        "enable_prefix_caching": caching,
    }  # fmt: skip
    llm = make_llm(tiny_llama, **options)
    items = record_items(llm.engine)
    outs = llm.generate(N_PROMPTS, n_params(3))
    assert len(admitted_past_zero(items)) == 6  # samples 1 and 2 shared their prompt
    for j, out in enumerate(outs):
        samples = out.outputs
        assert len({tuple(s.token_ids) for s in samples}) == 3
        assert out.logprobs == samples[0].logprobs
        for i, sample in enumerate(samples):
            single = singles[3 * j + i]
            assert sample.token_ids == single.token_ids, (j, i)
            assert_same_logprobs(sample.logprobs, single.logprobs)
    assert_idle_and_balanced(llm.engine)


@MODES
def test_greedy_samples_with_repetition_penalty_match_hf(tiny_checkpoints, async_scheduling):
    """Greedy samples are identical, each exactly transformers' with the penalty: the samples
    after the first skip the prompt's cached blocks, yet count all of its tokens."""
    path = tiny_checkpoints["MistralForCausalLM"]
    prompts = random_prompts(random.Random(15), 3, 1024, 30, 60)
    p = greedy(16, n=3, repetition_penalty=1.5, frequency_penalty=0.5)
    llm = make_llm(path, block_size=8, async_scheduling=async_scheduling)
    items = record_items(llm.engine)
    outs = llm.generate(prompts, p)
    assert len(admitted_past_zero(items)) == 6
    for prompt, out in zip(prompts, outs, strict=True):
        samples = [s.token_ids for s in out.outputs]
        ref = hf_processed_greedy_allowing_near_ties(path, prompt, p, samples[0])
        assert ref != hf_greedy_reference(path, prompt, 16)
        assert samples == [ref] * 3
    assert_idle_and_balanced(llm.engine)


# --------------------------------------------------------- prompt logprobs
@MODES
def test_prompt_logprobs_reuse_no_cached_prefix(tiny_llama, async_scheduling):
    """A request with prompt_logprobs computes its whole prompt (the cache would skip positions
    whose logprobs it needs); its blocks still join the cache, and others keep hitting it."""
    llm = make_llm(tiny_llama, block_size=8, async_scheduling=async_scheduling)
    engine = llm.engine
    items = record_items(engine)
    stats = engine.scheduler.stats
    rng = random.Random(16)
    shared, tail_a, tail_b = random_prompts(rng, 3, 1024, 20, 20)
    shared = (shared * 3)[:48]  # six full blocks
    a, b = shared + tail_a, shared + tail_b

    llm.generate([a], greedy(4))
    assert stats.hit_tokens == 0
    p = greedy(6, logprobs=1, prompt_logprobs=3)
    out = llm.generate([b], p)[0]
    assert prefill_of(items, out.request_id) == [(0, len(b))]
    assert stats.hit_tokens == 0 and stats.queries == 2
    check_logprobs_against_hf(tiny_llama, b, out, p)

    # Without prompt logprobs the same prompt hits the cache: every full block of b, which the
    # request with prompt logprobs registered.
    out = llm.generate([b], greedy(6))[0]
    assert prefill_of(items, out.request_id) == [(64, len(b) - 64)]
    assert stats.hit_tokens == 64

    # n = 2: each sample computes the whole prompt and has complete prompt logprobs.
    p2 = greedy(5, n=2, logprobs=0, prompt_logprobs=1)
    out = llm.generate([b], p2)[0]
    for i, sample in enumerate(out.outputs):
        assert prefill_of(items, out.request_id, i) == [(0, len(b))]
        view = SimpleNamespace(
            token_ids=sample.token_ids,
            logprobs=sample.logprobs,
            prompt_logprobs=out.prompt_logprobs,
        )
        check_logprobs_against_hf(tiny_llama, b, view, p2)
    assert stats.hit_tokens == 64
    assert_idle_and_balanced(engine)


def test_streamed_samples_carry_their_own_prompt_logprobs(tiny_llama):
    """Every sample's streamed outputs have its full prompt logprobs from its first token on."""
    llm = make_llm(tiny_llama, block_size=4, max_num_batched_tokens=16)
    engine = llm.engine
    prompt = random_prompts(random.Random(17), 1, 1024, 30, 30)[0]
    engine.add_request(prompt, greedy(3, n=3, prompt_logprobs=2))
    firsts = {}
    for out in engine.stream_outputs():
        assert len(out.prompt_logprobs) == len(prompt)
        firsts.setdefault(out.index, out.prompt_logprobs)
    assert sorted(firsts) == [0, 1, 2]
    assert all(p[0] is None for p in firsts.values())
    for i in (1, 2):
        assert_same_logprobs(firsts[i][1:], firsts[0][1:])
    assert_idle_and_balanced(engine)


# ------------------------------------------------------------ portable path
def test_logprobs_with_sharing_on_the_portable_path(tiny_llama):
    """enforce_eager (the portable ops, not the fused forward) gives the same logprobs, prompt
    logprobs included, with shared prefixes and n > 1."""
    prompts = shared_prefix_prompts(18, 2, 8, 24)
    rng = random.Random(19)
    params = [dataclasses.replace(p, n=2) for p in mixed_params(rng, len(prompts))]
    results = []
    for enforce_eager in (True, False):
        llm = make_llm(
            tiny_llama, block_size=8, max_num_batched_tokens=48, enforce_eager=enforce_eager
        )
        assert (llm.engine.execution.ops == "portable") == enforce_eager
        outs = llm.generate(prompts, params)
        for prompt, out, p in zip(prompts, outs, params, strict=True):
            check_logprobs_against_hf(tiny_llama, prompt, out, p)
        results.append(outs)
        assert_idle_and_balanced(llm.engine)
    for eager, fast in zip(*results, strict=True):
        assert [s.token_ids for s in eager.outputs] == [s.token_ids for s in fast.outputs]
        for x, y in zip(eager.outputs, fast.outputs, strict=True):
            assert_same_logprobs(x.logprobs, y.logprobs)
