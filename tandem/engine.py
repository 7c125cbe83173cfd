"""The engine loop: schedule, build, launch, retire; synchronous or asynchronous.

Async (the default) launches step N+1 before retiring step N, so the host's scheduling and
building overlap the device's compute. The scheduler speculates that nothing in flight finishes;
a request that does finish has its one extra in-flight token discarded at retirement.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import GenerationConfig

from tandem.batch import BatchBuilder, StepExtras
from tandem.config import EngineConfig
from tandem.detokenizer import IncrementalDetokenizer, NoDetokenizer
from tandem.distributed.executor import MultiprocExecutor, WorkerFailure
from tandem.distributed.parallel import check_shardable
from tandem.logprobs import LogprobsArrays, unpack
from tandem.metrics import RequestTiming, RunSummary, StepRecord, summarize
from tandem.models import fast_path
from tandem.models.loader import build_model, find_tokenizer, read_config
from tandem.ops import cpu_kernels
from tandem.request import LogitsProcessing, Request, RequestOutput, SamplingParams
from tandem.runner import ModelRunner, build_runner, cache_capacity
from tandem.sampling import seed_key
from tandem.scheduler import ScheduledBatch, Scheduler
from tandem.streams import StepHandle

logger = logging.getLogger("tandem")

METRICS_HISTORY = 100_000  # step and request records kept: bounded, so a server can run for days


@dataclass
class _InFlight:
    batch: ScheduledBatch
    handle: StepHandle
    record: StepRecord
    extras: StepExtras | None  # how to read logprobs out of the step's packed output


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        device, dtype = config.torch_device, config.torch_dtype
        parallel = config.tensor_parallel_size > 1
        if device.type == "cpu" and config.cpu_threads is not None and not parallel:
            torch.set_num_threads(config.cpu_threads)
        if config.model is None:
            from tandem.default_model import default_model_path

            model_path = default_model_path()
        else:
            model_path = Path(config.model)
        path, self.spec, hf_config = read_config(model_path)
        self.model_path = path
        # None for a folder without tokenizer files (config.json for dummy weights): the engine
        # then takes token-id prompts only and its outputs carry token ids, not text.
        self.tokenizer = find_tokenizer(path)
        self._backend_tokenizer = self.tokenizer.backend_tokenizer if self.tokenizer else None
        if self.tokenizer is None:
            logger.info("%s has no tokenizer files: prompts must be token ids", path)
        self.eos_token_ids = _eos_token_ids(hf_config, self.tokenizer, path)
        max_model_len = config.max_model_len or self.spec.max_position_embeddings
        if max_model_len > self.spec.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"{self.spec.max_position_embeddings}"
            )

        if parallel:  # the ranks load their shards and size their caches; the minimum holds
            check_shardable(self.spec, config.tensor_parallel_size)
            executor = MultiprocExecutor(config, str(path))
            num_blocks = executor.num_kv_blocks
        else:
            model = build_model(
                path, self.spec, hf_config, dtype, device, config.max_model_len,
                load_format=config.load_format, seed=config.seed,
            )  # fmt: skip
            self.execution = fast_path.prepare(model, device, dtype, config.enforce_eager)
            num_blocks = cache_capacity(model, config, device)
        cache_tokens = num_blocks * config.block_size
        if cache_tokens < max_model_len:
            logger.info(
                "KV cache holds %d tokens: max_model_len lowered from %d",
                cache_tokens,
                max_model_len,
            )
            max_model_len = cache_tokens
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_blocks

        self.scheduler = Scheduler(
            num_blocks,
            config.block_size,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            max_model_len,
            config.enable_prefix_caching,
        )
        self.builder = BatchBuilder(self.scheduler.block_table, config.block_size, max_model_len)
        table_rows = self.scheduler.slots.size
        if parallel:
            executor.start(num_blocks, table_rows, max_model_len)
            self.runner: ModelRunner | MultiprocExecutor = executor
            self.execution = executor.plan
        else:
            self.runner = build_runner(model, config, device, num_blocks, table_rows, max_model_len)
            self.execution.cuda_graph_sizes = self.runner.graph_sizes
            if device.type == "cpu" and config.cpu_threads is not None:  # kept per engine
                self.runner.set_cpu_threads(config.cpu_threads, config.cpu_threads)
                self.execution.cpu_threads = config.cpu_threads
            elif device.type == "cpu" and self.execution.kernels:
                self._tune_cpu_threads(model)
            # Loading the model opened parallel regions on this thread; the steps may be
            # submitted from another (a server's loop), and this thread's OpenMP team would
            # throttle the device thread's (`CPUStream.submit`).
            cpu_kernels.release_openmp_threads()
        logger.info("execution: %s", self.execution.describe())
        self._depth = 1 if config.async_scheduling else 0
        self._inflight: deque[_InFlight] = deque()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        if parallel:
            self.runner.on_exit = self._wakeup.set  # an idle loop learns of a dead rank at once
        self._live_ids: set[str] = set()
        self._requests: dict[str, list[Request]] = {}  # request id -> its samples
        self._detok: dict[tuple[str, int], IncrementalDetokenizer] = {}
        self._seed_counter = itertools.count()
        self._token_text: dict[int, str] = {}  # token id -> its text, for logprobs
        self.step_records: deque[StepRecord] = deque(maxlen=METRICS_HISTORY)
        self.finished_timings: deque[RequestTiming] = deque(maxlen=METRICS_HISTORY)

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
        params = params or SamplingParams()
        if params.stop and self.tokenizer is None:
            raise ValueError(
                "stop strings need a tokenizer, and this model has no tokenizer "
                "(its folder has no tokenizer files): use stop_token_ids"
            )
        token_ids = self._tokenize(prompt)
        max_tokens = self._resolve_max_tokens(len(token_ids), params)
        processing = self._logits_processing(params)
        seed = params.seed
        if seed is None:  # derived from the engine seed and arrival order: runs are reproducible
            seed = hash((self.config.seed, next(self._seed_counter)))
        return Request(
            request_id=request_id if request_id is not None else uuid.uuid4().hex,
            prompt_token_ids=token_ids,
            params=params,
            seed=seed,
            sampling_row=self._sampling_row(params, seed),
            max_tokens=max_tokens,
            arrival_time=time.perf_counter(),
            processing=processing,
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )

    def _sampling_row(self, params: SamplingParams, seed: int) -> tuple:
        top_k = params.top_k if params.top_k < self.spec.vocab_size else 0  # whole vocab: off
        return (params.temperature, top_k, params.top_p, params.min_p, seed_key(seed))

    def _logits_processing(self, params: SamplingParams) -> LogitsProcessing | None:
        """Resolve penalties, logit_bias and min_tokens against the model; None if unused."""
        vocab = self.spec.vocab_size
        bias = params.logit_bias or {}
        bad = [t for t in bias if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})")
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        processing = LogitsProcessing(
            presence=params.presence_penalty,
            frequency=params.frequency_penalty,
            repetition=params.repetition_penalty,
            bias_ids=np.fromiter(bias, np.int64, len(bias)),
            bias_values=np.fromiter(bias.values(), np.float32, len(bias)),
            min_tokens=params.min_tokens,
            # Ids past the logits cannot be sampled anyway (and must not index them).
            min_tokens_ids=np.array(
                sorted(t for t in stops if t < vocab) if params.min_tokens else [], np.int64
            ),
        )
        return processing if processing.used else None

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

    def abort(self, request_id: str) -> None:
        """Thread-safe; aborting an unknown or finished request does nothing."""
        self._inbox.put(("abort", request_id))
        self._wakeup.set()

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._live_ids) or bool(self._inflight)

    @property
    def async_scheduling(self) -> bool:
        return self._depth == 1

    @async_scheduling.setter
    def async_scheduling(self, enabled: bool) -> None:
        """Switch loops between runs (the benchmark compares both on one set of weights)."""
        if self.has_unfinished():
            raise RuntimeError("switch the loop only while the engine is idle")
        self._depth = 1 if enabled else 0

    @property
    def enable_prefix_caching(self) -> bool:
        return self.scheduler.enable_prefix_caching

    @enable_prefix_caching.setter
    def enable_prefix_caching(self, enabled: bool) -> None:
        """Switch prefix caching between runs (the benchmark compares both); switching drops
        the cached blocks no request holds, so each run starts cold."""
        if self.has_unfinished():
            raise RuntimeError("switch prefix caching only while the engine is idle")
        self.scheduler.enable_prefix_caching = enabled
        self.scheduler.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block no request holds (only while idle)."""
        if self.has_unfinished():
            raise RuntimeError("reset the prefix cache only while the engine is idle")
        self.scheduler.reset_prefix_cache()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

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
            self._inflight.append(_InFlight(batch, handle, record, inputs.extras))
        while self._inflight and (len(self._inflight) > self._depth or batch is None):
            outputs.extend(self._retire(self._inflight.popleft()))
        return outputs

    def stream_outputs(self) -> Iterator[RequestOutput]:
        """Run until every queued request has finished, yielding outputs as they come."""
        while self.has_unfinished():
            yield from self.step()

    def reset_metrics(self) -> None:
        self.step_records.clear()
        self.finished_timings.clear()

    def summary(self) -> RunSummary:
        """Figures over the records kept (the last METRICS_HISTORY steps and requests)."""
        return summarize(list(self.step_records), list(self.finished_timings))

    def close(self) -> None:
        try:
            while self._inflight:
                self._retire(self._inflight.popleft())
        except WorkerFailure:
            pass  # already raised by the step that met it; what is left is to stop the ranks
        finally:
            self.runner.close()

    # ------------------------------------------------------------- internals
    def _tune_cpu_threads(self, model) -> None:
        """Time a decode step per thread count where the steps will run (the device thread, with
        its own OpenMP team); the runner applies the pick to decode steps, every core to prefills."""
        batch = min(self.config.max_num_seqs, 32)
        timings = self.runner.stream.submit(lambda: fast_path.tune_cpu_threads(model, batch))
        self.execution.thread_timings_ms = timings.wait()
        best = fast_path.pick_cpu_threads(self.execution.thread_timings_ms, batch)
        self.execution.cpu_threads = best
        self.runner.set_cpu_threads(best, max(self.execution.thread_timings_ms))

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "this model has no tokenizer (its folder has no tokenizer files): "
                    "give the prompt as a list of token ids"
                )
            if not prompt:
                raise ValueError("prompt is empty")
            token_ids = self.tokenizer(prompt).input_ids
        elif isinstance(prompt, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            token_ids = list(prompt)
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        if not token_ids:
            raise ValueError("prompt is empty")
        bad = [t for t in token_ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {self.spec.vocab_size})"
            )
        return token_ids

    def _resolve_max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ValueError(
                f"prompt has {prompt_len} tokens, which leaves no room to generate within "
                f"max_model_len {self.max_model_len}"
            )
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise ValueError(
                f"prompt ({prompt_len} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len {self.max_model_len}"
            )
        return params.max_tokens

    def _drain_inbox(self) -> list[RequestOutput]:
        outputs = []
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return outputs
            if kind == "add":
                samples = self._fan_out(payload)
                self._requests[payload.request_id] = samples
                for request in samples:
                    self._detok[request.key] = (
                        NoDetokenizer()
                        if self._backend_tokenizer is None
                        else IncrementalDetokenizer(
                            self._backend_tokenizer,
                            request.prompt_token_ids,
                            request.params.stop,
                            request.params.skip_special_tokens,
                        )
                    )
                    self.scheduler.add(request)
            elif (samples := self._requests.get(payload)) is not None:
                for request in samples:  # live, so at least one sample finishes here
                    if not request.finished:
                        outputs.append(self._finish(request, "abort"))

    def _fan_out(self, request: Request) -> list[Request]:
        """n > 1: the request's samples, each its own Request with its own seed.

        They share the prompt through the prefix cache: sample 0 prefills it, and the others,
        held back while its blocks are being computed (`Scheduler`), then find them cached and
        compute only the prompt's tail (at most one block) before sampling with their own seed.
        """
        samples = [request]
        for i in range(1, request.params.n):
            sample = copy.copy(request)
            # Per-sample state, nothing aliased: copies of the request's, which has not run yet
            # (so they hold only initial values, like prompt_logprobs' leading None).
            for name, value in vars(request).items():
                if isinstance(value, (list, dict, set)) and name != "prompt_token_ids":
                    setattr(sample, name, type(value)(value))
            sample.index = i
            sample.seed = sample_seed(request.seed, i)
            sample.sampling_row = self._sampling_row(request.params, sample.seed)
            samples.append(sample)
        return samples

    def _retire(self, inflight: _InFlight) -> list[RequestOutput]:
        record = inflight.record
        t0 = time.perf_counter()
        result = inflight.handle.wait()  # the step's one deliberate sync
        t1 = time.perf_counter()
        sampled = inflight.batch.sampled
        extras = inflight.extras
        logprobs: list = [None] * len(sampled)
        if extras is None:
            sampled_ids = result.tolist()
        else:
            ids, groups = unpack(result.numpy(), len(sampled), extras.output_groups)
            sampled_ids = ids.tolist()
            if len(extras.logprob_rows):
                rows = extras.logprob_rows.tolist()
                entries = groups.pop(0).to_dicts(
                    [sampled_ids[s] for s in rows],
                    [sampled[s].request.params.logprobs for s in rows],
                    self._decode_token,
                )
                for s, entry in zip(rows, entries, strict=True):
                    logprobs[s] = entry
            if groups:
                self._add_prompt_logprobs(extras, groups[0])
        # Before the tokens: a request that finishes on one of them still caches its full blocks.
        self.scheduler.retire_step(inflight.batch)
        outputs = []
        for item, token, lp in zip(sampled, sampled_ids, logprobs, strict=True):
            request = item.request
            request.num_inflight -= 1
            if request.finished:
                continue  # the speculative token of a request that finished a step earlier
            outputs.append(self._append_token(request, token, t1, lp))
        record.spans["wait"] = (t0, t1)
        record.spans["update"] = (t1, time.perf_counter())
        record.device = inflight.handle.device_span
        self.step_records.append(record)
        return outputs

    def _add_prompt_logprobs(self, extras: StepExtras, arrays: LogprobsArrays) -> None:
        """Append each prompt position's result; positions recomputed after a preemption that
        were already retired are skipped (steps retire in order, so the list grows in order)."""
        spans = extras.prompt_logprob_spans
        entries = arrays.to_dicts(
            [r.prompt_token_ids[p + 1] for r, first, n in spans for p in range(first, first + n)],
            [r.params.prompt_logprobs for r, _, n in spans for _ in range(n)],
            self._decode_token,
        )
        j = 0
        for request, first, count in spans:
            done = request.prompt_logprobs
            for p in range(first, first + count):
                if p + 1 == len(done):
                    done.append(entries[j])
                j += 1

    def _decode_token(self, token: int) -> str | None:
        """A token's text for logprobs; None without a tokenizer."""
        if self._backend_tokenizer is None:
            return None
        text = self._token_text.get(token)
        if text is None:
            text = self._backend_tokenizer.decode([token], skip_special_tokens=False)
            self._token_text[token] = text
        return text

    def _append_token(
        self, request: Request, token: int, now: float, logprobs: dict | None = None
    ) -> RequestOutput:
        request.output_token_ids.append(token)
        request.token_times.append(now)
        if request.logprobs is not None:
            request.logprobs.append(logprobs)
        params = request.params
        detok = self._detok[request.key]
        reason = None
        if (
            token in params.stop_token_ids
            or (token in self.eos_token_ids and not params.ignore_eos)
            # Stop strings count only from min_tokens on (as in vLLM); stop ids are masked before.
            or detok.add(token, check_stop=len(request.output_token_ids) >= params.min_tokens)
        ):
            reason = "stop"
        elif len(request.output_token_ids) >= request.max_tokens:
            reason = "length"
        if reason is not None:
            return self._finish(request, reason)
        return self._output(request, detok, detok.delta(finished=False), [token])

    def _finish(self, request: Request, reason: str) -> RequestOutput:
        self.scheduler.finish(request, reason)
        self.finished_timings.append(RequestTiming(request.arrival_time, request.token_times))
        detok = self._detok.pop(request.key)
        new_ids = request.output_token_ids[-1:] if reason != "abort" else []
        output = self._output(request, detok, detok.delta(finished=True), new_ids, finished=True)
        samples = self._requests[request.request_id]
        if all(sample.finished for sample in samples):
            del self._requests[request.request_id]
            with self._lock:
                self._live_ids.discard(request.request_id)
        return output

    @staticmethod
    def _output(
        request: Request,
        detok: IncrementalDetokenizer | NoDetokenizer,
        delta_text: str,
        delta_ids: list[int],
        finished: bool = False,
    ) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            text=detok.emitted_text,
            # Cumulative ids: a copy when finished, else the live list (copying every step is O(n^2)).
            token_ids=list(request.output_token_ids) if finished else request.output_token_ids,
            delta_text=delta_text,
            delta_token_ids=delta_ids,
            finished=finished,
            finish_reason=request.finish_reason if finished else None,
            index=request.index,
            logprobs=_snapshot(request.logprobs, finished),
            prompt_logprobs=_snapshot(request.prompt_logprobs, finished),
        )


def _snapshot(values: list | None, finished: bool) -> list | None:
    """Like token_ids: a running request's live list, a finished one's own copy."""
    return list(values) if finished and values is not None else values


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded `seed`.

    Sample 0 keeps the request's seed, so n = 1 and sample 0 of n > 1 agree; the others get
    distinct seeds derived from (seed, index) by a stable hash: the same in every run and process.
    """
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _eos_token_ids(hf_config, tokenizer, path: Path) -> set[int]:
    ids: set[int] = set()
    for source in (hf_config.eos_token_id, getattr(tokenizer, "eos_token_id", None)):
        ids.update(source if isinstance(source, list) else [source] if source is not None else [])
    if (path / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(path, local_files_only=True).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids
