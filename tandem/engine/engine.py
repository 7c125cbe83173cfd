"""The engine loop: schedule, build, launch, retire; synchronous or asynchronous.

Async (the default) launches step N+1 before retiring step N, so the host's scheduling and
building overlap the device's compute. The scheduler speculates that nothing in flight finishes;
a request that does finish has its one extra in-flight token discarded at retirement.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from tandem.config import EngineConfig
from tandem.engine.fan_out import fan_out
from tandem.engine.intake import RequestIntake, eos_token_ids
from tandem.engine.outputs import OutputProcessor
from tandem.engine.stats import EngineStats, StepHistory
from tandem.execution.batch import BatchBuilder
from tandem.execution.executor import WorkerFailure
from tandem.execution.setup import load_execution
from tandem.execution.streams import StepHandle
from tandem.metrics import RequestTiming, RunSummary, StepRecord
from tandem.models.catalog import resolve_model
from tandem.models.generation_defaults import read_generation_defaults
from tandem.models.loader import find_tokenizer, read_config
from tandem.request import Request, RequestOutput, SamplingParams
from tandem.sampler.inputs import LogprobRows
from tandem.scheduling.scheduler import ScheduledBatch, Scheduler

logger = logging.getLogger("tandem")


@dataclass
class _InFlight:
    batch: ScheduledBatch
    handle: StepHandle
    record: StepRecord
    logprobs: LogprobRows | None  # how to read logprobs out of the step's packed output


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        path, self.spec, hf_config = read_config(resolve_model(config.model))
        self.model_path = path
        # None for a folder without tokenizer files (config.json for dummy weights): the engine
        # then takes token-id prompts only and its outputs carry token ids, not text.
        self.tokenizer = find_tokenizer(path)
        if self.tokenizer is None:
            logger.info("%s has no tokenizer files: prompts must be token ids", path)
        self.eos_token_ids = eos_ids = eos_token_ids(hf_config, self.tokenizer, path)
        self.generation_defaults = read_generation_defaults(path, config.generation_config)
        max_model_len = config.max_model_len or self.spec.max_position_embeddings
        if max_model_len > self.spec.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"{self.spec.max_position_embeddings}"
            )
        loaded = load_execution(config, path, self.spec, hf_config)
        self.num_kv_blocks = num_blocks = loaded.num_kv_blocks
        if num_blocks * config.block_size < max_model_len:
            logger.info(
                "KV cache holds %d tokens: max_model_len lowered from %d",
                num_blocks * config.block_size,
                max_model_len,
            )
            max_model_len = num_blocks * config.block_size
        self.max_model_len = max_model_len

        self.scheduler = Scheduler(
            num_blocks,
            config.block_size,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            max_model_len,
            config.enable_prefix_caching,
        )
        self.builder = BatchBuilder(self.scheduler.block_table, config.block_size, max_model_len)
        self.runner, self.execution = loaded.start(self.scheduler.slots.size, max_model_len)
        logger.info("execution: %s", self.execution.describe())
        self.intake = RequestIntake(
            self.tokenizer, self.spec.vocab_size, eos_ids, max_model_len, config.seed
        )
        self.outputs = OutputProcessor(self.tokenizer, eos_ids, config.detokenize)
        self.history = StepHistory()
        self._depth = 1 if config.async_scheduling else 0
        self._inflight: deque[_InFlight] = deque()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        if config.tensor_parallel_size > 1:
            self.runner.on_exit = self._wakeup.set  # an idle loop learns of a dead rank at once
        self._live_ids: set[str] = set()
        self._requests: dict[str, list[Request]] = {}  # request id -> its samples

    # ------------------------------------------------------------------ API
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Validate and queue a request (thread-safe). Bad input raises ValueError, nothing else."""
        return self.submit(self.make_request(prompt, params, request_id))

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> Request:
        """Tokenize and validate, without queuing: raises ValueError naming the problem."""
        return self.intake.make_request(prompt, params, request_id)

    def submit(self, request: Request) -> str:
        with self._lock:
            if request.request_id in self._live_ids:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            self._live_ids.add(request.request_id)
        self._inbox.put(("add", request))
        self._wakeup.set()
        return request.request_id

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block an idle loop thread until a request arrives (or timeout); True if there is work."""
        self.runner.check_health()
        if self.has_unfinished():
            return True
        self._wakeup.wait(timeout)
        self._wakeup.clear()
        self.runner.check_health()
        return self.has_unfinished()

    def abort(self, request_id: str, index: int | None = None) -> None:
        """End the request (or only its sample `index`) as "abort". Thread-safe; aborting an
        unknown or finished request does nothing."""
        self._inbox.put(("abort", (request_id, index)))
        self._wakeup.set()

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._live_ids) or bool(self._inflight)

    def stats(self) -> EngineStats:
        """Running and waiting requests, KV blocks, prefix-cache counters, at this moment."""
        return EngineStats.of(self.scheduler)

    def summary(self) -> RunSummary:
        """Figures over the records kept (see `history` for windows)."""
        return self.history.summary()

    @property
    def async_scheduling(self) -> bool:
        return self._depth == 1

    def configure(
        self, *, async_scheduling: bool | None = None, enable_prefix_caching: bool | None = None
    ) -> None:
        """Switch the loop or prefix caching while idle (a benchmark compares both on one set of
        weights). Switching prefix caching drops the cached blocks no request holds."""
        if self.has_unfinished():
            raise RuntimeError("reconfigure the engine only while it is idle")
        if async_scheduling is not None:
            self._depth = 1 if async_scheduling else 0
        if enable_prefix_caching is not None:
            self.scheduler.enable_prefix_caching = enable_prefix_caching
            self.scheduler.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block no request holds (only while idle)."""
        if self.has_unfinished():
            raise RuntimeError("reset the prefix cache only while the engine is idle")
        self.scheduler.reset_prefix_cache()

    def step(self) -> list[RequestOutput]:
        """One turn of the loop. Async: launch the next step, then retire the previous one."""
        outputs = self._drain_inbox()
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch is not None:
            t1 = time.perf_counter()
            inputs = self.builder.build(batch)
            t2 = time.perf_counter()
            handle = self.runner.launch(inputs)
            t3 = time.perf_counter()
            record = StepRecord(batch.step_id, batch.num_tokens, len(batch.items))
            record.spans = {"schedule": (t0, t1), "build": (t1, t2), "launch": (t2, t3)}
            self._inflight.append(_InFlight(batch, handle, record, inputs.sampler.logprobs))
        while self._inflight and (len(self._inflight) > self._depth or batch is None):
            outputs.extend(self._retire(self._inflight.popleft()))
        return outputs

    def stream_outputs(self) -> Iterator[RequestOutput]:
        """Run until every queued request has finished, yielding outputs as they come."""
        while self.has_unfinished():
            yield from self.step()

    def close(self, retire: bool = True) -> None:
        """Retire what is in flight, then stop the device side. `retire=False` after a failure:
        the engine's state is suspect, so the device is freed without reading any step."""
        try:
            while retire and self._inflight:
                self._retire(self._inflight.popleft())
        except WorkerFailure:
            pass  # already raised by the step that met it; what is left is to stop the ranks
        finally:
            self.runner.close()

    # ------------------------------------------------------------- internals
    def _drain_inbox(self) -> list[RequestOutput]:
        outputs = []
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return outputs
            if kind == "add":
                samples = fan_out(payload, self.spec.vocab_size)
                self._requests[payload.request_id] = samples
                for request in samples:
                    self.outputs.track(request)
                    self.scheduler.add(request)
            elif (samples := self._requests.get(payload[0])) is not None:
                index = payload[1]
                for request in samples:  # every unfinished sample asked for ends here
                    if not request.finished and index in (None, request.index):
                        outputs.append(self._finish(request, "abort"))

    def _retire(self, inflight: _InFlight) -> list[RequestOutput]:
        record = inflight.record
        t0 = time.perf_counter()
        result = inflight.handle.wait()  # the step's one deliberate sync
        t1 = time.perf_counter()
        sampled = inflight.batch.sampled
        sampled_ids, logprobs = self.outputs.read_step(result, sampled, inflight.logprobs)
        # Before the tokens: a request that finishes on one of them still caches its full blocks.
        self.scheduler.retire_step(inflight.batch)
        outputs = []
        for item, token, lp in zip(sampled, sampled_ids, logprobs, strict=True):
            request = item.request
            request.num_inflight -= 1
            if request.finished:
                record.discarded += 1  # summed into RunSummary.discarded_tokens
                continue  # the speculative token of a request that finished a step earlier
            reason = self.outputs.append_token(request, token, t1, lp)
            if reason is None:
                outputs.append(self.outputs.running_output(request, [token]))
            else:
                outputs.append(self._finish(request, reason))
        record.spans["wait"] = (t0, t1)
        record.spans["update"] = (t1, time.perf_counter())
        record.device = inflight.handle.device_span
        self.history.add_step(record)
        return outputs

    def _finish(self, request: Request, reason: str) -> RequestOutput:
        self.scheduler.finish(request, reason)
        self.history.add_request(RequestTiming(request.arrival_time, request.token_times))
        output = self.outputs.finished_output(request)
        samples = self._requests[request.request_id]
        if all(sample.finished for sample in samples):
            del self._requests[request.request_id]
            with self._lock:
                self._live_ids.discard(request.request_id)
        return output
