"""ModelRunner: turns a step's host arrays into device work and launches it without waiting.

Everything a step does runs on the stream: copy inputs in, write host-known tokens into the token
table, gather input ids from the table, forward, sample, scatter the sampled ids into the table
(where the next step gathers them), copy them out. The host learns the sampled ids only in
`handle.wait()`, and a step whose grammar rows follow drafts hands its drafts over before its
forward (`step_drafts`).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from tandem.config import EngineConfig
from tandem.execution.batch import SKIPPED_STEP, StepInputs
from tandem.execution.cuda_graphs import (
    DecodeGraphs,
    GraphInputs,
    VerifyShape,
    graph_sizes,
    verify_shape,
)
from tandem.execution.drafting import ngram_drafts, place_tokens, proposed_drafts
from tandem.execution.kv_cache import (
    allocate_kv_cache,
    kv_bytes_per_block,
    layer_groups,
    num_blocks_for_budget,
)
from tandem.execution.pipeline import StageLinks
from tandem.execution.streams import JoinedHandle, StepHandle, make_stream
from tandem.execution.thread_plan import ThreadPlan
from tandem.execution.transfer import to_device
from tandem.models.llama import LlamaModel
from tandem.ops.attention_metadata import AttentionMetadata
from tandem.sampler.inputs import SamplerInputs, VerifyRows, select_rows
from tandem.sampler.logprobs import pack
from tandem.sampler.sampler import PendingSample, Sampler
from tandem.scheduling.kv_groups import KVGroups

SPARE_KV_BLOCKS = 1  # allocated after the scheduler's blocks: padded graph rows write K/V there
_NO_IDS = torch.empty(0, dtype=torch.int64)  # what a pipeline stage before the last returns


@dataclass
class _Pending:
    """A step's sampling state between its two parts (set on the stream by the first)."""

    sample: PendingSample | None = None
    sample_index: torch.Tensor | None = None
    input_ids: torch.Tensor | None = None  # where a verification's drafts are
    # The step's drafts on their way to the host (`step_drafts`), and the CUDA event after
    # their copy; `drafted` is set once the first part has made them, or has failed.
    drafts: torch.Tensor | None = None
    drafts_copied: torch.cuda.Event | None = None
    drafted: threading.Event = field(default_factory=threading.Event)


class _PinnedStaging:
    """Double-buffered pinned host memory and a copy stream: one host-to-device copy per step.

    The copy runs on its own stream, so step N+1's inputs travel while step N computes; the
    compute stream waits for it with an event. A buffer is rewritten only after the copy that last
    read it has completed.
    """

    def __init__(self, device: torch.device, num_buffers: int = 2):
        self.device = device
        self.copy_stream = torch.cuda.Stream(device)
        self._buffers: list[torch.Tensor | None] = [None] * num_buffers
        self._events: list[torch.cuda.Event | None] = [None] * num_buffers
        self._next = 0

    def upload(self, array: np.ndarray) -> torch.Tensor:
        """Called on the compute stream; returns the device copy, ordered before later work."""
        i = self._next
        self._next = (i + 1) % len(self._buffers)
        if self._events[i] is not None:
            self._events[i].synchronize()  # normally long done: the step that used it retired
        buf = self._buffers[i]
        if buf is None or buf.numel() < array.size or buf.dtype != _torch_dtype(array):
            buf = torch.empty(max(array.size, 1 << 14), dtype=_torch_dtype(array), pin_memory=True)
            self._buffers[i] = buf
        buf[: array.size].numpy()[:] = array
        compute = torch.cuda.current_stream(self.device)
        event = torch.cuda.Event()
        with torch.cuda.stream(self.copy_stream):
            out = buf[: array.size].to(self.device, non_blocking=True)
            event.record(self.copy_stream)
        compute.wait_event(event)
        out.record_stream(compute)  # allocated on the copy stream, used on the compute stream
        self._events[i] = event
        return out


def _torch_dtype(array: np.ndarray) -> torch.dtype:
    return torch.float32 if array.dtype == np.float32 else torch.int64


def _block_bytes(model: LlamaModel, config: EngineConfig) -> int:
    """A block id's bytes: one block of positions in each cache tensor of the model (of its
    pipeline stage)."""
    spec = model.spec
    places = _stage_places(model, layer_groups(spec, config.max_model_len))
    return kv_bytes_per_block(
        len(places), config.block_size, model.local_spec.num_kv_heads, spec.head_dim,
        config.kv_storage_dtype,
    )  # fmt: skip


def _stage_places(model: LlamaModel, groups: KVGroups) -> list[int]:
    """The cache tensors the layers of the model's pipeline stage use (all of them in one
    process)."""
    layers = model.stage.layers(model.spec.num_layers)
    return sorted({groups.layer_place[i] for i in layers})


def cache_capacity(
    model: LlamaModel, config: EngineConfig, device: torch.device, draft: LlamaModel | None = None
) -> int:
    """KV blocks this process can hold: `num_kv_blocks`, else what its memory budget fits for
    this model's (this rank's) KV heads, and a draft model's beside them (a block id holds
    both). The engine sizes the scheduler to it (TP: the least of the ranks')."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    per_block = _block_bytes(model, config) + (_block_bytes(draft, config) if draft else 0)
    return num_blocks_for_budget(
        per_block, device, config.kv_cache_memory_gib, config.gpu_memory_utilization
    )


def build_runner(
    model: LlamaModel,
    config: EngineConfig,
    device: torch.device,
    num_blocks: int,
    table_rows: int,
    max_model_len: int,
    draft: LlamaModel | None = None,
) -> ModelRunner:
    """A runner with its KV cache (the scheduler's blocks and the spare ones; a draft model's
    in the same blocks) and, where they apply, its captured decode graphs: the same for the
    engine's process and every TP rank."""

    def cache_of(m: LlamaModel, groups: KVGroups) -> list[torch.Tensor | None]:
        """Per layer, its cache tensor (layers of different groups share one; a layer of
        another pipeline stage has none)."""
        held = _stage_places(m, groups)
        tensors = allocate_kv_cache(
            len(held), num_blocks + SPARE_KV_BLOCKS, config.block_size,
            m.local_spec.num_kv_heads, m.spec.head_dim, config.kv_storage_dtype, device,
        )  # fmt: skip
        places = dict(zip(held, tensors, strict=True))
        return [places.get(p) for p in groups.layer_place]

    groups = layer_groups(model.spec, config.max_model_len)
    # A captured graph has one block table, and fixed shapes: steps of models with several
    # groups of layers, or with experts (whose row counts per expert the host reads), run
    # eagerly, as do a pipeline stage's (their hand-offs between stages are not captured).
    sizes = graph_sizes(device, config.enforce_eager, config.max_num_seqs)
    one_stage = model.stage.num_stages == 1
    sizes = sizes if groups.num_groups == 1 and model.spec.moe is None and one_stage else None
    caches = cache_of(model, groups)
    verify = (
        verify_shape(config.speculative_config, max_model_len, config.max_num_seqs)
        if sizes
        else None
    )
    runner = ModelRunner(
        model, caches, groups, table_rows, max_model_len, config.block_size, device, sizes, verify
    )
    if draft is not None:
        runner.draft = DraftModel(
            draft, cache_of(draft, layer_groups(draft.spec, config.max_model_len))
        )
    return runner


@dataclass
class DraftModel:
    """Speculative decoding's draft model and its KV cache (indexed by the target's blocks)."""

    model: LlamaModel
    kv_caches: list[torch.Tensor]


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[torch.Tensor],
        groups: KVGroups,
        table_rows: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        graph_sizes: list[int] | None = None,
        verify: VerifyShape | None = None,
    ):
        """`kv_caches` hold the scheduler's blocks plus SPARE_KV_BLOCKS, per layer (`groups`:
        which block tables the layers use); `graph_sizes`: the padded batch sizes to capture
        decode steps at (CUDA), None for eager steps only."""
        self.model = model
        self.kv_caches = kv_caches
        self.groups = groups
        self.block_size = block_size
        self.device = device
        # Every running request's tokens, by (table row, position): the only copy the device
        # needs; one row more, where padded graph rows put their samples and read drafts.
        sink = table_rows * max_model_len
        self.token_table = torch.zeros(sink + max_model_len, dtype=torch.int64, device=device)
        self.max_model_len = max_model_len
        # Speculative decoding: each row's length as the device knows it (a verification
        # advances it by what it accepts, which the host learns only when the step retires);
        # one entry more, where padded graph rows write theirs.
        self.lengths = torch.zeros(table_rows + 1, dtype=torch.int64, device=device)
        self.draft: DraftModel | None = None  # build_runner sets it
        self.links: StageLinks | None = None  # a pipeline stage's (set by its worker)
        # Everything that happens to the logits; owns penalties' per-row token counts.
        self.sampler = Sampler(table_rows, model.spec.vocab_size, device)
        self.stream = make_stream(device)
        self._threads: ThreadPlan | None = None
        self._constrained: _Pending | None = None  # the launched step awaiting its bitmask
        self._previous_output = np.zeros(0, np.int64)  # CPU: the last step's, as the host reads it
        weakref.finalize(self, self.stream.close)  # a dropped engine stops its worker thread
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._int_staging = _PinnedStaging(device)
            self._float_staging = _PinnedStaging(device)
            self._out = [
                torch.empty(table_rows, dtype=torch.int64, pin_memory=True) for _ in range(2)
            ]
            self._out_next = 0
        self.eager_verifications = 0  # verification steps run without a graph, for reports
        self.graphs: DecodeGraphs | None = None
        if graph_sizes:
            spare = kv_caches[0].shape[1] - SPARE_KV_BLOCKS
            width = -(-max_model_len // block_size)
            self.graphs = DecodeGraphs(
                graph_sizes, width, spare, block_size, sink, table_rows, device, verify
            )
            with torch.inference_mode():
                self.graphs.capture(self._graph_step)

    @property
    def skips_stopped_steps(self) -> bool:
        """Whether a step's `StopCheck` is read (CPU: the previous step's tokens are at hand)."""
        return not self._cuda

    def launch(self, inputs: StepInputs) -> StepHandle:
        """Enqueue the step and return at once; the handle's wait() yields the sampled ids.

        A step with grammar rows stops before sampling them: `sample_constrained` finishes it
        with their bitmask, which the host builds while this part runs."""
        # CPU: the tensor views are made here, while the device runs the step before this one;
        # CUDA: the upload is the stream's first work (`_execute`).
        views = None if self._cuda else to_device(inputs, None)
        if inputs.sampler.grammar is None or not self.model.stage.is_last:
            return self.stream.submit(lambda: self._execute(inputs, views))
        pending = _Pending()
        self._constrained = pending
        return self.stream.submit(lambda: self._execute_constrained(inputs, views, pending))

    def step_drafts(self, first: StepHandle) -> np.ndarray:
        """The drafts of the step `launch` just returned (every verifying request's, in batch
        order), as soon as the device has made them, before its forward: the host waits for
        them here, deliberately (its grammar rows' bitmask follows the drafts), once per step
        whose `SamplerInputs.drafts_to_host`."""
        pending = self._constrained
        pending.drafted.wait()
        if pending.drafts is None:
            first.wait()  # raises what the step raised
            raise RuntimeError("the step ended without making its drafts")
        if pending.drafts_copied is not None:
            pending.drafts_copied.synchronize()
        return pending.drafts.numpy()

    def sample_constrained(self, first: StepHandle, bitmask: torch.Tensor) -> StepHandle:
        """The rest of the step `launch` just returned: its grammar rows sampled under `bitmask`
        ([rows, words] int32; on CUDA from pinned memory, copied without a sync)."""
        pending, self._constrained = self._constrained, None
        second = self.stream.submit(lambda: self._finish_sampling(pending, bitmask))
        return JoinedHandle(first, second)

    def close(self) -> None:
        self.stream.close()

    @property
    def graph_sizes(self) -> list[int]:
        """The padded batch sizes whose decode steps replay a captured graph."""
        return self.graphs.sizes if self.graphs is not None else []

    @property
    def graph_histories(self) -> tuple[int, ...]:
        """The history bands of the captured ngram verifications (none: they run eagerly)."""
        verify = self._graph_verify
        return verify.histories if verify is not None else ()

    @property
    def graph_verify_tokens(self) -> int:
        """The most tokens a captured ngram verification holds (0: they run eagerly)."""
        verify = self._graph_verify
        return max(verify.sizes) if verify is not None else 0

    @property
    def _graph_verify(self) -> VerifyShape | None:
        return self.graphs.verify if self.graphs is not None else None

    def check_health(self) -> None:
        """In-process execution has no separate worker to lose (see MultiprocExecutor)."""

    def set_cpu_threads(self, plan: ThreadPlan) -> None:
        """CPU: compute threads per step, by its prefill tokens and the K/V it reads.

        Small decode GEMMs may run best on fewer threads (leaving the host a core), while a
        prefill's large GEMMs, or a long context's attention, may want every core; the count
        is switched per step, on the stream."""
        self._threads = plan

    # ------------------------------------------------------------ on the stream
    def _execute_constrained(self, x: StepInputs, views: StepInputs | None, pending: _Pending):
        try:
            return self._execute(x, views, pending)
        finally:
            pending.drafted.set()  # a step that failed before its drafts: step_drafts raises

    @torch.inference_mode()
    def _execute(self, x: StepInputs, views: StepInputs | None, pending: _Pending | None = None):
        """Step `x` on the stream; `views`: its tensors, made by the host (CPU), or None: upload
        them here (CUDA)."""
        if self._threads is not None:
            # Each row reads its context. A plan is set on a CPU only: a host tensor, no sync.
            kv_positions = int(x.context_lens.sum())
            wanted = self._threads.threads(x.num_tokens - x.num_decodes, kv_positions)
            if torch.get_num_threads() != wanted:
                torch.set_num_threads(wanted)
        for slot, adapter in x.lora_loads:  # in stream order: steps before read the old one
            self.model.lora.write(slot, adapter)
        if x.stop_check is not None and x.stop_check.all_stopped(self._previous_output):
            self._previous_output = np.zeros(0, np.int64)  # this step made none
            return SKIPPED_STEP
        adapted = len(x.lora_slots) > 0  # a captured graph runs the base model only
        if self.graphs is not None and not adapted and (ids := self._replay(x)) is not None:
            return self._to_host(ids)
        t = views if views is not None else to_device(x, self._upload)
        table = self.token_table
        links, stage = self.links, self.model.stage
        if links is not None and not stage.is_last:  # earlier steps' ids, where they'd be by now
            links.take_ids(table, self.lengths, x.reads_through)
        if len(x.known_index):
            table.index_copy_(0, t.known_index, t.known_tokens)
        if len(x.length_rows):
            self.lengths.index_copy_(0, t.length_rows, t.lengths)
        v = t.sampler.verify
        if v is not None:
            self.eager_verifications += 1
            self._prepare_verification(t, v)
        input_ids = table[t.token_index]
        if pending is not None and x.sampler.drafts_to_host:
            self._drafts_to_host(pending, input_ids[v.draft_batch])
        meta = AttentionMetadata(
            slot_mapping=t.slot_mapping,
            block_tables=t.block_tables,
            context_lens=t.context_lens,
            num_decodes=x.num_decodes,
            decode_max_blocks=x.decode_max_blocks,
            prefills=x.prefills,
            block_size=self.block_size,
            distinct_decodes=v is None,  # a verification gives a request several decode rows
        )
        if len(x.group_block_tables):
            meta.by_layer = self._layer_metadata(meta, t)
        self.stream.wake_waiters()  # the previous step's results go to the host now
        extra = {"lora_slots": t.lora_slots} if adapted else {}  # base steps: the plain call
        if links is not None and not stage.is_first:  # where the stage before stopped
            extra["carried"] = links.receive_stream(x.num_tokens)
        hidden = self.model(input_ids, t.positions, self.kv_caches, meta, **extra)
        if links is not None and not stage.is_last:  # no sampling here
            links.hand_on(hidden, x.step_id, t.sample_index, v.table_rows if v else None)
            return _NO_IDS
        if x.draft_kv and self.draft is not None:  # the draft's KV of every token, as the target's
            self.draft.model(input_ids, t.positions, self.draft.kv_caches, meta)
        sample = self.sampler.begin(
            hidden, t.logits_index, self.model.compute_logits, t.sampler, table, input_ids
        )
        if pending is not None:  # the grammar rows' bitmask comes in the step's second part
            pending.sample, pending.sample_index = sample, t.sample_index
            pending.input_ids = input_ids
            return None
        return self._store(t.sample_index, input_ids, *self.sampler.finish(sample), t.sampler)

    def _drafts_to_host(self, pending: _Pending, drafts: torch.Tensor) -> None:
        if self._cuda:  # a non-blocking copy; step_drafts waits for its event, not the step
            pending.drafts = torch.empty(len(drafts), dtype=torch.int64, pin_memory=True)
            pending.drafts.copy_(drafts, non_blocking=True)
            pending.drafts_copied = torch.cuda.Event()
            pending.drafts_copied.record()
        else:
            pending.drafts = drafts
        pending.drafted.set()

    def _layer_metadata(self, meta: AttentionMetadata, t: StepInputs) -> list[AttentionMetadata]:
        """Each layer's metadata: its group's slots and block tables (group 0's is `meta`)."""
        metas = [meta] + [
            replace(meta, slot_mapping=slots, block_tables=tables)
            for slots, tables in zip(t.group_slot_mapping, t.group_block_tables, strict=True)
        ]
        return [metas[g] for g in self.groups.layer_group]

    @torch.inference_mode()
    def _finish_sampling(self, pending: _Pending, bitmask: torch.Tensor):
        # The step's tensors are freed here, in the step: freed where the job is dropped, after
        # the engine has woken to read the step, they would wait for the GIL the engine holds.
        sample, pending.sample = pending.sample, None
        input_ids, pending.input_ids = pending.input_ids, None
        ids, logprobs = self.sampler.finish(sample, bitmask)
        return self._store(pending.sample_index, input_ids, ids, logprobs, sample.x)

    def _prepare_verification(self, t: StepInputs, v: VerifyRows[torch.Tensor]) -> None:
        """Place the verifying requests' tokens by the device's lengths and write their drafts
        into the token table, where the step gathers its inputs."""
        lengths = self.lengths[v.table_rows]
        place_tokens(t, v, lengths, self.max_model_len, self.block_size)
        if v.max_drafts == 0:
            return
        if v.method == "draft_model":
            self._draft_model_drafts(t, v, lengths)
            return
        make = proposed_drafts if v.proposals is not None else ngram_drafts
        drafts = make(self.token_table, v, lengths, self.max_model_len)
        self.token_table.index_copy_(
            0, t.token_index[v.draft_batch], drafts[v.draft_item, v.draft_index]
        )

    def _draft_model_drafts(
        self, t: StepInputs, v: VerifyRows[torch.Tensor], lengths: torch.Tensor
    ) -> None:
        """Pass j feeds each request with more than j drafts its token at `length - 1 + j` and
        samples the next with the target's settings and seeded noise of that position (so a
        draft that agrees with the target's draw is accepted); each draft goes into the table,
        where the next pass and the target's forward read it."""
        draft, table, bs, width = self.draft, self.token_table, self.block_size, t.block_tables
        offset = 0
        for j, size in enumerate(v.pass_sizes):
            items = v.pass_items[offset : offset + size]
            offset += size
            positions = lengths[items] - 1 + j
            at = v.table_rows[items] * self.max_model_len + positions
            blocks = width[v.item_batch[items]]
            slots = blocks.gather(1, (positions // bs)[:, None])[:, 0] * bs + positions % bs
            meta = AttentionMetadata(
                slot_mapping=slots, block_tables=blocks, context_lens=positions + 1,
                num_decodes=size, decode_max_blocks=t.decode_max_blocks, prefills=[],
                block_size=bs,
            )  # fmt: skip
            hidden = draft.model(table[at], positions, draft.kv_caches, meta)
            rows = select_rows(t.sampler.sampling, v.item_row[items])
            rows.output_index = positions + 1 - v.prompt_lens[items]
            table.index_copy_(
                0, at + 1, self.sampler.sample(draft.model.compute_logits(hidden), rows)
            )

    def _store(
        self,
        sample_index: torch.Tensor,
        input_ids: torch.Tensor,
        ids: torch.Tensor,
        logprobs: list,
        x: SamplerInputs[torch.Tensor],
    ):
        """Sampled ids into the token table and to the host (see `_keep`)."""
        ids = self._keep(sample_index, input_ids, ids, x)
        if self.links is not None:  # the last stage: the stages before keep their tables alike
            self.links.send_ids(ids)
        return self._to_host(pack(ids, logprobs) if logprobs else ids)

    def _keep(
        self,
        sample_index: torch.Tensor,
        input_ids: torch.Tensor,
        ids: torch.Tensor,
        x: SamplerInputs[torch.Tensor],
    ) -> torch.Tensor:
        """Sampled ids into the token table (the next step gathers them); a verification's
        kept counts advance its rows' lengths and follow the ids (what the host reads)."""
        if len(ids):
            self.token_table.index_copy_(0, sample_index, ids)
        if x.verify is not None:
            kept = self.sampler.keep_verified(ids, input_ids, x)
            self.lengths.index_add_(0, x.verify.table_rows, kept)
            ids = torch.cat([ids, kept])
        return ids

    def _replay(self, x: StepInputs) -> torch.Tensor | None:
        """A decode step (or an ngram verification) through its captured graph; None if it
        has none."""
        key = self.graphs.key_for(x)
        if key is None:
            return None
        size = key[0]
        words = self.graphs.pack(x, size)
        # On a CPU the graph logic runs eagerly (tests/test_cuda_graphs.py).
        uploaded = self._int_staging.upload(words) if self._cuda else torch.from_numpy(words)
        if len(x.known_index):
            self.token_table.index_copy_(0, *self.graphs.known_tokens(uploaded, size, x))
        return self.graphs.replay(key, uploaded, x)

    def _graph_step(self, inputs: GraphInputs, mode: str, history: int | None) -> torch.Tensor:
        """What a captured step does, from the static buffers: the eager path's decode at a
        fixed padded size; with a history band, its verification too. Returns the sampled ids
        (then, verifying, each request's kept count)."""
        n = inputs.size
        i = inputs.ints
        self.lengths.index_copy_(0, i["length_rows"], i["lengths"])  # under speculation
        verify = None if history is None else inputs.verify_rows(self.graphs.verify, history)
        t = inputs.step(mode, verify)
        if verify is not None:
            self._prepare_verification(t, verify)
        input_ids = self.token_table[t.token_index]  # one past the padded rows: a spare read
        meta = AttentionMetadata(
            slot_mapping=t.slot_mapping[:n],
            block_tables=t.block_tables[:n],
            context_lens=t.context_lens[:n],
            num_decodes=n,
            decode_max_blocks=t.block_tables.shape[1],
            prefills=[],
            block_size=self.block_size,
            distinct_decodes=verify is None,
        )
        hidden = self.model(input_ids[:n], t.positions[:n], self.kv_caches, meta)
        ids = self.sampler.sample(self.model.compute_logits(hidden), inputs.sampling(mode, n))
        return self._keep(t.sample_index[:n], input_ids, ids, t.sampler)

    def _upload(self, packed: np.ndarray) -> torch.Tensor:
        """CUDA: one pinned, double-buffered copy per dtype of the step's arrays."""
        staging = self._float_staging if packed.dtype == np.float32 else self._int_staging
        return staging.upload(packed)

    def _to_host(self, packed: torch.Tensor):
        """CPU: the tensor itself. CUDA: a non-blocking copy into pinned memory (double buffered:
        a buffer is rewritten two steps later, after the engine has read it)."""
        if not self._cuda:
            self._previous_output = packed.numpy()  # what a `StopCheck` of the next step reads
            return packed
        i = self._out_next
        self._out_next = 1 - i
        if self._out[i].numel() < packed.numel():  # logprobs outgrew it: a larger one, kept
            self._out[i] = torch.empty(
                max(packed.numel(), 2 * self._out[i].numel()), dtype=torch.int64, pin_memory=True
            )
        host = self._out[i][: packed.numel()]
        host.copy_(packed, non_blocking=True)
        return host
