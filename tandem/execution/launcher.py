"""vLLM's `external_launcher`: a launcher (torchrun, a Kubernetes LeaderWorkerSet, Slurm's srun)
starts every rank, and each runs a whole engine, SPMD: the same requests, scheduled alike
(the scheduler is a pure function of them), every rank computing its shard of each step and
sampling the same ids from the gathered logits. Nothing is sent between engines but the
model's own collectives, so ranks may sit on any number of machines.

What could make the ranks' schedules part is kept equal: the KV cache is the smallest any rank
holds, and the compute threads are fixed (a timed choice could differ by rank, and a timing
run that repeats until its figures settle would issue a different number of collectives).
"""

from __future__ import annotations

import os
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tandem.config import EngineConfig, usable_cores
from tandem.execution.rendezvous import meet, rendezvous_timeout_s, settings_of
from tandem.models.parallel import TensorParallel

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def join_launcher_group(
    config: EngineConfig, model_path: Path
) -> tuple[TensorParallel, EngineConfig]:
    """This process's rank in the launcher's group (joined once, `rendezvous.meet`: every rank
    within a timeout, with the same settings), and the config every rank runs with; ValueError
    names what the launcher did not set or what does not match."""
    missing = [name for name in LAUNCHER_ENV if name not in os.environ]
    if missing:
        raise ValueError(
            "distributed_executor_backend='external_launcher' runs under a launcher that sets "
            f"{', '.join(LAUNCHER_ENV)} (torchrun does); missing: {', '.join(missing)}"
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != config.tensor_parallel_size:
        raise ValueError(
            f"the launcher started {world} ranks (WORLD_SIZE) but tensor_parallel_size is "
            f"{config.tensor_parallel_size}: every rank holds one shard, so they must be equal"
        )
    cuda = config.torch_device.type == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    if not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = meet(rank, world, backend, settings_of(config, model_path), addr, port)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=rendezvous_timeout_s()))  # fmt: skip
    if not cuda and config.cpu_threads is None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        config = replace(config, cpu_threads=max(1, usable_cores() // local))
    return TensorParallel(rank, world), config


def agree_on_blocks(num_blocks: int, device: torch.device) -> int:
    """The fewest KV blocks any rank holds: every rank's scheduler must have the same pool."""
    count = torch.tensor([num_blocks], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    return int(count.item())  # once, at start-up
