"""Structured outputs on the host, with xgrammar: grammars compiled once (cached, off the engine
loop), one matcher per sample advanced by retired tokens only, and each step's bitmask.

The asynchronous loop's rule: a step's bitmask is built after the step before it retires (so
every matcher has seen every token before the one sampled), while that step's forward runs. A
request that finished in the step before holds a discarded token in this one: its row is left
unconstrained and its matcher is never advanced again. A request verifying drafts has a row
after each draft: its matcher walks the drafts (the device hands them over as soon as it has
made them) and is rolled back; only retired tokens advance it for good.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from tandem.request import Request, StructuredOutputsParams
from tandem.sampler.inputs import GrammarRows
from tandem.scheduling.scheduler import ScheduledBatch

if TYPE_CHECKING:  # imported where first used: it adds most of a second to every start-up
    import xgrammar as xgr

GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)
# xgrammar's errors start with "[time] /path/file.cc:line: ": the rest is the message.
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")


class GrammarCompiler:
    """Compiles a request's `StructuredOutputsParams` for one tokenizer; the same spec gives the
    same compiled grammar (a bounded cache). Thread-safe; `submit` compiles on a worker thread."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int, eos_token_ids: list[int]
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._lock = threading.Lock()
        self._compiler: xgr.GrammarCompiler | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._compile_key = functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)(self._compile_key_now)

    @property
    def bitmask_width(self) -> int:
        """int32 words per row of a step's bitmask."""
        return (self.vocab_size + 31) // 32

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec`; raises ValueError naming what is wrong with it."""
        if self.tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer, and it has none")
        return self._compile_key(*spec.key)

    def check_json_schema(self, schema: dict) -> None:
        """Raises ValueError as compiling `schema` would, without the vocabulary: the grammar
        alone takes milliseconds where a compile against a large vocabulary takes a second (a
        request's tools are each checked, though only a forced call's schema constrains)."""
        import xgrammar as xgr

        try:
            xgr.Grammar.from_json_schema(_safe_lengths(json.dumps(schema)), any_whitespace=False)
        except (RuntimeError, ValueError, TypeError) as exc:
            message = _XGRAMMAR_PREFIX.sub("", str(exc).strip()).strip()
            raise ValueError(f"structured_outputs.json is invalid: {message}") from None

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """Compile on this compiler's thread: the engine loop never waits for a grammar."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="tandem-grammar")
        return self._pool.submit(self.compile, spec)

    def cache_info(self) -> functools._CacheInfo:
        return self._compile_key.cache_info()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _xgrammar(self) -> xgr.GrammarCompiler:
        import xgrammar as xgr

        with self._lock:  # built on first use: reading a large vocabulary takes a moment
            if self._compiler is None:
                info = tokenizer_info(self.tokenizer, self.vocab_size, self.eos_token_ids)
                # Our own cache (by spec) replaces xgrammar's; one thread leaves the device's.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _compile_key_now(self, kind: str, text: str) -> xgr.CompiledGrammar:
        compiler = self._xgrammar()
        try:
            if kind == "json":
                return compiler.compile_json_schema(_safe_lengths(text), any_whitespace=False)
            if kind == "json_object":  # any object (a bare JSON value is not an object)
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                alternatives = " | ".join(json.dumps(c) for c in json.loads(text))
                return compiler.compile_grammar(f"root ::= {alternatives}")
            if kind == "grammar":  # EBNF (xgrammar's GBNF) has "::=" rules; Lark has ":" rules
                if "::=" in text:
                    return compiler.compile_grammar(text)
                return compiler.compile_lark(text)
            return compiler.compile_structural_tag(text)
        except (RuntimeError, ValueError, TypeError) as exc:
            message = _XGRAMMAR_PREFIX.sub("", str(exc).strip()).strip()
            raise ValueError(f"structured_outputs.{kind} is invalid: {message}") from None


# A JSON string's characters other than '"', '\\' and control characters, for `_safe_lengths`.
_PLAIN_CHARACTER = '[^"\\\\\\x00-\\x1f]'


def _safe_lengths(schema_text: str) -> str:
    """The schema with each length-bounded string given a pattern of plain characters.

    xgrammar 0.2.9 compiles minLength / maxLength to a character class that admits raw control
    characters, which JSON forbids (mlc-ai/xgrammar#800); its patterns compile correctly. Strings
    with a pattern, format, enum or const of their own are left alone."""
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return schema_text  # xgrammar names the problem

    def visit(node: object) -> None:
        if isinstance(node, list):
            for item in node:
                visit(item)
        if not isinstance(node, dict):
            return
        bounded = "minLength" in node or "maxLength" in node
        own = any(k in node for k in ("pattern", "format", "enum", "const"))
        if node.get("type") == "string" and bounded and not own:
            low, high = node.get("minLength", 0), node.get("maxLength", "")
            if isinstance(low, int) and isinstance(high, (int, str)):
                node["pattern"] = f"^{_PLAIN_CHARACTER}{{{low},{high}}}$"
        for value in node.values():
            visit(value)

    visit(schema)
    return json.dumps(schema)


def tokenizer_info(
    tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: list[int]
) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, with special tokens other than the stop tokens never
    allowed. xgrammar would read "<s>" or "<|im_end|>" as their literal text, which a grammar may
    accept, though the detokenizer drops them: an empty string marks a token as special."""
    import xgrammar as xgr

    detected = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
    )
    special = set(tokenizer.all_special_ids)
    special.update(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
    special.difference_update(stop_token_ids)
    vocab = [""] * max(len(tokenizer), vocab_size)
    for token, i in tokenizer.get_vocab().items():
        vocab[i] = "" if i in special else token
    return xgr.TokenizerInfo(
        vocab[:vocab_size],
        detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=stop_token_ids,
        add_prefix_space=detected.add_prefix_space,
    )


@dataclass
class RequestGrammar:
    """One sample's matcher, advanced by its retired tokens, in order, once each."""

    matcher: xgr.GrammarMatcher
    num_accepted: int = 0

    @classmethod
    def of(cls, compiled: xgr.CompiledGrammar) -> RequestGrammar:
        import xgrammar as xgr

        return cls(xgr.GrammarMatcher(compiled))

    def accept(self, token: int) -> bool:
        self.num_accepted += 1
        return self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        """Accepted a stop token after a complete output: nothing more may follow."""
        return self.matcher.is_terminated()


class PendingGrammars:
    """Samples held out of the scheduler while their grammar compiles on the compiler's thread
    (the server's core: its front end validated the grammar already)."""

    def __init__(self, compiler: GrammarCompiler, on_done: Callable[[], None]):
        self._compiler = compiler
        self._on_done = on_done  # wakes an idle loop
        self._pending: list[tuple[list[Request], Future]] = []

    def __bool__(self) -> bool:
        return bool(self._pending)

    def add(self, samples: list[Request], spec: StructuredOutputsParams) -> None:
        future = self._compiler.submit(spec)
        future.add_done_callback(lambda _: self._on_done())
        self._pending.append((samples, future))

    def wait(self, timeout: float) -> None:
        """Until one of them has compiled (or failed), at most `timeout` seconds."""
        wait([f for _, f in self._pending], timeout=timeout, return_when=FIRST_COMPLETED)

    def done(self) -> list[tuple[list[Request], xgr.CompiledGrammar | None, str | None]]:
        """Those compiled or failed, each with its grammar or the reason it failed."""
        done = []
        for entry in [e for e in self._pending if e[1].done()]:
            self._pending.remove(entry)
            samples, future = entry
            try:
                done.append((samples, future.result(), None))
            except ValueError as exc:
                done.append((samples, None, str(exc)))
        return done


def initial_bitmask(compiled: xgr.CompiledGrammar, width: int) -> np.ndarray:
    """[width] int32: the tokens a grammar allows first (what a reasoning row's answer starts
    under on the device, `sampler/reasoning.py`)."""
    import xgrammar as xgr

    bitmask = torch.full((1, width), -1, dtype=torch.int32)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    return bitmask[0].numpy()


def prepare_reasoning(request: Request, width: int) -> None:
    """Give a reasoning sample with a compiled grammar its grammar's initial mask."""
    if request.reasoning is not None and request.compiled_grammar is not None:
        request.reasoning.initial_mask = initial_bitmask(request.compiled_grammar, width)


def grammar_of(request: Request) -> RequestGrammar:
    """The sample's matcher, made on first use (samples of one request share the compiled
    grammar, never a matcher)."""
    if request.grammar is None:
        request.grammar = RequestGrammar.of(request.compiled_grammar)
    return request.grammar


def advance_grammar(request: Request, token: int) -> str | None:
    """Feed a retired token to the sample's matcher: "stop" once the grammar has ended, "abort"
    (the request's error set) for a token its bitmask did not allow, which only a bug makes."""
    grammar = grammar_of(request)
    if not grammar.accept(token):
        request.error = f"token {token} does not match the request's grammar"
        return "abort"
    return "stop" if grammar.terminated else None


def is_answer(request: Request) -> bool:
    """Whether the sample's latest retired token belongs to the answer (not to its thinking)."""
    return request.reasoning is None or request.reasoning.last_kind == "content"


def allowed_prefix(request: Request, tokens: np.ndarray) -> int:
    """How many of `tokens`, from the sample's retired end on, its grammar allows in a row (its
    matcher walks them and is rolled back): a suffix proposal is cut there, so no draft the
    grammar refuses is verified. A sample with no grammar, or still thinking, allows all."""
    if request.compiled_grammar is None or not is_answer(request):
        return len(tokens)
    matcher = grammar_of(request).matcher
    taken = 0
    for token in tokens.tolist():
        if matcher.is_terminated() or not matcher.accept_token(token):
            break
        taken += 1
    if taken:
        matcher.rollback(taken)
    return taken


_NO_DRAFTS = np.zeros(0, np.int64)


def constrained_items(
    batch: ScheduledBatch, rows: GrammarRows, drafts: np.ndarray | None
) -> list[tuple]:
    """The step's items with sampling rows under a bitmask, as the step chose them when it was
    built (`GrammarRows.items`, in sampling-row order), each with its drafts: its share of
    `drafts`, which holds every verifying item's in batch order (None: the step has none)."""
    drafts = _NO_DRAFTS if drafts is None else drafts
    starts = np.cumsum([0] + [item.num_drafts for item in batch.items])
    return [
        (batch.items[i], drafts[starts[i] : starts[i] + batch.items[i].num_drafts])
        for i in rows.items
    ]


class StepBitmasks:
    """Builds each step's bitmask: every live row's matcher in one xgrammar call (C++, without
    the GIL), so the host's Python work per step barely grows with the constrained rows."""

    def __init__(self, width: int, pin_memory: bool = False):
        self.width = width
        self.pin_memory = pin_memory  # CUDA: the upload is then a non-blocking copy
        self._batch = None

    def build(self, items: list[tuple]) -> torch.Tensor:
        """[rows, width] int32 for `constrained_items`: bit t of a row allows token t there.
        An item's first row is its matcher's state; the row after each of its drafts is the
        state past that draft. Rows after a draft the grammar refuses stay open: the row
        before cannot sample that draft, so it and what follows are rejected anyway.

        Every request's retired tokens must already be accepted (its matcher is at the token
        being sampled). min_tokens is folded in here: its stop ids are cleared unless the
        grammar allows nothing else (then the grammar ends the output). A request drafts only
        past min_tokens (`draft_policy.can_draft`), so that is only ever a first row."""
        num_rows = sum(item.num_rows for item, _ in items)  # 1 + its drafts each
        bitmask = torch.full(
            (num_rows, self.width), -1, dtype=torch.int32, pin_memory=self.pin_memory
        )
        rows, matchers, walks, min_tokens = [], [], [], []
        row = 0
        for item, drafts in items:
            request, first = item.request, row
            row += item.num_rows
            if request.finished:
                continue  # its tokens are discarded at retirement: any value will do
            if request.reasoning is not None and request.reasoning.content_start is None:
                continue  # its first token opened the thinking block: thinking is free
            grammar = grammar_of(request)
            # A verification's output index is the device's; all before it have retired. A
            # reasoning sample's grammar starts at its answer.
            at = len(request.output_token_ids) if item.verify else item.output_index
            if request.reasoning is not None:
                at -= request.reasoning.content_start
            if grammar.num_accepted != at:
                raise RuntimeError(
                    f"grammar of {request.request_id!r} is at token {grammar.num_accepted}, "
                    f"the step samples token {at}"
                )
            rows.append(first)
            matchers.append(grammar.matcher)
            proc = request.processing
            if proc is not None and at < proc.min_tokens and len(proc.min_tokens_ids):
                min_tokens.append((first, proc.min_tokens_ids))
            if len(drafts):
                walks.append(_DraftWalk(grammar.matcher, first, drafts.tolist()))
        if matchers:
            self._matcher_batch().batch_fill_next_token_bitmask(matchers, bitmask, rows)
        for first, ids in min_tokens:
            _clear_unless_empty(bitmask[first].numpy(), ids)
        if walks:
            self._fill_past_drafts(walks, bitmask)
        return bitmask

    def _fill_past_drafts(self, walks: list[_DraftWalk], bitmask: torch.Tensor) -> None:
        """Each walk's rows after its drafts: its matcher advanced draft by draft (every walk
        at draft j in one xgrammar call), then rolled back to where it was."""
        batch = self._matcher_batch()
        for j in range(max(len(w.drafts) for w in walks)):
            live = [w for w in walks if w.taken == j < len(w.drafts)]
            if not live:
                break
            taken = batch.batch_accept_token([w.matcher for w in live], [w.drafts[j] for w in live])
            past = []
            for walk, ok in zip(live, taken, strict=True):
                walk.taken += ok
                if ok and not walk.matcher.is_terminated():  # a stop ends the output
                    past.append(walk)
            if past:
                rows = [w.first + j + 1 for w in past]
                batch.batch_fill_next_token_bitmask([w.matcher for w in past], bitmask, rows)
        for walk in walks:
            if walk.taken:
                walk.matcher.rollback(walk.taken)

    def _matcher_batch(self):
        if self._batch is None:
            import xgrammar as xgr

            self._batch = xgr.BatchGrammarMatcher(max_threads=1)  # the other cores compute
        return self._batch


@dataclass
class _DraftWalk:
    """A request's matcher walking its drafts to fill the rows after them."""

    matcher: xgr.GrammarMatcher
    first: int  # the request's first bitmask row
    drafts: list[int]
    taken: int = 0  # drafts the matcher has accepted so far


def _clear_unless_empty(row: np.ndarray, ids: np.ndarray) -> None:
    words, bits = ids // 32, (ids % 32).astype(np.uint32)
    cleared = row.view(np.uint32).copy()
    np.bitwise_and.at(cleared, words, ~(np.uint32(1) << bits))
    if cleared.any():
        row.view(np.uint32)[:] = cleared
