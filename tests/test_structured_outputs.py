"""Structured outputs in the engine: every constrained output matches its grammar on the random
built-in weights (only the grammar keeps it valid), the asynchronous loop equals the synchronous
one token for token with constraints mixed into plain batches, and bad grammars are refused
before anything is queued."""

from __future__ import annotations

import json
import random
import re
import threading

import jsonschema
import pytest
import torch

from tandem import SamplingParams
from tandem.request import MAX_GRAMMAR_CHARS, StructuredOutputsParams
from tandem.sampler.grammar import apply_token_bitmask, token_allowed
from tests.shared_tp import ranks_from_a_fork_server  # noqa: F401

from conftest import random_prompts
from helpers import assert_idle_and_balanced, make_llm, run_both_loops

# Bounded strings, numbers and arrays: random weights would otherwise write one string forever.
# (A pattern, not maxLength: xgrammar 0.2.9 lets raw control characters into maxLength strings.)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{0,6}$"},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["red", "green", "blue"]},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "count", "tag", "flags"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,5}@(x|yz)\.com"
CHOICES = ["alpha", "beta", "gamma delta"]
EBNF = 'root ::= "(" item (", " item)* ")"\nitem ::= [0-9] | "x"'
LARK = 'start: "<" WORD ">"\nWORD: /[a-z]{1,4}/'


def so(**kind) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kind)


def json_params(i: int, **kw) -> SamplingParams:
    temperature = 0.0 if i % 2 else 1.0  # greedy and seeded rows alike
    kw.setdefault("max_tokens", 64)
    return SamplingParams(temperature=temperature, seed=i, structured_outputs=so(json=SCHEMA), **kw)


def check_json(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return make_llm(tiny_llama)


def test_every_kind_of_constraint_holds_on_random_weights(llm):
    cases = [
        (so(json=SCHEMA), check_json),
        (so(regex=REGEX), lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
        (so(choice=CHOICES), lambda t: t in CHOICES or pytest.fail(t)),
        (so(grammar=EBNF), lambda t: re.fullmatch(r"\(([0-9x])(, [0-9x])*\)", t) or pytest.fail(t)),
        (so(grammar=LARK), lambda t: re.fullmatch(r"<[a-z]{1,4}>", t) or pytest.fail(t)),
    ]
    prompts = ["the cat", "a b c d", "hello there"]
    for spec, check in cases:
        params = [
            SamplingParams(max_tokens=96, temperature=t, seed=s, structured_outputs=spec)
            for t, s in ((0.0, 0), (1.0, 1), (1.0, 2))
        ]
        for out in llm.generate(prompts, params):
            assert out.finish_reason == "stop", (spec.kind, out.text)
            check(out.text)
    assert_idle_and_balanced(llm.engine)


def test_json_object_is_an_object(llm):
    """Random weights write strings that rarely end: an object begins, and parses if it ends."""
    params = [SamplingParams(max_tokens=48, seed=s, structured_outputs=so(json_object=True))
              for s in range(4)]  # fmt: skip
    for out in llm.generate(["a"] * 4, params):
        assert out.text.startswith("{")
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)


def test_same_spec_compiles_once(llm):
    grammars = llm.engine.grammars
    before = grammars.cache_info()
    first = grammars.compile(so(json=SCHEMA))
    assert grammars.compile(so(json=json.loads(json.dumps(SCHEMA)))) is first
    after = grammars.cache_info()
    assert after.hits - before.hits >= 1 and after.misses - before.misses <= 1


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"json": {"type": "objekt"}}, r"structured_outputs\.json is invalid: .*objekt"),
        ({"json": "{not json"}, r"structured_outputs\.json is invalid"),
        ({"regex": "a(b"}, r"structured_outputs\.regex is invalid: .*parenthesis"),
        ({"grammar": "root ::= missing_rule"}, r"structured_outputs\.grammar is invalid"),
        ({"grammar": "start: UNDEFINED"}, r"structured_outputs\.grammar is invalid"),
        ({"regex": "a" * (MAX_GRAMMAR_CHARS + 1)}, r"at most 65536 are accepted"),
        ({"regex": "a", "choice": ["b"]}, r"exactly one of .*got regex, choice"),
        ({"choice": []}, r"choice must be a non-empty list"),
    ],
)
def test_bad_grammars_are_refused_before_queuing(llm, spec, message):
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request([5, 6, 7], SamplingParams(structured_outputs=spec))
    assert not llm.engine.has_unfinished()  # nothing was queued
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=3))[0].finish_reason is not None


def test_grammar_that_cannot_finish_in_max_tokens_ends_with_length(llm):
    spec = so(json={"type": "object", "properties": {"s": {"type": "string", "minLength": 40}},
                    "required": ["s"]})  # fmt: skip
    out = llm.generate(["x"], SamplingParams(max_tokens=6, seed=0, structured_outputs=spec))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    assert out.text.startswith('{"s": "')  # the partial text the grammar allowed


def test_grammar_wins_over_min_tokens_and_ends_even_with_ignore_eos(llm):
    spec = so(choice=["yes", "no"])
    for kw in ({"min_tokens": 10}, {"ignore_eos": True}):
        out = llm.generate(
            ["q"], SamplingParams(max_tokens=30, seed=1, structured_outputs=spec, **kw)
        )
        assert out[0].text in ("yes", "no") and out[0].finish_reason == "stop", kw
    assert_idle_and_balanced(llm.engine)


def test_async_equals_sync_with_constraints_mixed_into_plain_batches(tiny_llama):
    """Chunked prefill and preemption, constrained and plain requests in the same steps."""
    rng = random.Random(5)
    prompts = random_prompts(rng, 10, 1024, 10, 60)
    params = [
        json_params(i) if i % 3 else SamplingParams(max_tokens=24, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    options = dict(num_kv_blocks=40, block_size=4, max_num_batched_tokens=32, max_num_seqs=6)
    runs = run_both_loops(tiny_llama, prompts, params, **options)
    assert all(llm.engine.scheduler.num_preemptions > 0 for _, llm in runs.values())
    for i, (sync, async_) in enumerate(zip(runs[False][0], runs[True][0], strict=True)):
        assert sync.token_ids == async_.token_ids, i
        if params[i].structured_outputs is not None:
            check_json(async_.text)
    # The asynchronous loop dropped each constrained request's token after its end.
    assert runs[True][1].engine.summary().discarded_tokens > 0


def test_constraints_with_n_penalties_logprobs_and_prefix_caching(tiny_llama):
    shared = list(range(10, 42))  # a prompt prefix that fills blocks, cached across requests
    prompts = [shared + [50 + i] for i in range(4)]
    params = [
        json_params(i, n=2, presence_penalty=0.5, repetition_penalty=1.2, logprobs=2)
        for i in range(4)
    ]
    runs = run_both_loops(tiny_llama, prompts, params, block_size=8, enable_prefix_caching=True)
    for mode, (outputs, llm) in runs.items():
        assert llm.engine.scheduler.stats.hits > 0, mode
        for out in outputs:
            assert len(out.outputs) == 2
            for sample in out.outputs:
                check_json(sample.text)
                assert len(sample.logprobs) == len(sample.token_ids)
    for sync, async_ in zip(runs[False][0], runs[True][0], strict=True):
        assert [s.token_ids for s in sync.outputs] == [s.token_ids for s in async_.outputs]


def test_tokens_after_the_end_never_reach_the_matcher(llm):
    engine = llm.engine
    engine.configure(async_scheduling=True)
    request = engine.make_request([7, 8, 9], SamplingParams(max_tokens=40, seed=3,
                                                            structured_outputs=so(choice=CHOICES)))  # fmt: skip
    engine.submit(request)
    while engine.has_unfinished():
        engine.step()
    assert request.finish_reason == "stop" and request.output_token_ids[-1] in engine.eos_token_ids
    # The stop token ended it (never fed), and the one sampled after it was dropped.
    assert request.grammar.num_accepted == len(request.output_token_ids) - 1
    assert engine.history.summary().discarded_tokens >= 1


def test_grammars_submitted_uncompiled_compile_off_the_loop(llm):
    """The server's core path: compiled after submission, a bad one ends the request."""
    engine = llm.engine
    good = engine.make_request([3, 4], json_params(1), "good", compile_grammar=False)
    bad_params = SamplingParams(structured_outputs=so(regex="(("))
    bad = engine.make_request([3, 4], bad_params, "bad", compile_grammar=False)
    aborted = engine.make_request([3, 4], json_params(2), "aborted", compile_grammar=False)
    assert good.compiled_grammar is None
    for request in (good, bad, aborted):
        engine.submit(request)
    engine.abort("aborted")
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    check_json(finals["good"].text)
    assert finals["bad"].finish_reason == "abort"
    assert "structured_outputs.regex is invalid" in finals["bad"].error
    assert finals["aborted"].finish_reason == "abort" and finals["aborted"].token_ids == []
    assert_idle_and_balanced(engine)


def test_plain_rows_are_sampled_before_the_bitmask_arrives(llm):
    """The sampler's first part already holds the free rows' final ids."""
    engine = llm.engine
    runner = engine.runner
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=1, seed=1))
    engine.add_request([5, 6, 8], json_params(1, max_tokens=1))
    captured = {}
    finish = runner.sampler.finish

    def spy(pending, bitmask=None):
        captured["free"] = pending.ids[pending.x.grammar.free_rows].clone()
        ids, groups = finish(pending, bitmask)
        captured["final"] = ids[pending.x.grammar.free_rows].clone()
        return ids, groups

    runner.sampler.finish = spy
    try:
        while engine.has_unfinished():
            engine.step()
    finally:
        runner.sampler.finish = finish
    assert torch.equal(captured["free"], captured["final"])


@pytest.mark.parametrize("vocab", [33, 1000, 1024, 49152])
def test_bitmask_kernel_equals_the_reference(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, words), dtype=torch.int32, generator=g)
    bitmask[1] = 0
    bitmask[2] = -1
    bitmask[3, words // 2 :] = 0
    out = logits.clone()
    apply_token_bitmask(out, bitmask)
    expected = logits.masked_fill(~token_allowed(bitmask, vocab), float("-inf"))
    assert torch.equal(out, expected)
    assert torch.isneginf(out[1]).all() and torch.equal(out[2], logits[2])


def test_two_ranks_equal_one_under_constraints(tiny_llama, llm):
    """Each rank applies the bitmask the engine sends it: the same tokens as one process. A
    constrained request with prompt logprobs too (the step the ranks are sent must not carry
    the request, whose compiled grammar does not pickle)."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15, 16, 17, 18]]
    params = [
        json_params(0),
        SamplingParams(max_tokens=8, seed=4),
        json_params(1, n=2),
        json_params(2, max_tokens=8, logprobs=1, prompt_logprobs=2),
    ]
    tp = make_llm(tiny_llama, tensor_parallel_size=2, cpu_threads=1)
    try:
        for mode in (False, True):
            tp.engine.configure(async_scheduling=mode)
            got = tp.generate(prompts, params)
            want = llm.generate(prompts, params)
            for a, b in zip(got, want, strict=True):
                assert [s.token_ids for s in a.outputs] == [s.token_ids for s in b.outputs]
            check_json(got[0].text)
            ranks, one = got[3], want[3]
            assert len(ranks.prompt_logprobs) == len(prompts[3])
            assert ranks.prompt_logprobs[0] is None  # nothing predicts the first prompt token
            for a, b in zip(
                ranks.prompt_logprobs[1:] + ranks.outputs[0].logprobs,
                one.prompt_logprobs[1:] + one.outputs[0].logprobs,
                strict=True,
            ):
                assert a.keys() == b.keys()
                for token, entry in a.items():  # the ranks' all-reduce sums in its own order
                    assert entry.logprob == pytest.approx(b[token].logprob, abs=1e-4)
    finally:
        tp.close()


def test_a_slow_compile_delays_no_other_request(llm):
    """A grammar still compiling (held here by a gate) leaves every other request running."""
    engine = llm.engine
    grammars = engine.grammars
    gate = threading.Event()
    compile_now = grammars._compile_key

    def held(kind, text):
        assert gate.wait(30)
        return compile_now(kind, text)

    grammars._compile_key = held
    try:
        slow = engine.make_request([3, 4], json_params(1), "slow", compile_grammar=False)
        engine.submit(slow)
        engine.add_request([5, 6], SamplingParams(max_tokens=6, ignore_eos=True), "plain")
        finished = []
        while "plain" not in finished:
            finished += [out.request_id for out in engine.step() if out.finished]
        assert slow.compiled_grammar is None and not slow.output_token_ids  # still waiting
        gate.set()
        while engine.has_unfinished():
            finished += [out.request_id for out in engine.step() if out.finished]
    finally:
        grammars._compile_key = compile_now
        gate.set()
    assert finished == ["plain", "slow"]
    check_json(_text(llm, slow))


def _text(llm, request) -> str:
    return llm.get_tokenizer().decode(request.output_token_ids, skip_special_tokens=True)


def test_length_bounded_strings_hold_no_raw_control_characters(llm):
    """xgrammar 0.2.9 lets them into minLength / maxLength strings; the compiler rewrites those
    bounds as a pattern of plain characters (control characters are random weights' favourite)."""
    schema = {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 5},
              "minItems": 3, "maxItems": 3}  # fmt: skip
    spec = so(json=schema)
    params = [SamplingParams(max_tokens=48, seed=s, structured_outputs=spec) for s in range(12)]
    outputs = llm.generate(["x"] * 12, params)
    for out in outputs:
        if out.finish_reason == "stop":
            value = json.loads(out.text)  # strict: it refuses raw control characters
            # xgrammar also takes overlong UTF-8 (e0 8b ba), which decodes to one U+FFFD a byte.
            if "\ufffd" not in out.text:
                jsonschema.validate(value, schema)
    assert sum(out.finish_reason == "stop" for out in outputs) >= 6
