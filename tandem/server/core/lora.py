"""LoRA adapters in the engine core, which owns them: the `--lora-modules` of the command line,
loaded before the core says `Ready`, and vLLM's runtime loads and unloads, answered between
steps.

A load reads and checks the PEFT files (`Engine.adapters.add`) on a thread of its own, never on
the loop: the loop goes on stepping, and sends the answer once the thread is done (the loop
looks after every step, and every `LOAD_POLL_MS` while idle). An unload, a list and a request's
adapter (`resolve`) touch only the engine's table of names, on the loop, so a request never
meets an adapter half-removed. Each core numbers its adapters itself (`lora_int_id`, unique
within the engine), so front ends never have to agree on numbers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from tandem.lora import LoraNotFound, LoRARequest
from tandem.server.core import wire

LOAD_POLL_MS = 5  # an idle core with a load in progress looks this often whether it is done
# Runtime loads and unloads are vLLM's development feature: off unless asked for.
RUNTIME_UPDATING_ENVS = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "TANDEM_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_updating_allowed(flag: bool = False, environ: Mapping[str, str] | None = None) -> bool:
    """--allow-runtime-lora-updating, or either environment variable set to 1 or true."""
    environ = os.environ if environ is None else environ
    return flag or any(
        environ.get(name, "").strip().lower() in ("1", "true") for name in RUNTIME_UPDATING_ENVS
    )


@dataclass(frozen=True)
class LoraModule:
    """One adapter of `--lora-modules`: its name (what a request's `model` says), its PEFT
    folder, and the base model it adapts as /v1/models names it (vLLM's `base_model_name`)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoraModule:
    """vLLM's two spellings: `name=path`, or a JSON object with "name", "path" and optionally
    "base_model_name". ValueError names what is wrong."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{text!r} is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"{text!r}: expected a JSON object")
        unknown = sorted(set(value) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"{text!r}: unknown keys {', '.join(unknown)}")
        name, path, base = value.get("name"), value.get("path"), value.get("base_model_name")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f'{text!r}: "name" and "path" must be non-empty strings')
        if base is not None and not isinstance(base, str):
            raise ValueError(f'{text!r}: "base_model_name" must be a string')
        return LoraModule(name, path, base or None)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f'{text!r}: expected name=path or {{"name": ..., "path": ...}}')
    return LoraModule(name, path)


def unknown_adapter(name: str) -> str:
    """A request naming an adapter the core does not hold (the front end's view was stale)."""
    return f"the model {name!r} does not exist (no LoRA adapter of that name is loaded)"


def already_loaded(name: str) -> str:
    return f"The lora adapter '{name}' has already been loaded."  # vLLM's words


def not_found(name: str) -> str:
    return f"The lora adapter '{name}' cannot be found."  # vLLM's words


# What a pending load answers with: (front end, its query, adapter, base model name, the load).
_Pending = tuple[bytes, int, str, str | None, Future]


class CoreAdapters:
    """The adapters of one core's engine, as the front ends see them (`wire.LoraCard`s)."""

    def __init__(self, engine):
        self.engine = engine
        self._next_id = 1
        self._base_names: dict[str, str | None] = {}  # adapter -> the base model it names
        self._pending: list[_Pending] = []
        self._pool: ThreadPoolExecutor | None = None  # started with the first runtime load

    @property
    def enabled(self) -> bool:
        return self.engine.adapters.enabled

    @property
    def loading(self) -> bool:
        return bool(self._pending)

    def load_now(self, module: LoraModule) -> None:
        """At start-up, before `Ready` (LoraError names a bad adapter)."""
        self.engine.adapters.add(self._request(module.name, module.path))
        self._base_names[module.name] = module.base_model_name

    def resolve(self, name: str) -> LoRARequest | None:
        """A request's adapter by name (None: no such adapter is loaded)."""
        return self.engine.adapters.get(name)

    def cards(self) -> list[wire.LoraCard]:
        return [
            wire.LoraCard(
                r.lora_name, r.lora_path, r.lora_int_id, self._base_names.get(r.lora_name)
            )
            for r in self.engine.adapters.list()
        ]

    def answer(self, query: int, error: str | None = None, status: int = 200) -> wire.LoraAnswer:
        return wire.LoraAnswer(query, self.cards(), error, status)

    def handle(
        self, identity: bytes, message: wire.LoraLoad | wire.LoraUnload | wire.LoraList
    ) -> wire.LoraAnswer | None:
        """The answer now, or None for a load begun on the loader thread (`finished` has it)."""
        if isinstance(message, wire.LoraList):
            return self.answer(message.query)
        if isinstance(message, wire.LoraUnload):
            return self._unload(message)
        return self._load(identity, message)

    def finished(self) -> list[tuple[bytes, wire.LoraAnswer]]:
        """The answers of the loads the thread has done since the last call, in order."""
        if not self._pending or not self._pending[0][4].done():
            return []
        done = []
        while self._pending and self._pending[0][4].done():
            identity, query, name, base, future = self._pending.pop(0)
            exc = future.exception()
            if exc is None:
                self._base_names[name] = base
                done.append((identity, self.answer(query)))
            elif isinstance(exc, ValueError):  # LoraError: the adapter, named, and why
                done.append((identity, self.answer(query, str(exc), 400)))
            else:
                message = f"loading LoRA adapter {name!r} failed: {type(exc).__name__}: {exc}"
                done.append((identity, self.answer(query, message, 500)))
        return done

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ internals
    def _request(self, name: str, path: str) -> LoRARequest:
        request = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        return request

    def _load(self, identity: bytes, message: wire.LoraLoad) -> wire.LoraAnswer | None:
        name = message.name
        if not name or not message.path:
            return self.answer(message.query, "lora_name and lora_path must be non-empty", 400)
        if not self.enabled:
            off = f"LoRA adapter {name!r}: LoRA is off (start the server with --enable-lora)"
            return self.answer(message.query, off, 400)
        if self.resolve(name) is not None or any(p[2] == name for p in self._pending):
            return self.answer(message.query, already_loaded(name), 400)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tandem-lora-load")
        future = self._pool.submit(self.engine.adapters.add, self._request(name, message.path))
        self._pending.append((identity, message.query, name, message.base_model_name, future))
        return None

    def _unload(self, message: wire.LoraUnload) -> wire.LoraAnswer:
        name = message.name
        if name is None:  # by number alone
            held = [r for r in self.engine.adapters.list() if r.lora_int_id == message.int_id]
            name = held[0].lora_name if held else None
        if name is None:
            what = f"lora_int_id {message.int_id}"
            return self.answer(message.query, f"no LoRA adapter has {what}", 404)
        try:
            self.engine.adapters.remove(name)
        except LoraNotFound:
            return self.answer(message.query, not_found(name), 404)
        self._base_names.pop(name, None)
        return self.answer(message.query)
