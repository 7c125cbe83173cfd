"""n > 1: one request becomes n samples, each its own `Request` with its own seed.

They share the prompt through the prefix cache: sample 0 prefills it, and the others, held back
while its blocks are being computed (`Scheduler`), then find them cached and compute only the
prompt's tail (at most one block) before sampling with their own seed.
"""

from __future__ import annotations

import copy
import hashlib

from tandem.engine.intake import sampling_row
from tandem.request import Request


def fan_out(request: Request, vocab_size: int) -> list[Request]:
    """The request's samples: itself as sample 0, then copies with per-sample state."""
    samples = [request]
    for i in range(1, request.params.n):
        sample = copy.copy(request)
        # Per-sample state, nothing aliased: copies of the request's, which has not run yet
        # (so they hold only initial values, like prompt_logprobs' leading None).
        for name, value in vars(request).items():
            if isinstance(value, (list, dict, set)) and name != "prompt_token_ids":
                setattr(sample, name, type(value)(value))
        if request.reasoning is not None:
            sample.reasoning = copy.copy(request.reasoning)
        sample.index = i
        sample.seed = sample_seed(request.seed, i)
        sample.sampling_row = sampling_row(request.params, sample.seed, vocab_size)
        samples.append(sample)
    return samples


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded `seed`.

    Sample 0 keeps the request's seed, so n = 1 and sample 0 of n > 1 agree; the others get
    distinct seeds derived from (seed, index) by a stable hash: the same in every run and process.
    """
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")
