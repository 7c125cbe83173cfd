"""The prefix cache's blocks, stored and removed, as vLLM publishes them: KV-cache-aware routers
(llm-d's KV cache manager, Dynamo's ZMQ relay) subscribe to every engine and send a prompt where
its prefix's blocks are.

The wire is vLLM's: one ZeroMQ PUB message per step that changed the cache, three frames (the
topic, a sequence number as 8 big-endian bytes, and a msgpack `KVEventBatch`); the events are
tagged arrays (`["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium,
lora_name, extra_keys, group_idx]`, `["BlockRemoved", hashes, medium, group_idx]`). A block's
hash is Tandem's chained key (16 bytes of blake2b, the group of layers in a 17th byte past
group 0): a block's parent is the one before it in the same request, and a router that hashes
tokens itself reads `token_ids`.
"""

from __future__ import annotations

import contextlib
import time
from urllib.parse import urlsplit, urlunsplit

import msgspec
import zmq

from tandem.config import EngineConfig, KVEventsConfig
from tandem.scheduling.block_pool import BlockRemoved, BlockStored
from tandem.scheduling.scheduler import Scheduler


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """vLLM's base of the events (`vllm.distributed.kv_events`)."""


class BlockStoredEvent(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None


class BlockRemovedEvent(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes]
    medium: str | None
    group_idx: int | None = None


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


def endpoint_for(endpoint: str, rank: int) -> str:
    """A tcp endpoint's port offset by the data-parallel rank (vLLM's rule); others as given."""
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or rank == 0 or parts.port is None:
        return endpoint
    host = parts.netloc.rsplit(":", 1)[0]
    return urlunsplit((parts.scheme, f"{host}:{parts.port + rank}", "", "", ""))


class KVEventPublisher:
    """One engine's events, published after each step that changed its prefix cache."""

    def __init__(self, config: KVEventsConfig, block_size: int, medium: str):
        self.config = config
        self.block_size = block_size
        self.medium = medium  # "CPU" or "GPU": where the blocks live
        self.endpoint = endpoint_for(config.endpoint, config.data_parallel_rank)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, config.hwm)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(self.endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"kv_events_config: cannot bind {self.endpoint}: {exc}") from None
        self._encoder = msgspec.msgpack.Encoder()
        self._topic = config.topic.encode()
        self._sequence = 0

    def publish(self, events: list[BlockStored | BlockRemoved]) -> None:
        """The step's events as one batch; a subscriber too slow to keep up loses batches (the
        sequence numbers say how many), never the engine's time."""
        if not events:
            return
        batch = KVEventBatch(time.time(), [self._event(e) for e in events],
                             self.config.data_parallel_rank)  # fmt: skip
        frames = [self._topic, self._sequence.to_bytes(8, "big"), self._encoder.encode(batch)]
        self._sequence += 1
        with contextlib.suppress(zmq.Again):  # at the high-water mark: dropped, as vLLM's
            self._socket.send_multipart(frames, flags=zmq.NOBLOCK)

    def _event(self, event: BlockStored | BlockRemoved) -> KVCacheEvent:
        if isinstance(event, BlockRemoved):
            return BlockRemovedEvent([event.key], self.medium)
        return BlockStoredEvent(
            [event.key], event.parent, list(event.token_ids), self.block_size, event.lora_id,
            self.medium, event.lora_name, group_idx=event.group,
        )  # fmt: skip

    def close(self) -> None:
        self._socket.close()
        self._context.term()


class NoKVEvents:
    """Events not asked for: nothing is recorded (the scheduler's list stays None)."""

    def publish(self, events: list) -> None:
        pass

    def close(self) -> None:
        pass


def start_kv_events(config: EngineConfig, scheduler: Scheduler) -> KVEventPublisher | NoKVEvents:
    """A publisher of `scheduler`'s cache as `config.kv_events_config` asks, which starts the
    scheduler recording."""
    events = config.kv_events_config
    if events is None or not events.publishes:
        return NoKVEvents()
    scheduler.record_cache_events()
    medium = "GPU" if config.torch_device.type == "cuda" else "CPU"
    return KVEventPublisher(events, scheduler.block_size, medium)
