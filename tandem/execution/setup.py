"""An engine's device side, built in two phases: load the weights and size the KV cache (here or
in every tensor-parallel rank), then, once the scheduler exists, allocate the cache and start the
runner. The engine never sees which of the two kinds of executor it got."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.config import EngineConfig
from tandem.execution import fast_path
from tandem.execution.cpu_threads import apply_cpu_threads
from tandem.execution.executor import MultiprocExecutor
from tandem.execution.fast_path import ExecutionPlan
from tandem.execution.launcher import agree_on_blocks, join_launcher_group
from tandem.execution.runner import ModelRunner, build_runner, cache_capacity
from tandem.models.catalog import resolve_model
from tandem.models.llama import LlamaModel
from tandem.models.loader import build_model, read_config
from tandem.models.parallel import SINGLE, check_shardable, pipeline_stage
from tandem.models.spec import LlamaSpec
from tandem.ops import cpu_kernels

Executor = ModelRunner | MultiprocExecutor  # launch(inputs) -> handle; handle.wait() -> ids


@dataclass
class LoadedExecution:
    """Weights loaded, KV capacity known; `start` builds the runner."""

    config: EngineConfig
    num_kv_blocks: int
    model: LlamaModel | None  # in this process; None over several ranks
    executor: MultiprocExecutor | None  # the ranks; None in one process
    plan: ExecutionPlan | None  # one process: known once loaded; TP: once started
    draft: LlamaModel | None = None  # speculative decoding's draft model, when it has one

    def start(self, table_rows: int, max_model_len: int) -> tuple[Executor, ExecutionPlan]:
        config = self.config
        if self.executor is not None:
            self.executor.start(self.num_kv_blocks, table_rows, max_model_len)
            return self.executor, self.executor.plan
        model, plan, device = self.model, self.plan, config.torch_device
        runner = build_runner(
            model, config, device, self.num_kv_blocks, table_rows, max_model_len, self.draft
        )
        plan.cuda_graph_sizes = runner.graph_sizes
        plan.cuda_graph_histories = runner.graph_histories
        plan.cuda_graph_verify_tokens = runner.graph_verify_tokens
        if device.type == "cpu" and (config.cpu_threads is not None or plan.kernels):
            batch = min(config.max_num_seqs, 32)
            apply_cpu_threads(
                runner, model, plan, config.cpu_threads, batch, max_model_len,
                config.kv_storage_dtype,
            )  # fmt: skip
        # Loading the model opened parallel regions on this thread; the steps may be submitted
        # from another (a server's loop), and this thread's OpenMP team would throttle the
        # device thread's (`CPUStream.submit`).
        cpu_kernels.release_openmp_threads()
        return runner, plan


def load_execution(config: EngineConfig, path: Path, spec: LlamaSpec, hf_config) -> LoadedExecution:
    device, dtype = config.torch_device, config.torch_dtype
    spmd = config.distributed_executor_backend == "external_launcher"
    tp = SINGLE
    if config.tensor_parallel_size > 1:
        check_shardable(spec, config.tensor_parallel_size)
    pp = config.pipeline_parallel_size
    pipeline_stage(pp - 1, pp, spec)  # refuses a split the model's layers cannot take
    if config.node_rank > 0:
        raise ValueError(
            f"node {config.node_rank} of {config.nnodes} runs no engine: start it with "
            "`tandem serve --headless` (node 0 runs the engine)"
        )
    if spmd:  # a launcher started every rank: this one is a whole engine over its shard
        tp, config = join_launcher_group(config, path)
    elif config.world_size > 1:  # the ranks load their shards and size their caches
        executor = MultiprocExecutor(config, str(path))
        return LoadedExecution(config, executor.num_kv_blocks, None, executor, None)
    if device.type == "cpu" and config.cpu_threads is not None:
        torch.set_num_threads(config.cpu_threads)
    model = build_model(
        path, spec, hf_config, dtype, device, config.max_model_len, tp,
        load_format=config.load_format, seed=config.seed, quantization=config.weight_quantization,
        int8_activations=config.int8_activations,
    )  # fmt: skip
    plan = fast_path.prepare(model, device, dtype, config.enforce_eager)
    if config.enable_lora:
        model.enable_lora(config.max_loras, config.max_lora_rank, device)
    draft = _load_draft_model(config, spec)
    capacity = cache_capacity(model, config, device, draft)
    if spmd:
        capacity = agree_on_blocks(capacity, device)
    return LoadedExecution(config, capacity, model, None, plan, draft)


def _load_draft_model(config: EngineConfig, target: LlamaSpec) -> LlamaModel | None:
    """The draft model of `speculative_config` (method draft_model), on the target's device and
    dtype: it must share the target's vocabulary, since its tokens are the target's inputs."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    path, draft_spec, hf_config = read_config(resolve_model(spec.model))
    if draft_spec.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model has a vocabulary of {draft_spec.vocab_size} tokens; "
            f"the target's has {target.vocab_size}: a draft model must share it"
        )
    device, dtype = config.torch_device, config.torch_dtype
    # In its checkpoint's own format (a GGUF's blocks run as they are): a draft is meant to be
    # cheap, whatever the target's `quantization` does to the target.
    quantization = "none" if config.enforce_eager else None
    draft = build_model(path, draft_spec, hf_config, dtype, device, config.max_model_len,
                        quantization=quantization)  # fmt: skip
    fast_path.prepare(draft, device, dtype, config.enforce_eager)
    return draft
