"""Incremental detokenization with stop strings.

Text is produced by the tokenizers library's DecodeStream, which never splits a multi-byte
character. While a request runs, text that could still turn out to be the start of a stop string
is held back, so a stop string (which is never part of the output) is never streamed by mistake.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

_PREFIX_TOKENS = 4  # prompt tokens that seed the stream, so the first word gets its spacing right


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool,
    ):
        self._tokenizer = tokenizer
        seed = prompt_token_ids[-_PREFIX_TOKENS:]
        # A seed ending inside a multi-byte character would be emitted with the first output.
        while seed and tokenizer.decode(seed, skip_special_tokens=skip_special_tokens).endswith(
            "\ufffd"
        ):
            seed = seed[:-1]
        self._stream = DecodeStream(ids=seed, skip_special_tokens=skip_special_tokens)
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._emitted = 0
        self.matched_stop: str | None = None  # the stop string that ended the text

    def add(self, token_id: int, check_stop: bool = True) -> bool:
        """Appends one token's text; True if a stop string appeared (the text is cut before it).

        With check_stop False (before min_tokens) stop strings are not looked for.
        """
        piece = self._stream.step(self._tokenizer, token_id)
        if not piece:
            return False
        search_from = max(0, len(self.text) - self._holdback)
        self.text += piece
        if not self._stop or not check_stop:
            return False
        hits = [(i, s) for s in self._stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            at, self.matched_stop = min(hits)
            self.text = self.text[:at]
            return True
        return False

    @property
    def emitted_text(self) -> str:
        return self.text[: self._emitted]

    def delta(self, finished: bool) -> str:
        """Text not yet emitted; unless finished, minus what a stop string might still claim."""
        end = len(self.text) if finished or not self._stop else len(self.text) - self._holdback
        if end <= self._emitted:
            return ""
        out = self.text[self._emitted : end]
        self._emitted = end
        return out


class NoDetokenizer:
    """For a model without a tokenizer: no text, and no stop strings (they are refused)."""

    text = ""
    emitted_text = ""
    matched_stop = None

    def add(self, token_id: int, check_stop: bool = True) -> bool:
        return False

    def delta(self, finished: bool) -> str:
        return ""


class TokenTexts:
    """Each token's own text (special tokens included), decoded once: logprobs label tokens by
    it. Without a tokenizer, None."""

    def __init__(self, tokenizer: Tokenizer | None):
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token: int) -> str | None:
        if self._tokenizer is None:
            return None
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self._tokenizer.decode([token], skip_special_tokens=False)
        return text
