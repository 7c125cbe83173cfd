"""The prefix cache's events in vLLM's wire format (`kv_events_config`), read as a router reads
them: a ZeroMQ SUB socket and msgspec structs as vLLM's own subscriber example declares them.
Every full block a request computes is stored once, chained to its parent, with its tokens;
the blocks evicted for later requests are removed, by the same hashes."""

from __future__ import annotations

import socket
import time
from typing import Any

import msgspec
import pytest
import zmq

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig, KVEventsConfig
from tandem.engine.kv_events import endpoint_for
from tandem.server.serve import replica_options

BLOCK = 16


# The subscriber's side, as vLLM's example (examples/online_serving/kv_events_subscriber.py)
# declares it: tagged array structs.
class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[Any]
    parent_block_hash: Any | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Any]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_blocks_stored_chained_with_their_tokens_then_removed_when_evicted(tiny_llama) -> None:
    port = free_port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}", "topic": "kv"}
    llm = LLM(str(tiny_llama), cpu_threads=1, num_kv_blocks=12, max_model_len=256,
              block_size=BLOCK, kv_events_config=config)  # fmt: skip
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    time.sleep(0.5)  # a SUB socket receives what is published after it has joined
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    try:
        params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
        first = llm.generate([list(range(100, 140))], params)[0]
        events, sequence = receive(sub, decoder)
        stored = [e for e in events if isinstance(e, BlockStored)]
        tokens = first.prompt_token_ids + first.outputs[0].token_ids  # 70: four full blocks
        assert [e.token_ids for e in stored] == [
            tokens[j * BLOCK : (j + 1) * BLOCK] for j in range(4)
        ]
        hashes = [e.block_hashes[0] for e in stored]
        assert len(set(hashes)) == 4 and all(isinstance(h, bytes) for h in hashes)
        assert [e.parent_block_hash for e in stored] == [None, *hashes[:3]]
        assert {(e.block_size, e.medium, e.lora_id, e.group_idx) for e in stored} == {
            (BLOCK, "CPU", None, 0)
        }
        # Two more requests of 5 blocks each in a pool of 12: the first one's blocks go.
        llm.generate([list(range(300 + 50 * i, 340 + 50 * i)) for i in range(2)], params)
        later, more = receive(sub, decoder)
        removed = [h for e in later if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert removed and set(removed) <= set(hashes)
        assert sequence == list(range(len(sequence)))  # one batch per step that changed it
        assert more[0] == sequence[-1] + 1
    finally:
        sub.close()
        context.term()
        llm.close()


def receive(sub: zmq.Socket, decoder) -> tuple[list, list[int]]:
    """Every batch published so far: their events in order, and their sequence numbers."""
    events, sequence = [], []
    while sub.poll(1000):
        topic, number, payload = sub.recv_multipart()
        assert topic == b"kv"
        sequence.append(int.from_bytes(number, "big"))
        batch = decoder.decode(payload)
        assert batch.data_parallel_rank == 0 and batch.ts > 0
        events.extend(batch.events)
    return events, sequence


def test_each_data_parallel_core_publishes_on_its_own_port() -> None:
    assert endpoint_for("tcp://*:5557", 0) == "tcp://*:5557"
    assert endpoint_for("tcp://*:5557", 2) == "tcp://*:5559"
    assert endpoint_for("ipc:///tmp/kv", 1) == "ipc:///tmp/kv"
    config = EngineConfig(device="cpu", kv_events_config={"enable_kv_cache_events": True})
    replicas = replica_options(config, 2)
    assert [r.config.kv_events_config.data_parallel_rank for r in replicas] == [0, 1]


def test_bad_event_settings_are_refused(tiny_llama) -> None:
    with pytest.raises(ValueError, match="unknown or unsupported fields: replay_endpoint"):
        EngineConfig(kv_events_config={"enable_kv_cache_events": True, "replay_endpoint": "x"})
    with pytest.raises(ValueError, match="publisher must be 'zmq' or 'null'"):
        KVEventsConfig(enable_kv_cache_events=True, publisher="kafka")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(ValueError, match=f"kv_events_config: cannot bind {endpoint}"):
            LLM(str(tiny_llama), cpu_threads=1, num_kv_blocks=16,
                kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoint})  # fmt: skip
