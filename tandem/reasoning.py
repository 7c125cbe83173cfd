"""Reasoning: which part of an output is the model's thinking, and the budget that bounds it.

Reasoning models write a block (`<think> ... </think>`) before the answer. A reasoning parser
(vLLM's names: `deepseek_r1`, `qwen3`) names the block's two tags, each one token of the
vocabulary, so that the block is found by token ids: the tags are in neither part, and a
forced end is the end token itself.

Each sample of a request moves through phases, one token at a time (`advance`):
  MAY_OPEN  the model may open the block: the start tag opens it (THINKING), anything else
            means there is no thinking (CLOSED, that token being the answer's first);
  THINKING  in the block: the end tag closes it; any other token is thinking and spends one of
            the budget, and when the budget is spent the next token is forced (FORCE);
  FORCE     this token is the end tag, whatever was sampled;
  FIRST     the answer's first token, under a grammar: it is sampled under the grammar's
            initial mask (the device applies it, since the host learns of the close one step
            late), and the host's matcher takes over from the next token;
  CLOSED    the answer, or no reasoning at all.
Where a request starts is the prompt's doing (`initial_phase`): a prompt that opens the block
(a template whose generation prompt writes `<think>`) starts THINKING; one whose thinking is
already closed (Qwen3's template with `enable_thinking` false writes an empty block) starts
CLOSED; otherwise the parser decides (`deepseek_r1`: THINKING, since its templates may open the
block themselves and the model writes only the end; `qwen3`: MAY_OPEN).

The same machine runs twice: on the device, per token-table row, where the budget is enforced
(`sampler/reasoning.py`: the loop never waits for the host to force an end), and on the host,
over retired tokens (`ReasoningTracker`), where it sorts text into thinking and answer and
tells the grammar where the answer starts. The host's view is one step late, never different.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

CLOSED, THINKING, FORCE, FIRST, MAY_OPEN = 0, 1, 2, 3, 4
NO_BUDGET = 1 << 40  # the budget of a request that sets none: never spent


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str
    end: str
    starts_thinking: bool  # with no tag in the prompt: the output begins in the block


REASONING_PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", "<think>", "</think>", starts_thinking=True),
    "qwen3": ReasoningParser("qwen3", "<think>", "</think>", starts_thinking=False),
}
PARSER_CHOICES = ("auto", "none", *REASONING_PARSERS)


@dataclass(frozen=True)
class ReasoningTokens:
    """A parser resolved against a tokenizer: its tags' ids."""

    parser: ReasoningParser
    start: int
    end: int

    def describe(self) -> str:
        p = self.parser
        return f"reasoning parser {p.name}: {p.start} ({self.start}) ... {p.end} ({self.end})"


def resolve_parser(name: str | None, tokenizer) -> ReasoningTokens | None:
    """The parser `name` names for `tokenizer` ("auto": qwen3's where the chat template writes
    <think>, else none). Raises ValueError where a tag is not one token of the vocabulary."""
    if name in (None, "none") or tokenizer is None:
        if name not in (None, "none", "auto"):
            raise ValueError(f"reasoning parser {name!r} needs the model's tokenizer")
        return None
    if name == "auto":
        template = str(getattr(tokenizer, "chat_template", None) or "")
        if "<think>" not in template:
            return None
        name = "qwen3"
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser {name!r}; expected one of {', '.join(PARSER_CHOICES)}"
        )
    parser = REASONING_PARSERS[name]
    ids = []
    for tag in (parser.start, parser.end):
        found = tokenizer(tag, add_special_tokens=False).input_ids
        if len(found) != 1:
            raise ValueError(
                f"reasoning parser {name!r}: {tag} is {len(found)} tokens in this vocabulary; "
                "the parser needs it as one token"
            )
        ids.append(found[0])
    return ReasoningTokens(parser, *ids)


def initial_phase(
    prompt: list[int], tokens: ReasoningTokens, blank: Callable[[list[int]], bool]
) -> int:
    """Where a request's output starts, from its prompt's last tag: an open block goes on
    (THINKING), a block closed at the very end of the prompt (`blank`: whether ids are only
    whitespace) stays closed (CLOSED: Qwen3's template when thinking is off), anything else is
    the parser's choice."""
    for i in range(len(prompt) - 1, -1, -1):
        token = prompt[i]
        if token == tokens.start:
            return THINKING
        if token == tokens.end:
            if blank(prompt[i + 1 :]):
                return CLOSED
            break
    return THINKING if tokens.parser.starts_thinking else MAY_OPEN


def advance(phase: int, budget: int, token: int, tokens: ReasoningTokens, grammar: bool):
    """(phase, budget, token) after one output token: the phase the next token starts in, the
    budget left, and the token itself (the end tag where the phase forced it)."""
    after_close = FIRST if grammar else CLOSED
    if phase == FORCE:
        return after_close, budget, tokens.end
    if phase == MAY_OPEN:
        if token == tokens.start:
            return (FORCE if budget <= 0 else THINKING), budget, token
        return CLOSED, budget, token
    if phase == THINKING:
        if token == tokens.end:
            return after_close, budget, token
        if token != tokens.start:  # a start tag inside the block is a tag, not thinking
            budget -= 1
        return (FORCE if budget <= 0 else THINKING), budget, token
    return CLOSED, budget, token  # FIRST, CLOSED


@dataclass
class ReasoningTracker:
    """One sample's phase on the host, advanced by retired tokens: what the device's row holds
    once every launched step has retired. `content_start` is the output index of the answer's
    first token (None until the block has closed, or was never opened)."""

    tokens: ReasoningTokens
    phase: int
    budget: int
    grammar: bool  # the answer is under a grammar (its first token: FIRST)
    content_start: int | None = None
    num_thinking: int = 0  # thinking tokens so far (tags not counted)
    last_kind: str | None = None  # the kind of the latest token advanced over
    initial_mask: Any = None  # the answer's grammar's first mask (int32 words), once compiled
    _seen: int = field(default=0, repr=False)  # output tokens advanced over

    @classmethod
    def start(
        cls,
        prompt: list[int],
        tokens: ReasoningTokens,
        budget: int | None,
        grammar: bool,
        blank: Callable[[list[int]], bool],
    ) -> ReasoningTracker:
        phase = initial_phase(prompt, tokens, blank)
        budget = NO_BUDGET if budget is None else budget
        if phase == THINKING and budget <= 0:
            phase = FORCE
        tracker = cls(tokens, phase, budget, grammar)
        if phase == CLOSED:
            tracker.content_start = 0
        return tracker

    @property
    def active(self) -> bool:
        """Whether the device's row may still act (mask, force, count): not CLOSED."""
        return self.phase != CLOSED

    @property
    def retired(self) -> int:
        """Output tokens advanced over (the retired ones)."""
        return self._seen

    def device_acts_at(self, output_index: int) -> bool:
        """Whether the device's row may act on the token at `output_index` (launched steps run
        ahead of this tracker): until the answer's first token, where a grammar's initial mask
        applies; the host takes the answer's grammar over after it."""
        return self.content_start is None or output_index <= self.content_start

    def kind(self, token: int) -> str:
        """What the next output token is, before advancing: "thinking", "tag" or "content"."""
        if self.phase == FORCE or (self.phase == THINKING and token == self.tokens.end):
            return "tag"
        if token == self.tokens.start and self.phase in (MAY_OPEN, THINKING):
            return "tag"
        if self.phase == THINKING:
            return "thinking"
        return "content"

    def advance(self, token: int) -> str:
        """Take one retired output token; returns its kind (`kind`)."""
        kind = self.kind(token)
        if kind == "thinking":
            self.num_thinking += 1
        elif kind == "content" and self.content_start is None:
            self.content_start = self._seen
        state = advance(self.phase, self.budget, token, self.tokens, self.grammar)
        self.phase, self.budget = state[0], state[1]
        self._seen += 1
        if self.content_start is None and self.phase in (FIRST, CLOSED):
            self.content_start = self._seen  # the answer starts with the next token
        self.last_kind = kind
        return kind
