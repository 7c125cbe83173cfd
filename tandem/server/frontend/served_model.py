"""The model as a front end sees it: the engine core's handshake, plus its own tokenizer.

The front end validates and tokenizes requests, applies chat templates and detokenizes outputs,
so it needs the tokenizer and the limits the core resolved (context length, vocabulary, stop
ids), never the weights. It compiles structured outputs' grammars too, so that a bad schema,
regex or grammar is the client's 400 from an intake lane, never a failure in the core (which
compiles again, for its own matchers).
"""

from __future__ import annotations

import copy
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from tandem.engine.detokenizer import IncrementalDetokenizer, NoDetokenizer, TokenTexts
from tandem.engine.grammar import GrammarCompiler
from tandem.engine.intake import RequestIntake, ending_token_ids
from tandem.models.catalog import checkpoint_path
from tandem.models.loader import find_tokenizer
from tandem.reasoning import resolve_parser
from tandem.request import Logprob, Request, SamplingParams, StructuredOutputsParams, TokenLogprobs
from tandem.server.core import wire


def load_tokenizer(model_path: str | Path) -> PreTrainedTokenizerBase | None:
    """The tokenizer of the checkpoint at `model_path` (None: the checkpoint has none). A front
    end loads it while the cores start, before their `Ready` says which checkpoint they load."""
    return find_tokenizer(checkpoint_path(model_path))


class ServedModel:
    def __init__(
        self,
        ready: wire.Ready,
        tokenizer: PreTrainedTokenizerBase | None,
        configured_name: str | None = None,
    ):
        """`tokenizer`: `load_tokenizer(ready.model_path)`'s."""
        self.model_path = Path(ready.model_path)
        self.model_type = ready.model_type
        self.configured_name = configured_name  # as given on the command line, if any
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.eos_token_ids = set(ready.eos_token_ids)
        self.num_kv_blocks = ready.num_kv_blocks
        self.max_num_seqs = ready.max_num_seqs
        self.sampling_defaults = ready.sampling_defaults
        self.tokenizer = tokenizer
        self.reasoning = resolve_parser(ready.reasoning_parser, tokenizer)  # the core's parser
        # Its seeds are never used: the core derives unseeded requests' seeds in arrival order.
        self.intake = RequestIntake(
            self.tokenizer,
            self.vocab_size,
            self.eos_token_ids,
            self.max_model_len,
            0,
            self.reasoning,
        )
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        self.backend = self.tokenizer.backend_tokenizer if self.tokenizer is not None else None
        self.token_text = TokenTexts(self.backend)  # a token's text, for logprobs

    def make_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str
    ) -> Request:
        """Tokenize and validate (the grammar too): raises ValueError naming the problem."""
        request = self.intake.make_request(prompt, params, request_id)
        if params.structured_outputs is not None:
            self.check_grammar(params.structured_outputs)
        return request

    def check_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compile `spec` (cached by spec); raises ValueError ("structured_outputs.<kind> ...")."""
        self.grammars.compile(spec)

    def choice_text(self, request: Request) -> ChoiceText:
        return ChoiceText(self, request)

    def logprobs(self, entries: list[list[tuple[int, float, int]]]) -> list[TokenLogprobs]:
        return [
            {token: Logprob(lp, rank, self.token_text(token)) for token, lp, rank in entry}
            for entry in entries
        ]


class ChoiceText:
    """One choice's text, built token by token exactly as the offline engine builds it: a token
    that ends the request by id (EOS, stop_token_ids) adds no text; stop strings count from
    min_tokens on and cut the text before them. With a reasoning tracker (a chat request to a
    reasoning model), each token goes to the thinking or the answer, the tags to neither, and
    stop strings are looked for in the answer."""

    def __init__(self, model: ServedModel, request: Request):
        params = request.params
        self.detokenizer = self._detokenizer(model, request, params.stop)
        self.tracker = copy.copy(request.reasoning)  # each choice walks its own tokens
        self.thinking = self._detokenizer(model, request, []) if self.tracker else None
        self.stop_ids = ending_token_ids(params, model.eos_token_ids)
        self.min_tokens = params.min_tokens
        self.num_tokens = 0

    @staticmethod
    def _detokenizer(
        model: ServedModel, request: Request, stop: list[str]
    ) -> IncrementalDetokenizer | NoDetokenizer:
        if model.backend is None:
            return NoDetokenizer()
        return IncrementalDetokenizer(
            model.backend, request.prompt_token_ids, stop, request.params.skip_special_tokens
        )

    def add(self, token: int) -> bool:
        """True if a stop string has appeared: the choice ends on this token."""
        self.num_tokens += 1
        kind = self.tracker.advance(token) if self.tracker is not None else "content"
        if kind == "thinking":
            self.thinking.add(token, check_stop=False)
        if token in self.stop_ids or kind != "content":
            return False  # the core ends the request on a stop id
        return self.detokenizer.add(token, check_stop=self.num_tokens >= self.min_tokens)

    def delta(self, finished: bool) -> str:
        return self.detokenizer.delta(finished)

    def thinking_delta(self, finished: bool) -> str:
        """New thinking text (always "" without a reasoning tracker)."""
        return self.thinking.delta(finished) if self.thinking is not None else ""

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the choice, if one did."""
        return self.detokenizer.matched_stop
