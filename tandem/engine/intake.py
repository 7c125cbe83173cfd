"""Request intake: a prompt and its SamplingParams become a validated `Request`, or a ValueError
naming the problem. Runs on the caller's thread, so bad input never reaches the loop."""

from __future__ import annotations

import itertools
import time
import uuid
from pathlib import Path

import numpy as np
from transformers import GenerationConfig

from tandem.reasoning import ReasoningTokens, ReasoningTracker
from tandem.request import LogitsProcessing, Request, SamplingParams
from tandem.sampler.sampling import seed_key


class RequestIntake:
    """Tokenizes, resolves lengths against the context limit, and resolves penalties, bias and
    min_tokens against the model's vocabulary and stop ids."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: set[int],
        max_model_len: int,
        engine_seed: int,
        reasoning: ReasoningTokens | None = None,
    ):
        """`reasoning`: the engine's reasoning parser, resolved (None: no reasoning parser)."""
        self.tokenizer = tokenizer  # None: the model folder has no tokenizer files
        self.reasoning = reasoning
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._engine_seed = engine_seed
        self._seed_counter = itertools.count()

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> Request:
        params = params or SamplingParams()
        if params.stop and self.tokenizer is None:
            raise ValueError(
                "stop strings need a tokenizer, and this model has no tokenizer "
                "(its folder has no tokenizer files): use stop_token_ids"
            )
        if params.thinking_token_budget is not None and self.reasoning is None:
            raise ValueError(
                "thinking_token_budget needs a reasoning model, and this one has no reasoning "
                "parser (its chat template writes no <think>; see --reasoning-parser)"
            )
        token_ids = self.tokenize(prompt)
        max_tokens = self._resolve_max_tokens(len(token_ids), params)
        processing = self._logits_processing(params)
        seed = params.seed
        if seed is None:  # derived from the engine seed and arrival order: runs are reproducible
            seed = hash((self._engine_seed, next(self._seed_counter)))
        request = Request(
            request_id=request_id if request_id is not None else uuid.uuid4().hex,
            prompt_token_ids=token_ids,
            params=params,
            seed=seed,
            sampling_row=sampling_row(params, seed, self.vocab_size),
            max_tokens=max_tokens,
            arrival_time=time.perf_counter(),
            processing=processing,
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        if self.reasoning is not None:
            request.reasoning = ReasoningTracker.start(
                token_ids,
                self.reasoning,
                params.thinking_token_budget,
                grammar=params.structured_outputs is not None,
                blank=self._blank,
            )
        return request

    def _blank(self, token_ids: list[int]) -> bool:
        """Whether the ids are whitespace only (a prompt's tail after a closed thinking block)."""
        return not self.tokenizer.decode(token_ids).strip()

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "this model has no tokenizer (its folder has no tokenizer files): "
                    "give the prompt as a list of token ids"
                )
            if not prompt:
                raise ValueError("prompt is empty")
            token_ids = self.tokenizer(prompt).input_ids
        elif isinstance(prompt, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            token_ids = list(prompt)
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        if not token_ids:
            raise ValueError("prompt is empty")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        return token_ids

    def _resolve_max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ValueError(
                f"prompt has {prompt_len} tokens, which leaves no room to generate within "
                f"max_model_len {self.max_model_len}"
            )
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise ValueError(
                f"prompt ({prompt_len} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len {self.max_model_len}"
            )
        return params.max_tokens

    def _logits_processing(self, params: SamplingParams) -> LogitsProcessing | None:
        """Resolve penalties, logit_bias and min_tokens against the model; None if unused."""
        vocab = self.vocab_size
        bias = params.logit_bias or {}
        bad = [t for t in bias if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})")
        stops = ending_token_ids(params, self.eos_token_ids)
        processing = LogitsProcessing(
            presence=params.presence_penalty,
            frequency=params.frequency_penalty,
            repetition=params.repetition_penalty,
            bias_ids=np.fromiter(bias, np.int64, len(bias)),
            bias_values=np.fromiter(bias.values(), np.float32, len(bias)),
            min_tokens=params.min_tokens,
            # Ids past the logits cannot be sampled anyway (and must not index them).
            min_tokens_ids=np.array(
                sorted(t for t in stops if t < vocab) if params.min_tokens else [], np.int64
            ),
        )
        return processing if processing.used else None


def ending_token_ids(params: SamplingParams, eos_token_ids: set[int]) -> set[int]:
    """The ids that end a request when sampled: its stop_token_ids, and EOS unless ignored."""
    return set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids)


def sampling_row(params: SamplingParams, seed: int, vocab_size: int) -> tuple:
    """The request's sampler settings as the batch builder packs them."""
    top_k = params.top_k if params.top_k < vocab_size else 0  # the whole vocabulary: off
    return (params.temperature, top_k, params.top_p, params.min_p, seed_key(seed))


def context_limit(requested: int | None, model_limit: int) -> int:
    """The longest sequence (prompt and output) the engine takes: `requested`
    (`EngineConfig.max_model_len`) or the model's own limit, never past it."""
    limit = requested or model_limit
    if limit > model_limit:
        raise ValueError(
            f"max_model_len {limit} exceeds the model's max_position_embeddings {model_limit}"
        )
    return limit


def eos_token_ids(hf_config, tokenizer, path: Path) -> set[int]:
    """Every id that ends a request: the config's, the tokenizer's, generation_config.json's."""
    ids: set[int] = set()
    for source in (hf_config.eos_token_id, getattr(tokenizer, "eos_token_id", None)):
        ids.update(source if isinstance(source, list) else [source] if source is not None else [])
    if (path / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(path, local_files_only=True).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids
