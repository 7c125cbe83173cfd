"""Megatron-style tensor parallelism: which slice of each weight a rank holds, and its collectives.

Q/K/V and gate/up are split by output rows (column-parallel), O and down by input columns
(row-parallel, one all-reduce each), the vocabulary by rows for the embedding and the LM head.
KV heads are split like the query heads; with fewer KV heads than ranks each KV head is
replicated on the ranks whose query heads use it (as vLLM does). A mixture-of-experts block
splits every expert's intermediate dimension like the MLP's and replicates its router.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from tandem.models.spec import LlamaSpec, checkpoint_shapes


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group (rank 0 of 1 when not parallel)."""

    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None  # a pipeline stage's ranks; None: every rank

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def group_name(self) -> str:
        """The process group's registered name, for collectives issued from C++ ("": none)."""
        if not self.enabled:
            return ""
        return (self.group or dist.group.WORLD).group_name

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place. Every rank gets the same bits (one reduction, shared)."""
        if self.enabled:
            dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Largest over ranks, in place."""
        if self.enabled:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C] on each rank -> [N, world * C], ranks in order (the vocabulary shards)."""
        if not self.enabled:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()

# vLLM's VLLM_PP_LAYER_PARTITION under Tandem's name: layers per stage, e.g. "14,14"
LAYER_PARTITION_ENV = "TANDEM_PP_LAYER_PARTITION"


@dataclass(frozen=True)
class PipelineStage:
    """Which layers this process computes: stage `index` of `num_stages`, layers start..stop-1.
    The first stage embeds the tokens, the last normalises and computes the logits."""

    index: int = 0
    num_stages: int = 1
    start: int = 0
    stop: int | None = None  # None: every layer (one stage)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def holds_layer(self, layer: int) -> bool:
        return self.start <= layer and (self.stop is None or layer < self.stop)

    def layers(self, num_layers: int) -> range:
        return range(self.start, num_layers if self.stop is None else self.stop)

    def holds(self, name: str, tied_embeddings: bool) -> bool:
        """Whether checkpoint tensor `name` belongs to this stage: its layers' tensors, the
        embedding on the first (and, tied, on the last, whose logits read it), the final norm and
        the LM head on the last."""
        if name.startswith("model.layers."):
            return self.holds_layer(int(name.split(".", 3)[2]))
        if name == "model.embed_tokens.weight":
            return self.is_first or (tied_embeddings and self.is_last)
        return self.is_last


WHOLE_MODEL = PipelineStage()


def pipeline_stage(index: int, num_stages: int, spec: LlamaSpec) -> PipelineStage:
    """Stage `index`'s layers: `TANDEM_PP_LAYER_PARTITION` when set, else the split whose
    costliest stage costs least, the last stage's logits counted beside its layers."""
    num_layers = spec.num_layers
    if num_stages == 1:
        return WHOLE_MODEL
    given = os.environ.get(LAYER_PARTITION_ENV)
    if given:
        try:
            counts = [int(part) for part in given.split(",")]
        except ValueError:
            counts = []
        if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(
                f"{LAYER_PARTITION_ENV}={given!r} must be {num_stages} positive layer counts "
                f"that add up to the model's {num_layers} layers"
            )
    elif num_layers < num_stages:
        raise ValueError(
            f"pipeline_parallel_size {num_stages} exceeds the model's {num_layers} layers"
        )
    else:
        counts = balanced_split(num_layers, num_stages, logits_in_layers(spec))
    start = sum(counts[:index])
    return PipelineStage(index, num_stages, start, start + counts[index])


def logits_in_layers(spec: LlamaSpec) -> float:
    """What the logits cost a token, in layers: the LM head's weights over a layer's (those a
    token multiplies by: a mixture's routed experts only). A large vocabulary makes them several
    layers' worth (SmolLM2-135M's about 8, Gemma 3 270M's about 30)."""
    per_token = 0.0
    for name, shape in checkpoint_shapes(spec).items():
        if len(shape) == 2 and name.startswith("model.layers."):
            routed = ".experts." in name
            per_token += math.prod(shape) * (spec.moe.top_k / spec.moe.num_experts if routed else 1)
    return spec.vocab_size * spec.hidden_size / (per_token / spec.num_layers)


def balanced_split(num_layers: int, num_stages: int, last_extra: float) -> list[int]:
    """Layers per stage, each at least one: the last takes k (it also bears `last_extra`
    layers' worth of logits), the others share the rest evenly (the remainder on the first);
    the k whose costliest stage is cheapest, the fewest layers on the last stage on a tie."""

    def split(k: int) -> list[int]:
        share, extra = divmod(num_layers - k, num_stages - 1)
        return [share + (i < extra) for i in range(num_stages - 1)] + [k]

    def cost(counts: list[int]) -> float:
        return max(max(counts[:-1]), counts[-1] + last_extra)

    return min((split(k) for k in range(1, num_layers - num_stages + 2)), key=cost)


def check_shardable(spec: LlamaSpec, world_size: int) -> None:
    """Refuse a model whose shapes do not split over `world_size` ranks, naming the numbers."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world_size}")
    problems = []
    if spec.num_heads % world_size:
        problems.append(f"{spec.num_heads} attention heads")
    kv = spec.num_kv_heads
    if kv % world_size and world_size % kv:
        problems.append(f"{kv} KV heads (neither a multiple nor a divisor of {world_size})")
    if spec.intermediate_size % world_size:
        problems.append(f"intermediate size {spec.intermediate_size}")
    moe = spec.moe
    if moe is not None and moe.intermediate_size % world_size:
        problems.append(f"expert intermediate size {moe.intermediate_size}")
    if moe is not None and moe.shared_intermediate_size % world_size:
        problems.append(f"shared expert intermediate size {moe.shared_intermediate_size}")
    if problems:
        raise ValueError(
            f"tensor_parallel_size {world_size} does not divide the model's {', '.join(problems)}"
        )


@dataclass(frozen=True)
class Shard:
    """The slices of a model that one rank holds, in the checkpoint's coordinates."""

    spec: LlamaSpec  # the whole model's
    tp: TensorParallel

    @property
    def local_spec(self) -> LlamaSpec:
        """The shapes this rank computes (vocab_size stays the whole model's)."""
        s, n = self.spec, self.tp.world_size
        moe = s.moe and replace(
            s.moe,
            intermediate_size=s.moe.intermediate_size // n,
            shared_intermediate_size=s.moe.shared_intermediate_size // n,
        )
        return replace(
            s,
            num_heads=s.num_heads // n,
            num_kv_heads=max(1, s.num_kv_heads // n),
            intermediate_size=s.intermediate_size // n,
            moe=moe,
        )

    def _even_share(self, total: int) -> slice:
        """This rank's equal share of `total` items (heads, columns), in rank order."""
        local = total // self.tp.world_size
        return slice(self.tp.rank * local, (self.tp.rank + 1) * local)

    @property
    def q_heads(self) -> slice:
        return self._even_share(self.spec.num_heads)

    @property
    def kv_heads(self) -> slice:
        """Split evenly, or, with fewer KV heads than ranks, the one KV head this rank's query
        heads read (query head h reads KV head h // (heads / kv_heads))."""
        first = self.tp.rank * self.spec.num_kv_heads // self.tp.world_size
        return slice(first, first + self.local_spec.num_kv_heads)

    @property
    def intermediate(self) -> slice:
        return self._even_share(self.spec.intermediate_size)

    @property
    def expert_intermediate(self) -> slice:
        """Every expert's rows (gate, up) and columns (down) on this rank."""
        return self._even_share(self.spec.moe.intermediate_size)

    @property
    def shared_intermediate(self) -> slice:
        return self._even_share(self.spec.moe.shared_intermediate_size)

    @property
    def vocab_per_rank(self) -> int:
        """Rows of the embedding and LM head on every rank (the last one padded with zeros)."""
        return -(-self.spec.vocab_size // self.tp.world_size)

    @property
    def vocab(self) -> slice:
        start = self.tp.rank * self.vocab_per_rank
        return slice(start, min(start + self.vocab_per_rank, self.spec.vocab_size))


def heads_to_rows(heads: slice, head_dim: int) -> slice:
    return slice(heads.start * head_dim, heads.stop * head_dim)


@dataclass(frozen=True)
class Placement:
    """Checkpoint tensor -> parameter: the rows or columns this rank takes, and where they go."""

    target: str
    offset: int | None = None  # first row in the parameter (fused qkv, gate_up, vocab shards)
    rows: slice | None = None  # rows of the checkpoint tensor (column-parallel, vocabulary)
    cols: slice | None = None  # columns of the checkpoint tensor (row-parallel)
    expert: int | None = None  # the target is a stack of experts: this one's matrix
