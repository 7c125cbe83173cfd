"""The engine loop: schedule, build, launch, retire; synchronous or asynchronous.

Async (the default) launches step N+1 before retiring step N, so the host's scheduling and
building overlap the device's compute (over a pipeline's stages, one step per stage). The
scheduler speculates that nothing in flight finishes; a request that does finish has its one
extra in-flight token discarded at retirement.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from tandem.config import EngineConfig, SpeculativeConfig
from tandem.engine.fan_out import fan_out
from tandem.engine.grammar import (
    GrammarCompiler,
    PendingGrammars,
    StepBitmasks,
    constrained_items,
    prepare_reasoning,
)
from tandem.engine.inbox import Inbox
from tandem.engine.intake import RequestIntake, context_limit, eos_token_ids
from tandem.engine.kv_events import start_kv_events
from tandem.engine.lora import Adapters
from tandem.engine.outputs import OutputProcessor
from tandem.engine.speculation import Speculation, check_speculation
from tandem.engine.stats import EngineStats, StepHistory, describe_kv_cache, kv_bytes_read
from tandem.engine.stop_check import retire_skipped, stop_check
from tandem.execution.batch import SKIPPED_STEP, BatchBuilder
from tandem.execution.executor import WorkerFailure
from tandem.execution.kv_cache import layer_groups
from tandem.execution.setup import load_execution
from tandem.execution.streams import StepHandle
from tandem.lora import LoRARequest
from tandem.metrics import RequestTiming, RunSummary, SpeculativeStats, StepRecord
from tandem.models.catalog import resolve_model
from tandem.models.errors import ModelLoadError
from tandem.models.generation_defaults import read_generation_defaults
from tandem.models.loader import find_tokenizer, read_config
from tandem.reasoning import resolve_parser
from tandem.request import Request, RequestOutput, RequestStatus, SamplingParams
from tandem.sampler.inputs import GrammarRows, LogprobRows
from tandem.scheduling.scheduler import ScheduledBatch, Scheduler

logger = logging.getLogger("tandem")


class _Keep:
    """`Engine.configure`'s default: leave the setting as it is."""


KEEP = _Keep()


@dataclass
class _InFlight:
    batch: ScheduledBatch
    handle: StepHandle
    record: StepRecord
    logprobs: LogprobRows | None  # how to read logprobs out of the step's packed output
    grammar: GrammarRows | None = None  # the rows the host's bitmask constrains


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        path, self.spec, hf_config = read_config(resolve_model(config.model))
        self.model_path = path
        self.model_type: str = hf_config.model_type  # transformers' name: "llama", "gemma3_text"
        # None for a folder without tokenizer files (config.json for dummy weights): the engine
        # then takes token-id prompts only and its outputs carry token ids, not text.
        self.tokenizer = find_tokenizer(path)
        if self.tokenizer is None:
            logger.info("%s has no tokenizer files: prompts must be token ids", path)
        self.eos_token_ids = eos_ids = eos_token_ids(hf_config, self.tokenizer, path)
        self.generation_defaults = read_generation_defaults(
            path, config.generation_config
        ).overridden(config.override_generation_config)
        max_model_len = context_limit(config.max_model_len, self.spec.max_position_embeddings)
        groups = layer_groups(self.spec, config.max_model_len)
        check_speculation(config.speculative_config, groups)
        loaded = load_execution(config, path, self.spec, hf_config)
        self.num_kv_blocks = num_blocks = loaded.num_kv_blocks
        fits = groups.max_length(
            num_blocks, config.block_size, config.max_num_batched_tokens, max_model_len
        )
        if fits < max_model_len:
            logger.info(
                "KV cache holds %d tokens: max_model_len lowered from %d", fits, max_model_len
            )
        self.max_model_len = max_model_len = min(fits, max_model_len)

        self.scheduler = Scheduler(
            num_blocks, config.block_size, config.max_num_seqs, config.max_num_batched_tokens,
            max_model_len, config.enable_prefix_caching, groups=groups,
            pipeline_stages=config.pipeline_parallel_size,
        )  # fmt: skip
        self.builder = BatchBuilder(self.scheduler.block_table, config.block_size, max_model_len)
        self._depth = self.scheduler.use_loop(config.async_scheduling)
        self.speculation = Speculation(config.speculative_config, self.scheduler, self.builder)
        self.speculation.use(config.speculative_config, self._depth)
        self.kv_events = start_kv_events(config, self.scheduler)
        self.runner, self.execution = loaded.start(self.scheduler.slots.size, max_model_len)
        logger.info("execution: %s", self.execution.describe())
        self.reasoning = resolve_parser(config.reasoning_parser, self.tokenizer)
        if self.reasoning is not None:
            logger.info("%s", self.reasoning.describe())
        elif "thinking_token_budget" in self.generation_defaults.values:
            raise ModelLoadError(
                f"a default thinking_token_budget needs a reasoning model: {path} has no "
                "reasoning parser (its chat template writes no <think>; see --reasoning-parser)"
            )
        self.intake = RequestIntake(
            self.tokenizer, self.spec.vocab_size, eos_ids, max_model_len, config.seed,
            self.reasoning,
        )  # fmt: skip
        self.outputs = OutputProcessor(self.tokenizer, eos_ids, config.detokenize)
        self.grammars = GrammarCompiler(self.tokenizer, self.spec.vocab_size, eos_ids)
        on_cuda = config.torch_device.type == "cuda"
        self._bitmasks = StepBitmasks(self.grammars.bitmask_width, pin_memory=on_cuda)
        self.history = StepHistory()
        self._kv_bytes, kv_cache = describe_kv_cache(config, self.spec)
        logger.info("KV cache: %d blocks of %d tokens, %s", num_blocks, config.block_size, kv_cache)
        self._speculative_stats = SpeculativeStats()
        self._inflight: deque[_InFlight] = deque()
        self.inbox = Inbox()
        self._compiling = PendingGrammars(self.grammars, self.inbox.wakeup.set)
        if config.world_size > 1:
            self.runner.on_exit = self.inbox.wakeup.set  # an idle loop learns of a dead rank now
        self._requests: dict[str, list[Request]] = {}  # request id -> its samples
        self.adapters = Adapters(config, self.spec, self.scheduler, self._requests)

    # ------------------------------------------------------------------ API
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Validate and queue a request (thread-safe). Bad input raises ValueError, nothing else."""
        return self.submit(self.make_request(prompt, params, request_id, lora_request=lora_request))

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        compile_grammar: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        """Tokenize and validate, without queuing: raises ValueError naming the problem.

        A structured output's grammar is compiled here, in the caller's thread (a bad one is
        refused now); with `compile_grammar=False` (input validated elsewhere: the server's front
        end) it is compiled off the loop once the request is submitted. A LoRA adapter not yet
        loaded is loaded here too (LoraError, a ValueError, names a bad one)."""
        request = self.intake.make_request(prompt, params, request_id)
        if lora_request is not None:
            request.lora, request.lora_key = lora_request, self.adapters.add(lora_request).cache_key
        spec = request.params.structured_outputs
        if spec is not None and compile_grammar:
            request.compiled_grammar = self.grammars.compile(spec)
            prepare_reasoning(request, self.grammars.bitmask_width)
        return request

    def submit(self, request: Request) -> str:
        self.inbox.add(request)
        return request.request_id

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block an idle loop thread until a request arrives (or timeout); True if there is work."""
        self.runner.check_health()
        if self.has_unfinished():
            return True
        self.inbox.wait(timeout)
        self.runner.check_health()
        return self.has_unfinished()

    def abort(self, request_id: str, index: int | None = None) -> None:
        """End the request (or only its sample `index`) as "abort". Thread-safe; aborting an
        unknown or finished request does nothing."""
        self.inbox.abort(request_id, index)

    def has_unfinished(self) -> bool:
        return self.inbox.any_live() or bool(self._inflight)

    def stats(self) -> EngineStats:
        """Running and waiting requests, KV blocks, prefix-cache and speculation counters, at
        this moment."""
        return EngineStats.of(self.scheduler, self._speculative_stats)

    def summary(self) -> RunSummary:
        """Figures over the records kept (see `history` for windows)."""
        return self.history.summary()

    @property
    def async_scheduling(self) -> bool:
        return self._depth > 0

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one cached token holds over every layer (and every rank's heads)."""
        return sum(self._kv_bytes.values())

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        """The speculative decoding in use (None: off)."""
        return self.builder.speculative

    def configure(
        self,
        *,
        async_scheduling: bool | None = None,
        enable_prefix_caching: bool | None = None,
        speculative_config: SpeculativeConfig | dict | str | None | _Keep = KEEP,
    ) -> None:
        """Switch the loop, prefix caching or speculative decoding (None: off) while idle (a
        benchmark compares them on one set of weights). Switching prefix caching drops the
        cached blocks no request holds; a draft model must be the one the engine loaded."""
        if self.has_unfinished():
            raise RuntimeError("reconfigure the engine only while it is idle")
        if async_scheduling is not None:
            self._depth = self.scheduler.use_loop(async_scheduling)
            self.speculation.loop_changed(self._depth)
        if enable_prefix_caching is not None:
            self.scheduler.enable_prefix_caching = enable_prefix_caching
            self.scheduler.reset_prefix_cache()
        if speculative_config is not KEEP:
            self.speculation.use(SpeculativeConfig.of(speculative_config), self._depth)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block no request holds (only while idle)."""
        if self.has_unfinished():
            raise RuntimeError("reset the prefix cache only while the engine is idle")
        self.scheduler.reset_prefix_cache()

    def step(self) -> list[RequestOutput]:
        """One turn of the loop. Async: launch the next step, then retire the previous one."""
        outputs = self._drain_inbox()
        outputs.extend(self._admit_compiled())
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch is not None:
            t1 = time.perf_counter()
            inputs = self.builder.build(batch)
            if self.adapters.enabled:
                inputs.lora_loads = self.adapters.step_loads()
            before = self._inflight[-1] if self._inflight else None
            if before and self.runner.skips_stopped_steps and inputs.sampler.grammar is None:
                inputs.stop_check = stop_check(
                    batch, before.batch, before.logprobs, self.eos_token_ids
                )
            t2 = time.perf_counter()
            handle = self.runner.launch(inputs)
            t3 = time.perf_counter()
            record = StepRecord(batch.step_id, batch.num_tokens, len(batch.items))
            record.kv_bytes = kv_bytes_read(self._kv_bytes, batch)
            record.spans = {"schedule": (t0, t1), "build": (t1, t2), "launch": (t2, t3)}
            s = inputs.sampler
            self._inflight.append(_InFlight(batch, handle, record, s.logprobs, s.grammar))
            if inputs.sampler.grammar is not None:
                # Its bitmask needs every earlier token: retire the step before it first (its
                # forward runs meanwhile), then build the bitmask and launch the sampling.
                while len(self._inflight) > 1:
                    outputs.extend(self._retire(self._inflight.popleft()))
                self._sample_constrained(self._inflight[-1], inputs.sampler.drafts_to_host)
        elif not self._inflight and self._compiling:
            self._compiling.wait(0.05)
        while self._inflight and (len(self._inflight) > self._depth or batch is None):
            outputs.extend(self._retire(self._inflight.popleft()))
        self.kv_events.publish(self.scheduler.take_cache_events())
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
            self.grammars.close()
            self.kv_events.close()

    # ------------------------------------------------------------- internals
    def _drain_inbox(self) -> list[RequestOutput]:
        outputs = []
        for kind, payload in self.inbox.take():
            if kind == "add":
                samples = fan_out(payload, self.spec.vocab_size)
                self._requests[payload.request_id] = samples
                for request in samples:
                    self.outputs.track(request)
                spec = payload.params.structured_outputs
                if spec is not None and payload.compiled_grammar is None:
                    self._compiling.add(samples, spec)
                    continue
                for request in samples:
                    self.scheduler.add(request)
            elif (samples := self._requests.get(payload[0])) is not None:
                index = payload[1]
                for request in samples:  # every unfinished sample asked for ends here
                    if not request.finished and index in (None, request.index):
                        outputs.append(self._finish(request, "abort"))
        return outputs

    def _admit_compiled(self) -> list[RequestOutput]:
        """Queue the requests whose grammar has compiled; end those whose grammar failed."""
        outputs = []
        for samples, compiled, error in self._compiling.done():
            for request in samples:
                if request.finished:
                    continue  # aborted while its grammar compiled
                if error is not None:
                    request.error = error
                    outputs.append(self._finish(request, "abort"))
                else:
                    request.compiled_grammar = compiled
                    prepare_reasoning(request, self.grammars.bitmask_width)
                    self.scheduler.add(request)
        return outputs

    def _sample_constrained(self, inflight: _InFlight, drafts_to_host: bool) -> None:
        """Build the newest step's bitmask (its forward is running) and launch its sampling."""
        t0 = time.perf_counter()
        drafts = self.runner.step_drafts(inflight.handle) if drafts_to_host else None
        rows = inflight.grammar
        bitmask = self._bitmasks.build(constrained_items(inflight.batch, rows, drafts))
        inflight.handle = self.runner.sample_constrained(inflight.handle, bitmask)
        inflight.record.spans["grammar"] = (t0, time.perf_counter())

    def _retire(self, inflight: _InFlight) -> list[RequestOutput]:
        record = inflight.record
        t0 = time.perf_counter()
        result = inflight.handle.wait()  # the step's one deliberate sync
        t1 = time.perf_counter()
        if isinstance(result, str) and result == SKIPPED_STEP:
            # Every request in it ended a step earlier: nothing ran, nothing to read.
            retire_skipped(inflight.batch, self.scheduler)
            record.skipped = True
            record.spans["wait"] = (t0, t1)
            record.device = inflight.handle.device_span
            self.history.add_step(record)
            return []
        sampled = inflight.batch.sampled
        kept = self.outputs.read_step(result, sampled, inflight.logprobs)
        # Before the tokens: a request that finishes on one of them still caches its full blocks.
        self.scheduler.retire_step(inflight.batch)
        outputs = []
        for item, (tokens, logprobs) in zip(sampled, kept, strict=True):
            request = item.request
            self.scheduler.settle(item, len(tokens))
            if request.finished:  # drafts past its end say nothing of how well it drafts
                record.discarded += len(tokens)  # summed into RunSummary.discarded_tokens
                continue  # the speculative tokens of a request that finished a step earlier
            if item.num_drafts:
                self.speculation.count(record, item, len(tokens))
            reason, new = self.outputs.append_tokens(request, tokens, logprobs, t1)
            record.discarded += len(tokens) - len(new)  # after its end: never streamed
            if reason is None:
                outputs.append(self.outputs.running_output(request, new))
            else:
                outputs.append(self._finish(request, reason, new if reason != "abort" else None))
        record.spans["wait"] = (t0, t1)
        record.spans["update"] = (t1, time.perf_counter())
        record.device = inflight.handle.device_span
        record.device_wait = inflight.handle.device_wait
        self.history.add_step(record)
        self._speculative_stats.add(record)
        self.speculation.time_step(inflight.batch, record)
        return outputs

    def _finish(
        self, request: Request, reason: str, new_ids: list[int] | None = None
    ) -> RequestOutput:
        if request.status is RequestStatus.WAITING and request not in self.scheduler.waiting:
            request.status, request.finish_reason = RequestStatus.FINISHED, reason  # compiling
        else:
            self.scheduler.finish(request, reason)
        self.history.add_request(RequestTiming(request.arrival_time, request.token_times))
        output = self.outputs.finished_output(request, new_ids)
        samples = self._requests[request.request_id]
        if all(sample.finished for sample in samples):
            del self._requests[request.request_id]
            self.inbox.release(request.request_id)
        return output
