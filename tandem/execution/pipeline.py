"""A pipeline stage's links to its neighbours: the stream forward, the sampled ids back.

Every rank receives every step's inputs from the engine, so a stage knows each step's shape
without being told. Stage k hands the stream it stopped at (`[2, tokens, hidden]`: the last
layer's output and the residual) to the same tensor-parallel rank of stage k + 1. Only the last
stage samples; it sends each step's ids to the stages before it: the first stage's token table
is where the next steps gather their inputs, as the last stage's own table is. A verification's
kept counts follow its ids, so every stage's row lengths advance as the last stage's do and
every stage places the next verification's tokens alike (and drafts alike from its table). A
stage takes them only when a step reads them (`StepInputs.reads_through`), so while the last
stage finishes micro-batch N the first already computes N + 1. Sends do not wait: the receiver
is usually busy with the step before, and a stage's last ids are never taken.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from tandem.models.parallel import PipelineStage


class StageLinks:
    def __init__(
        self,
        stage: PipelineStage,
        rank: int,
        tp_size: int,
        hidden: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.hidden = hidden
        self.dtype = dtype
        self.device = device
        first_rank = rank - stage.index * tp_size  # this rank's peer in each stage
        self.previous = rank - tp_size if not stage.is_first else None
        self.next = rank + tp_size if not stage.is_last else None
        self.last = first_rank + (stage.num_stages - 1) * tp_size
        # The last stage: where the ids go (this rank's peers in the stages before).
        earlier = range(first_rank, rank, tp_size) if stage.is_last else range(0)
        self.earlier = list(earlier)
        self._sends: deque[tuple[dist.Work, torch.Tensor]] = deque()
        # A stage before the last: steps whose ids are still to come, in order (step id, where
        # they go, and a verification's rows, whose lengths advance by the kept counts after).
        self._awaited: deque[tuple[int, torch.Tensor, torch.Tensor | None]] = deque()

    def receive_stream(self, num_tokens: int) -> torch.Tensor:
        """The stream of this step from the stage before (blocks until it has come)."""
        carried = torch.empty((2, num_tokens, self.hidden), dtype=self.dtype, device=self.device)
        dist.recv(carried, self.previous)
        return carried

    def hand_on(
        self,
        carried: torch.Tensor,
        step_id: int,
        sample_index: torch.Tensor,
        verify_rows: torch.Tensor | None,
    ) -> None:
        """Send this step's stream to the next stage, and await its ids (where its tokens were
        placed: a verification's places are computed on the device)."""
        self._send(carried.contiguous(), self.next)
        self._awaited.append((step_id, sample_index, verify_rows))

    def send_ids(self, ids: torch.Tensor) -> None:
        """The last stage: this step's sampled ids (and a verification's kept counts) to the
        stages before (none: nothing sent)."""
        if len(ids):
            ids = ids.contiguous()
            for rank in self.earlier:
                self._send(ids, rank)

    def take_ids(self, token_table: torch.Tensor, lengths: torch.Tensor, through: int) -> None:
        """Every awaited step's ids up to step `through` into the table, and a verification's
        kept counts into its rows' lengths, as the last stage stored them."""
        while self._awaited and self._awaited[0][0] <= through:
            _, index, rows = self._awaited.popleft()
            kept = 0 if rows is None else len(rows)
            if len(index) + kept:
                ids = torch.empty(len(index) + kept, dtype=torch.int64, device=self.device)
                dist.recv(ids, self.last)
                token_table.index_copy_(0, index, ids[: len(index)])
                if rows is not None:
                    lengths.index_add_(0, rows, ids[len(index) :])

    def _send(self, tensor: torch.Tensor, to: int) -> None:
        """Send without waiting: a send completes once its receiver has posted the receive,
        and a stage takes a step's ids only when a later step reads them, so a sender that
        waited for it could wait on a stage that waits on the sender. The tensor is kept until
        its send completes."""
        self._sends = deque(pair for pair in self._sends if not pair[0].is_completed())
        self._sends.append((dist.isend(tensor, to), tensor))
