"""What the user sees of a retired step: sampled ids and logprobs read from the step's packed
output, tokens appended with their stop checks, text detokenized, `RequestOutput`s assembled."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from tandem.engine.detokenizer import IncrementalDetokenizer, NoDetokenizer, TokenTexts
from tandem.engine.grammar import advance_grammar, is_answer
from tandem.execution.batch import kept_runs
from tandem.request import Request, RequestOutput, TokenLogprobs
from tandem.sampler.inputs import LogprobRows
from tandem.sampler.logprobs import LogprobsArrays, unpack
from tandem.scheduling.scheduler import ScheduledRequest


class OutputProcessor:
    """Per live sample: its detokenizer (incremental text, stop strings with hold-back); with a
    reasoning parser, a second one for the thinking, each token going to its part
    (`ReasoningTracker`; the tags to neither, stop strings looked for in the answer)."""

    def __init__(self, tokenizer, eos_token_ids: set[int], detokenize: bool = True):
        """`detokenize` False: no text, no stop strings, no logprob token texts (the caller's)."""
        detokenize = detokenize and tokenizer is not None
        self._backend = tokenizer.backend_tokenizer if detokenize else None
        self.eos_token_ids = eos_token_ids
        self._detok: dict[tuple[str, int], IncrementalDetokenizer | NoDetokenizer] = {}
        self._thinking: dict[tuple[str, int], IncrementalDetokenizer | NoDetokenizer] = {}
        self.decode_token = TokenTexts(self._backend)  # a token's text for logprobs

    def track(self, request: Request) -> None:
        self._detok[request.key] = self._detokenizer(request, request.params.stop)
        if request.reasoning is not None:
            self._thinking[request.key] = self._detokenizer(request, [])

    def _detokenizer(
        self, request: Request, stop: list[str]
    ) -> IncrementalDetokenizer | NoDetokenizer:
        if self._backend is None:
            return NoDetokenizer()
        params = request.params
        return IncrementalDetokenizer(
            self._backend, request.prompt_token_ids, stop, params.skip_special_tokens
        )

    def read_step(
        self, result, sampled: list[ScheduledRequest], lp: LogprobRows | None
    ) -> list[tuple[list[int], list[TokenLogprobs | None]]]:
        """Each sampled item's tokens with their logprobs (None where not asked): one token,
        or a verification's accepted run (its count follows the ids in the packed output).
        Prompt logprobs are appended to their requests here."""
        num_rows = [it.num_rows for it in sampled]
        num_verified = sum(it.verify for it in sampled)
        total = sum(num_rows)
        groups = lp.output_groups if lp is not None else []
        ids, arrays = unpack(np.asarray(result), total + num_verified, groups)
        row_ids = ids[:total].tolist()
        logprobs: list[TokenLogprobs | None] = [None] * total
        if lp is not None and len(lp.rows):
            rows = lp.rows.tolist()
            row_items = [it for it, n in zip(sampled, num_rows, strict=True) for _ in range(n)]
            entries = arrays.pop(0).to_dicts(
                [row_ids[s] for s in rows],
                [row_items[s].request.params.logprobs for s in rows],
                self.decode_token,
            )
            for s, entry in zip(rows, entries, strict=True):
                logprobs[s] = entry
        if arrays:
            self._add_prompt_logprobs(lp, arrays[0])
        runs = kept_runs(num_rows, [it.verify for it in sampled], ids[total:].tolist())
        return [(row_ids[a:b], logprobs[a:b]) for a, b in runs]

    def _add_prompt_logprobs(self, lp: LogprobRows, arrays: LogprobsArrays) -> None:
        """Append each prompt position's result; positions recomputed after a preemption that
        were already retired are skipped (steps retire in order, so the list grows in order)."""
        spans = lp.prompt_spans
        entries = arrays.to_dicts(
            [r.prompt_token_ids[p + 1] for r, first, n in spans for p in range(first, first + n)],
            [r.params.prompt_logprobs for r, _, n in spans for _ in range(n)],
            self.decode_token,
        )
        j = 0
        for request, first, count in spans:
            done = request.prompt_logprobs
            for p in range(first, first + count):
                if p + 1 == len(done):
                    done.append(entries[j])
                j += 1

    def append_tokens(
        self, request: Request, tokens: list[int], logprobs: list, now: float
    ) -> tuple[str | None, list[int]]:
        """Append a step's tokens up to the first that ends the request (a stop, its length, the
        end of its grammar): the finish reason (None: it runs on) and the tokens kept. Those
        after the end are never streamed."""
        reason, kept = None, []
        for token, lp in zip(tokens, logprobs, strict=True):
            reason = self.append_token(request, token, now, lp)
            if reason is None and request.compiled_grammar is not None and is_answer(request):
                reason = advance_grammar(request, token)
            kept.append(token)
            if reason is not None:
                break
        return reason, kept

    def append_token(
        self, request: Request, token: int, now: float, logprobs: TokenLogprobs | None
    ) -> str | None:
        """Record a retired token; returns the finish reason it causes ("stop", "length")."""
        request.output_token_ids.append(token)
        request.token_times.append(now)
        if request.logprobs is not None:
            request.logprobs.append(logprobs)
        params = request.params
        kind = request.reasoning.advance(token) if request.reasoning is not None else "content"
        if kind == "thinking":
            self._thinking[request.key].add(token, check_stop=False)
        if (
            token in params.stop_token_ids
            or (token in self.eos_token_ids and not params.ignore_eos)
            # Stop strings count only from min_tokens on (as in vLLM); stop ids are masked before.
            or kind == "content"
            and self._detok[request.key].add(
                token, check_stop=len(request.output_token_ids) >= params.min_tokens
            )
        ):
            return "stop"
        if len(request.output_token_ids) >= request.max_tokens:
            return "length"
        return None

    def running_output(self, request: Request, new_ids: list[int]) -> RequestOutput:
        detok, thinking = self._detok[request.key], self._thinking.get(request.key)
        return _output(request, detok, thinking, new_ids, finished=False)

    def finished_output(self, request: Request, new_ids: list[int] | None = None) -> RequestOutput:
        """The last output of a finished (or aborted) sample, with the tokens its last step
        added (`new_ids`; none by default); forgets its detokenizers."""
        detok, thinking = self._detok.pop(request.key), self._thinking.pop(request.key, None)
        return _output(request, detok, thinking, new_ids or [], finished=True)


def _output(
    request: Request,
    detok: IncrementalDetokenizer | NoDetokenizer,
    thinking: IncrementalDetokenizer | NoDetokenizer | None,
    delta_ids: list[int],
    finished: bool,
) -> RequestOutput:
    delta_text = detok.delta(finished)
    delta_reasoning = thinking.delta(finished) if thinking is not None else ""
    return RequestOutput(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        text=detok.emitted_text,
        # Cumulative ids: a copy when finished, else the live list (copying every step is O(n^2)).
        token_ids=list(request.output_token_ids) if finished else request.output_token_ids,
        delta_text=delta_text,
        delta_token_ids=delta_ids,
        finished=finished,
        finish_reason=request.finish_reason if finished else None,
        error=request.error if finished else None,
        index=request.index,
        logprobs=_snapshot(request.logprobs, finished),
        prompt_logprobs=_snapshot(request.prompt_logprobs, finished),
        reasoning=thinking.emitted_text if thinking is not None else None,
        delta_reasoning=delta_reasoning,
        num_cached_tokens=request.num_cached_tokens or 0,
        speculative=replace(request.speculation) if request.speculation.num_verified else None,
    )


def _snapshot(values: list | None, finished: bool) -> list | None:
    """Like token_ids: a running request's live list, a finished one's own copy."""
    return list(values) if finished and values is not None else values
