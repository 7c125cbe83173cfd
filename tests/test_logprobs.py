"""Logprobs: the sampled token's and the top-k, of generated and prompt tokens, computed on the
device from the raw logits, equal `log_softmax` of transformers' logits at the same positions."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tandem import SamplingParams
from tandem.sampler.logprobs import pack, score_tokens, unpack

from conftest import _load_hf_model, random_prompts
from helpers import assert_idle_and_balanced, greedy, make_llm, run_both_loops

ATOL = 1e-4


def hf_logprobs(path, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' fp32 logits: row i is the distribution of token i + 1."""
    model = _load_hf_model(str(path))
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return logits.log_softmax(dim=-1)


def check_entry(entry: dict, token: int, ref_row: torch.Tensor, k: int) -> None:
    """One token's dict: `token` first with its logprob and rank, then the reference's top k."""
    ids = list(entry)
    assert ids[0] == token
    assert entry[token].logprob == pytest.approx(ref_row[token].item(), abs=ATOL)
    # Its rank among the reference's values, up to ties within the tolerance (values that close
    # may order either way between two sums of the same logits).
    value = ref_row[token]
    highest, lowest = int((ref_row > value + ATOL).sum()) + 1, int((ref_row > value - ATOL).sum())
    assert highest <= entry[token].rank <= lowest
    top_values, top_ids = ref_row.topk(k)
    expected = {int(t): float(v) for t, v in zip(top_ids, top_values, strict=True)}
    assert set(ids) == expected.keys() | {token}
    for rank, (tid, value) in enumerate(expected.items(), 1):
        assert entry[tid].logprob == pytest.approx(value, abs=ATOL)
        assert entry[tid].rank == rank
    assert all(isinstance(e.decoded_token, str) for e in entry.values())


def check_against_hf(path, prompt: list[int], out, params: SamplingParams) -> None:
    ref = hf_logprobs(path, prompt + out.token_ids)
    n = len(prompt)
    if params.logprobs is None:
        assert out.logprobs is None
    else:
        assert len(out.logprobs) == len(out.token_ids)
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            check_entry(entry, token, ref[n - 1 + i], params.logprobs)
    if params.prompt_logprobs is None:
        assert out.prompt_logprobs is None
    else:
        assert len(out.prompt_logprobs) == n and out.prompt_logprobs[0] is None
        for j in range(1, n):
            check_entry(out.prompt_logprobs[j], prompt[j], ref[j - 1], params.prompt_logprobs)


def mixed_params(rng: random.Random, n: int, **kw) -> list[SamplingParams]:
    """Some requests ask for logprobs, prompt logprobs, both or neither, with various k."""
    return [
        greedy(
            rng.randint(1, 12),
            logprobs=rng.choice([None, 0, 1, 5, 20]),
            prompt_logprobs=rng.choice([None, 0, 3]),
            **kw,
        )
        for _ in range(n)
    ]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "options",
    [{}, {"max_num_batched_tokens": 24, "block_size": 4}],
    ids=["whole-prompts", "chunked"],
)
def test_logprobs_equal_hf_log_softmax(tiny_llama, async_scheduling, options):
    rng = random.Random(1)
    prompts = random_prompts(rng, 10, 1024, 1, 80)
    params = mixed_params(rng, len(prompts))
    llm = make_llm(tiny_llama, async_scheduling=async_scheduling, **options)
    outs = llm.generate(prompts, params)
    for prompt, out, p in zip(prompts, outs, params, strict=True):
        check_against_hf(tiny_llama, prompt, out, p)
    assert_idle_and_balanced(llm.engine)


def test_logprobs_are_raw_under_sampling_and_penalties(tiny_llama):
    """Temperature, top-k and penalties shape the sample, not the reported (raw) logprobs."""
    rng = random.Random(2)
    prompts = random_prompts(rng, 6, 1024, 5, 40)
    params = [
        SamplingParams(
            max_tokens=10, temperature=1.5, top_k=20, seed=i, ignore_eos=True, logprobs=4,
            repetition_penalty=1.3, presence_penalty=0.5, logit_bias={100 + i: 3.0},
        )
        for i in range(len(prompts))
    ]  # fmt: skip
    outs = make_llm(tiny_llama).generate(prompts, params)
    for prompt, out, p in zip(prompts, outs, params, strict=True):
        check_against_hf(tiny_llama, prompt, out, p)
    # Sampled, not greedy: some tokens are not the most likely under the raw distribution.
    assert any(e[t].rank > 1 for o in outs for t, e in zip(o.token_ids, o.logprobs, strict=True))


@pytest.mark.parametrize(
    "options",
    [
        {"max_num_batched_tokens": 32, "block_size": 4},
        {"num_kv_blocks": 24, "block_size": 8, "max_num_batched_tokens": 48},
    ],
    ids=["chunked", "preemption"],
)
def test_async_logprobs_equal_sync(tiny_llama, options):
    rng = random.Random(3)
    prompts = random_prompts(rng, 12, 1024, 20, 90)
    params = [
        SamplingParams(
            max_tokens=rng.randint(4, 16), temperature=rng.choice([0.0, 0.8]), seed=i,
            ignore_eos=True, logprobs=rng.choice([None, 2]), prompt_logprobs=rng.choice([None, 2]),
        )
        for i in range(len(prompts))
    ]  # fmt: skip
    runs = run_both_loops(tiny_llama, prompts, params, **options)
    results = {mode: outputs for mode, (outputs, _) in runs.items()}
    if "num_kv_blocks" in options:
        assert all(llm.engine.scheduler.num_preemptions > 0 for _, llm in runs.values())
    for prompt, p, sync, async_ in zip(prompts, params, results[False], results[True], strict=True):
        assert sync.token_ids == async_.token_ids
        check_against_hf(tiny_llama, prompt, async_, p)
        check_against_hf(tiny_llama, prompt, sync, p)


def test_prompt_logprobs_survive_preemption_mid_prefill(tiny_llama):
    """A long prompt preempted between its chunks is recomputed; its prompt logprobs come out
    once each, complete and right (results of recomputed positions are not appended twice)."""
    rng = random.Random(4)
    prompts = random_prompts(rng, 6, 1024, 60, 120)
    params = [greedy(12, logprobs=1, prompt_logprobs=2) for _ in prompts]
    llm = make_llm(tiny_llama, num_kv_blocks=20, block_size=8, max_num_batched_tokens=24)
    scheduler = llm.engine.scheduler
    preempt, mid_prefill = scheduler.preempt, []

    def spy(request):
        mid_prefill.append(request.num_computed_tokens < request.num_prompt_tokens)
        preempt(request)

    scheduler.preempt = spy
    outs = llm.generate(prompts, params)
    assert any(mid_prefill) and not all(mid_prefill)  # both mid-prefill and mid-decode
    for prompt, out, p in zip(prompts, outs, params, strict=True):
        check_against_hf(tiny_llama, prompt, out, p)
    assert_idle_and_balanced(llm.engine)


def test_streamed_outputs_carry_logprobs_of_their_tokens(tiny_llama):
    llm = make_llm(tiny_llama)
    engine = llm.engine
    request_id = engine.add_request([5, 6, 7], greedy(6, logprobs=2))
    seen_ids, seen_logprobs = [], []
    for out in engine.stream_outputs():
        assert out.request_id == request_id
        n = len(out.delta_token_ids)
        seen_ids += out.delta_token_ids
        seen_logprobs += out.logprobs[len(out.token_ids) - n :]
        assert len(out.logprobs) == len(out.token_ids)
    assert out.finished and seen_ids == out.token_ids
    assert [list(e)[0] for e in seen_logprobs] == out.token_ids
    assert seen_logprobs == out.logprobs


def test_plain_requests_take_the_plain_path(tiny_llama):
    """No request asks for logprobs or processing: the steps carry no extras at all."""
    llm = make_llm(tiny_llama)
    runner = llm.engine.runner
    launched = []
    launch = runner.launch
    runner.launch = lambda inputs: launched.append(inputs) or launch(inputs)
    llm.generate([[5, 6, 7], [8, 9]], greedy(4))
    assert launched and all(x.sampler.plain for x in launched)
    llm.generate([[5, 6, 7], [8, 9]], [greedy(4), greedy(4, logprobs=0)])
    assert not launched[-1].sampler.plain
    assert runner.sampler.token_counts.output_counts is None  # never allocated without penalties


def test_pack_round_trips_exactly():
    """Float32 logprobs travel bit for bit inside the int64 output, -inf included."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=gen)
    logits[1, 3] = float("-inf")
    lp = logits.log_softmax(-1)
    ids = torch.tensor([3, 7, 0, 49, 12])
    a = score_tokens(lp, ids, 4)
    b = score_tokens(lp[:2], torch.tensor([3, 3]), 0)
    out_ids, (ua, ub) = unpack(pack(ids, [a, b]).numpy(), 5, [(5, 4), (2, 0)])
    assert out_ids.tolist() == ids.tolist()
    np.testing.assert_array_equal(ua.logprob, a.logprob.numpy())
    np.testing.assert_array_equal(ua.top_logprobs, a.top_logprobs.numpy())
    np.testing.assert_array_equal(ua.top_ids, a.top_ids.numpy())
    np.testing.assert_array_equal(ua.rank, a.rank.numpy())
    assert ub.logprob[1] == float("-inf") and ub.top_ids.shape == (2, 0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 1.5}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ],
)
def test_invalid_logprobs_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
