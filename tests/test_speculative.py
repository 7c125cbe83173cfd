"""Speculative decoding: the same tokens as decoding without drafts, in both loops.

Drafts are verified by sampling every position as decoding without them would (the same seeded
noise), so greedy and seeded outputs alike must equal the engine's without speculation, token for
token, under any block size, chunked prefill, preemption (with drafts in flight), aborts, n > 1
and prefix caching; stops inside an accepted run drop what follows; KV blocks and rows balance.
`cycling_llama` makes long accepted runs; `tiny_llama` mostly rejected ones.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from tandem import SamplingParams
from tandem.config import SpeculativeConfig
from tandem.request import StructuredOutputsParams
from tandem.sampler.inputs import SamplingFlags, SamplingRows
from tandem.sampler.sampling import sample
from tests.shared_tp import ranks_from_a_fork_server  # noqa: F401

from conftest import hf_greedy_reference
from helpers import assert_idle_and_balanced, greedy, make_llm, run_both_loops

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
ALWAYS = {**NGRAM, "adaptive": False}  # every step drafts its full length
SUFFIX = {"method": "suffix", "num_speculative_tokens": 6}
SUFFIX_ALWAYS = {**SUFFIX, "adaptive": False}  # as long as its proposal, up to 6
METHODS = {"ngram": (NGRAM, ALWAYS), "suffix": (SUFFIX, SUFFIX_ALWAYS)}


@pytest.fixture(params=list(METHODS))
def method(request) -> str:
    """Each drafting method that needs no second model: n-gram on the device, suffix trees."""
    return request.param


@pytest.fixture
def always(method) -> dict:
    return METHODS[method][1]


def prompts_with_repeats() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    span = torch.randint(20, 1000, (9,), generator=g).tolist()
    return [
        span * 3 + [17],
        torch.randint(20, 1000, (23,), generator=g).tolist(),
        [40, 41, 42] * 5,
        torch.randint(20, 1000, (5,), generator=g).tolist(),
    ]


def generate(path, prompts, params, speculative=None, **options):
    llm = make_llm(path, speculative_config=speculative, **options)
    outputs = llm.generate(prompts, params)
    assert_idle_and_balanced(llm.engine)
    stats = llm.engine.stats().speculative
    llm.engine.close()
    return [[c.token_ids for c in o.outputs] for o in outputs], stats


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("block_size", [1, 16])
def test_greedy_equals_decoding_without_drafts(cycling_llama, async_scheduling, block_size, method):
    prompts = prompts_with_repeats()
    params = greedy(40)
    options = dict(async_scheduling=async_scheduling, block_size=block_size)
    reference, _ = generate(cycling_llama, prompts, params, **options)
    for speculative in METHODS[method]:  # adaptive drafts follow this model's cost here
        out, stats = generate(cycling_llama, prompts, params, speculative, **options)
        assert out == reference
    assert stats.accepted_tokens > stats.drafted_tokens / 3  # long accepted runs
    assert stats.mean_accepted_length > 2


def test_greedy_equals_transformers(cycling_llama):
    prompts = prompts_with_repeats()[:2]
    out, stats = generate(cycling_llama, prompts, greedy(24), ALWAYS)
    assert stats.accepted_tokens
    for prompt, (tokens,) in zip(prompts, out, strict=True):
        assert tokens == hf_greedy_reference(cycling_llama, prompt, 24)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mostly_rejected_drafts_change_nothing(tiny_llama, async_scheduling, always):
    prompts = prompts_with_repeats()
    params = greedy(24)
    reference, _ = generate(tiny_llama, prompts, params, async_scheduling=async_scheduling)
    out, stats = generate(tiny_llama, prompts, params, always, async_scheduling=async_scheduling)
    assert out == reference
    assert stats.drafted_tokens > stats.accepted_tokens


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_seeded_sampling_equals_decoding_without_drafts(cycling_llama, async_scheduling, always):
    """Each position is sampled with its own seeded noise, whatever the drafts: the same tokens
    in both loops, with and without speculation, at any batch composition."""
    prompts = prompts_with_repeats()
    params = [
        SamplingParams(max_tokens=32, temperature=t, top_k=k, seed=i, ignore_eos=True)
        for i, (t, k) in enumerate([(0.3, 0), (0.7, 0), (1.0, 20), (0.5, 0)])
    ]
    options = dict(async_scheduling=async_scheduling)
    reference, _ = generate(cycling_llama, prompts, params, **options)
    out, stats = generate(cycling_llama, prompts, params, always, **options)
    assert out == reference and stats.accepted_tokens
    alone, _ = generate(cycling_llama, prompts[1:2], params[1:2], always, **options)
    assert alone[0] == reference[1]


def test_chunked_prefill_preemption_and_prefix_caching(cycling_llama, always):
    """A small cache preempts requests with drafts in flight; prompts share a prefix and chunk."""
    shared = prompts_with_repeats()[0]
    prompts = [shared + [5, 6], shared + [7], shared, prompts_with_repeats()[2]]
    params = [greedy(m) for m in (30, 24, 36, 20)]
    options = dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=4)
    for async_scheduling in (False, True):
        reference, _ = generate(cycling_llama, prompts, params, async_scheduling=async_scheduling,
                                **options)  # fmt: skip
        llm = make_llm(
            cycling_llama, speculative_config=always, async_scheduling=async_scheduling, **options
        )
        out = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
        assert out == reference
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.stats().prefix_cache.hits > 0
        assert_idle_and_balanced(llm.engine)


def test_n_samples_and_length_limits(cycling_llama, always):
    prompts = prompts_with_repeats()[:3]
    params = [
        SamplingParams(max_tokens=m, temperature=0.6, seed=3, n=2, ignore_eos=True)
        for m in (1, 2, 7)
    ]
    # The context limit: prompt plus outputs reach max_model_len exactly.
    options = dict(max_model_len=len(prompts[0]) + 7)
    for async_scheduling in (False, True):
        reference, _ = generate(cycling_llama, prompts, params, async_scheduling=async_scheduling,
                                **options)  # fmt: skip
        out, _ = generate(cycling_llama, prompts, params, always,
                          async_scheduling=async_scheduling, **options)  # fmt: skip
        assert out == reference
        assert [len(o[0]) for o in out] == [1, 2, 7]


def stream(path, prompt, params, speculative, async_scheduling):
    llm = make_llm(path, speculative_config=speculative, async_scheduling=async_scheduling)
    engine = llm.engine
    engine.add_request(prompt, params)
    deltas = [list(o.delta_token_ids) for o in engine.stream_outputs()]
    assert_idle_and_balanced(engine)
    return deltas


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stop_inside_an_accepted_run(cycling_llama, async_scheduling, always):
    """A stop id inside an accepted run ends the request there: nothing after it is streamed,
    and the tokens equal the ones without drafts. The prompt is the model's own cycle, so the
    first verification already accepts a run, and the stop id is in it."""
    path = generate(cycling_llama, prompts_with_repeats()[:1], greedy(21))[0][0][0]
    prompt = path[-7:] * 3
    continued = generate(cycling_llama, [prompt], greedy(8))[0][0][0]
    stop = continued[3]
    params = SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[stop])
    expected = stream(cycling_llama, prompt, params, None, async_scheduling)
    deltas = stream(cycling_llama, prompt, params, always, async_scheduling)
    tokens = sum(deltas, [])
    assert tokens == sum(expected, []) == continued[:4]
    assert len(deltas[-1]) > 1  # the stop came inside an accepted run


def test_drafts_past_a_finish_are_not_counted(cycling_llama):
    """The async loop has verified a request's next drafts by the time it learns the request
    stopped; those are discarded with its tokens and count neither as drafted nor as rejected
    (nor in the adaptive policy's estimate), so both loops report the same counters. The prompt
    is the model's own cycle of 7 distinct tokens, and the request stops at the cycle's last."""
    path = generate(cycling_llama, prompts_with_repeats()[:1], greedy(21))[0][0][0]
    prompt = path[-7:] * 3
    continued = generate(cycling_llama, [prompt], greedy(8))[0][0][0]
    params = SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[continued[6]])
    on = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)  # keeps the next step alive
    counted = {}
    for async_scheduling in (False, True):
        llm = make_llm(cycling_llama, speculative_config=ALWAYS, async_scheduling=async_scheduling)
        out, _ = llm.generate([prompt, prompts_with_repeats()[2]], [params, on])
        assert (out.outputs[0].token_ids, out.outputs[0].finish_reason) == (continued[:7], "stop")
        counted[async_scheduling] = llm.engine.summary()
        assert_idle_and_balanced(llm.engine)
        llm.engine.close()
    assert counted[True].discarded_tokens > counted[False].discarded_tokens  # a verification
    assert counted[True].speculative == counted[False].speculative
    assert counted[True].speculative.accepted_tokens > 0


def test_a_verification_after_a_stop_inside_an_accepted_run_is_skipped(cycling_llama):
    """The stop id is inside a run of accepted drafts: the device thread finds it among the
    kept tokens (the kept count follows the ids) and skips the verification launched after."""
    path = generate(cycling_llama, prompts_with_repeats()[:1], greedy(21))[0][0][0]
    prompt = path[-7:] * 3
    continued = generate(cycling_llama, [prompt], greedy(8))[0][0][0]
    params = SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[continued[5]])
    runs = run_both_loops(cycling_llama, [prompt], [params], speculative_config=ALWAYS)
    (sync, sync_llm), (async_, async_llm) = runs[False], runs[True]
    assert async_[0].token_ids == sync[0].token_ids == continued[:6]
    a, s = async_llm.engine.summary(), sync_llm.engine.summary()
    assert a.skipped_steps == 1 and a.num_steps == s.num_steps
    assert a.speculative.accepted_tokens > 0 and a.speculative == s.speculative


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stop_string_inside_an_accepted_run(cycling_llama, async_scheduling):
    """A stop string found in an accepted run ends the request there, as without drafts."""
    path = generate(cycling_llama, prompts_with_repeats()[:1], greedy(21))[0][0][0]
    prompt = path[-7:] * 3
    llm = make_llm(cycling_llama, speculative_config=ALWAYS, async_scheduling=async_scheduling)
    continued = llm.generate([prompt], greedy(8))[0].outputs[0].text
    stop = continued[len(continued) // 2 :][:3]
    params = SamplingParams(max_tokens=40, temperature=0, stop=[stop])
    on = llm.generate([prompt], params)[0].outputs[0]
    off = make_llm(cycling_llama).generate([prompt], params)[0].outputs[0]
    assert (on.text, on.token_ids, on.finish_reason) == (off.text, off.token_ids, "stop")
    assert stop not in on.text and len(on.token_ids) < 40
    assert_idle_and_balanced(llm.engine)


def test_abort_with_drafts_in_flight(cycling_llama, always):
    llm = make_llm(cycling_llama, speculative_config=always)
    engine = llm.engine
    for i, prompt in enumerate(prompts_with_repeats()):
        engine.add_request(prompt, greedy(40), request_id=str(i))
    outputs = engine.step() + engine.step() + engine.step()
    engine.abort("0")
    engine.abort("2")
    while engine.has_unfinished():
        outputs += engine.step()
    finished = {o.request_id: o for o in outputs if o.finished}
    assert finished["0"].finish_reason == finished["2"].finish_reason == "abort"
    assert len(finished["1"].token_ids) == 40
    assert_idle_and_balanced(engine)


def test_logprobs_grammar_and_penalties_beside_drafts(cycling_llama):
    """Requests with logprobs, a grammar, penalties and a bias draft side by side; logprobs of
    accepted runs are those of decoding without drafts."""
    prompts = prompts_with_repeats()
    params = [
        greedy(24, logprobs=2),
        greedy(24, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
        greedy(24, repetition_penalty=1.3, presence_penalty=0.5),
        greedy(24, logit_bias={17: 5.0}),
    ]
    llm_off = make_llm(cycling_llama)
    llm_on = make_llm(cycling_llama, speculative_config=ALWAYS)
    for async_scheduling in (False, True):
        llm_off.engine.configure(async_scheduling=async_scheduling)
        llm_on.engine.configure(async_scheduling=async_scheduling)
        off, on = llm_off.generate(prompts, params), llm_on.generate(prompts, params)
        for a, b in zip(off, on, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(off[0].outputs[0].logprobs, on[0].outputs[0].logprobs, strict=True):
            assert list(x) == list(y)
            for token in x:
                assert x[token].rank == y[token].rank
                assert x[token].logprob == pytest.approx(y[token].logprob, abs=1e-4)
    assert llm_on.engine.stats().speculative.accepted_tokens
    assert_idle_and_balanced(llm_on.engine)


# Grammars that refuse much of what `cycling_llama` would say, so that the bitmask after a draft
# decides what is kept: the drafts come from the history the grammar shaped.
LOWERCASE = r"[ a-z]{0,400}"
WORD_LIST = {
    "type": "array",
    "items": {"type": "string", "pattern": "^[a-z ]{0,12}$"},
    "maxItems": 3,
}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_constrained_requests_draft_under_their_grammar(cycling_llama, async_scheduling, always):
    """A request under a grammar drafts too: each row after a draft is sampled under the
    matcher's state past that draft, so the outputs (greedy and seeded) are those of decoding
    without drafts, accepted runs included, through a small cache's preemptions, and every one
    matches its grammar."""
    prompts = prompts_with_repeats()
    specs = [StructuredOutputsParams(regex=LOWERCASE), StructuredOutputsParams(json=WORD_LIST)]
    params = [
        SamplingParams(max_tokens=40, temperature=t, seed=i, structured_outputs=specs[i % 2])
        for i, t in enumerate((0.0, 0.0, 0.8, 0.8))
    ]
    options = dict(async_scheduling=async_scheduling, block_size=4, num_kv_blocks=30)
    reference, _ = generate(cycling_llama, prompts, params, **options)
    for speculative in (always, draft_model(cycling_llama)) if always is ALWAYS else (always,):
        out, stats = generate(cycling_llama, prompts, params, speculative, **options)
        assert out == reference
        assert stats.accepted_tokens > 0
    llm = make_llm(cycling_llama, speculative_config=always, **options)
    texts = [o.outputs[0].text for o in llm.generate(prompts, params)]
    assert llm.engine.stats().num_preemptions > 0
    llm.engine.close()
    for i, text in enumerate(texts):
        if i % 2 == 0:
            assert re.fullmatch(LOWERCASE, text), text
        else:
            assert len(json.loads(text)) <= 3, text  # complete JSON


def test_two_ranks_draft_under_a_grammar(cycling_llama, always):
    """Under tensor parallelism rank 0 hands the engine each step's drafts for the bitmask;
    every rank samples under it: the tokens of one process decoding without drafts."""
    prompts = prompts_with_repeats()
    specs = [StructuredOutputsParams(regex=LOWERCASE), StructuredOutputsParams(json=WORD_LIST)]
    params = [
        SamplingParams(max_tokens=30, temperature=t, seed=1, structured_outputs=spec)
        for t in (0.0, 0.8)
        for spec in specs
    ]
    reference, _ = generate(cycling_llama, prompts, params)
    tp = make_llm(cycling_llama, tensor_parallel_size=2, cpu_threads=1, speculative_config=always)
    try:
        for async_scheduling in (False, True):
            tp.engine.configure(async_scheduling=async_scheduling)
            got = [[c.token_ids for c in o.outputs] for o in tp.generate(prompts, params)]
            assert got == reference
        assert tp.engine.stats().speculative.accepted_tokens > 0
        assert_idle_and_balanced(tp.engine)
    finally:
        tp.close()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalties_count_accepted_tokens_only(cycling_llama, async_scheduling, always):
    """Penalized requests draft too: each verifying row sees the counts of the tokens before
    its position (drafts included), and only kept tokens stay counted."""
    prompts = prompts_with_repeats()
    params = [
        greedy(30, frequency_penalty=0.4),
        greedy(30, presence_penalty=0.8),
        greedy(30, repetition_penalty=1.2),
        SamplingParams(max_tokens=30, temperature=0.7, seed=5, frequency_penalty=0.2,
                       repetition_penalty=1.1, ignore_eos=True),
    ]  # fmt: skip
    options = dict(async_scheduling=async_scheduling)
    reference, _ = generate(cycling_llama, prompts, params, **options)
    out, stats = generate(cycling_llama, prompts, params, always, **options)
    assert out == reference
    assert stats.accepted_tokens > 0


def test_configure_switches_speculation(cycling_llama):
    llm = make_llm(cycling_llama)
    engine = llm.engine
    assert engine.speculative_config is None
    prompts = prompts_with_repeats()
    off = llm.generate(prompts, greedy(20))
    engine.configure(speculative_config=NGRAM)
    assert engine.speculative_config == SpeculativeConfig(**NGRAM)
    on = llm.generate(prompts, greedy(20))
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert engine.stats().speculative.drafted_tokens
    with pytest.raises(ValueError, match="draft model"):
        engine.configure(speculative_config={"method": "draft_model", "model": "/elsewhere"})
    engine.configure(speculative_config=None)
    assert engine.speculative_config is None


def test_step_costs_outlive_switching_speculation_off_and_on(cycling_llama):
    """What a step of n tokens costs is timed once per method and loop for the engine's life:
    speculation switched off and on again drafts from the times it has, not from an untimed
    start that drafts in every other step only."""
    llm = make_llm(cycling_llama, async_scheduling=False)
    engine = llm.engine
    engine.configure(speculative_config=NGRAM)
    llm.generate(prompts_with_repeats(), greedy(24))
    first = engine.scheduler.drafts
    assert first.costs.costs(1, 5) is not None  # two bands of step sizes timed
    engine.configure(speculative_config=None)
    engine.configure(speculative_config=NGRAM)
    again = engine.scheduler.drafts
    assert again is not first and again.costs is first.costs
    llm.generate(prompts_with_repeats(), greedy(24))
    assert again._untimed_steps == 0
    engine.configure(async_scheduling=True)  # the other loop's steps are timed apart
    assert again.costs is not first.costs and again.costs.costs(1, 5) is None
    engine.configure(async_scheduling=False)
    assert again.costs is first.costs


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "eagle"}, "method must be one of"),
        ({"num_speculative_tokens": 0}, "positive integer"),
        ({"num_speculative_tokens": 99}, "at most"),
        ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "draft_model"}, "needs one"),
        ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, "positive integer"),
        ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, "non-negative"),
        ({"method": "suffix", "suffix_decoding_max_spec_factor": 0}, "positive number"),
        ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, r"in \[0, 1\]"),
        ({"speculative": 1}, "unknown fields"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_speculative_config_is_refused(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.of(value)


def test_verification_keeps_the_target_distribution():
    """The accepted draft is the target's own seeded draw: over many seeds a draft is accepted
    with its probability under the target, and the kept token follows the target exactly."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None].repeat(4000, 1)
    n = len(logits)
    rows = SamplingRows(
        temperature=torch.ones(n), top_k=torch.zeros(n, dtype=torch.int64),
        top_p=torch.ones(n), min_p=torch.zeros(n),
        seed_keys=torch.arange(n, dtype=torch.int64) * 7919, output_index=torch.zeros(n, dtype=torch.int64),
        flags=SamplingFlags(all_greedy=False, use_top_k=False, use_top_p=False, use_min_p=False),
    )  # fmt: skip
    tokens = sample(logits, rows)
    draft = 1  # a fixed guess, as an ngram draft is
    accepted = (tokens == draft).float().mean().item()
    assert accepted == pytest.approx(probs[draft].item(), abs=0.025)
    frequencies = torch.bincount(tokens, minlength=4).float() / n
    chi2 = (((frequencies - probs) ** 2) / probs).sum().item() * n
    assert chi2 < 16.3  # 3 degrees of freedom, p = 0.001


def draft_model(path, k=3) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k,
            "adaptive": False}  # fmt: skip


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_draft_model_equals_decoding_without_drafts(cycling_llama, tiny_llama, async_scheduling):
    """A draft model drafts with the target's settings and seeded noise: the target as its own
    draft has every draft accepted, greedy and sampled alike; another model mostly rejected;
    outputs equal decoding without drafts either way, through a small cache's preemptions."""
    prompts = prompts_with_repeats()
    params = [greedy(30), greedy(12)] + [
        SamplingParams(max_tokens=30, temperature=0.8, seed=i, ignore_eos=True) for i in (1, 2)
    ]
    options = dict(async_scheduling=async_scheduling, block_size=4, num_kv_blocks=30)
    reference, _ = generate(cycling_llama, prompts, params, **options)
    out, stats = generate(cycling_llama, prompts, params, draft_model(cycling_llama), **options)
    assert out == reference
    assert stats.accepted_tokens == stats.drafted_tokens > 0
    out, stats = generate(cycling_llama, prompts, params, draft_model(tiny_llama), **options)
    assert out == reference
    assert stats.accepted_tokens < stats.drafted_tokens / 4


def test_a_draft_model_must_share_the_vocabulary(cycling_llama, tmp_path):
    from tandem.models.default_model import build_checkpoint

    other = build_checkpoint(tmp_path / "other", vocab_size=1100)
    with pytest.raises(ValueError, match="vocabulary"):
        make_llm(cycling_llama, speculative_config=draft_model(other))
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        make_llm(cycling_llama, speculative_config=draft_model(other), tensor_parallel_size=2)


def reference_ngram(history: list[int], k: int, longest: int, shortest: int) -> list[int]:
    """Prompt lookup in plain Python: the latest earlier occurrence of the longest suffix."""
    n_tokens = len(history)
    for n in range(longest, shortest - 1, -1):
        if n_tokens < n + 1:
            continue
        suffix = history[-n:]
        ends = [e for e in range(n - 1, n_tokens - 1) if history[e - n + 1 : e + 1] == suffix]
        if ends:
            end = ends[-1]
            break
    else:
        end = n_tokens - 2
    period = n_tokens - 1 - end
    return [history[end + 1 + j % period] for j in range(k)]


def test_ngram_drafts_equal_prompt_lookup():
    from tandem.execution.drafting import ngram_drafts
    from tandem.sampler.inputs import VerifyRows

    g = torch.Generator().manual_seed(3)
    max_len, rows, k = 64, 6, 5
    table = torch.randint(0, 6, (rows * max_len + 1,), generator=g)  # few ids: many repeats
    lengths = torch.tensor([2, 3, 9, 30, 64, 17])
    empty = torch.zeros(0, dtype=torch.int64)
    for longest, shortest in ((4, 2), (3, 1), (1, 1)):
        v = VerifyRows(
            table_rows=torch.arange(rows), num_drafts=torch.full((rows,), k), prompt_lens=empty,
            token_item=empty, token_offset=empty, token_batch=empty, sample_rows=empty,
            draft_batch=empty, draft_item=empty, draft_index=empty,
            check_rows=empty, pass_items=empty, item_batch=empty, item_row=empty, pass_sizes=[],
            max_drafts=k, history_len=64, method="ngram", lookup=(longest, shortest),
        )  # fmt: skip
        got = ngram_drafts(table, v, lengths, max_len).tolist()
        for r in range(rows):
            history = table[r * max_len : r * max_len + int(lengths[r])].tolist()
            assert got[r] == reference_ngram(history, k, longest, shortest), (r, longest)
