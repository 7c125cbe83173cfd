"""SPMD under a launcher (`distributed_executor_backend="external_launcher"`, vLLM's name): two
torchrun agents, as on two machines (`--nnodes 2`, c10d rendezvous), each start one rank, and
each rank runs a whole engine over its shard. The ranks agree on the KV cache and generate the
same tokens, which are those of the engine's own two spawned ranks (the same shards, the same
sums) and, greedy, transformers' (up to near ties)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from spmd_ranks import GREEDY, PROMPTS, SEEDED

from tandem.config import EngineConfig
from tandem.execution.launcher import join_launcher_group
from tests.shared_tp import ranks_from_a_fork_server  # noqa: F401

from conftest import hf_greedy_reference_allowing_near_ties
from helpers import make_llm

ROOT = Path(__file__).resolve().parents[1]


def test_two_torchrun_agents_agree(tiny_llama: Path, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    agents = [
        subprocess.Popen(
            [
                *torchrun,
                "--node-rank",
                str(node),
                str(ROOT / "tests" / "spmd_ranks.py"),
                str(tiny_llama),
                str(tmp_path / "out"),
            ],
            env=env,
            stdout=(tmp_path / f"node{node}.log").open("w"),
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        for node in range(2)
    ]
    try:
        codes = [agent.wait(300) for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    logs = "\n".join((tmp_path / f"node{n}.log").read_text()[-3000:] for n in range(2))
    assert codes == [0, 0], logs
    ranks = [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == {**ranks[1], "rank": 0}  # the same blocks, the same tokens

    llm = make_llm(tiny_llama, tensor_parallel_size=2, cpu_threads=1)
    try:
        spawned = {
            name: [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
            for name, params in (("greedy", GREEDY), ("seeded", SEEDED))
        }
    finally:
        llm.close()
    for loop in ("sync", "async"):
        for name in ("greedy", "seeded"):
            assert ranks[0][f"{loop}-{name}"] == spawned[name], (loop, name)
    for prompt, tokens in zip(PROMPTS, ranks[0]["async-greedy"], strict=True):
        assert tokens == hf_greedy_reference_allowing_near_ties(tiny_llama, prompt, tokens)


def test_the_launchers_settings_are_checked(monkeypatch) -> None:
    config = EngineConfig(tensor_parallel_size=2, distributed_executor_backend="external_launcher")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="missing: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        join_launcher_group(config, Path("model"))
    env = {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="started 4 ranks .* tensor_parallel_size is 2"):
        join_launcher_group(config, Path("model"))
    with pytest.raises(ValueError, match="distributed_executor_backend must be"):
        EngineConfig(distributed_executor_backend="ray")
    with pytest.raises(ValueError, match='needs "adaptive": false'):
        EngineConfig(
            distributed_executor_backend="external_launcher", speculative_config={"method": "ngram"}
        )
