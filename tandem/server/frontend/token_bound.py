"""A provable lower bound on how many tokens a text becomes, computed without tokenizing it.

Tokenizing a multi-megabyte prompt takes seconds; refusing it should not. For a byte-level BPE
tokenizer the bound is exact, not a guess: its pre-tokenizer maps every UTF-8 byte of the text to
one alphabet character and drops nothing, so the tokens of a text spell out all of its bytes, and
no token spells more than `max_token_bytes` of them (the longest vocabulary entry, or the longest
added token, which is matched in the raw text). Hence

    tokens(text) >= ceil(utf8_bytes(text) / max_token_bytes) + special tokens added (BOS, ...)

and it is tight: a text made of the longest token, repeated, tokenizes to exactly that many.

The proof needs every stage of the pipeline to keep every byte, so `prompt_bound` accepts only
pipelines it can vouch for (no normalizer, byte-level pre-tokenization, a BPE that knows every
byte, added tokens that do not swallow neighbouring whitespace). For any other tokenizer it
returns None with the reason, and prompts are tokenized, off the event loop, before being judged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# Pre-tokenizers that only split (with a behaviour that keeps every piece) or map bytes.
_SPLITTERS = {"Split", "Digits", "Punctuation"}


@dataclass(frozen=True)
class PromptBound:
    max_token_bytes: int  # no token spells more bytes of the text than this
    num_special_tokens: int  # added around every text encoded with special tokens (BOS, ...)

    def min_tokens(self, text: str, add_special_tokens: bool = True) -> int:
        """A number of tokens `text` is certain to have at least: O(1) for ASCII text, one
        UTF-8 encoding otherwise."""
        specials = self.num_special_tokens if add_special_tokens else 0
        return specials + -(-_utf8_length(text) // self.max_token_bytes)

    def describe(self) -> str:
        return f"byte-level BPE, no token longer than {self.max_token_bytes} bytes"


def _utf8_length(text: str) -> int:
    if text.isascii():  # O(1) in CPython: the string records it
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def prompt_bound(tokenizer: Any) -> tuple[PromptBound | None, str]:
    """The bound for a transformers fast tokenizer, or (None, why it cannot be proved)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None, "not a fast (Rust) tokenizer"
    spec = json.loads(backend.to_str())
    reason = _unsupported(spec)
    if reason:
        return None, reason
    added = list(backend.get_added_tokens_decoder().values())
    for token in added:
        if token.lstrip or token.rstrip:  # it absorbs any amount of whitespace beside it
            return None, f"added token {token.content!r} strips the whitespace around it"
    vocab = backend.get_vocab(with_added_tokens=False)
    # In byte-level BPE every vocabulary character stands for one byte of the text.
    longest = max([len(t) for t in vocab] + [len(t.content.encode("utf-8")) for t in added])
    return PromptBound(longest, _num_special_tokens(tokenizer, backend)), ""


def _unsupported(spec: dict[str, Any]) -> str:
    """Why this tokenizer.json's pipeline might lose or merge bytes; "" if it cannot."""
    if spec.get("normalizer") is not None:
        return f"it has a normalizer ({spec['normalizer'].get('type')}), which may shrink text"
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    if kinds.count("ByteLevel") != 1:
        return "its pre-tokenizer is not byte-level"
    for step in steps:
        if step.get("type") == "ByteLevel":
            continue
        if step.get("type") not in _SPLITTERS:
            return f"its pre-tokenizer includes {step.get('type')}"
        if step.get("behavior") == "Removed":
            return f"its {step['type']} pre-tokenizer removes text"
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        return f"its model is {model.get('type')}, not BPE"
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return "its BPE marks subwords"
    from tokenizers.pre_tokenizers import ByteLevel

    # A character missing from the vocabulary would be dropped (or fused into one unknown token).
    missing = [c for c in ByteLevel.alphabet() if c not in model.get("vocab", {})]
    if missing:
        return f"its vocabulary lacks {len(missing)} of the 256 byte characters"
    return ""


def _num_special_tokens(tokenizer: Any, backend: Any) -> int:
    """Tokens the post-processor adds to a single text. Taken as the smaller of what it declares
    and what an actual call adds (either alone would do; a lower bound only needs the minimum)."""
    processor = backend.post_processor
    declared = processor.num_special_tokens_to_add(False) if processor is not None else 0
    with_special = len(tokenizer("a", add_special_tokens=True).input_ids)
    without = len(tokenizer("a", add_special_tokens=False).input_ids)
    return max(0, min(declared, with_special - without))
