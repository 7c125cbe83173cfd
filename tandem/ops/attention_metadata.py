"""What a step tells the attention kernels: KV slots, block tables, context lengths, and the
prefill chunks as host ints (portable and Triton kernels alike read it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.ops import cpu_kernels


@dataclass
class PrefillSegment:
    """One prefill chunk: host ints, so the per-chunk loop never reads the device."""

    token_start: int  # offset of the chunk in the packed batch
    num_tokens: int
    context_len: int  # KV length after this chunk (cached prefix + chunk)
    row: int  # row of the chunk's request in block_tables

    @property
    def attends_as_decodes(self) -> bool:
        """Whether the CPU kernels read this chunk's context in place, query j as the decode of
        its token would (context up to its own position): a few queries after a cached context,
        where gathering that context into a copy and masking it costs more than the queries
        (up to the kernel build's bound, `cpu_kernels.decode_like_tokens`)."""
        return (
            self.num_tokens <= cpu_kernels.decode_like_tokens()
            and self.context_len > self.num_tokens
        )


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat KV-cache slot of every token
    block_tables: torch.Tensor  # [R, max_blocks] of the batch's requests, decodes first
    context_lens: torch.Tensor  # [R] KV length after this step
    num_decodes: int
    decode_max_blocks: int  # columns of block_tables that decodes need
    prefills: list[PrefillSegment]
    block_size: int
    # Each decode row is a different request's one new token, whose position is its context
    # length less one (a plain decode step; a verification gives one request several rows):
    # a kernel may then rotate and cache a row's own key and attend to it at once.
    distinct_decodes: bool = False
    # Models whose layers keep different blocks (sliding windows beside full attention): each
    # layer's own metadata (its group's slots and block tables); None: this one serves all.
    by_layer: list[AttentionMetadata] | None = None

    def for_layer(self, layer: int) -> AttentionMetadata:
        return self if self.by_layer is None else self.by_layer[layer]
