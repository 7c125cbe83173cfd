"""Reasoning models under both loops: the thinking is separated from the answer, its budget holds
exactly (the device forces the end, no host in the way), and a grammar constrains the answer
after the thinking, never the thinking; async equals sync, two ranks equal one, preemption in
the middle of the thinking changes nothing.

The model is a tiny random Qwen3 whose chat template opens the thinking block in the generation
prompt (`thinking_qwen3`): its random weights never close the block within these lengths, so
the budget alone ends it and every case is deterministic.
"""

from __future__ import annotations

import itertools
import json
import random

import jsonschema
import pytest
import torch

from tandem import SamplingParams
from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.reasoning import (
    CLOSED,
    FIRST,
    FORCE,
    MAY_OPEN,
    NO_BUDGET,
    REASONING_PARSERS,
    THINKING,
    ReasoningTokens,
    advance,
    resolve_parser,
)
from tandem.request import StructuredOutputsParams
from tandem.sampler.inputs import ReasoningFlags, ReasoningRows
from tandem.sampler.reasoning import ThinkingState
from tests.shared_tp import ranks_from_a_fork_server  # noqa: F401

from helpers import assert_idle_and_balanced, make_llm, run_both_loops

SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },  # fmt: skip
    "required": ["colour", "n"],
    "additionalProperties": False,
}
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def llm(thinking_qwen3):
    llm = make_llm(thinking_qwen3, max_model_len=512)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def tags(llm) -> ReasoningTokens:
    tokens = llm.engine.reasoning
    assert tokens is not None and tokens.parser.name == "qwen3"  # chosen from the template
    return tokens


def chat_ids(llm, question: str, **template) -> list[int]:
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True,
        **template,
    )  # fmt: skip
    return tok(text, add_special_tokens=False).input_ids


def parts(token_ids: list[int], tags: ReasoningTokens) -> tuple[list[int], list[int]]:
    """(thinking, answer) of an output that starts inside the block (the prompt opened it)."""
    if tags.end not in token_ids:
        return token_ids, []
    end = token_ids.index(tags.end)
    return token_ids[:end], token_ids[end + 1 :]


def text(tokenizer, prompt: list[int], ids: list[int]) -> str:
    """The text of `ids` as the engine detokenizes (a byte left over at the end is dropped)."""
    detok = IncrementalDetokenizer(tokenizer.backend_tokenizer, prompt, [], True)
    for token in ids:
        detok.add(token)
    return detok.text


# ------------------------------------------------------------- the machine
def test_the_device_moves_as_the_host_does() -> None:
    """Every phase, kind of token, budget and grammar: `ThinkingState.advance` on a row equals
    `tandem.reasoning.advance`, forced token included."""
    tokens = ReasoningTokens(REASONING_PARSERS["qwen3"], start=7, end=8)
    cases = list(
        itertools.product(
            (CLOSED, THINKING, FORCE, FIRST, MAY_OPEN), (7, 8, 3), (0, 1, 2, NO_BUDGET),
            (False, True),
        )
    )  # fmt: skip
    state = ThinkingState(len(cases), vocab_size=16, device=torch.device("cpu"))
    for i, (phase, _, budget, grammar) in enumerate(cases):
        state.phase[i], state.budget[i], state.grammar[i] = phase, budget, grammar
    empty = torch.zeros(0, dtype=torch.int64)
    rows = torch.arange(len(cases))
    r = ReasoningRows(rows, rows, empty, empty, empty, empty, empty, torch.zeros(0, 0),
                      start_token=7, end_token=8, flags=ReasoningFlags(use_masks=False))  # fmt: skip
    ids = torch.tensor([token for _, token, _, _ in cases])
    state.advance(ids, r)
    for i, (phase, token, budget, grammar) in enumerate(cases):
        want = advance(phase, budget, token, tokens, grammar)
        got = (int(state.phase[i]), int(state.budget[i]), int(ids[i]))
        assert got == want, (phase, token, budget, grammar)


def test_parsers_resolve_and_refuse(thinking_qwen3, tiny_llama) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(thinking_qwen3)
    assert resolve_parser("deepseek_r1", tok).parser.starts_thinking
    assert resolve_parser("auto", AutoTokenizer.from_pretrained(tiny_llama)) is None
    with pytest.raises(ValueError, match="<think> is 4 tokens"):
        resolve_parser("qwen3", AutoTokenizer.from_pretrained(tiny_llama))
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        resolve_parser("r2", tok)


# ------------------------------------------------------------------ budget
@pytest.mark.parametrize("budget", [0, 1, 5, 17])
def test_the_budget_holds_exactly_in_both_loops(thinking_qwen3, budget: int) -> None:
    """Greedy and seeded: exactly `budget` thinking tokens, then the end tag (forced), then the
    answer; the thinking and the answer as text, without the tags; async equals sync."""
    llm = make_llm(thinking_qwen3, max_model_len=512)
    tags = llm.engine.reasoning
    prompt = chat_ids(llm, "Think, then answer.")
    llm.close()
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                       thinking_token_budget=budget),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3, ignore_eos=True,
                       thinking_token_budget=budget),
    ]  # fmt: skip
    runs = run_both_loops(thinking_qwen3, [prompt, prompt], params, max_model_len=512)
    for sync, async_ in zip(runs[False][0], runs[True][0], strict=True):
        assert sync.token_ids == async_.token_ids
        assert (sync.reasoning, sync.text) == (async_.reasoning, async_.text)
        thinking, answer = parts(async_.token_ids, tags)
        assert len(thinking) == budget and async_.token_ids[budget] == tags.end
        assert tags.end not in answer and len(answer) == MAX_TOKENS - budget - 1
        tok = runs[True][1].get_tokenizer()
        assert (async_.reasoning, async_.text) == (
            text(tok, prompt, thinking),
            text(tok, prompt, answer),
        )
        assert "<think>" not in async_.text + async_.reasoning
    for _, llm in runs.values():
        llm.close()


def test_no_budget_thinks_to_the_end_and_says_length(llm, tags) -> None:
    """Without a budget the random model thinks until max_tokens: no answer, finish "length"."""
    out = llm.generate([chat_ids(llm, "Hi")], SamplingParams(max_tokens=12, temperature=0))[0]
    assert out.finish_reason == "length" and out.text == "" and tags.end not in out.token_ids
    assert out.reasoning and len(out.token_ids) == 12


def test_thinking_off_in_the_template_is_no_thinking(llm, tags) -> None:
    """Qwen3's template with enable_thinking false writes the block closed: all answer."""
    prompt = chat_ids(llm, "Hi", enable_thinking=False)
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    plain = make_llm(llm.engine.model_path, max_model_len=512, reasoning_parser="none")
    same = plain.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    plain.close()
    assert out.reasoning == "" and out.text == same[0].text and out.token_ids == same[0].token_ids
    assert same[0].reasoning is None


def test_a_prompt_that_does_not_open_the_block(thinking_qwen3, llm, tags) -> None:
    """Without the tag in the prompt: qwen3's parser waits for the model to open the block (this
    model does not: all answer); deepseek_r1's starts inside it (its templates may open the
    block themselves), so the budget ends it. (Opening it mid-output is the machine's first
    test.)"""
    prompt = chat_ids(llm, "Hi")[:-2]  # without "<think>\n"
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, thinking_token_budget=3)
    out = llm.generate([prompt], params)[0]
    assert out.token_ids[0] != tags.start and out.reasoning == "" and tags.end not in out.token_ids
    r1 = make_llm(thinking_qwen3, max_model_len=512, reasoning_parser="deepseek_r1")
    thought = r1.generate([prompt], params)[0]
    r1.close()
    assert thought.token_ids[:3] == out.token_ids[:3] and thought.token_ids[3] == tags.end
    assert thought.reasoning and thought.text


# ------------------------------------------------------ grammar after thinking
def json_params(i: int, budget: int = 6) -> SamplingParams:
    return SamplingParams(
        max_tokens=64, temperature=0.0 if i % 2 else 1.0, seed=i, thinking_token_budget=budget,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )  # fmt: skip


def test_the_schema_constrains_the_answer_not_the_thinking(thinking_qwen3) -> None:
    """Greedy and seeded, mixed with free requests, chunked prefill and preemption in the middle
    of the thinking: each answer is valid JSON, each thinking as long as its budget and free of
    the grammar (it is not JSON), async equals sync, and the free requests' tokens are what they
    are alone."""
    rng = random.Random(3)
    llm = make_llm(thinking_qwen3, max_model_len=512)
    prompt = chat_ids(llm, "Colour?")
    tags = llm.engine.reasoning
    llm.close()
    prompts, params = [], []
    for i in range(8):
        prompts.append(prompt + [rng.randrange(10, 900) for _ in range(rng.randrange(0, 30))])
        if i % 3 == 2:
            params.append(SamplingParams(max_tokens=30, seed=i, ignore_eos=True,
                                         thinking_token_budget=0))  # fmt: skip
        else:
            params.append(json_params(i, budget=4 + i))
    options = dict(max_model_len=512, num_kv_blocks=40, block_size=4,
                   max_num_batched_tokens=32, max_num_seqs=6)  # fmt: skip
    runs = run_both_loops(thinking_qwen3, prompts, params, **options)
    assert all(llm.engine.scheduler.num_preemptions > 0 for _, llm in runs.values())
    for i, (sync, async_) in enumerate(zip(runs[False][0], runs[True][0], strict=True)):
        assert sync.token_ids == async_.token_ids, i
        if params[i].structured_outputs is None:
            continue
        thinking, answer = parts(async_.token_ids, tags)
        assert len(thinking) == params[i].thinking_token_budget
        jsonschema.validate(json.loads(async_.text), SCHEMA)
        assert async_.finish_reason == "stop"
    alone = make_llm(thinking_qwen3, max_model_len=512)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        if sp.structured_outputs is None:
            assert alone.generate([p], sp)[0].token_ids == runs[True][0][i].token_ids
    alone.close()
    for _, llm in runs.values():
        llm.close()


def test_a_schema_when_the_model_may_open_the_block(thinking_qwen3, llm, tags) -> None:
    """A prompt that does not open the block (qwen3: the model may): the first token is sampled
    under the grammar's initial mask or the start tag, and the next one's bitmask waits for it
    (open if it opened the block, the matcher's otherwise). Here one answers at once, the other
    opens the block (a bias on the tag) and its budget of 0 closes it; async equals sync."""
    prompt = chat_ids(llm, "Colour?")[:-2]  # without "<think>\n"
    plain = json_params(1, budget=4)
    opening = json_params(3, budget=0)
    opening.logit_bias = {tags.start: 100.0}
    runs = run_both_loops(thinking_qwen3, [prompt, prompt], [plain, opening], max_model_len=512)
    for sync, async_ in zip(runs[False][0], runs[True][0], strict=True):
        assert sync.token_ids == async_.token_ids
        jsonschema.validate(json.loads(async_.text), SCHEMA)
    answered, opened = runs[True][0]
    assert answered.reasoning == "" and answered.token_ids[0] != tags.start
    assert opened.token_ids[:2] == [tags.start, tags.end] and opened.reasoning == ""
    for _, engine in runs.values():
        engine.close()


def test_a_schema_cut_off_in_the_thinking_ends_with_length(llm, tags) -> None:
    """max_tokens spent before the thinking ends: no answer, finish "length", no grammar error."""
    params = json_params(1, budget=50)
    params.max_tokens = 10
    out = llm.generate([chat_ids(llm, "Colour?")], params)[0]
    assert out.finish_reason == "length" and out.text == "" and out.error is None
    assert_idle_and_balanced(llm.engine)


def test_two_ranks_equal_one_with_reasoning(thinking_qwen3, llm) -> None:
    """Each rank keeps its rows' phases and budgets and gets the same initial masks: the same
    tokens as one process, free, budgeted and under a schema."""
    prompt = chat_ids(llm, "Colour?")
    params = [json_params(0), json_params(1, budget=3),
              SamplingParams(max_tokens=12, seed=2, thinking_token_budget=5)]  # fmt: skip
    tp = make_llm(thinking_qwen3, max_model_len=512, tensor_parallel_size=2, cpu_threads=1)
    try:
        for mode in (False, True):
            tp.engine.configure(async_scheduling=mode)
            got = tp.generate([prompt] * 3, params)
            want = llm.generate([prompt] * 3, params)
            assert [o.token_ids for o in got] == [o.token_ids for o in want]
            jsonschema.validate(json.loads(got[0].text), SCHEMA)
    finally:
        tp.close()


def test_a_budget_for_a_model_without_a_reasoning_parser_is_refused(tiny_llama) -> None:
    """Never silently ignored: a request's budget, or a default one, where no parser can find
    the thinking."""
    from tandem.models.errors import ModelLoadError

    plain = make_llm(tiny_llama)
    with pytest.raises(ValueError, match="thinking_token_budget needs a reasoning model"):
        plain.generate(["Hi"], SamplingParams(max_tokens=2, thinking_token_budget=4))
    assert plain.engine.reasoning is None
    plain.close()
    with pytest.raises(ModelLoadError, match="default thinking_token_budget needs a reasoning"):
        make_llm(tiny_llama, override_generation_config={"thinking_token_budget": 8})
