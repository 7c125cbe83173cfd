"""`serve()`: start the engine cores and the front ends, drain gracefully, never half-serve.

Processes: one engine core per data-parallel replica (`core.py`), and `api_server_count` front
ends (HTTP, validation, tokenization, detokenization, streaming) sharing one listening socket,
which this process binds first (so a port in use fails at once, before any model loads). With
one front end, this process is it; with several, this process only supervises.

Signals: the first SIGINT/SIGTERM starts a drain: the server keeps answering, with 503 +
Retry-After to new requests and /health (so a load balancer moves away), in-flight requests get
`grace_period` seconds to finish, the rest are aborted, and only then does it exit (0). A
second signal aborts everything at once. Front-end and core processes ignore SIGINT/SIGTERM
(a terminal's Ctrl-C reaches the whole group): the supervisor relays the drain with
`frontend_process.DRAIN_SIGNAL`, and stops cores once no front end is left.

Faults: a core that dies, hangs or fails a step makes every front end answer its requests with
an error at once, /health 503, and exit 1; a front end that dies makes the supervisor end the
others (aborting their requests). `serve` then raises `EngineFailure` (the CLI exits 1). Every
child dies with its parent, so none outlives even a SIGKILLed server.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

from tandem.config import EngineConfig, usable_cores
from tandem.execution.lifetime import child_start_method
from tandem.models.catalog import checkpoint_path, resolve_model
from tandem.server.core import wire
from tandem.server.core.lora import LoraModule, runtime_updating_allowed
from tandem.server.core.process import CoreOptions, start_core, stop_core

logger = logging.getLogger("tandem.server")

API_KEY_ENV = "TANDEM_API_KEY"


class EngineFailure(RuntimeError):
    """An engine core or a front end failed while serving; raised after clients were answered."""


def serve(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_waiting: int = 256,
    grace_period: float = 10.0,
    api_key: str | None = None,
    protect_metrics: bool = False,
    max_request_bytes: int | None = None,
    api_server_count: int = 1,
    data_parallel_size: int = 1,
    engine_timeout_s: float = 60.0,
    trace: str | None = None,
    served_model_name: list[str] | None = None,
    lora_modules: list[LoraModule] | None = None,
    allow_runtime_lora_updating: bool = False,
) -> None:
    """Serve `config`'s model over the OpenAI-compatible API until SIGINT/SIGTERM.

    `api_key` defaults to $TANDEM_API_KEY; without either, the API is open. `max_request_bytes`
    defaults to 16 MiB. `engine_timeout_s`: a core with requests in flight that sends nothing for
    this long is taken as hung. `trace`: each core writes a Chrome trace of its steps there on
    exit (`PATH`, or `PATH.N.json` per replica). `served_model_name`: the names clients may use
    for the model (the first is reported). `lora_modules`: LoRA adapters every core loads
    before serving (a bad one: `EngineFailure` naming it); they need `config.enable_lora`.
    `allow_runtime_lora_updating` (or $VLLM_ALLOW_RUNTIME_LORA_UPDATING /
    $TANDEM_ALLOW_RUNTIME_LORA_UPDATING set to 1 or true): vLLM's load and unload endpoints.
    Raises `EngineFailure` if a core or a front end fails.
    """
    if api_server_count < 1 or data_parallel_size < 1:
        raise ValueError("api_server_count and data_parallel_size must be >= 1")
    if data_parallel_size > 1 and config.nnodes > 1:
        raise ValueError("--data-parallel-size with --nnodes: run one server per machine behind "
                         "a router for data parallelism across machines (docs/multi_node.md)")  # fmt: skip
    if engine_timeout_s <= 0:
        raise ValueError("engine_timeout_s must be > 0")
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV) or None
    if protect_metrics and not api_key:
        raise ValueError("protect_metrics needs an API key (--api-key or $TANDEM_API_KEY)")
    if config.model is not None:  # a wrong path fails here at once, before any process
        checkpoint_path(resolve_model(config.model))
    check_draft(config, checkpoint_path)
    lora_modules = check_lora_modules(config, lora_modules or [])
    replicas = replica_options(config, data_parallel_size)
    listener = listening_socket(host, port)
    workdir = tempfile.mkdtemp(prefix="tandem-serve-")
    cores: list[multiprocessing.Process] = []
    failure: str | None = "the server did not start"
    try:
        start_method = child_start_method(config)
        if start_method == "fork":  # read here, the configs' modules are the cores' already
            model_path = check_configs(config)
        for i, options in enumerate(replicas):
            options.address = f"ipc://{workdir}/core-{i}"
            options.lora_modules = lora_modules
            if trace:
                options.trace_path = trace if len(replicas) == 1 else f"{trace}.{i}.json"
            cores.append(start_core(options, start_method, (listener.fileno(),)))
            where = f"CPU cores {options.cpu_set}" if options.cpu_set else "every CPU core"
            logger.info("engine core %d: pid %d, %s", i, cores[-1].pid, where)
        # While the cores load: the front end's own imports (the HTTP stack, the tokenizer's),
        # which take this process seconds; and the configs checked in full if not yet.
        if start_method != "fork":
            model_path = check_configs(config)
        from tandem.server import frontend_process

        options = frontend_process.FrontendOptions(
            cores=[
                frontend_process.CoreEndpoint(o.address, p.pid)
                for o, p in zip(replicas, cores, strict=True)
            ],
            model=config.model,
            served_model_name=served_model_name,
            model_path=str(model_path),
            max_waiting=max_waiting,
            grace_period=grace_period,
            api_key=api_key,
            protect_metrics=protect_metrics,
            max_request_bytes=max_request_bytes or frontend_process.DEFAULT_MAX_REQUEST_BYTES,
            engine_timeout_s=engine_timeout_s,
            parent_pid=os.getpid(),
            allow_runtime_lora_updating=runtime_updating_allowed(allow_runtime_lora_updating),
        )
        if api_server_count == 1:
            failure = frontend_process.run_frontend(options, listener)
        else:
            failure = frontend_process.supervise(
                options, listener, api_server_count, config.max_num_seqs, workdir
            )
        if failure is not None:  # a core that failed to start says why better than its front end
            notes = (wire.read_failure_note(o.address) for o in replicas)
            failure = next((note for note in notes if note), failure)
    finally:
        listener.close()
        for process in cores:  # after a failure a core may be hung: no long wait for it
            stop_core(process, timeout=10.0 if failure is None else 1.0)
        shutil.rmtree(workdir, ignore_errors=True)
    if failure is not None:
        raise EngineFailure(failure)


def check_configs(config: EngineConfig) -> Path:
    """The model's and the draft model's configs and the sampling defaults, read as the cores
    will read them: a ValueError names what is wrong (their modules import torch and
    transformers: called before forked cores, which then need not, or once spawned ones are on
    their way). Returns the model's checkpoint."""
    from tandem.models.generation_defaults import read_generation_defaults
    from tandem.models.loader import read_config

    path = read_config(resolve_model(config.model))[0]
    read_generation_defaults(path, config.generation_config).overridden(
        config.override_generation_config
    )
    check_draft(config, read_config)
    return path


def check_lora_modules(config: EngineConfig, modules: list[LoraModule]) -> list[LoraModule]:
    """The start-up adapters, before any process starts: LoRA on, names unique, folders there
    (each core reads and checks the files themselves: a bad one fails the start, named)."""
    if modules and not config.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    names = [module.name for module in modules]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"--lora-modules names {', '.join(map(repr, twice))} more than once")
    for module in modules:
        if not Path(module.path).is_dir():
            raise ValueError(f"--lora-modules {module.name}: no folder {module.path!r}")
    return list(modules)


def check_draft(config: EngineConfig, check: Callable[[Path], object]) -> None:
    """`check` on the draft model's checkpoint, if the config names one; its ValueError says
    that it is the draft's."""
    draft = config.speculative_config.model if config.speculative_config else None
    if draft is not None:
        try:
            check(resolve_model(draft))
        except ValueError as exc:
            raise ValueError(f"speculative_config.model: {exc}") from None


def replica_options(config: EngineConfig, data_parallel_size: int) -> list[CoreOptions]:
    """One core per replica. On the CPU each gets its own slice of the cores (and as many
    compute threads, unless --cpu-threads says otherwise); on CUDA its own devices."""
    if data_parallel_size == 1:
        return [CoreOptions(config, address="", parent_pid=os.getpid())]
    if config.torch_device.type == "cuda":
        raise ValueError(
            "data_parallel_size > 1 on CUDA: run one server per device for now "
            "(data-parallel replicas are split over CPU cores)"
        )
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < data_parallel_size:
        raise ValueError(
            f"data_parallel_size {data_parallel_size} needs at least as many CPU cores; "
            f"this process may use {usable_cores()}"
        )
    share = len(cores) // data_parallel_size
    options = []
    for i in range(data_parallel_size):
        cpu_set = cores[i * share : (i + 1) * share]
        replica = dataclasses.replace(config, cpu_threads=config.cpu_threads or len(cpu_set))
        if config.kv_events_config is not None:  # each core publishes on its own port
            replica.kv_events_config = dataclasses.replace(
                config.kv_events_config, data_parallel_rank=i
            )
        options.append(CoreOptions(replica, "", i, cpu_set, os.getpid()))
    return options


def listening_socket(host: str, port: int) -> socket.socket:
    """Bound, not yet listening: connections are refused until a front end is ready."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock
