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
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

from tandem.config import EngineConfig, SpeculativeConfig
from tandem.engine.fan_out import fan_out
from tandem.engine.grammar import (
    GrammarCompiler,
    StepBitmasks,
    allowed_prefix,
    constrained_items,
    grammar_of,
    is_answer,
    prepare_reasoning,
)
from tandem.engine.intake import RequestIntake, eos_token_ids
from tandem.engine.outputs import OutputProcessor
from tandem.engine.stats import EngineStats, StepHistory
from tandem.execution.batch import SKIPPED_STEP, BatchBuilder, StopCheck
from tandem.execution.executor import WorkerFailure
from tandem.execution.kv_cache import layer_groups
from tandem.execution.setup import load_execution
from tandem.execution.streams import StepHandle
from tandem.metrics import RequestTiming, RunSummary, SpeculativeStats, StepRecord
from tandem.models.catalog import resolve_model
from tandem.models.errors import ModelLoadError
from tandem.models.generation_defaults import read_generation_defaults
from tandem.models.loader import find_tokenizer, read_config
from tandem.ops.kv_quant import row_width
from tandem.reasoning import resolve_parser
from tandem.request import Request, RequestOutput, RequestStatus, SamplingParams
from tandem.sampler.inputs import GrammarRows, LogprobRows
from tandem.scheduling.draft_policy import DraftPolicy, StepCosts
from tandem.scheduling.kv_groups import KVGroups
from tandem.scheduling.scheduler import ScheduledBatch, Scheduler
from tandem.scheduling.suffix_proposer import SuffixProposer

logger = logging.getLogger("tandem")


class _Keep:
    """`Engine.configure`'s default: leave the setting as it is."""


KEEP = _Keep()


# A step of more requests than this is not checked before it runs: they rarely all stop at once.
STOP_CHECK_MAX_REQUESTS = 8


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
        max_model_len = config.max_model_len or self.spec.max_position_embeddings
        if max_model_len > self.spec.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"{self.spec.max_position_embeddings}"
            )
        groups = layer_groups(self.spec, config.max_model_len)
        _check_speculation(config.speculative_config, groups)
        loaded = load_execution(config, path, self.spec, hf_config)
        self.num_kv_blocks = num_blocks = loaded.num_kv_blocks
        fits = groups.max_length(
            num_blocks, config.block_size, config.max_num_batched_tokens, max_model_len
        )
        if fits < max_model_len:
            logger.info(
                "KV cache holds %d tokens: max_model_len lowered from %d", fits, max_model_len
            )
            max_model_len = fits
        self.max_model_len = max_model_len

        self.scheduler = Scheduler(
            num_blocks,
            config.block_size,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            max_model_len,
            config.enable_prefix_caching,
            groups=groups,
        )
        self.builder = BatchBuilder(self.scheduler.block_table, config.block_size, max_model_len)
        self._depth = 1 if config.async_scheduling else 0
        self._step_costs: dict[tuple[str, int], StepCosts] = {}
        self._speculation(config.speculative_config)
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
            self.tokenizer,
            self.spec.vocab_size,
            eos_ids,
            max_model_len,
            config.seed,
            self.reasoning,
        )
        self.outputs = OutputProcessor(self.tokenizer, eos_ids, config.detokenize)
        self.grammars = GrammarCompiler(self.tokenizer, self.spec.vocab_size, eos_ids)
        self._compiling: list[tuple[list[Request], Future]] = []  # samples waiting for a grammar
        on_cuda = config.torch_device.type == "cuda"
        self._bitmasks = StepBitmasks(self.grammars.bitmask_width, pin_memory=on_cuda)
        self.history = StepHistory()
        storage = config.kv_storage_dtype
        row_bytes = row_width(self.spec.head_dim, storage) * storage.itemsize
        self._kv_bytes = self.spec.kv_bytes_by_window(row_bytes)
        logger.info(
            "KV cache: %d blocks of %d tokens, %s, %d bytes a token", num_blocks,
            config.block_size, kv_cache_kind(config), self.kv_bytes_per_token,
        )  # fmt: skip
        self._speculative_stats = SpeculativeStats()
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
        compile_grammar: bool = True,
    ) -> Request:
        """Tokenize and validate, without queuing: raises ValueError naming the problem.

        A structured output's grammar is compiled here, in the caller's thread (a bad one is
        refused now); with `compile_grammar=False` (input validated elsewhere: the server's front
        end) it is compiled off the loop once the request is submitted."""
        request = self.intake.make_request(prompt, params, request_id)
        spec = request.params.structured_outputs
        if spec is not None and compile_grammar:
            request.compiled_grammar = self.grammars.compile(spec)
            prepare_reasoning(request, self.grammars.bitmask_width)
        return request

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
        """Running and waiting requests, KV blocks, prefix-cache and speculation counters, at
        this moment."""
        return EngineStats.of(self.scheduler, self._speculative_stats)

    def summary(self) -> RunSummary:
        """Figures over the records kept (see `history` for windows)."""
        return self.history.summary()

    @property
    def async_scheduling(self) -> bool:
        return self._depth == 1

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
            self._depth = 1 if async_scheduling else 0
            if self.scheduler.drafts is not None:
                self.scheduler.drafts.costs = self._step_costs_of(self.builder.speculative)
        if enable_prefix_caching is not None:
            self.scheduler.enable_prefix_caching = enable_prefix_caching
            self.scheduler.reset_prefix_cache()
        if speculative_config is not KEEP:
            self._speculation(SpeculativeConfig.of(speculative_config))

    def _speculation(self, spec: SpeculativeConfig | None) -> None:
        _check_speculation(spec, self.scheduler.groups)
        loaded = self.config.speculative_config
        same_draft = loaded is not None and loaded.model == spec.model if spec else False
        if spec is not None and spec.method == "draft_model" and not same_draft:
            raise ValueError(
                "a draft model must be loaded with the engine "
                "(EngineConfig.speculative_config): this engine has none or another"
            )
        self.builder.speculative = spec
        self.scheduler.drafts = (
            None
            if spec is None
            else DraftPolicy(spec.num_speculative_tokens, spec.adaptive, self._step_costs_of(spec))
        )
        suffix = spec is not None and spec.method == "suffix"
        self.scheduler.proposer = SuffixProposer(spec, allowed_prefix) if suffix else None

    def _step_costs_of(self, spec: SpeculativeConfig) -> StepCosts:
        """The step times drafts are priced by, kept per method and loop for the engine's life:
        what a step of n tokens costs is the device's and the model's, so speculation switched
        off and on again (`configure`) does not time its steps afresh, drafting less meanwhile."""
        return self._step_costs.setdefault((spec.method, self._depth), StepCosts())

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
            if (
                self._inflight
                and self.runner.skips_stopped_steps
                and inputs.sampler.grammar is None
            ):
                inputs.stop_check = self._stop_check(batch, self._inflight[-1])
            t2 = time.perf_counter()
            handle = self.runner.launch(inputs)
            t3 = time.perf_counter()
            record = StepRecord(batch.step_id, batch.num_tokens, len(batch.items))
            record.kv_bytes = kv_bytes_read(self._kv_bytes, batch)
            record.spans = {"schedule": (t0, t1), "build": (t1, t2), "launch": (t2, t3)}
            sampler = inputs.sampler
            self._inflight.append(
                _InFlight(batch, handle, record, sampler.logprobs, sampler.grammar)
            )
            if inputs.sampler.grammar is not None:
                # Its bitmask needs every earlier token: retire the step before it first (its
                # forward runs meanwhile), then build the bitmask and launch the sampling.
                while len(self._inflight) > 1:
                    outputs.extend(self._retire(self._inflight.popleft()))
                self._sample_constrained(self._inflight[-1], inputs.sampler.drafts_to_host)
        elif not self._inflight and self._compiling:
            wait([f for _, f in self._compiling], timeout=0.05, return_when=FIRST_COMPLETED)
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
            self.grammars.close()

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
                spec = payload.params.structured_outputs
                if spec is not None and payload.compiled_grammar is None:
                    future = self.grammars.submit(spec)
                    future.add_done_callback(lambda _: self._wakeup.set())
                    self._compiling.append((samples, future))
                    continue
                for request in samples:
                    self.scheduler.add(request)
            elif (samples := self._requests.get(payload[0])) is not None:
                index = payload[1]
                for request in samples:  # every unfinished sample asked for ends here
                    if not request.finished and index in (None, request.index):
                        outputs.append(self._finish(request, "abort"))

    def _admit_compiled(self) -> list[RequestOutput]:
        """Queue the requests whose grammar has compiled; end those whose grammar failed."""
        outputs = []
        for entry in [e for e in self._compiling if e[1].done()]:
            self._compiling.remove(entry)
            samples, future = entry
            try:
                compiled, error = future.result(), None
            except ValueError as exc:
                compiled, error = None, str(exc)
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

    def _stop_check(self, batch: ScheduledBatch, previous: _InFlight) -> StopCheck | None:
        """The check that skips `batch` if each of its requests stops in the step before it
        (`StopCheck`): only for a few decodes without grammars, all of them in that step, whose
        output holds nothing but ids; None otherwise."""
        if (
            previous.logprobs is not None
            or len(batch.items) > STOP_CHECK_MAX_REQUESTS
            or batch.num_decodes != len(batch.items)
        ):
            return None
        before = previous.batch.sampled
        index = {id(item.request): j for j, item in enumerate(before)}
        items = [index.get(id(item.request)) for item in batch.items]
        if None in items:
            return None
        eos = self.eos_token_ids
        return StopCheck(
            previous_rows=tuple(item.num_rows for item in before),
            previous_verify=tuple(item.verify for item in before),
            items=tuple(items),
            stop_ids=tuple(
                frozenset(p.stop_token_ids).union(() if p.ignore_eos else eos)
                for p in (item.request.params for item in batch.items)
            ),
        )

    def _retire(self, inflight: _InFlight) -> list[RequestOutput]:
        record = inflight.record
        t0 = time.perf_counter()
        result = inflight.handle.wait()  # the step's one deliberate sync
        t1 = time.perf_counter()
        if isinstance(result, str) and result == SKIPPED_STEP:
            # Every request in it ended a step earlier: nothing ran, nothing to read.
            running = [
                it.request.request_id for it in inflight.batch.sampled if not it.request.finished
            ]
            if running:  # the check and the host disagree: tokens would be lost, so stop here
                raise RuntimeError(f"step {record.step_id} was skipped with {running} running")
            self.scheduler.retire_step(inflight.batch)
            for item in inflight.batch.sampled:
                self.scheduler.settle(item, 0)
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
                record.drafted += item.num_drafts
                record.accepted += len(tokens) - 1
                record.verified += 1
                request.speculation.count(item.num_drafts, len(tokens) - 1)
                self.scheduler.drafts.observe(request, item.num_drafts, len(tokens) - 1)
            reason, new = None, []
            for token, lp in zip(tokens, logprobs, strict=True):
                reason = self.outputs.append_token(request, token, t1, lp)
                if reason is None and request.compiled_grammar is not None and is_answer(request):
                    reason = self._advance_grammar(request, token)
                new.append(token)
                if reason is not None:
                    record.discarded += len(tokens) - len(new)  # after the stop: never streamed
                    break
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
        batch = inflight.batch
        if self.scheduler.drafts is not None and batch.num_decodes == len(batch.items):
            device = record.device[1] - record.device[0] - record.device_wait
            self.scheduler.drafts.observe_step(record.num_tokens, device)  # decodes' cost only
        return outputs

    def _advance_grammar(self, request: Request, token: int) -> str | None:
        """Feed a retired token to the sample's matcher: "stop" once the grammar has ended."""
        grammar = grammar_of(request)
        if not grammar.accept(token):  # only a token sampled outside its bitmask: a bug
            request.error = f"token {token} does not match the request's grammar"
            return "abort"
        return "stop" if grammar.terminated else None

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
            with self._lock:
                self._live_ids.discard(request.request_id)
        return output


def kv_cache_kind(config: EngineConfig) -> str:
    """e.g. "float32" or "int8 codes, a float32 scale per token and KV head"."""
    if config.kv_cache_dtype == "auto":
        return str(config.torch_dtype).removeprefix("torch.")
    return f"{config.kv_cache_dtype} codes, a float32 scale per token and KV head"


def _check_speculation(spec: SpeculativeConfig | None, groups: KVGroups) -> None:
    """A draft model reads every earlier position through the target's blocks, which a window
    gives back."""
    if spec is not None and groups.windowed and spec.method == "draft_model":
        raise ValueError(
            "speculative_config method 'draft_model' is not supported with a sliding-window "
            "model (its blocks before the window are freed); use 'ngram'"
        )


def kv_bytes_read(bytes_by_window: dict[int | None, int], batch: ScheduledBatch) -> int:
    """Bytes of K and V a step's attention reads at least: each request's positions up to its
    last new one, within each layer's window (`LlamaSpec.kv_bytes_by_window`)."""
    ends = [item.start + item.num_tokens for item in batch.items]
    total = 0
    for window, per_position in bytes_by_window.items():
        positions = sum(ends) if window is None else sum(min(end, window) for end in ends)
        total += per_position * positions
    return total
