"""The LoRA adapters an engine holds: read and checked in the caller's thread (never on the
loop), kept on the host by name, and handed to the step that first runs each one in a slot
(`scheduling/lora_slots.py` picks the slot; the runner copies the weights in)."""

from __future__ import annotations

import threading
from collections.abc import Mapping

from tandem.config import EngineConfig
from tandem.lora import LoraError, LoraNotFound, LoRARequest
from tandem.models.lora import AdapterWeights, read_adapter
from tandem.models.spec import LlamaSpec
from tandem.request import Request
from tandem.scheduling.lora_slots import LoraSlots
from tandem.scheduling.scheduler import Scheduler


class Adapters:
    """By name, the adapters requests may name; thread-safe (a server loads and unloads them
    while the loop runs)."""

    def __init__(
        self,
        config: EngineConfig,
        spec: LlamaSpec,
        scheduler: Scheduler,
        live: Mapping[str, list[Request]],
    ):
        """`live`: the engine's unfinished requests, each one's samples (read on the loop)."""
        self._live = live
        self.enabled = config.enable_lora
        self.max_rank = config.max_lora_rank
        self._spec = spec
        self._scheduler = scheduler
        self._lock = threading.Lock()
        self._by_name: dict[str, AdapterWeights] = {}
        self._by_key: dict[str, AdapterWeights] = {}  # removed ones too, while requests use them
        self._removed: set[str] = set()  # keys of removed adapters the loop has to let go
        if self.enabled:
            scheduler.lora_slots = LoraSlots(config.max_loras)

    def add(self, request: LoRARequest) -> AdapterWeights:
        """Load the adapter (the same one again: nothing to do); LoraError names a bad one."""
        if not self.enabled:
            raise LoraError(
                f"LoRA adapter {request.lora_name!r}: LoRA is off (start the engine with "
                "enable_lora=True, or tandem serve --enable-lora)"
            )
        with self._lock:
            held = self._held(request)
        if held is not None:
            return held
        weights = read_adapter(request, self._spec, self.max_rank)  # outside the lock: disk
        with self._lock:
            held = self._held(request)  # another thread may have loaded it meanwhile
            if held is not None:
                return held
            self._by_name[request.lora_name] = weights
            self._by_key[weights.cache_key] = weights
        return weights

    def _held(self, request: LoRARequest) -> AdapterWeights | None:
        """Under the lock: the adapter if this very one is loaded; LoraError if its name or
        number is another's."""
        held = self._by_name.get(request.lora_name)
        if held is not None:
            if held.request == request:
                return held
            raise LoraError(f"a LoRA adapter named {request.lora_name!r} is loaded already, "
                            f"from {held.request.lora_path}")  # fmt: skip
        for other in self._by_name.values():
            if other.request.lora_int_id == request.lora_int_id:
                raise LoraError(f"LoRA adapter {request.lora_name!r}: lora_int_id "
                                f"{request.lora_int_id} is {other.request.lora_name!r}'s")  # fmt: skip
        return None

    def remove(self, name: str) -> None:
        """Unload: requests may no longer name it; those queued or running keep it to their end."""
        with self._lock:
            weights = self._by_name.pop(name, None)
            if weights is None:
                raise LoraNotFound(f"no LoRA adapter named {name!r} is loaded")
            self._removed.add(weights.cache_key)

    def get(self, name: str) -> LoRARequest | None:
        with self._lock:
            held = self._by_name.get(name)
            return held.request if held is not None else None

    def list(self) -> list[LoRARequest]:
        with self._lock:
            return [w.request for w in self._by_name.values()]

    def step_loads(self) -> list[tuple[int, AdapterWeights]]:
        """Loop thread: the adapters the step being built copies into slots; and the slots of
        removed adapters that nothing uses any more, given up."""
        slots = self._scheduler.lora_slots
        loads = [(slot, self._by_key[key]) for slot, key in slots.take_loads()]
        if self._removed:
            used = {r.lora_key for samples in self._live.values() for r in samples}
            with self._lock:
                done = self._removed - used  # the others: again at a later step
                self._removed -= done
            for key in done:
                slots.forget(key)
                self._by_key.pop(key, None)
        return loads
