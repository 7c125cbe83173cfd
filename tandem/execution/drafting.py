"""Drafts made on the device, from what the device holds: no host round trip.

A verifying request's tokens in a step are its last token (at position `length - 1`, `length`
being the row's length on the device) and its drafts after it. `place_tokens` sets their
positions, KV slots, context lengths and output indices from the device's lengths;
`ngram_drafts` finds the drafts in the request's own history (prompt-lookup decoding), and
`proposed_drafts` takes them from the host's suffix-tree proposals where those still hold.
"""

from __future__ import annotations

import torch

from tandem.execution.batch import StepInputs
from tandem.sampler.inputs import VerifyRows


def place_tokens(
    t: StepInputs, v: VerifyRows[torch.Tensor], lengths: torch.Tensor, max_len: int, block_size: int
) -> None:
    """Write the verifying tokens' positions into the step's device arrays (in place), from
    `lengths` ([V]: each verifying row's length before the step)."""
    positions = lengths[v.token_item] - 1 + v.token_offset
    b = v.token_batch
    row_start = v.table_rows[v.token_item] * max_len
    t.positions.index_copy_(0, b, positions)
    t.token_index.index_copy_(0, b, row_start + positions)
    columns, offsets = (positions // block_size)[:, None], positions % block_size
    slots_by_group = [t.slot_mapping, *t.group_slot_mapping]
    tables_by_group = [t.block_tables, *t.group_block_tables]
    for slots, tables in zip(slots_by_group, tables_by_group, strict=True):  # a group's blocks
        slots.index_copy_(0, b, tables[b].gather(1, columns)[:, 0] * block_size + offsets)
    t.context_lens.index_copy_(0, b, positions + 1)
    t.sample_index.index_copy_(0, v.sample_rows, row_start + positions + 1)
    output_index = positions + 1 - v.prompt_lens[v.token_item]
    sampling = t.sampler.sampling
    sampling.output_index.index_copy_(0, v.sample_rows, output_index)
    if (g := t.sampler.grammar) is not None:  # the free and the grammar rows have own copies
        g.free_sampling.output_index.copy_(sampling.output_index[g.free_rows])
        g.sampling.output_index.copy_(sampling.output_index[g.rows])


def ngram_drafts(
    token_table: torch.Tensor,
    v: VerifyRows[torch.Tensor],
    lengths: torch.Tensor,
    max_len: int,
) -> torch.Tensor:
    """[V, max_drafts] drafts: the tokens that followed the latest earlier occurrence of the
    row's last n tokens, for the longest n in `v.lookup` that occurs, continued periodically
    past the row's end (a repeating pattern repeats). A row with no occurrence repeats its last
    token (a guess that costs what any rejected draft costs).

    Every n at once, in a fixed number of ops (each one a round trip for the CPU stream's
    thread): for each end position, how many of the last tokens match backwards from it."""
    longest, shortest = v.lookup
    span, device = v.history_len, token_table.device
    columns = torch.arange(span, device=device)
    back = torch.arange(longest, device=device)
    history = token_table[(v.table_rows * max_len)[:, None] + columns[None, :]]  # [V, span]
    before = columns[:, None] - back[None, :]  # [span, n]: position i tokens before each end
    windows = history[:, before.clamp(min=0)]  # [V, span, n]
    suffix_at = lengths[:, None] - 1 - back[None, :]  # [V, n]
    suffix = history.gather(1, suffix_at.clamp(min=0))
    same = (windows == suffix[:, None, :]) & (before >= 0) & (suffix_at >= 0)[:, None, :]
    run = same.to(torch.int64).cumprod(dim=2).sum(dim=2)  # [V, span]: match length at each end
    earlier = columns[None, :] <= lengths[:, None] - 2  # not the suffix itself
    score = torch.where(earlier & (run >= shortest), run * span + columns[None, :], -1)
    best = score.amax(dim=1)  # the longest match, then the latest
    latest = torch.where(best >= 0, best % span, lengths - 2)
    period = lengths - 1 - latest
    steps = torch.arange(v.max_drafts, device=device)
    return history.gather(1, latest[:, None] + 1 + steps[None, :] % period[:, None])


def proposed_drafts(
    token_table: torch.Tensor,
    v: VerifyRows[torch.Tensor],
    lengths: torch.Tensor,
    max_len: int,
) -> torch.Tensor:
    """[V, max_drafts] drafts from the host's proposals (suffix decoding), each row's read past
    its length on the device: where the tokens the row holds from the proposal's start on are
    the proposal's first ones (the step in flight when it was made kept what it expected), and
    the proposal reaches every draft. Elsewhere the row's n-gram drafts."""
    proposals, start, known = v.proposals, v.proposal_start, v.proposal_len
    width = proposals.shape[1]
    offset = lengths - start  # tokens the device has past the host's
    columns = torch.arange(width, device=token_table.device)
    positions = (start[:, None] + columns[None, :]).clamp(max=max_len - 1)
    held = token_table[(v.table_rows * max_len)[:, None] + positions]
    agree = (held == proposals) | (columns[None, :] >= offset[:, None])
    usable = agree.all(dim=1) & (offset >= 0) & (offset + v.num_drafts <= known)
    steps = torch.arange(v.max_drafts, device=token_table.device)
    taken = proposals.gather(1, (offset[:, None] + steps[None, :]).clamp(0, width - 1))
    return torch.where(usable[:, None], taken, ngram_drafts(token_table, v, lengths, max_len))
