"""Penalties, logit_bias and min_tokens: the same greedy tokens as transformers' `generate` with
the matching logits processors, and async equal to sync, greedy and seeded, through chunked
prefill, preemption and table-row reuse."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from tandem import SamplingParams
from tandem.execution.batch import BatchBuilder
from tandem.request import LogitsProcessing, Request
from tandem.scheduling.scheduler import ScheduledBatch, ScheduledRequest

from conftest import _load_hf_model, follow_near_ties, hf_greedy_reference, random_prompts
from helpers import assert_idle_and_balanced, greedy, make_llm, run_both_loops


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over generated tokens, written independently of
    the engine: scores -= frequency * count + presence * [count > 0]."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(
            1, generated, torch.ones_like(generated, dtype=scores.dtype)
        )
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


_reference_cache: dict[tuple, list[int]] = {}


def hf_processed_greedy(
    path, prompt: list[int], p: SamplingParams, stop_ids=(), generated: Sequence[int] = ()
) -> list[int]:
    """transformers' greedy generate with processors in the engine's order: logit_bias, then
    min_tokens, then repetition, then presence/frequency. Stops on `stop_ids` (none: length).
    It continues after `generated`, tokens taken as already generated (`follow_near_ties`).
    Cached: the same requests are checked under several loops and schedules."""
    key = (
        str(path), tuple(prompt), p.max_tokens, p.repetition_penalty, p.presence_penalty,
        p.frequency_penalty, tuple(sorted(p.logit_bias.items())), p.min_tokens, tuple(stop_ids),
        tuple(generated),
    )  # fmt: skip
    if key not in _reference_cache:
        _reference_cache[key] = _hf_processed_greedy(path, prompt, p, stop_ids, list(generated))
    return list(_reference_cache[key])


def hf_processed_greedy_allowing_near_ties(
    path, prompt: list[int], p: SamplingParams, token_ids: list[int], stop_ids=()
) -> list[int]:
    """`hf_processed_greedy`, following the engine's `token_ids` where they are within
    FAST_PATH_LOGITS_ATOL of the top processed logit (conftest.follow_near_ties)."""
    model = _load_hf_model(str(path))

    def logits_after(prefix: list[int]) -> torch.Tensor:
        input_ids = torch.tensor([prompt + prefix])
        with torch.no_grad():
            row = model(input_ids).logits[:, -1].float()
        return _processors(p, len(prompt), stop_ids)(input_ids, row)[0]

    return follow_near_ties(
        token_ids,
        p.max_tokens,
        lambda prefix, n: hf_processed_greedy(path, prompt, p, stop_ids, prefix),
        logits_after,
    )


def _processors(p: SamplingParams, prompt_len: int, stop_ids) -> LogitsProcessorList:
    processors = []
    if p.logit_bias:
        processors.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias.items()]))
    if p.min_tokens and stop_ids:
        processors.append(
            MinNewTokensLengthLogitsProcessor(prompt_len, p.min_tokens, list(stop_ids))
        )
    if p.repetition_penalty != 1:
        processors.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if p.presence_penalty or p.frequency_penalty:
        processors.append(OpenAIPenalties(prompt_len, p.presence_penalty, p.frequency_penalty))
    return LogitsProcessorList(processors)


def _hf_processed_greedy(
    path, prompt: list[int], p: SamplingParams, stop_ids, generated: list[int]
) -> list[int]:
    if len(generated) == p.max_tokens or (generated and generated[-1] in stop_ids):
        return []  # the request has ended
    model = _load_hf_model(str(path))
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=p.max_tokens - len(generated),
        pad_token_id=model.config.pad_token_id,
        eos_token_id=list(stop_ids) or None,
    )
    input_ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=config,
            logits_processor=_processors(p, len(prompt), stop_ids),
        )
    return out[0, input_ids.shape[1] :].tolist()


def penalty_params(rng: random.Random, n: int) -> list[SamplingParams]:
    """A mix: each penalty alone, all together, and plain requests between them."""
    choices = [
        {},
        {"repetition_penalty": 1.6},
        {"repetition_penalty": 0.7},
        {"presence_penalty": 1.5},
        {"frequency_penalty": 2.0},
        {"presence_penalty": -1.0, "frequency_penalty": 0.5},
        {"logit_bias": {rng.randrange(3, 1024): 6.0, rng.randrange(3, 1024): -100.0}},
        {
            "repetition_penalty": 1.3, "presence_penalty": 0.6, "frequency_penalty": 0.9,
            "logit_bias": {rng.randrange(3, 1024): 4.0},
        },
    ]  # fmt: skip
    return [greedy(rng.randint(8, 24), **choices[i % len(choices)]) for i in range(n)]


def check_against_hf(path, prompts, params, **options):
    llm = make_llm(path, **options)
    outs = llm.generate(prompts, params)
    changed = 0
    for i, (prompt, p, out) in enumerate(zip(prompts, params, outs, strict=True)):
        reference = hf_processed_greedy_allowing_near_ties(path, prompt, p, out.token_ids)
        assert out.token_ids == reference, f"request {i}: {p}"
        changed += out.token_ids != hf_greedy_reference(path, prompt, p.max_tokens)
    assert changed >= len(prompts) // 2, "the penalties should change most outputs"
    assert_idle_and_balanced(llm.engine)
    return llm, outs


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "options",
    [
        {"max_num_batched_tokens": 2048},
        {"max_num_batched_tokens": 24, "block_size": 4},
        {"max_num_seqs": 2, "max_num_batched_tokens": 64},
    ],
    ids=["whole-prompts", "chunked", "row-reuse"],
)
def test_penalties_and_bias_match_hf_processors(tiny_checkpoints, async_scheduling, options):
    """Mistral (tied embeddings) repeats itself a lot, so the penalties bite hard."""
    path = tiny_checkpoints["MistralForCausalLM"]
    rng = random.Random(1)
    prompts = random_prompts(rng, 16, 1024, 1, 60)
    check_against_hf(
        path, prompts, penalty_params(rng, len(prompts)), async_scheduling=async_scheduling,
        **options,
    )  # fmt: skip


def test_repetition_penalty_matches_hf_generate(tiny_llama):
    """transformers' own repetition penalty (the processor `generate(repetition_penalty=...)`
    adds): prompt tokens count too."""
    rng = random.Random(2)
    prompts = random_prompts(rng, 6, 1024, 3, 40)
    p = greedy(16, repetition_penalty=1.8)
    for prompt, out in zip(prompts, make_llm(tiny_llama).generate(prompts, p), strict=True):
        assert out.token_ids == hf_processed_greedy_allowing_near_ties(
            tiny_llama, prompt, p, out.token_ids
        )


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preempted_requests_keep_exact_counts(tiny_checkpoints, async_scheduling):
    """Preempted mid-prefill and mid-decode, recomputed, the counts are rebuilt exactly: the
    same tokens as transformers (and so as an unpreempted run)."""
    path = tiny_checkpoints["MistralForCausalLM"]
    rng = random.Random(3)
    prompts = random_prompts(rng, 12, 1024, 20, 90)
    params = [
        greedy(24, repetition_penalty=1.4, presence_penalty=0.8, frequency_penalty=0.6)
        for _ in prompts
    ]
    llm, _ = check_against_hf(
        path, prompts, params, async_scheduling=async_scheduling,
        num_kv_blocks=24, block_size=8, max_num_batched_tokens=48,
    )  # fmt: skip
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_min_tokens_masks_stop_ids_until_reached(tiny_llama, async_scheduling):
    """Stop ids that greedy decoding would emit early are masked until min_tokens; the request
    then stops on the first one, exactly as transformers with MinNewTokensLength does."""
    rng = random.Random(4)
    prompts = random_prompts(rng, 8, 1024, 5, 40)
    params, stops = [], []
    for prompt in prompts:
        plain = hf_greedy_reference(tiny_llama, prompt, 12)
        stop_ids = sorted({plain[1], plain[3]})  # would stop at token 2 without min_tokens
        stops.append(stop_ids)
        params.append(greedy(20, min_tokens=6, stop_token_ids=stop_ids))
    llm = make_llm(tiny_llama, async_scheduling=async_scheduling, max_num_seqs=3)
    outs = llm.generate(prompts, params)
    for prompt, p, stop_ids, out in zip(prompts, params, stops, outs, strict=True):
        ref = hf_processed_greedy_allowing_near_ties(tiny_llama, prompt, p, out.token_ids, stop_ids)
        assert out.token_ids == ref
        assert len(out.token_ids) >= 7  # 6 tokens that are not stop ids, then maybe one
        assert not set(out.token_ids[:6]) & set(stop_ids)
        if out.token_ids[-1] in stop_ids:
            assert out.finish_reason == "stop"
    assert_idle_and_balanced(llm.engine)


def test_min_tokens_masks_eos_unless_ignored(tiny_llama):
    """EOS counts as a stop id for min_tokens (a huge bias makes it the greedy choice)."""
    llm = make_llm(tiny_llama)
    eos = min(llm.engine.eos_token_ids)
    prompt = [7, 8, 9, 10]
    p = SamplingParams(max_tokens=10, temperature=0, min_tokens=4, logit_bias={eos: 100.0})
    out = llm.generate([prompt], p)[0]
    assert out.token_ids == hf_processed_greedy_allowing_near_ties(
        tiny_llama, prompt, p, out.token_ids, [eos]
    )
    assert len(out.token_ids) == 5 and out.token_ids[-1] == eos and out.finish_reason == "stop"
    # With ignore_eos, EOS is neither a stop nor masked: the bias makes every token EOS.
    out = llm.generate([prompt], greedy(6, min_tokens=4, logit_bias={eos: 100.0}))[0]
    assert out.token_ids == [eos] * 6


def test_stop_strings_wait_for_min_tokens(tiny_llama):
    """As in vLLM, a stop string completed before min_tokens does not end the request."""
    llm = make_llm(tiny_llama)
    prompt = [9, 10, 11, 12]
    full = llm.generate([prompt], greedy(12))[0]
    stop = full.text[1:4]  # the text starts with it: found within the first few tokens
    early = llm.generate([prompt], greedy(12, stop=[stop]))[0]
    assert early.finish_reason == "stop" and len(early.token_ids) < 8
    late = llm.generate([prompt], greedy(12, stop=[stop], min_tokens=8))[0]
    assert len(late.token_ids) >= 8 and late.token_ids == full.token_ids[: len(late.token_ids)]
    assert late.text.startswith(full.text[:4])  # the early occurrence stayed in the text


@pytest.mark.parametrize(
    "options",
    [
        {"max_num_batched_tokens": 24, "block_size": 4},
        {"num_kv_blocks": 30, "block_size": 8, "max_num_batched_tokens": 64},
        {"max_num_seqs": 2},
    ],
    ids=["chunked", "preemption", "row-reuse"],
)
def test_async_equals_sync_seeded_with_every_feature(tiny_llama, options):
    rng = random.Random(5)
    prompts = random_prompts(rng, 14, 1024, 10, 100)
    params = [
        SamplingParams(
            max_tokens=rng.randint(4, 24), temperature=rng.choice([0.0, 0.8, 1.2]),
            top_k=rng.choice([0, 40]), seed=i, ignore_eos=rng.random() < 0.5,
            repetition_penalty=rng.choice([1.0, 1.5]),
            presence_penalty=rng.choice([0.0, 1.0]), frequency_penalty=rng.choice([0.0, 0.7]),
            logit_bias=rng.choice([None, {rng.randrange(1024): 5.0}]),
            min_tokens=rng.choice([0, 3]), stop_token_ids=rng.sample(range(3, 1024), 40),
            logprobs=rng.choice([None, 3]),
        )
        for i in range(len(prompts))
    ]  # fmt: skip
    runs = run_both_loops(tiny_llama, prompts, params, **options)
    results = {mode: outputs for mode, (outputs, _) in runs.items()}
    for sync, async_ in zip(results[False], results[True], strict=True):
        assert sync.token_ids == async_.token_ids
        assert sync.finish_reason == async_.finish_reason
        if sync.logprobs is not None:
            for a, b in zip(sync.logprobs, async_.logprobs, strict=True):
                assert list(a) == list(b)
                assert [x.logprob for x in a.values()] == pytest.approx(
                    [x.logprob for x in b.values()], abs=1e-5
                )
    assert any(o.finish_reason == "stop" for o in results[True])  # stop ids really bite


def test_counts_start_from_position_zero_on_admission():
    """A request admitted with a prefix it does not compute (a cached prefix) still gets the
    prefix counted: its tokens are written to the table and counted from position 0."""
    req = Request(
        "r", [11, 12, 13, 14, 15], SamplingParams(), 0, (0.0, 0, 1.0, 0.0, 0), 4, 0.0,
        processing=LogitsProcessing(repetition=1.5),
    )  # fmt: skip
    req.slot = 1
    builder = BatchBuilder(np.zeros((1, 4, 8), dtype=np.int64), block_size=4, max_model_len=32)
    item = ScheduledRequest(req, 1, start=3, num_tokens=2, sample=True, output_index=0)
    later = builder.build(ScheduledBatch(0, [item], 0))
    assert later.sampler.processing.prompt_tokens.tolist() == [32 + 3, 32 + 4]
    assert later.sampler.processing.reset_rows.tolist() == []
    item.admitted = True
    first = builder.build(ScheduledBatch(0, [item], 0))
    assert first.sampler.processing.reset_rows.tolist() == [1]
    assert first.sampler.processing.prompt_tokens.tolist() == [32 + p for p in range(5)]
    assert first.known_index.tolist() == [32 + p for p in range(5)]
    assert first.known_tokens.tolist() == [11, 12, 13, 14, 15]
    assert first.token_index.tolist() == [32 + 3, 32 + 4]  # computed: only the two


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ],
)
def test_invalid_penalty_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_logit_bias_outside_the_vocabulary_is_refused(tiny_llama):
    llm = make_llm(tiny_llama)
    with pytest.raises(ValueError, match="logit_bias token id 1024 is outside the vocabulary"):
        llm.engine.add_request([5, 6], SamplingParams(logit_bias={1024: 1.0}))
    assert not llm.engine.has_unfinished()
