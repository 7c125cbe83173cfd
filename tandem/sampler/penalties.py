"""Penalties, logit bias and min_tokens on the device, with token counts that never visit the host.

The counts a penalty needs are kept per token-table row, on the device: `prompt_seen[row, v]` says
whether token v occurs in the request's prompt, `output_counts[row, v]` how often it occurs among
its outputs. A token enters the counts when it enters the KV cache, that is as the *input* of a
step, read from the token table on the device. Every position of a request is computed exactly
once per stay in its row, so the counts are exact without the host knowing any token:

- async: step N+1 reads its input (step N's sampled token) from the table, counts it, then
  samples. Nothing waits for the host.
- chunked prefill: each chunk counts its own positions.
- admission (first arrival, or re-admission after preemption): the row is cleared, and positions
  the request skips computing (a cached prefix, an n > 1 sample's shared prompt) are written to
  the table and counted from host values. After preemption the recomputed outputs are inputs
  again, so they are counted again, once.

A speculative token sampled after a request finished is never an input, so it is never counted.
Speculative decoding's drafts are inputs that may be rejected: a verification counts its inputs
only once the step has kept them (`record_accepted`); until then each of its rows adds the ones
before it on top of the row's counts.
"""

from __future__ import annotations

import torch

from tandem.sampler.inputs import ProcessingRows


class TokenCounts:
    """Per table row: which tokens occur in the prompt, and how often each occurs in the output.

    Allocated on the first step that needs it, so an engine whose requests use no penalties pays
    nothing: 5 bytes per (table row, vocabulary id) otherwise.
    """

    def __init__(self, num_rows: int, vocab_size: int, device: torch.device):
        self.num_rows = num_rows
        self.vocab_size = vocab_size
        self.device = device
        self.prompt_seen: torch.Tensor | None = None  # [rows, V] bool
        self.output_counts: torch.Tensor | None = None  # [rows, V] float32 (exact below 2**24)

    def _allocate(self) -> None:
        shape = (self.num_rows, self.vocab_size)
        self.prompt_seen = torch.zeros(shape, dtype=torch.bool, device=self.device)
        self.output_counts = torch.zeros(shape, dtype=torch.float32, device=self.device)

    def record(self, table: torch.Tensor, p: ProcessingRows) -> None:
        """Clear admitted rows, then count the tokens entering the KV cache in this step."""
        if self.prompt_seen is None:
            self._allocate()
        seen, counts = self.prompt_seen, self.output_counts
        assert seen is not None and counts is not None
        v = self.vocab_size
        seen.index_fill_(0, p.reset_rows, False)
        counts.index_fill_(0, p.reset_rows, 0.0)
        seen.view(-1).index_fill_(0, p.prompt_rows * v + table[p.prompt_tokens], True)
        flat = p.output_rows * v + table[p.output_tokens]
        counts.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))

    def record_accepted(
        self, p: ProcessingRows, input_ids: torch.Tensor, kept: torch.Tensor
    ) -> None:
        """After a step with penalized verifications: count their inputs that were kept (the
        last token and the accepted drafts; `kept` [V] per verification)."""
        kept_input = (p.accept_offset < kept[p.accept_item]).to(torch.float32)
        flat = p.accept_rows * self.vocab_size + input_ids[p.accept_batch]
        self.output_counts.view(-1).index_add_(0, flat, kept_input)

    def apply_penalties(
        self, logits: torch.Tensor, p: ProcessingRows, input_ids: torch.Tensor
    ) -> None:
        """In place: repetition (transformers: divide positive logits, multiply negative ones, of
        every token seen in the prompt or output), then frequency and presence (OpenAI: subtract
        frequency * count, then presence * [count > 0], over output tokens only). Each is skipped
        when no row of the step uses it."""
        assert self.prompt_seen is not None and self.output_counts is not None
        rows, table_rows = p.penalty_rows, p.penalty_table_rows
        sub = logits[rows]
        counts = self.output_counts[table_rows]
        if len(p.pair_rows):  # a verification's rows also count the inputs up to their own
            flat = p.pair_rows * self.vocab_size + input_ids[p.pair_batch]
            counts.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
        if p.flags.use_repetition:
            seen = self.prompt_seen[table_rows]
            seen |= counts > 0
            repetition = p.repetition[:, None]
            sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
        if p.flags.use_frequency:
            sub -= counts * p.frequency[:, None]
        if p.flags.use_presence:
            sub -= (counts > 0) * p.presence[:, None]
        logits.index_copy_(0, rows, sub)


def apply_bias_and_mask(logits: torch.Tensor, p: ProcessingRows) -> None:
    """In place: add logit_bias, then forbid stop tokens of requests still short of min_tokens.

    Flat index_add_ / index_fill_ rather than index_put_: no sort, no host sync on any device.
    """
    flat, v = logits.view(-1), logits.shape[-1]
    if p.flags.use_bias:
        flat.index_add_(0, p.bias_rows * v + p.bias_ids, p.bias_values)
    if p.flags.use_mask:
        flat.index_fill_(0, p.mask_rows * v + p.mask_ids, float("-inf"))
