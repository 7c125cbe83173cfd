"""Tensor parallelism on CPU: gloo, two worker processes, tiny models.

Greedy outputs at two ranks equal transformers' and one rank's, for every architecture, through
both loops; seeded sampling is identical; logits stay within a bound of one rank's (a shard sums
its half of each row-parallel product before the all-reduce adds the halves). Chunked prefill,
preemption and aborts keep async equal to sync. A worker that dies or raises fails the engine
within seconds, names the rank and leaves no process; the real server streams at two ranks and,
when a rank is killed, answers everyone and exits 1.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest
import torch
from test_server import (
    metric_samples,
    processes,
    processes_in_group,
    sse_events,
    wait_for_health,
    wait_until,
)
from test_server_processes import process_name

from tandem import SamplingParams
from tandem.execution.executor import WorkerFailure
from tandem.models.default_model import build_checkpoint
from tandem.models.loader import SUPPORTED_ARCHITECTURES, build_model, read_config
from tandem.models.parallel import SINGLE, Shard, TensorParallel, check_shardable
from tests.shared_tp import ranks_from_a_fork_server  # noqa: F401

from conftest import hf_greedy_reference_allowing_near_ties, random_prompts
from helpers import assert_idle_and_balanced, greedy, make_llm

TP2 = {"tensor_parallel_size": 2, "cpu_threads": 1}


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.fixture(scope="module")
def mqa_odd_vocab(tmp_path_factory) -> Path:
    """One KV head (replicated on both ranks) and a vocabulary that two ranks split unevenly."""
    return build_checkpoint(
        tmp_path_factory.mktemp("mqa"), num_attention_heads=4, num_key_value_heads=1,
        vocab_size=1027, seed=3,
    )  # fmt: skip


# ------------------------------------------------------------------- sharding
def test_unshardable_models_are_refused_naming_the_numbers(tiny_llama):
    _, spec, _ = read_config(tiny_llama)  # 4 heads, 2 KV heads, intermediate 128
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide .*4 attention"):
        make_llm(tiny_llama, tensor_parallel_size=3)  # refused before any process starts
    with pytest.raises(ValueError, match=r"3 KV heads \(neither a multiple nor a divisor of 2\)"):
        check_shardable(replace(spec, num_heads=6, num_kv_heads=3), 2)
    with pytest.raises(ValueError, match="intermediate size 130"):
        check_shardable(replace(spec, intermediate_size=130), 4)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        make_llm(tiny_llama, tensor_parallel_size=0)


def test_shards_partition_heads_mlp_and_vocabulary(tiny_llama):
    _, spec, _ = read_config(tiny_llama)
    spec = replace(spec, num_heads=8, num_kv_heads=2, intermediate_size=64, vocab_size=1027)
    shards = [Shard(spec, TensorParallel(rank, 4)) for rank in range(4)]
    assert [s.q_heads for s in shards] == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    # 2 KV heads on 4 ranks: each is replicated on the two ranks whose query heads read it.
    group = spec.num_heads // spec.num_kv_heads
    for s in shards:
        assert s.kv_heads.stop - s.kv_heads.start == 1
        assert {h // group for h in range(s.q_heads.start, s.q_heads.stop)} == {s.kv_heads.start}
    assert [s.intermediate.start for s in shards] == [0, 16, 32, 48]
    covered = [i for s in shards for i in range(s.vocab.start, s.vocab.stop)]
    assert covered == list(range(1027)) and {s.vocab_per_rank for s in shards} == {257}
    even = [Shard(spec, TensorParallel(rank, 2)) for rank in range(2)]
    assert [s.kv_heads for s in even] == [slice(0, 1), slice(1, 2)]


def test_each_rank_loads_only_its_slices(mqa_odd_vocab):
    """In process (loading needs no process group): the two shards put together are the model,
    the replicated KV head is on both, and neither rank holds the whole model."""
    path, spec, hf_config = read_config(mqa_odd_vocab)

    def build(tp: TensorParallel):
        return build_model(path, spec, hf_config, torch.float32, torch.device("cpu"), None, tp)

    full = build(SINGLE)
    ranks = [build(TensorParallel(rank, 2)) for rank in range(2)]
    size = sum(p.numel() for p in full.parameters())
    assert all(sum(p.numel() for p in r.parameters()) < 0.75 * size for r in ranks)
    embed = torch.cat([r.embed.weight for r in ranks])
    assert torch.equal(embed[:1027], full.embed.weight) and not embed[1027:].any()
    head = torch.cat([r.lm_head.weight for r in ranks])
    assert torch.equal(head[:1027], full.lm_head.weight)
    layer, halves = full.layers[1], [r.layers[1] for r in ranks]
    q = spec.num_heads * spec.head_dim
    kv = spec.head_dim  # one KV head: replicated
    for h in halves:
        assert torch.equal(h.attn.qkv.weight[q // 2 :], layer.attn.qkv.weight[q:])
    assert torch.equal(torch.cat([h.attn.qkv.weight[: q // 2] for h in halves]),
                       layer.attn.qkv.weight[:q])  # fmt: skip
    assert halves[0].attn.qkv.weight.shape[0] == q // 2 + 2 * kv
    assert torch.equal(torch.cat([h.attn.o.weight for h in halves], 1), layer.attn.o.weight)
    assert torch.equal(torch.cat([h.mlp.down.weight for h in halves], 1), layer.mlp.down.weight)
    inter = spec.intermediate_size
    gate = torch.cat([h.mlp.gate_up.weight[: inter // 2] for h in halves])
    up = torch.cat([h.mlp.gate_up.weight[inter // 2 :] for h in halves])
    assert torch.equal(torch.cat([gate, up]), layer.mlp.gate_up.weight)


# ---------------------------------------------------------------- equivalence
@pytest.mark.parametrize("architecture", SUPPORTED_ARCHITECTURES)
def test_greedy_equals_transformers_in_both_loops(tiny_checkpoints, architecture):
    path = tiny_checkpoints[architecture]
    prompts = random_prompts(random.Random(11), 5, 1024, 3, 40)
    llm = make_llm(path, num_kv_blocks=128, max_model_len=512, **TP2)
    try:
        outputs = {}
        for mode in (False, True):
            llm.engine.configure(async_scheduling=mode)
            outputs[mode] = [o.token_ids for o in llm.generate(prompts, greedy(12))]
            assert_idle_and_balanced(llm.engine)
        assert outputs[True] == outputs[False]
        for prompt, tokens in zip(prompts, outputs[True], strict=True):
            assert tokens == hf_greedy_reference_allowing_near_ties(path, prompt, tokens, 12)
        # ngram drafts on every rank, from each rank's own token table: the same tokens.
        ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                 "adaptive": False}  # fmt: skip
        for mode in (False, True):
            llm.engine.configure(async_scheduling=mode, speculative_config=ngram)
            assert [o.token_ids for o in llm.generate(prompts, greedy(12))] == outputs[True]
            assert_idle_and_balanced(llm.engine)
        assert llm.engine.stats().speculative.drafted_tokens
    finally:
        llm.close()


def test_sliding_window_groups_on_two_ranks(sliding_qwen3):
    """Layers with windows beside full ones (several block tables): each rank's tables and
    dropped blocks follow the one scheduler."""
    prompts = random_prompts(random.Random(12), 4, 1024, 3, 40)
    llm = make_llm(sliding_qwen3, block_size=4, num_kv_blocks=160, max_model_len=512, **TP2)
    try:
        assert llm.engine.scheduler.groups.num_groups == 4
        for mode in (False, True):
            llm.engine.configure(async_scheduling=mode)
            for prompt, out in zip(prompts, llm.generate(prompts, greedy(16)), strict=True):
                reference = hf_greedy_reference_allowing_near_ties(
                    sliding_qwen3, prompt, out.token_ids, 16
                )
                assert out.token_ids == reference
            assert_idle_and_balanced(llm.engine)
    finally:
        llm.close()


def test_row_parallel_bias_is_added_once(llama_with_biases):
    """o_proj's bias (Llama with attention_bias) is added after the all-reduce, not per rank."""
    prompts = random_prompts(random.Random(4), 4, 1024, 3, 30)
    llm = make_llm(llama_with_biases, num_kv_blocks=64, **TP2)
    try:
        outs = llm.generate(prompts, greedy(10))
    finally:
        llm.close()
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf_greedy_reference_allowing_near_ties(llama_with_biases, prompt, out.token_ids, 10)
        assert out.token_ids == ref


def test_two_ranks_match_one_logits_and_seeded_sampling(mqa_odd_vocab):
    """Replicated KV head, padded vocabulary shard: tokens equal, logprobs within 1e-4."""
    prompts = random_prompts(random.Random(5), 6, 1024, 2, 60)
    plans = [greedy(10, logprobs=5)] * 3 + [
        SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=i, ignore_eos=True)
        for i in range(2)
    ]
    plans.append(  # penalties and n > 1 (their counts live on every rank)
        SamplingParams(
            max_tokens=10, temperature=0.8, seed=9, n=2, presence_penalty=0.5,
            repetition_penalty=1.3, logit_bias={7: 5.0}, min_tokens=3, ignore_eos=True,
        )
    )  # fmt: skip
    results = {}
    for size in (1, 2):
        llm = make_llm(mqa_odd_vocab, num_kv_blocks=128, tensor_parallel_size=size, cpu_threads=1)
        try:
            results[size] = llm.generate(prompts, plans)
        finally:
            llm.close()
    worst = 0.0
    for one, two in zip(results[1], results[2], strict=True):
        assert [o.token_ids for o in one.outputs] == [o.token_ids for o in two.outputs]
        for a, b in zip(one.logprobs or [], two.logprobs or [], strict=True):
            assert a.keys() == b.keys()  # the same top-5 ids
            worst = max(worst, *(abs(a[t].logprob - b[t].logprob) for t in a))
    assert worst < 1e-4, worst


def test_async_equals_sync_with_chunks_preemption_and_aborts(tiny_llama):
    llm = make_llm(
        tiny_llama, num_kv_blocks=20, block_size=8, max_num_seqs=4, max_num_batched_tokens=24,
        **TP2,
    )  # fmt: skip
    engine = llm.engine
    prompts = random_prompts(random.Random(8), 8, 1024, 10, 50)
    finals = {}
    try:
        for mode in (False, True):
            engine.configure(async_scheduling=mode)
            preemptions = engine.scheduler.num_preemptions
            ids = [engine.add_request(p, greedy(16)) for p in prompts]
            to_abort = {3: ids[0], 5: ids[6], 9: ids[2]}
            final, step = {}, 0
            while engine.has_unfinished():
                if step in to_abort:
                    engine.abort(to_abort[step])
                for out in engine.step():
                    if out.finished:
                        final[ids.index(out.request_id)] = out
                step += 1
            assert engine.scheduler.num_preemptions > preemptions
            assert_idle_and_balanced(engine)
            finals[mode] = final
        aborted = {0, 6, 2}
        for i, prompt in enumerate(prompts):
            for mode in (False, True):
                out = finals[mode][i]
                ref = hf_greedy_reference_allowing_near_ties(tiny_llama, prompt, out.token_ids)
                assert out.token_ids == ref
                assert (out.finish_reason == "abort") == (i in aborted and len(ref) < 16)
            if i not in aborted:
                assert finals[True][i].token_ids == finals[False][i].token_ids
    finally:
        llm.close()


# --------------------------------------------------------------------- faults
def test_killed_worker_fails_fast_and_names_the_rank(tiny_llama):
    llm = make_llm(tiny_llama, num_kv_blocks=256, **TP2)
    engine = llm.engine
    pids = [p.pid for p in engine.runner._procs.values()]
    for i in range(6):
        engine.add_request([10 + i, 11, 12], greedy(400))
    for _ in range(4):
        engine.step()
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match=r"rank 1 died \(killed by signal 9\)"):
        while engine.has_unfinished():
            engine.step()
    assert time.monotonic() - start < 10
    with pytest.raises(WorkerFailure, match="rank 1 died"):  # and stays failed
        engine.runner.launch(None)
    assert not any(_alive(pid) for pid in pids)
    llm.close()  # after the failure: stops quietly


def test_a_hung_rank_fails_the_engine_on_its_missing_heartbeat(tiny_llama, monkeypatch):
    """A rank that stops (alive, silent: SIGSTOP) fails the engine within seconds, named, and
    no process stays; stopped the moment the engine has started, before its heartbeat thread
    may have run (its first beat comes before it says it is ready)."""
    monkeypatch.setenv("TANDEM_HEARTBEAT_TIMEOUT", "2")
    llm = make_llm(tiny_llama, num_kv_blocks=256, **TP2)
    engine = llm.engine
    pids = [p.pid for p in engine.runner._procs.values()]
    os.kill(pids[1], signal.SIGSTOP)
    for i in range(4):
        engine.add_request([10 + i, 11, 12], greedy(400))
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match=r"rank 1 died \(no heartbeat for 2 s: hung\)"):
        while engine.has_unfinished():
            engine.step()
    assert time.monotonic() - start < 10
    wait_until(lambda: not any(_alive(pid) for pid in pids), 10, "the ranks to be gone")
    llm.close()


def test_idle_engine_learns_of_a_dead_rank(tiny_llama):
    """No step in flight: the engine loop's wait for work raises as soon as a rank dies."""
    llm = make_llm(tiny_llama, num_kv_blocks=64, **TP2)
    engine = llm.engine
    assert llm.generate([[5, 6, 7]], greedy(3))[0].token_ids  # it works, then idles
    os.kill(engine.runner._procs[0].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match=r"rank 0 died \(killed by signal 9\)"):
        while time.monotonic() - start < 30:  # as the server's loop thread calls it
            engine.wait_for_work(timeout=30)
    assert time.monotonic() - start < 5
    llm.close()
    assert not any(_alive(p.pid) for p in engine.runner._procs.values())


def test_worker_that_raises_at_start_is_named(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_llama.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.0.mlp.down_proj.weight"]
    save_file(tensors, broken / "model.safetensors")
    before = _children()
    with pytest.raises(WorkerFailure, match=r"rank 0 raised ModelLoadError: weights missing"):
        make_llm(broken, **TP2)
    wait_until(lambda: _children() <= before, 10, "workers to exit")


def _children() -> set[int]:
    """Live (non-zombie) ranks of this process: its spawned children (not multiprocessing's
    resource tracker, which the first spawn starts for good) and its fork server's children."""
    me = os.getpid()
    children = processes(lambda f: int(f[1]) == me and f[0] != "Z")
    servers = {str(pid) for pid in children if b"multiprocessing.forkserver" in _cmdline(pid)}
    forked = processes(lambda f: f[1] in servers and f[0] != "Z")
    return {pid for pid in children if b"spawn_main" in _cmdline(pid)} | set(forked)


# --------------------------------------------------------------------- server
def test_server_streams_at_two_ranks_and_exits_1_when_a_rank_dies(tiny_llama):
    """The real `tandem serve --tensor-parallel-size 2`: streamed completions through the
    openai client equal one rank's offline output; then a killed rank ends the running stream
    with an error naming it, a new request gets 503, the server exits 1 and no process stays."""
    prompts = ["Hello world", "The quick brown fox", "Once upon a time"]
    offline = make_llm(tiny_llama, num_kv_blocks=256, max_model_len=1024)
    refs = [o.text for o in offline.generate(prompts, greedy(12))]
    offline.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [
        sys.executable, "-m", "tandem", "serve", "--model", str(tiny_llama), "--port", str(port),
        "--tensor-parallel-size", "2", "--cpu-threads", "1", "--num-kv-blocks", "256",
        "--max-model-len", "1024", "--max-num-seqs", "1",
    ]  # fmt: skip
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(proc, url, 120)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        for prompt, ref in zip(prompts, refs, strict=True):
            stream = client.completions.create(
                model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            chunks = list(stream)
            assert "".join(c.choices[0].text for c in chunks if c.choices) == ref
            assert chunks[-1].choices[0].finish_reason == "length"

        group = processes_in_group(proc.pid)
        # The engine core (the server's child, forked) and its two ranks (the core's children,
        # spawned), beside multiprocessing's resource tracker.
        [core] = [pid for pid in group if process_name(pid) == "tandem-core-0"]
        assert _parent(core) == proc.pid
        workers = sorted(pid for pid in group if b"spawn_main" in _cmdline(pid))
        assert len(workers) == 2 and all(_parent(pid) == core for pid in workers)
        body = {"model": model, "prompt": "long", "max_tokens": 900, "ignore_eos": True}
        with (
            httpx.Client(timeout=30) as http,
            ThreadPoolExecutor(1) as pool,
            http.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r,
        ):
            events = sse_events(r.iter_lines())
            next(events)  # it is running, and holds the one running slot
            queued = pool.submit(http.post, f"{url}/v1/completions", json=body)
            waiting = ("tandem_requests_waiting", (("engine", "0"),))
            wait_until(lambda: metric_samples(url)[waiting] == 1, 10, "a queued request")
            os.kill(max(workers), signal.SIGKILL)  # rank 1: spawned after rank 0
            rest = list(events)
            answer = queued.result(30)
        assert rest[-1] == "[DONE]"
        assert "rank 1 died (killed by signal 9)" in rest[-2]["error"]["message"]
        assert answer.status_code == 503
        assert "rank 1 died" in answer.json()["error"]["message"]
        assert proc.wait(60) == 1
        # multiprocessing's resource tracker leaves once it reads EOF from the server's end
        wait_until(
            lambda: processes_in_group(proc.pid) == [], 10, "every process of the server to exit"
        )
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_rendezvous_uses_master_addr_and_port_when_given(monkeypatch):
    from tandem.execution.executor import _rendezvous

    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "29555")
    assert _rendezvous() == "tcp://10.1.2.3:29555"
    monkeypatch.delenv("MASTER_ADDR")
    monkeypatch.delenv("MASTER_PORT")
    assert _rendezvous().startswith("tcp://127.0.0.1:")
