"""Log-probabilities on the device, and the packed step output that carries them back.

A step returns one int64 tensor: the sampled ids, then (when some request asks) the logprobs
results, float32 values stored bit for bit in the low 32 bits of an int64 word. So the ids and
their logprobs travel in the step's one device-to-host copy, and the host splits them by a layout
it already knows (the sizes come from the step's host arrays).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tandem.request import Logprob, TokenLogprobs


@dataclass
class TokenLogprobsTensors:
    """For N tokens: each token's log-probability and rank, and the top-k alternatives."""

    logprob: torch.Tensor  # [N] float32
    rank: torch.Tensor  # [N] int64, 1 = most likely
    top_ids: torch.Tensor  # [N, k] int64
    top_logprobs: torch.Tensor  # [N, k] float32


def score_tokens(logprobs: torch.Tensor, tokens: torch.Tensor, k: int) -> TokenLogprobsTensors:
    """logprobs [N, V] (a log_softmax), tokens [N] -> their logprob, rank and the top k."""
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    rank = (logprobs > chosen[:, None]).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    return TokenLogprobsTensors(chosen, rank, top_ids, top_logprobs)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 words holding the same 32 bits (exact, unlike a value cast)."""
    return x.float().contiguous().view(torch.int32).to(torch.int64).reshape(-1)


def pack(ids: torch.Tensor, groups: list[TokenLogprobsTensors]) -> torch.Tensor:
    pieces = [ids]
    for g in groups:
        pieces += [_bits(g.logprob), g.rank, g.top_ids.reshape(-1), _bits(g.top_logprobs)]
    return torch.cat(pieces)


@dataclass
class LogprobsArrays:
    """TokenLogprobsTensors on the host."""

    logprob: np.ndarray
    rank: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray

    def to_dicts(
        self, tokens: list[int], ks: list[int], decode: Callable[[int], str]
    ) -> list[TokenLogprobs]:
        """Row i as vLLM's per-token dict: tokens[i] (sampled or prompt) first, then the top
        ks[i] alternatives by rank."""
        logprobs, ranks = self.logprob.tolist(), self.rank.tolist()
        top_ids, top_logprobs = self.top_ids.tolist(), self.top_logprobs.tolist()
        out = []
        for i, (token, k) in enumerate(zip(tokens, ks, strict=True)):
            entry = {token: Logprob(logprobs[i], ranks[i], decode(token))}
            top = zip(top_ids[i][:k], top_logprobs[i][:k], strict=True)
            for rank, (tid, lp) in enumerate(top, 1):
                if tid not in entry:
                    entry[tid] = Logprob(lp, rank, decode(tid))
            out.append(entry)
        return out


def unpack(
    packed: np.ndarray, num_ids: int, groups: list[tuple[int, int]]
) -> tuple[np.ndarray, list[LogprobsArrays]]:
    """Split a packed step output: the ids, then one LogprobsArrays per (rows, k) group."""
    ids = packed[:num_ids]
    offset = num_ids
    out = []
    for n, k in groups:
        sizes = [n, n, n * k, n * k]
        a, b, c, d = np.split(packed[offset : offset + sum(sizes)], np.cumsum(sizes)[:-1])
        offset += sum(sizes)
        out.append(
            LogprobsArrays(
                a.astype(np.int32).view(np.float32),
                b,
                c.reshape(n, k),
                d.astype(np.int32).view(np.float32).reshape(n, k),
            )
        )
    assert offset == len(packed), "packed step output does not match its layout"
    return ids, out
