"""Reasoning on the device: each row's phase and thinking budget, kept beside the token table.

The phases are `tandem/reasoning.py`'s, and `ThinkingState.advance` is its `advance` over a
step's rows at once. The host never waits on them: a row's state is set from host values when
the request is admitted (a re-admission after preemption included: its tokens are all known
then), and from there only the steps move it, in stream order. So the budget holds exactly in
both loops: the step after the last thinking token samples the end tag, whatever the host has
seen, and the step after the end samples the answer's first token under the grammar's initial
mask (the host prepared it at admission), since the host learns of the end one step late.
"""

from __future__ import annotations

import numpy as np
import torch

from tandem.reasoning import CLOSED, FIRST, FORCE, MAY_OPEN, THINKING
from tandem.sampler.grammar import apply_token_bitmask
from tandem.sampler.inputs import ReasoningRows


class ThinkingState:
    """Per token-table row: phase, budget left, whether the answer is under a grammar, and that
    grammar's initial mask (allocated on the first one: 4 bytes per row and 32 vocabulary ids)."""

    def __init__(self, num_rows: int, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.phase = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.budget = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.grammar = torch.zeros(num_rows, dtype=torch.bool, device=device)
        self.masks: torch.Tensor | None = None  # [rows, words] int32

    def reset(self, r: ReasoningRows[torch.Tensor]) -> None:
        """Admitted rows start from the host's state; rows with a grammar get its initial mask."""
        if len(r.reset_rows):
            self.phase.index_copy_(0, r.reset_rows, r.reset_phase)
            self.budget.index_copy_(0, r.reset_rows, r.reset_budget)
            self.grammar.index_copy_(0, r.reset_rows, r.reset_grammar.bool())
        if len(r.mask_rows):
            if self.masks is None:
                shape = (len(self.phase), self.words)
                self.masks = torch.full(shape, -1, dtype=torch.int32, device=self.phase.device)
            masks = r.masks.view(torch.int32)[:, : self.words]
            self.masks.index_copy_(0, r.mask_rows, masks)

    def constrain(self, logits: torch.Tensor, r: ReasoningRows[torch.Tensor]) -> None:
        """Before sampling: a row taking the answer's first token (FIRST), or one that may open
        the block (MAY_OPEN), under a grammar samples within the grammar's initial mask (and
        MAY_OPEN may also open the block)."""
        if not r.flags.use_masks:
            return
        rows, table_rows = r.rows, r.table_rows
        phase = self.phase[table_rows]
        under = self.grammar[table_rows] & ((phase == FIRST) | (phase == MAY_OPEN))
        masks = torch.where(under[:, None], self.masks[table_rows], -1)
        word, bit = divmod(r.start_token, 32)
        start_bit = int(np.int32(np.uint32(1 << bit)))  # the word's sign bit for bit 31
        opening = (phase == MAY_OPEN).to(torch.int32) * start_bit
        masks[:, word] |= opening
        sub = logits[rows]
        apply_token_bitmask(sub, masks)
        logits.index_copy_(0, rows, sub)

    def advance(self, ids: torch.Tensor, r: ReasoningRows[torch.Tensor]) -> None:
        """After sampling, in place: rows due to end their thinking take the end tag, then every
        row's phase and budget move on by its token (`tandem.reasoning.advance`)."""
        rows, table_rows = r.rows, r.table_rows
        phase = self.phase[table_rows]
        budget = self.budget[table_rows]
        end, start = r.end_token, r.start_token
        tokens = torch.where(phase == FORCE, end, ids[rows])
        ids.index_copy_(0, rows, tokens)
        is_end, is_start = tokens == end, tokens == start
        close = torch.where(self.grammar[table_rows], FIRST, CLOSED)
        thinking = phase == THINKING
        budget = budget - (thinking & ~is_end & ~is_start).to(torch.int64)
        spent_or = torch.where(budget <= 0, FORCE, THINKING)
        new = torch.full_like(phase, CLOSED)  # FIRST and CLOSED go to CLOSED
        new = torch.where(phase == MAY_OPEN, torch.where(is_start, spent_or, CLOSED), new)
        new = torch.where(thinking, torch.where(is_end, close, spent_or), new)
        new = torch.where(phase == FORCE, close, new)
        self.phase.index_copy_(0, table_rows, new)
        self.budget.index_copy_(0, table_rows, budget)
