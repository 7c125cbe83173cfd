"""Suffix decoding's proposals: continuations from suffix trees, made on the host, checked on the
device.

The trees are arctic-inference's (`SuffixDecodingCache`, as vLLM's `method: "suffix"` uses
them): one per running request over its prompt and output, and one global tree over the outputs
of the last `suffix_decoding_max_cached_requests` requests (first in, first out). A proposal is
the most frequent continuation of the longest context the trees match, as long as each token's
estimated chance (its count over its parent's, multiplied along the path) stays at least
`suffix_decoding_min_token_prob` and at most `suffix_decoding_max_spec_factor` times the matched
length.

The host knows a request's retired tokens only: under the asynchronous loop the step in flight
adds tokens it has not read. So a proposal starts at the retired end (`Proposal.start`) and runs
past the in-flight tokens; the device takes the drafts after its own length only where the
tokens it holds since `start` are the proposal's first ones (the step in flight kept every draft
and sampled what the trees expected), and its own n-gram drafts otherwise
(`execution/drafting.proposed_drafts`). A request under a grammar has its proposal cut at the
first token the grammar refuses, so no refused draft is verified.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import count

import numpy as np

from tandem.config import SpeculativeConfig
from tandem.request import Request


@dataclass
class Proposal:
    start: int  # the position of tokens[0]: the request's retired length when proposed
    tokens: np.ndarray  # int64: the trees' continuation from there


class SuffixProposer:
    """The trees, fed with each request's retired tokens when it next drafts or ends."""

    def __init__(
        self,
        spec: SpeculativeConfig,
        allowed: Callable[[Request, np.ndarray], int] | None = None,
    ):
        """`allowed`: how many of a proposal's tokens the request may sample in a row (its
        grammar's say; None: all)."""
        self.spec = spec
        self.allowed = allowed
        from arctic_inference.suffix_decoding import SuffixDecodingCache  # checked by the config

        self.cache = SuffixDecodingCache(
            max_tree_depth=spec.suffix_decoding_max_tree_depth,
            max_cached_requests=spec.suffix_decoding_max_cached_requests,
        )
        self._ids = count()
        self._keys: dict[Request, int] = {}  # running requests' tree ids (by identity)
        self._fed: dict[Request, int] = {}  # their outputs added so far

    @property
    def num_active(self) -> int:
        """Requests holding a tree of their own."""
        return len(self._keys)

    @property
    def num_cached(self) -> int:
        """Outputs in the global tree."""
        return len(self.cache.cached_requests)

    def propose(self, request: Request, max_drafts: int) -> Proposal:
        """The continuation of the request's retired tokens: enough for the tokens in flight
        (every draft kept) and `max_drafts` more."""
        key = self._feed(request)
        prompt, output = request.prompt_token_ids, request.output_token_ids
        depth = self.spec.suffix_decoding_max_tree_depth
        context = (list(prompt[-depth:]) + list(output[-depth:]))[-depth:]
        # The drafts may be as many as the factor allows for the match that holds once the
        # in-flight tokens are as expected (it is longer by them), after those tokens.
        inflight, factor = request.num_inflight, self.spec.suffix_decoding_max_spec_factor
        draft = self.cache.speculate(
            key,
            context,
            max_spec_tokens=inflight + max_drafts,
            max_spec_factor=factor,
            max_spec_offset=inflight * (1 + factor),
            min_token_prob=self.spec.suffix_decoding_min_token_prob,
        )
        tokens = np.asarray(draft.token_ids, np.int64)
        if self.allowed is not None:
            tokens = tokens[: self.allowed(request, tokens)]
        return Proposal(len(prompt) + len(output), tokens)

    def finish(self, request: Request) -> None:
        """The request ended: its whole output joins the global tree, its own tree goes."""
        if self.spec.suffix_decoding_max_cached_requests or request in self._keys:
            self.cache.stop_request(self._feed(request))
            del self._keys[request], self._fed[request]

    def _feed(self, request: Request) -> int:
        key = self._keys.get(request)
        if key is None:
            key = self._keys[request] = next(self._ids)
            self._fed[request] = 0
            self.cache.start_request(key, request.prompt_token_ids)
        new = request.output_token_ids[self._fed[request] :]
        if new:
            self.cache.add_active_response(key, new)
            self._fed[request] += len(new)
        return key
