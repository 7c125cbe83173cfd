"""The engine-core process: the engine's loop, fed and drained over one ZeroMQ ROUTER socket.

Nothing else runs here: no HTTP, no JSON, no tokenizing or detokenizing, so between two steps
this process does only the engine's own host work and the socket's, and no other thread competes
for the GIL with the device thread and the loop (but for a LoRA adapter's files being read while
a runtime load lasts, on a thread of their own: `lora.py`). Front ends (API-server processes) connect
DEALER sockets, say `Hello`, get `Ready`, then send `Inbox`es; after every step each front end
with requests in it gets one `StepOutputs` with all of their new tokens and the engine's stats.

Signals: SIGINT and SIGTERM are ignored (draining is the front ends' job: the core serves until
they are done); SIGUSR1 stops it at once. It dies with its parent (`PR_SET_PDEATHSIG`), so no
core outlives a server killed with SIGKILL. A step that raises is reported to every front end
as `CoreFailed`, and the process exits 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import multiprocessing
import os
import signal
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from tandem.config import EngineConfig
from tandem.execution.lifetime import close_inherited, die_with_parent, name_process
from tandem.lora import LoraError
from tandem.metrics import write_chrome_trace
from tandem.request import RequestOutput
from tandem.server.core import wire
from tandem.server.core.lora import LOAD_POLL_MS, CoreAdapters, LoraModule, unknown_adapter

if TYPE_CHECKING:  # the engine's module imports it: `tandem serve` imports this one first
    from tandem.models.generation_defaults import GenerationDefaults

logger = logging.getLogger("tandem.server")

STOP_SIGNAL = signal.SIGUSR1
IDLE_POLL_MS = 1000  # an idle core wakes this often to check its ranks' health
STATS_WINDOW_S = 1.0  # the device-idle gauge's window
GAUGE_HISTORY_STEPS = 2048  # step records kept for the gauge (a window holds fewer)
GAUGE_HISTORY_REQUESTS = 100
TIMELINE_S = 10.0  # the most of the past a dashboard's timeline query gets


@dataclass
class CoreOptions:
    config: EngineConfig
    address: str  # where the ROUTER socket binds (ipc://...)
    engine_index: int = 0
    cpu_set: list[int] | None = None  # the CPU cores this replica computes on; None: all
    parent_pid: int = 0
    trace_path: str | None = None  # write a Chrome trace of every step here on exit
    lora_modules: list[LoraModule] = dataclasses.field(default_factory=list)  # loaded at start


def start_core(
    options: CoreOptions, start_method: str = "spawn", close_in_child: tuple[int, ...] = ()
) -> multiprocessing.Process:
    """Start a core process. "spawn": a fresh interpreter with no state from this one. "fork"
    (`child_start_method`): this process's copy, with the engine imported here first;
    `close_in_child` names the file descriptors the core must not hold (the server's listening
    socket). A caller that starts many (a test suite) may pass "forkserver": forked from a
    server process that has imported the engine once (the environment is the one that process
    started with)."""
    context = multiprocessing.get_context(start_method)
    if start_method == "fork":
        import tandem.engine.engine  # noqa: F401  (what the core runs, imported before the fork)
    elif start_method == "forkserver":
        # A configuration class too: transformers imports them (and what they all share, most
        # of a second's imports) at a checkpoint's first config read, else in every core.
        context.set_forkserver_preload(
            [
                "tandem.engine.engine",
                "tandem.server.core.process",
                "transformers.models.llama.configuration_llama",
            ]
        )
    inherited = close_in_child if start_method == "fork" else ()  # others inherit no fds
    process = context.Process(
        target=run_core, args=(options, inherited), name=f"tandem-core-{options.engine_index}"
    )
    process.start()
    return process


def stop_core(process: multiprocessing.Process, timeout: float = 10.0) -> None:
    """Stop a core (`STOP_SIGNAL`, then SIGKILL if it does not go) and reap it."""
    if process.is_alive() and process.pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, STOP_SIGNAL)
        process.join(timeout)
    if process.is_alive():
        process.kill()
    process.join()


def run_core(options: CoreOptions, close_in_child: tuple[int, ...] = ()) -> None:
    """The process's entry point."""
    close_inherited(close_in_child)
    name_process(f"tandem-core-{options.engine_index}")
    die_with_parent(options.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(STOP_SIGNAL, _exit_now)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    if options.cpu_set:
        os.sched_setaffinity(0, options.cpu_set)
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 1000)  # a last CoreFailed still reaches the front ends
    sock.bind(options.address)
    code = 0
    engine = None
    try:
        from tandem.engine.engine import Engine  # after the signals: loading takes seconds

        engine = Engine(dataclasses.replace(options.config, detokenize=False))
        adapters = CoreAdapters(engine)
        for module in options.lora_modules:
            adapters.load_now(module)
    except Exception as exc:
        if isinstance(exc, LoraError):  # a bad adapter of --lora-modules: it names itself
            logger.error("engine core %d: --lora-modules: %s", options.engine_index, exc)
            message = f"--lora-modules: {exc}"
        else:
            logger.exception("engine core %d failed to start", options.engine_index)
            message = f"the engine failed to start: {type(exc).__name__}: {exc}"
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.close(retire=False)
        if options.address.startswith("ipc://"):
            with contextlib.suppress(OSError), open(wire.failure_note(options.address), "w") as f:
                f.write(message)
        _fail_hellos(sock, message)
        sock.close()
        context.term()
        sys.exit(1)
    # A full collection would walk the model's and engine's objects holding the GIL, stalling
    # the device thread's next step: they live as long as the process, so they are frozen.
    gc.collect()
    gc.freeze()
    loop = CoreLoop(
        engine, sock, options.engine_index, keep_history=bool(options.trace_path), adapters=adapters
    )
    try:
        loop.run()
    except SystemExit:
        pass
    except BaseException:
        code = 1  # already logged and reported
    finally:
        adapters.close()
        engine.close(retire=False)
        if options.trace_path:
            steps = engine.history.steps()
            write_chrome_trace({f"engine core {options.engine_index}": steps}, options.trace_path)
            logger.info("trace of %d steps written to %s", len(steps), options.trace_path)
        sock.close()
        context.term()
    sys.exit(code)


def _exit_now(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _fail_hellos(sock: zmq.Socket, message: str) -> None:
    """Tell the front ends that already said hello why there will be no `Ready`."""
    while sock.poll(100):
        identity, _ = sock.recv_multipart()
        sock.send_multipart([identity, wire.encode(wire.CoreFailed(message))])


class CoreLoop:
    def __init__(
        self,
        engine,
        sock: zmq.Socket,
        engine_index: int,
        keep_history: bool = False,
        adapters: CoreAdapters | None = None,
    ):
        """`keep_history`: keep every step record (for a trace), not only the gauge's window."""
        self.engine = engine
        self.adapters = adapters or CoreAdapters(engine)
        self.sock = sock
        self.engine_index = engine_index
        self._frontends: list[bytes] = []  # identities that said hello
        self._owner: dict[str, bytes] = {}  # request id -> its front end
        self._unfinished: dict[str, int] = {}  # request id -> samples not finished
        self._stats_stale = False  # something changed since the front ends last heard
        self._generation_tokens = 0  # output tokens sent since start
        if not keep_history:
            engine.history.keep(steps=GAUGE_HISTORY_STEPS, requests=GAUGE_HISTORY_REQUESTS)
        self._window_start = engine.history.mark()
        self._window_time = time.perf_counter()
        self._device_idle = 0.0

    def run(self) -> None:
        engine = self.engine
        try:
            while True:
                busy = engine.has_unfinished()
                idle_ms = LOAD_POLL_MS if self.adapters.loading else IDLE_POLL_MS
                if self.sock.poll(0 if busy else idle_ms):
                    t0 = time.perf_counter()
                    if self._receive():
                        return
                    self._stamp("receive", t0)
                if self.adapters.loading:  # a LoRA load's thread is done: its answer goes out
                    for identity, answer in self.adapters.finished():
                        self.sock.send_multipart([identity, wire.encode(answer)])
                if engine.has_unfinished():
                    outputs = engine.step()
                    t0 = time.perf_counter()
                    self._send(outputs)
                    self._stamp("send", t0)
                elif self._stats_stale:
                    self._send([])  # idle now: the front ends' gauges read the final state
                else:
                    engine.wait_for_work(0)  # raises if a tensor-parallel rank has died
        except BaseException as exc:
            if isinstance(exc, SystemExit):
                raise
            logger.exception("engine core %d failed", self.engine_index)
            failed = wire.encode(wire.CoreFailed(f"{type(exc).__name__}: {exc}"))
            for identity in self._frontends:
                self.sock.send_multipart([identity, failed])
            raise

    def _stamp(self, span: str, start: float) -> None:
        """The core's own host work, on the latest step's record (a trace shows it)."""
        record = self.engine.history.latest()
        if record is not None:
            record.spans[span] = (start, time.perf_counter())

    # ------------------------------------------------------------- inputs
    def _receive(self) -> bool:
        """Handle every message waiting; True if told to shut down."""
        while self.sock.poll(0):
            identity, payload = self.sock.recv_multipart()
            message = wire.frontend_decoder.decode(payload)
            if isinstance(message, wire.Inbox):
                self._add(identity, message.adds)
                for abort in message.aborts:
                    self.engine.abort(abort.request_id, abort.index)
            elif isinstance(message, wire.Hello):
                self._frontends.append(identity)
                self.sock.send_multipart([identity, wire.encode(self._ready())])
                self.sock.send_multipart([identity, wire.encode(self._outputs([]))])
            elif isinstance(message, wire.TimelineQuery):
                self.sock.send_multipart([identity, wire.encode(self._timeline(message.after))])
            elif isinstance(message, (wire.LoraLoad, wire.LoraUnload, wire.LoraList)):
                answer = self.adapters.handle(identity, message)  # None: a load under way
                if answer is not None:
                    self.sock.send_multipart([identity, wire.encode(answer)])
            elif isinstance(message, wire.Shutdown):
                return True
        return False

    def _add(self, identity: bytes, adds: list[wire.NewRequest]) -> None:
        for new in adds:
            try:  # validated by the front end already; checked again against the engine's state
                lora = None
                if new.lora_name is not None:  # by name: unloaded since the front end looked?
                    lora = self.adapters.resolve(new.lora_name)
                    if lora is None:
                        self._refuse(identity, new, unknown_adapter(new.lora_name), 404)
                        continue
                # A grammar compiles off this loop, once the request is submitted. The adapter
                # is loaded already: make_request only looks it up.
                request = self.engine.make_request(
                    new.prompt_token_ids,
                    new.params,
                    new.request_id,
                    compile_grammar=False,
                    lora_request=lora,
                )
                self.engine.submit(request)
            except ValueError as exc:
                self._refuse(identity, new, str(exc))
                continue
            self._owner[new.request_id] = identity
            self._unfinished[new.request_id] = new.params.n
        self._stats_stale = True

    def _refuse(
        self, identity: bytes, new: wire.NewRequest, error: str, status: int | None = None
    ) -> None:
        refusal = [
            wire.TokenDelta(new.request_id, i, [], 0, True, None, error, error_status=status)
            for i in range(new.params.n)
        ]
        self.sock.send_multipart([identity, wire.encode(self._outputs(refusal))])

    def _ready(self) -> wire.Ready:
        engine = self.engine
        return wire.Ready(
            engine_index=self.engine_index,
            pid=os.getpid(),
            model_path=str(engine.model_path),
            model_type=engine.model_type,
            max_model_len=engine.max_model_len,
            vocab_size=engine.spec.vocab_size,
            eos_token_ids=sorted(engine.eos_token_ids),
            num_kv_blocks=engine.num_kv_blocks,
            max_num_seqs=engine.config.max_num_seqs,
            execution=engine.execution.describe(),
            reasoning_parser=engine.reasoning.parser.name if engine.reasoning else None,
            sampling_defaults=server_defaults(engine.generation_defaults),
            sampling_defaults_note=engine.generation_defaults.describe(),
            enable_lora=self.adapters.enabled,
            adapters=self.adapters.cards(),
        )

    # ------------------------------------------------------------ outputs
    def _send(self, outputs: list[RequestOutput]) -> None:
        """One message per front end with outputs in this step (every front end once idle)."""
        by_owner: dict[bytes, list[wire.TokenDelta]] = defaultdict(list)
        for output in outputs:
            delta = token_delta(output)
            self._generation_tokens += len(delta.token_ids)
            by_owner[self._owner[output.request_id]].append(delta)
            if output.finished:
                self._unfinished[output.request_id] -= 1
                if not self._unfinished[output.request_id]:
                    del self._unfinished[output.request_id], self._owner[output.request_id]
        idle = not self.engine.has_unfinished()
        if not by_owner and not idle:
            return  # a step that sampled nothing for anyone (a prompt chunk)
        if idle:
            self._stats_stale = False
            for identity in self._frontends:
                by_owner.setdefault(identity, [])
        for identity, deltas in by_owner.items():
            self.sock.send_multipart([identity, wire.encode(self._outputs(deltas))])

    def _outputs(self, deltas: list[wire.TokenDelta]) -> wire.StepOutputs:
        return wire.StepOutputs(deltas, self._stats())

    def _stats(self) -> wire.CoreStats:
        history = self.engine.history
        now = time.perf_counter()
        if now - self._window_time >= STATS_WINDOW_S:
            if history.mark().steps != self._window_start.steps:
                summary = history.summary(since=self._window_start)
                self._device_idle = summary.device_idle_fraction
                self._window_start = history.mark()
            self._window_time = now
        s = self.engine.stats()
        cache, spec = s.prefix_cache, s.speculative
        return wire.CoreStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_blocks_total=s.kv_blocks_total,
            kv_blocks_used=s.kv_blocks_used,
            kv_blocks_cached=s.kv_blocks_cached,
            num_preemptions=s.num_preemptions,
            prefix_query_tokens=cache.query_tokens,
            prefix_hit_tokens=cache.hit_tokens,
            prefix_hit_requests=cache.hits,
            prefix_hit_rate=cache.hit_rate,
            device_idle_fraction=self._device_idle,
            num_steps=history.mark().steps,
            spec_drafts=spec.num_verified,
            spec_draft_tokens=spec.drafted_tokens,
            spec_accepted_tokens=spec.accepted_tokens,
            spec_acceptance_rate=spec.acceptance_rate,
            spec_mean_accepted_length=spec.mean_accepted_length,
            spec_method=method.method if (method := self.engine.speculative_config) else "",
            generation_tokens=self._generation_tokens,
        )

    def _timeline(self, after: int) -> wire.Timeline:
        """The steps retired after step `after`, within the last `TIMELINE_S` seconds."""
        now = time.perf_counter()
        steps = []
        for record in reversed(self.engine.history.steps()):
            if record.step_id <= after or record.spans["schedule"][0] < now - TIMELINE_S:
                break
            spans = wire.StepSpans(
                record.step_id,
                record.num_tokens,
                record.num_seqs,
                record.device,
                record.device_wait,
                record.skipped,
                record.spans,
            )
            steps.append(spans)
        steps.reverse()
        return wire.Timeline(now, steps)


def server_defaults(defaults: GenerationDefaults) -> dict[str, float | int]:
    """What a front end puts under a request's own values: the model's sampling defaults, and
    the output cap as `max_tokens` (the default of a request that sets none, and its bound)."""
    cap = {} if defaults.max_tokens is None else {"max_tokens": defaults.max_tokens}
    return {**defaults.values, **cap}


def token_delta(output: RequestOutput) -> wire.TokenDelta:
    new = output.delta_token_ids
    logprobs = None
    if output.logprobs is not None:
        logprobs = [
            [(token, lp.logprob, lp.rank) for token, lp in entry.items()]
            for entry in output.logprobs[len(output.logprobs) - len(new) :]
        ]
    return wire.TokenDelta(
        request_id=output.request_id,
        index=output.index,
        token_ids=list(new),
        num_output_tokens=len(output.token_ids),
        finished=output.finished,
        finish_reason=output.finish_reason,
        error=output.error,
        logprobs=logprobs,
        speculative=dataclasses.astuple(output.speculative)
        if output.finished and output.speculative
        else None,
    )
