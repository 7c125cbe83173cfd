"""A pipeline stage's links to its neighbours: the stream forward, the sampled ids back.

Every rank receives every step's inputs from the engine, so a stage knows each step's shape
without being told. Stage k hands the stream it stopped at (`[2, tokens, hidden]`: the last
layer's output and the residual) to the same tensor-parallel rank of stage k + 1. Only the last
stage samples; it sends each step's ids to the first stage, whose token table the next steps
gather their inputs from, as the last stage's own table has them. The first stage takes them
only when a step reads them (`StepInputs.reads_through`), so while the last stage finishes
micro-batch N the first already computes N + 1. Sends do not wait: the receiver is usually busy
with the step before.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from tandem.models.parallel import PipelineStage

MAX_PENDING_SENDS = 4  # sends in flight before the oldest is waited for (their buffers live)


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
        self.stage = stage
        self.hidden = hidden
        self.dtype = dtype
        self.device = device
        first_rank = rank - stage.index * tp_size  # this rank's peer in each stage
        self.previous = rank - tp_size if not stage.is_first else None
        self.next = rank + tp_size if not stage.is_last else None
        self.first = first_rank if stage.is_last else None  # where the ids go
        self.last = first_rank + (stage.num_stages - 1) * tp_size if stage.is_first else None
        self._sends: deque[tuple[dist.Work, torch.Tensor]] = deque()
        # The first stage: steps whose ids are still to come, in order (step id, where they go).
        self._awaited: deque[tuple[int, torch.Tensor]] = deque()

    def receive_stream(self, num_tokens: int) -> torch.Tensor:
        """The stream of this step from the stage before (blocks until it has come)."""
        carried = torch.empty((2, num_tokens, self.hidden), dtype=self.dtype, device=self.device)
        dist.recv(carried, self.previous)
        return carried

    def hand_on(self, carried: torch.Tensor, step_id: int, sample_index: torch.Tensor) -> None:
        """Send this step's stream to the next stage; the first stage awaits its ids."""
        self._send(carried.contiguous(), self.next)
        if self.stage.is_first:
            self._awaited.append((step_id, sample_index))

    def send_ids(self, ids: torch.Tensor) -> None:
        """The last stage: this step's sampled ids to the first stage (none: nothing sent)."""
        if len(ids):
            self._send(ids.contiguous(), self.first)

    def take_ids(self, token_table: torch.Tensor, through: int) -> None:
        """The first stage: every awaited step's ids up to step `through`, into the table."""
        while self._awaited and self._awaited[0][0] <= through:
            _, index = self._awaited.popleft()
            if len(index):
                ids = torch.empty(len(index), dtype=torch.int64, device=self.device)
                dist.recv(ids, self.last)
                token_table.index_copy_(0, index, ids)

    def close(self) -> None:
        """Wait for the sends in flight (their receivers may be gone: not an error here)."""
        while self._sends:
            work, _ = self._sends.popleft()
            try:
                work.wait()
            except RuntimeError:
                break

    def _send(self, tensor: torch.Tensor, to: int) -> None:
        while len(self._sends) >= MAX_PENDING_SENDS:
            self._sends.popleft()[0].wait()
        self._sends.append((dist.isend(tensor, to), tensor))
