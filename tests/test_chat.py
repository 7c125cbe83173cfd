"""`tandem chat`: the conversation kept and rendered by the chat template, replies streamed and
identical to offline generation, Ctrl-C aborting a reply; the command in real processes."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from tandem import LLM, SamplingParams
from tandem.chat import DIM, RESET, Conversation, stream_reply
from tandem.cli import build_parser, sampling_params
from tandem.engine.chat_template import chat_template_problem
from tandem.models.default_model import default_model_path
from tandem.models.generation_defaults import CHAT_SAMPLING, GenerationDefaults

from helpers import assert_idle_and_balanced, greedy

ENGINE = {"max_model_len": 512, "kv_cache_memory_gib": 0.1, "cpu_threads": 2, "device": "cpu"}
ENGINE_FLAGS = ["--max-model-len", "512", "--kv-cache-memory-gib", "0.1", "--cpu-threads", "2",
                "--device", "cpu", "--max-tokens", "8", "--ignore-eos"]  # fmt: skip
FLAGS = [*ENGINE_FLAGS, "--temperature", "0"]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    llm = LLM(**ENGINE)  # the built-in default model: a real BPE tokenizer and a chat template
    yield llm
    llm.close()


def template_ids(llm: LLM, messages: list[dict]) -> list[int]:
    """The prompt the server would build for `messages`."""
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_replies_stream_keep_the_conversation_and_match_offline_generation(llm: LLM) -> None:
    conversation = Conversation(llm.engine, greedy(8))
    deltas: list[str] = []
    first = conversation.reply("Hello there", deltas.append)
    assert first and "".join(deltas) == first and len(deltas) > 1
    out = conversation.last_output
    prompt = template_ids(llm, [user("Hello there")])
    bos = llm.get_tokenizer().bos_token_id
    assert out.prompt_token_ids == prompt and prompt[:2].count(bos) == 1  # one BOS, not two
    offline = llm.generate(prompt, greedy(8))[0]
    assert out.token_ids == offline.token_ids and first == offline.text

    second = conversation.reply("And then?")
    history = [user("Hello there"), {"role": "assistant", "content": first}, user("And then?")]
    assert conversation.last_output.prompt_token_ids == template_ids(llm, history)
    assert conversation.messages == [*history, {"role": "assistant", "content": second}]

    conversation.reset()
    assert conversation.messages == []
    assert conversation.reply("Hello there") == first
    assert conversation.last_output.prompt_token_ids == prompt
    assert_idle_and_balanced(llm.engine)


def test_reset_keeps_the_system_message(llm: LLM) -> None:
    system = {"role": "system", "content": "Answer briefly."}
    conversation = Conversation(llm.engine, greedy(4), system="Answer briefly.")
    conversation.reply("Hi")
    assert conversation.last_output.prompt_token_ids == template_ids(llm, [system, user("Hi")])
    conversation.reset()
    assert conversation.messages == [system]


def test_ctrl_c_mid_reply_aborts_it_and_keeps_the_history(llm: LLM) -> None:
    conversation = Conversation(llm.engine, greedy(8))
    expected = conversation.reply("Once upon a time")
    conversation.reset()
    conversation.reply("Hello there")
    before = list(conversation.messages)
    seen: list[str] = []

    def ctrl_c(delta: str) -> None:
        seen.append(delta)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        conversation.reply("Tell me a story", ctrl_c)
    assert len(seen) == 1
    assert not llm.engine.has_unfinished()
    assert_idle_and_balanced(llm.engine)
    assert conversation.messages == before

    conversation.reset()
    assert conversation.reply("Once upon a time") == expected  # the engine is fine afterwards


def test_no_tokenizer_or_no_template_is_named() -> None:
    from tandem.server.frontend.errors import APIError
    from tandem.server.generation.prepare import render_chat

    assert "no tokenizer" in chat_template_problem(None)
    assert "no chat template" in chat_template_problem(SimpleNamespace(chat_template=None))
    # The server's messages, whichever API the conversation came through.
    for tokenizer, message in [
        (None, "this model has no tokenizer (its folder has no tokenizer files), so "
         "a conversation cannot become a prompt; use /v1/completions with token ids"),
        (SimpleNamespace(chat_template=""), "this model's tokenizer has no chat template, so "
         "a conversation cannot become a prompt; use /v1/completions with a plain prompt"),
    ]:  # fmt: skip
        with pytest.raises(APIError) as info:
            render_chat(SimpleNamespace(tokenizer=tokenizer), [])
        assert str(info.value) == message and info.value.param == "messages"


def tandem_chat(*args: str, stdin: Path | None = None) -> subprocess.Popen:
    """`tandem chat` in a process of its own, started now, reading `stdin` (a file) if given."""
    with open(stdin or "/dev/null", encoding="utf-8") as source:
        return subprocess.Popen(
            [sys.executable, "-m", "tandem", "chat", *args],
            stdin=source,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )


def no_template_model(root: Path) -> Path:
    """The default model without its chat template, as a base model's folder is."""
    model = root / "no-template"
    shutil.copytree(default_model_path(), model, ignore=shutil.ignore_patterns("chat_template*"))
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)  # where transformers 4 keeps it
    config_path.write_text(json.dumps(config))
    return model


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SimpleNamespace]:
    """The processes the tests below judge, run side by side (each spends seconds importing)."""
    # A stop at "\n" keeps each reply on one line, so the lines are the replies.
    one_line = [*FLAGS, "--stop", "\n"]
    root = tmp_path_factory.mktemp("chat")
    turns = root / "turns.txt"
    turns.write_text("Hello there\n\nAnd then?\n/reset\nHello there\n", encoding="utf-8")
    no_template = no_template_model(root)  # first: it builds the default model if not cached
    procs = {
        "one_shot": tandem_chat("Hello there", *one_line),
        "piped": tandem_chat(*one_line, stdin=turns),
        "no_template": tandem_chat("Hello", "--model", str(no_template), *FLAGS),
        # The default model sets no sampling: a chat samples with llama.cpp's defaults.
        "seed_1": tandem_chat("Tell me a story", *ENGINE_FLAGS, "--sampling-seed", "1"),
        "seed_2": tandem_chat("Tell me a story", *ENGINE_FLAGS, "--sampling-seed", "2"),
        "greedy": tandem_chat("Tell me a story", *FLAGS),
    }
    results = {}
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=300)
            results[name] = SimpleNamespace(
                returncode=proc.returncode, stdout=stdout, stderr=stderr
            )
    finally:
        for proc in procs.values():
            proc.kill()  # nothing left behind if one hangs (a no-op on those that exited)
    return results


def test_one_shot_and_piped_turns(runs: dict[str, SimpleNamespace]) -> None:
    one_shot, piped = runs["one_shot"], runs["piped"]
    assert one_shot.returncode == 0, one_shot.stderr
    answer = one_shot.stdout.removesuffix("\n")
    assert answer.strip() and "\n" not in answer
    assert piped.returncode == 0, piped.stderr
    replies = piped.stdout.split("\n")
    assert len(replies) == 4 and replies[3] == "", piped.stdout  # three replies, one per line
    assert replies[0] == answer and replies[2] == answer  # after /reset: the first turn again


def test_a_model_without_chat_template_exits_2(runs: dict[str, SimpleNamespace]) -> None:
    result = runs["no_template"]
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("tandem chat: error:") and "no chat template" in lines[-1]


def test_chat_samples_with_llama_cpp_defaults_unless_told_otherwise(
    runs: dict[str, SimpleNamespace], llm: LLM
) -> None:
    """A model that sets no sampling gets llama.cpp's chat defaults (said on stderr at start):
    two seeds give two replies; `--temperature 0` is greedy, equal to offline generation."""
    replies = {}
    for name in ("seed_1", "seed_2", "greedy"):
        result = runs[name]
        assert result.returncode == 0, result.stderr
        said = next(line for line in result.stderr.splitlines() if "sampling defaults" in line)
        assert "temperature=0.8, top_k=40, top_p=0.95, min_p=0.05" in said, said
        assert "llama.cpp's chat defaults" in said
        replies[name] = result.stdout.removesuffix("\n")
    assert replies["seed_1"] != replies["seed_2"]
    assert "over them: --temperature 0" in runs["greedy"].stderr
    offline = llm.generate(template_ids(llm, [user("Tell me a story")]), greedy(8))[0]
    assert replies["greedy"] == offline.text
    seeded = SamplingParams(max_tokens=8, ignore_eos=True, seed=1, **CHAT_SAMPLING)
    assert (
        replies["seed_1"]
        == llm.generate(template_ids(llm, [user("Tell me a story")]), seeded)[0].text
    )


def test_chat_sampling_comes_from_the_model_when_it_sets_any() -> None:
    """The model's defaults where it sets how to sample; llama.cpp's where it sets none or only a
    thinking budget; the flags over either."""
    model = GenerationDefaults({"temperature": 0.6, "top_p": 0.9}, "generation_config.json")
    assert model.for_chat() is model
    budget_only = GenerationDefaults({"thinking_token_budget": 5}, "the override")
    assert budget_only.for_chat().values == {**CHAT_SAMPLING, "thinking_token_budget": 5}
    none = GenerationDefaults(source="no generation_config.json")
    assert none.for_chat().values == CHAT_SAMPLING
    args = build_parser().parse_args(["chat", "--temperature", "0", "--top-k", "5"])
    params = sampling_params(args, none.for_chat().values)
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (0, 5, 0.95, 0.05)
    args = build_parser().parse_args(["chat"])
    params = sampling_params(args, model.for_chat().values)
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.9, 0)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_thinking_is_shown_dimmed_before_the_answer_on_a_terminal(thinking_qwen3: Path) -> None:
    """A reasoning model's thinking streams first, dimmed, then the answer after a blank line;
    piped, only the answer. The conversation keeps the answer alone."""
    llm = LLM(str(thinking_qwen3), **ENGINE)
    try:
        params = SamplingParams(max_tokens=12, temperature=0, thinking_token_budget=4)
        terminal, pipe = Terminal(), io.StringIO()
        stream_reply(Conversation(llm.engine, params), "Hi", terminal)
        conversation = Conversation(llm.engine, params)
        stream_reply(conversation, "Hi", pipe)
        out = conversation.last_output
        assert out.reasoning and out.text
        assert terminal.getvalue() == f"{DIM}{out.reasoning}{RESET}\n\n{out.text}\n"
        assert pipe.getvalue() == out.text + "\n"
        assert conversation.messages[-1] == {"role": "assistant", "content": out.text}
    finally:
        llm.close()
