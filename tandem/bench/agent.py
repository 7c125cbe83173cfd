"""The agent-session workload's prompts: a coding agent's sessions (Claude Code, Codex) as the
model sees them.

Every session starts with one long fixed head (a system prompt and tool definitions) and grows a
turn at a time by the previous answer and a tool result. So turn k+1's prompt begins with turn
k's prompt and answer, which the prefix cache can serve, and the first prompt of every session
begins with the head, which every session after the first can reuse.

How turn k+1 is made decides what can be reused. `exact`: turn k's prompt ids, its answer's ids
as generated, then the chat template's text after the answer (end of turn, the tool result, the
next generation prompt) tokenized on its own: a client that keeps token ids. `rendered`: the
whole conversation rendered and tokenized again, the answer as text, as a server does; where
the answer's text tokenizes differently from the generated ids (or the template writes an
earlier turn differently), the prompt departs from the cached one there.
"""

from __future__ import annotations

import json
import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.engine.chat_template import chat_template_problem, render_chat_text

AGENT_PRESET = "agent"
AGENT_SIZES = {"sessions": 4, "turns": 5, "head_len": 8192, "tool_result_len": 400}
AGENT_OUTPUT_LEN = 48
PROMPT_MODES = ("exact", "rendered")
# What each session asks: `explain` a task over the files it reads (answers the model words
# itself), or `edit`: every file it reads repeated back with one line changed, as an agent
# rewriting a file does (answers that re-emit the tool result: what speculation drafts).
AGENT_TASKS = ("explain", "edit")
EDIT_TASK = "Repeat the following file exactly, with line 2 changed to say that the tests pass:\n"
EDIT_NEXT = "The same for this file:\n"
AGENT_TOOLS = Path(__file__).with_name("data") / "agent_tools.json"  # package data
PASSAGES = Path(__file__).with_name("data") / "copy_passages.txt"
QUESTIONS = Path(__file__).with_name("data") / "chat_prompts.txt"
# The seed names the tool set in the first line: heads of other seeds share no cached block.
PREAMBLE = (
    "You are an interactive coding agent (tool set {seed}) that helps users with software "
    "engineering tasks. "
    "Use the instructions below and the tools available to you to assist the user. Answer "
    "concisely. When a tool result comes back, decide on the next step and say it in one or "
    "two sentences before calling the next tool.\n\n# Tools\n\n"
)
# Room a turn's template markers take beyond its tool result and answer (role headers, ends of
# turn), and the first turn's task: the head is shortened by these to fit the context.
TURN_OVERHEAD = 24
TASK_LEN = 64


@dataclass(frozen=True)
class AgentShape:
    sessions: int
    turns: int
    head_len: int  # tokens of the shared head (about: whole tool definitions)
    tool_result_len: int  # tokens each turn adds (about)
    output_len: int  # each answer's tokens, exact (EOS is ignored)
    stagger_s: float = 0.0  # session s starts at s * stagger_s
    task: str = "explain"  # AGENT_TASKS

    def __post_init__(self) -> None:
        for name in ("sessions", "turns", "head_len", "tool_result_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.stagger_s < 0:
            raise ValueError("--session-stagger must be >= 0")
        if self.task not in AGENT_TASKS:
            raise ValueError(f"--agent-task takes {' or '.join(AGENT_TASKS)}, got {self.task!r}")

    def start_time(self, session: int) -> float:
        """Seconds after the run's start that the session's first turn arrives."""
        return session * self.stagger_s

    def final_len(self, head_len: int) -> int:
        """A session's length at its last answer, at most (the context it needs)."""
        per_turn = self.tool_result_len + self.output_len + TURN_OVERHEAD
        return head_len + self.turns * per_turn + TASK_LEN

    def context(self) -> int:
        """A server's context per session: a whole session's tokens, rounded up to 256."""
        return -(-self.final_len(self.head_len) // 256) * 256

    def head_that_fits(self, max_model_len: int) -> int:
        """The head, shortened so that a whole session fits in the context."""
        head = min(self.head_len, max_model_len - self.final_len(0))
        if head < 1:
            raise ValueError(
                f"{self.turns} turns of {self.tool_result_len} + {self.output_len} tokens leave no "
                f"room for a head in max_model_len {max_model_len}: fewer --turns or a shorter "
                "--tool-result-len"
            )
        return head


class Conversations(ABC):
    """Each session's prompts: its first, then each next from the previous prompt and answer."""

    mode: str = "exact"
    respliced: int = 0  # exact mode: turns the template did not extend, rendered anew

    @abstractmethod
    def first(self, session: int) -> list[int]: ...

    @abstractmethod
    def next(
        self, session: int, turn: int, prompt: list[int], answer: list[int]
    ) -> tuple[list[int], int]:
        """The prompt of turn `turn` (0-based, >= 1), after `prompt` and its `answer`, and how
        many tokens the turn adds to them (the template's end of turn, the tool result, the
        next generation prompt): what an ideal cache leaves to compute."""


class TokenConversations(Conversations):
    """A model without a tokenizer: random ids, a turn's ids appended to the previous prompt
    and answer."""

    def __init__(self, shape: AgentShape, head_len: int, vocab_size: int, seed: int):
        self.shape, self.vocab_size, self.seed = shape, vocab_size, seed
        self.head = _random_ids(random.Random(seed), head_len, vocab_size)

    def _added(self, session: int, turn: int) -> list[int]:
        rng = random.Random(f"{self.seed}-{session}-{turn}")
        return _random_ids(rng, self.shape.tool_result_len, self.vocab_size)

    def first(self, session: int) -> list[int]:
        return self.head + self._added(session, 0)

    def next(
        self, session: int, turn: int, prompt: list[int], answer: list[int]
    ) -> tuple[list[int], int]:
        added = self._added(session, turn)
        return prompt + answer + added, len(added)


class AgentTexts:
    """The sessions' texts, sized in a tokenizer's tokens: the head (a system message of tool
    definitions), each session's task, each turn's tool result (a user message). The same seed
    gives the same texts; `tandem bench compare --served` sends them to servers as messages."""

    def __init__(
        self, tokenizer: Any, head_len: int, tool_result_len: int, seed: int, task: str = "explain"
    ):
        self.tokenizer, self.tool_result_len, self.seed = tokenizer, tool_result_len, seed
        self.task = task
        self.system = tool_definitions(tokenizer, head_len, seed)

    def first_messages(self, session: int) -> list[dict[str, str]]:
        """A session's first turn: the head, then its task and first tool result."""
        questions = _lines(QUESTIONS)
        asked = EDIT_TASK if self.task == "edit" else f"Task: {questions[session % len(questions)]}"
        task = f"{asked}\n\n{self.tool_result(session, 0)}"
        return [{"role": "system", "content": self.system}, {"role": "user", "content": task}]

    def turn_message(self, session: int, turn: int) -> str:
        """A later turn's user message: the tool result (edit: asked to be repeated too)."""
        asked = EDIT_NEXT if self.task == "edit" else ""
        return asked + self.tool_result(session, turn)

    def tool_result(self, session: int, turn: int) -> str:
        """About --tool-result-len tokens of numbered file lines, as an agent's Read returns."""
        rng = random.Random(f"{self.seed}-{session}-{turn}")
        sentences = _sentences()
        lines = [f"$ cat src/module_{session}_{turn}.txt"]
        tokens = self.count(lines[0] + "\n")
        while True:  # never past the length (the context was sized by it)
            line = f"{len(lines):6d}\t{rng.choice(sentences)}"
            n = self.count(line + "\n")
            if tokens + n > self.tool_result_len:  # the words of the last line that fit
                words = line.split(" ")
                while words and tokens + self.count(" ".join(words) + "\n") > self.tool_result_len:
                    words.pop()
                return "\n".join(lines + [" ".join(words)] if words else lines)
            lines.append(line)
            tokens += n

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)


class ChatConversations(Conversations):
    """Messages through the chat template (plain text blocks where the tokenizer has none)."""

    def __init__(
        self, shape: AgentShape, head_len: int, tokenizer: Any, seed: int, mode: str = "exact"
    ):
        if mode not in PROMPT_MODES:
            raise ValueError(f"--agent-prompts takes {' or '.join(PROMPT_MODES)}, got {mode!r}")
        self.tokenizer, self.mode = tokenizer, mode
        self.texts = AgentTexts(tokenizer, head_len, shape.tool_result_len, seed, shape.task)
        self.render: Callable[[list[dict[str, str]]], str] = (
            (lambda messages: render_chat_text(tokenizer, messages))
            if chat_template_problem(tokenizer) is None
            else _plain_text
        )
        self.messages: dict[int, list[dict[str, str]]] = {}

    def _ids(self, text: str) -> list[int]:
        # A rendered template writes any BOS itself (render_chat_ids does the same).
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def first(self, session: int) -> list[int]:
        self.messages[session] = self.texts.first_messages(session)
        return self._ids(self.render(self.messages[session]))

    def next(
        self, session: int, turn: int, prompt: list[int], answer: list[int]
    ) -> tuple[list[int], int]:
        messages = self.messages[session]
        before = self.render(messages)
        text = self.tokenizer.decode(answer, skip_special_tokens=True)
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": self.texts.turn_message(session, turn)},
        ]
        after = self.render(messages)
        rendered = self._ids(after)
        if not after.startswith(before + text):  # the template rewrote an earlier turn
            self.respliced += self.mode == "exact"
            return rendered, len(rendered) - len(prompt) - len(answer)
        tail = self._ids(after[len(before + text) :])
        if self.mode == "exact":
            return prompt + answer + tail, len(tail)
        return rendered, len(tail)


def tool_definitions(tokenizer: Any, num_tokens: int, seed: int) -> str:
    """A system prompt of at most about `num_tokens` tokens: a preamble, then JSON tool schemas,
    one a line: the shipped tools, then as many MCP servers' copies of them (each description
    with a sentence of its own) as the length takes."""
    rng = random.Random(seed)
    tools = json.loads(AGENT_TOOLS.read_text(encoding="utf-8"))
    sentences = _sentences()
    preamble = PREAMBLE.format(seed=seed)
    lines, tokens = [], len(tokenizer(preamble).input_ids)
    for copy in range(num_tokens):  # whole tools, never past the length
        for tool in tools:
            name = tool["name"] if copy == 0 else f"mcp__server{copy}__{tool['name']}"
            extra = "" if copy == 0 else " " + rng.choice(sentences)
            line = json.dumps(_schema(name, tool["description"] + extra, tool["parameters"]))
            tokens += len(tokenizer(line + "\n", add_special_tokens=False).input_ids)
            if tokens > num_tokens:
                return preamble + "\n".join(lines)
            lines.append(line)
    return preamble + "\n".join(lines)


def _schema(name: str, description: str, parameters: dict[str, list[str]]) -> dict[str, Any]:
    """An OpenAI-style function tool."""
    properties = {p: {"type": t, "description": d} for p, (t, d) in parameters.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": [*parameters][:1],
            },
        },
    }


def _plain_text(messages: list[dict[str, str]]) -> str:
    """A tokenizer without a chat template: the messages' texts, a blank line apart."""
    return "".join(m["content"] + "\n\n" for m in messages)


def _random_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(3, vocab_size) for _ in range(n)]


def _lines(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _sentences() -> list[str]:
    text = " ".join(PASSAGES.read_text(encoding="utf-8").split())
    return [s.strip() + "." for s in text.split(". ") if s.strip()]


def make_conversations(
    shape: AgentShape,
    tokenizer: Any,
    vocab_size: int,
    max_model_len: int,
    seed: int,
    mode: str = "exact",
) -> Conversations:
    """The sessions' prompts: chat messages where the model has a tokenizer, else random ids;
    the head shortened where the context needs it."""
    head = shape.head_that_fits(max_model_len)
    if tokenizer is None:
        return TokenConversations(shape, head, vocab_size, seed)
    return ChatConversations(shape, head, tokenizer, seed, mode)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
