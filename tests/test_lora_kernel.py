"""The CPU kernel of the LoRA deltas (csrc lora.cpp, `tandem::lora_add_`) against the reference
(`tandem.ops.lora.lora_add_reference_`), and the one-call forward's LoRA (`tandem::llama_forward`)
against the same forward over weights with the adapter merged in.

Each token's sums run in a fixed order over its own row (inputs ascending, then ranks), so a row's
delta is the same bits whatever else its step holds; weights past a slot's rank and slots that
adapt nothing are never read into a result (here they hold NaN).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.ops import cpu_kernels
from tandem.ops.lora import lora_add_reference_

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def kernels() -> cpu_kernels.KernelBuild:
    build = cpu_kernels.load()
    assert build.available, build.error  # the CI machine has a compiler: the kernels must build
    return build


@pytest.fixture(params=[2, 1])
def torch_threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def adapters(
    g: torch.Generator, slots: int, in_features: int, parts: list[int], max_rank: int, ranks=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every slot's a, b, ranks and part_ends as the device holds them, with NaN wherever a slot's
    rank leaves a weight unused (past a part's rank in a and b)."""
    out_features = sum(parts)
    a = torch.randn(slots, len(parts), in_features, max_rank, generator=g) / in_features**0.5
    b = torch.randn(slots, max_rank, out_features, generator=g) * 0.1
    if ranks is None:
        ranks = torch.randint(0, max_rank + 1, (slots, len(parts)), generator=g)
    ends = torch.tensor(parts).cumsum(0)
    for s in range(slots):
        start = 0
        for p, end in enumerate(ends.tolist()):
            rank = int(ranks[s, p])
            a[s, p, :, rank:] = float("nan")
            b[s, rank:, start:end] = float("nan")
            start = end
    return a, b, ranks, ends


def strided_rows(t: torch.Tensor, pad: int = 5) -> torch.Tensor:
    """t as a view whose rows lie `pad` floats further apart than its columns need."""
    wide = torch.full((t.shape[0], t.shape[1] + pad), float("inf"))
    view = wide[:, 2 : 2 + t.shape[1]]
    view.copy_(t)
    return view


# (in, parts' columns, slots, max rank): ranks and column counts that are and are not whole
# vectors of either build (8 or 16 lanes), one part and several.
SHAPES = [
    (576, [576, 192, 192], 8, 16),
    (64, [48], 2, 16),
    (100, [37, 5, 20], 3, 8),
    (70, [17, 1, 100, 40], 5, 40),
    (33, [960], 4, 3),
    (5, [2, 3], 2, 1),  # tensors shorter than one vector
]


@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize(
    "shape", SHAPES, ids=lambda s: "x".join(map(str, [s[0], *s[1], s[2], s[3]]))
)
@pytest.mark.parametrize("strided", [False, True])
def test_lora_add_is_the_reference(tokens, shape, strided, torch_threads) -> None:
    in_features, parts, slots, max_rank = shape
    g = torch.Generator().manual_seed(tokens * 100 + in_features)
    ranks = torch.randint(0, max_rank + 1, (slots, len(parts)), generator=g)
    ranks[0] = 0  # a slot that adapts nothing
    ranks[-1, 0] = max_rank  # and one at the whole rank of a part
    ranks[-1, -1] = 0  # leaving another part alone
    a, b, ranks, ends = adapters(g, slots, in_features, parts, max_rank, ranks)
    x = torch.randn(tokens, in_features, generator=g)
    base = torch.randn(tokens, sum(parts), generator=g)
    slot_ids = torch.randint(-1, slots, (tokens,), generator=g)
    slot_ids[0] = slots - 1
    expected = base.double()
    lora_add_reference_(expected, x.double(), slot_ids, a.double(), b.double(), ranks, ends)
    reference = base.clone()
    lora_add_reference_(reference, x, slot_ids, a, b, ranks, ends)

    out = strided_rows(base) if strided else base.clone()
    torch.ops.tandem.lora_add_(out, strided_rows(x) if strided else x, slot_ids, a, b, ranks, ends)
    torch.testing.assert_close(out, expected.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    untouched = (slot_ids == -1) | (slot_ids == 0)  # the base model's rows, the idle slot's
    assert torch.equal(out[untouched], base[untouched])
    if strided:  # nothing outside the view is written
        assert torch.isinf(out.as_strided((tokens, 2), (out.stride(0), 1), 0)).all()
        assert torch.isinf(out.as_strided((tokens, 3), (out.stride(0), 1), 2 + sum(parts))).all()


def test_a_prefill_of_one_adapter_is_the_reference(torch_threads) -> None:
    """Many rows of one slot: several blocks of rows, every part's tile."""
    g = torch.Generator().manual_seed(3)
    ranks = torch.tensor([[0, 0, 0], [64, 33, 8]])
    a, b, ranks, ends = adapters(g, 2, 576, [576, 192, 192], 64, ranks)
    x = torch.randn(1100, 576, generator=g)
    base = torch.randn(1100, 960, generator=g)
    slot_ids = torch.ones(1100, dtype=torch.int64)
    expected = base.double()
    lora_add_reference_(expected, x.double(), slot_ids, a.double(), b.double(), ranks, ends)
    out = base.clone()
    torch.ops.tandem.lora_add_(out, x, slot_ids, a, b, ranks, ends)
    torch.testing.assert_close(out, expected.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES[:4], ids=lambda s: f"in{s[0]}-rank{s[3]}")
def test_a_rows_delta_does_not_depend_on_its_step(shape, torch_threads) -> None:
    """A row's result is the same bits alone, in a decode-sized step of mixed adapters, in a
    large step and wherever it sits among its slot's rows: a sequence decodes the same in any
    batch, and a prompt prefills the same in any chunks."""
    in_features, parts, slots, max_rank = shape
    g = torch.Generator().manual_seed(in_features)
    ranks = torch.randint(0, max_rank + 1, (slots, len(parts)), generator=g)
    ranks[:, 0] = max_rank
    a, b, ranks, ends = adapters(g, slots, in_features, parts, max_rank, ranks)
    x = torch.randn(400, in_features, generator=g)
    base = torch.randn(400, sum(parts), generator=g)
    slot_ids = torch.randint(-1, slots, (400,), generator=g)
    slot_ids[200:] = slots - 1  # a long run of one slot, as a prefill's
    whole = base.clone()
    torch.ops.tandem.lora_add_(whole, x, slot_ids, a, b, ranks, ends)
    for first, count in [(0, 1), (5, 1), (250, 1), (8, 8), (3, 9), (1, 13), (40, 64), (190, 20)]:
        rows = slice(first, first + count)
        part = base[rows].clone()
        torch.ops.tandem.lora_add_(part, x[rows], slot_ids[rows], a, b, ranks, ends)
        assert torch.equal(part, whole[rows]), (first, count)
    # rows picked out of order, mixed with others
    pick = torch.randperm(400, generator=g)[:37]
    part = base[pick].clone()
    torch.ops.tandem.lora_add_(part, x[pick], slot_ids[pick], a, b, ranks, ends)
    assert torch.equal(part, whole[pick])


def test_nothing_to_add() -> None:
    """An empty group (a mixture of experts' MLP), a step without rows, rows of no adapter."""
    g = torch.Generator().manual_seed(0)
    a, b, ranks, ends = adapters(g, 2, 16, [8, 8], 4)
    x, base = torch.randn(3, 16, generator=g), torch.randn(3, 16, generator=g)
    out = base.clone()
    empty = torch.empty(0)
    torch.ops.tandem.lora_add_(
        out, x, torch.zeros(3, dtype=torch.int64), empty, empty, empty, empty
    )
    torch.ops.tandem.lora_add_(out, x, torch.full((3,), -1), a, b, ranks, ends)
    torch.ops.tandem.lora_add_(out[:0], x[:0], torch.zeros(0, dtype=torch.int64), a, b, ranks, ends)
    assert torch.equal(out, base)


def test_bad_inputs_are_refused() -> None:
    g = torch.Generator().manual_seed(0)
    a, b, ranks, ends = adapters(g, 3, 16, [8, 8], 4, ranks=torch.full((3, 2), 4))
    x, out = torch.randn(5, 16, generator=g), torch.zeros(5, 16)
    slots = torch.tensor([0, 1, 2, -1, 0])

    def call(**changed):
        args = dict(out=out, x=x, slots=slots, a=a, b=b, ranks=ranks, part_ends=ends) | changed
        torch.ops.tandem.lora_add_(*args.values())

    call()  # the valid call
    cases = [
        (dict(x=x.double()), "x must be float32"),
        (dict(out=out.half()), "out must be float32"),
        (dict(slots=slots.int()), "slots must be int64"),
        (dict(a=a.double()), "a must be float32"),
        (dict(ranks=ranks.int()), "ranks must be int64"),
        (dict(part_ends=ends.int()), "part_ends must be int64"),
        (dict(out=torch.zeros(16, 5).T), "out must be .* contiguous last dimension"),
        (dict(x=torch.randn(16, 5).T), "x must be .* contiguous last dimension"),
        (dict(out=torch.zeros(4, 16)), "out has 4 rows, x has 5"),
        (dict(slots=slots[:4]), r"slots must be int64 \[T\]"),
        (dict(slots=torch.tensor([0, 1, 3, -1, 0])), r"slots\[2\] = 3 is outside \[-1, 3\)"),
        (dict(slots=torch.tensor([0, -2, 0, 0, 0])), r"slots\[1\] = -2 is outside"),
        (
            dict(a=a[:, :, :15].contiguous()),
            r"a must be contiguous float32 \[slots, parts, in = 16",
        ),
        (dict(a=a.transpose(2, 3)), "a must be contiguous"),
        (
            dict(b=b[:2].contiguous()),
            r"b must be contiguous float32 \[slots = 3, rank = 4, out = 16",
        ),
        (dict(b=b[:, :3].contiguous()), "b must be contiguous float32"),
        (dict(ranks=ranks[:, :1].contiguous()), r"ranks must be int64 \[slots = 3, parts = 2\]"),
        (
            dict(ranks=torch.tensor([[4, 4], [5, 0], [0, 0]])),
            r"ranks\[1, 0\] = 5 is outside \[0, 4\]",
        ),
        (dict(ranks=torch.tensor([[4, 4], [4, 4], [0, -1]])), r"ranks\[2, 1\] = -1 is outside"),
        (dict(part_ends=torch.tensor([8])), r"part_ends must be int64 \[parts = 2\]"),
        (dict(part_ends=torch.tensor([8, 15])), "part_ends must end at out = 16"),
        (dict(part_ends=torch.tensor([9, 8])), "part_ends must rise from 0"),
        (dict(part_ends=torch.tensor([-1, 16])), "part_ends must rise from 0"),
    ]
    for changed, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call(**changed)
    assert torch.equal(out[3], torch.zeros(16))  # the valid call left slot -1's row alone


# ---- the one-call forward's LoRA ----

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, BLOCK = 64, 4, 2, 16, 96, 50, 4
Q, KV = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
LORA_PARTS = {  # group: (in, its parts' columns)
    "qkv": (HIDDEN, [Q, KV, KV]),
    "o": (Q, [HIDDEN]),
    "gate_up": (HIDDEN, [INTER, INTER]),
    "down": (INTER, [HIDDEN]),
}
# csrc LayerWeight: 4 norms, 4 linear layers of 5, router, shared expert, 2 output norms
WEIGHTS_PER_LAYER = 38


def linear_slot(weight: torch.Tensor, bias: torch.Tensor | None = None) -> list[torch.Tensor]:
    """A linear layer as the forward reads it: a float weight (no panels), its bias or none."""
    empty = torch.empty(0)
    return [weight, empty, empty, empty, empty if bias is None else bias]


def random_layers(g: torch.Generator, layers: int) -> list[dict[str, torch.Tensor]]:
    def w(*shape):
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    return [
        {
            "input_norm": 1 + 0.1 * torch.randn(HIDDEN, generator=g),
            "q_norm": 1 + 0.1 * torch.randn(HEAD_DIM, generator=g),
            "k_norm": 1 + 0.1 * torch.randn(HEAD_DIM, generator=g),
            "post_norm": 1 + 0.1 * torch.randn(HIDDEN, generator=g),
            "qkv": w(Q + 2 * KV, HIDDEN),
            "qkv_bias": 0.1 * torch.randn(Q + 2 * KV, generator=g),
            "o": w(HIDDEN, Q),
            "o_bias": 0.1 * torch.randn(HIDDEN, generator=g),
            "gate_up": w(2 * INTER, HIDDEN),
            "down": w(HIDDEN, INTER),
        }
        for _ in range(layers)
    ]


def flat_weights(layers: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    empty = torch.empty(0)
    flat = []
    for L in layers:
        flat += [L["input_norm"], L["q_norm"], L["k_norm"], L["post_norm"]]
        flat += linear_slot(L["qkv"], L["qkv_bias"]) + linear_slot(L["o"], L["o_bias"])
        flat += linear_slot(L["gate_up"]) + linear_slot(L["down"])
        flat += [empty] + [empty] * 5 + [empty] * 5 + [empty]  # no router, no shared expert
        flat += [empty, empty]  # no norms of the attention's and the MLP's outputs (Gemma's)
        assert len(flat) % WEIGHTS_PER_LAYER == 0
    return flat


def merged(layers, lora_layers, slot: int) -> list[dict[str, torch.Tensor]]:
    """The layers with slot `slot`'s adapter merged into their weights: W[j] += (A_p B_p)[:, j]
    over each part p's columns j (the scaling is folded into b)."""
    out = []
    for L, groups in zip(layers, lora_layers, strict=True):
        L = dict(L)
        for name, (a, b, ranks, ends) in groups.items():
            if a.numel() == 0:
                continue
            weight, start = L[name].clone(), 0
            for p, end in enumerate(ends.tolist()):
                r = int(ranks[slot, p])
                weight[start:end] += (
                    a[slot, p, :, :r].double() @ b[slot, :r, start:end].double()
                ).T.float()
                start = end
            L[name] = weight
        out.append(L)
    return out


def llama_forward(weights, lora, lora_slots, lengths: list[int], seed: int = 0) -> torch.Tensor:
    """A step of fresh prefills of `lengths` tokens (one request each) through the one-call
    forward; returns the final hidden states."""
    g = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    ids = torch.randint(0, VOCAB, (tokens,), generator=g)
    embed = torch.randn(VOCAB, HIDDEN, generator=g)
    final_norm = 1 + 0.1 * torch.randn(HIDDEN, generator=g)
    layers = len(weights) // WEIGHTS_PER_LAYER
    blocks_per_request = max(-(-n // BLOCK) for n in lengths)
    num_blocks = blocks_per_request * len(lengths)
    caches = [torch.zeros(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM) for _ in range(layers)]
    tables = torch.arange(num_blocks).view(len(lengths), blocks_per_request)
    positions = torch.cat([torch.arange(n) for n in lengths])
    slot_mapping = torch.cat(
        [tables[i, 0] * BLOCK + torch.arange(n) for i, n in enumerate(lengths)]
    )
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    prefills = torch.tensor(
        [[s, n, n, i, 0] for i, (s, n) in enumerate(zip(starts, lengths, strict=True))]
    )
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    angles = torch.outer(torch.arange(64).float(), inv)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    return torch.ops.tandem.llama_forward(
        ids, positions, embed, weights, caches, final_norm, [cos] * layers, [sin] * layers,
        [slot_mapping] * layers, [tables] * layers, [0] * layers,
        torch.zeros(0, dtype=torch.int64), 0, prefills, BLOCK, HEADS, KV_HEADS, HEAD_DIM,
        1e-6, HEAD_DIM**-0.5, False, "", 0, 0, False, lora, lora_slots,
    )  # fmt: skip


def lora_weights(g: torch.Generator, layers: int, slots: int, max_rank: int, skip=()):
    """Per layer, per group: a, b, ranks, part_ends (`skip`: (layer, group) pairs without LoRA,
    an empty a as a mixture of experts' MLP has)."""
    out = []
    for layer in range(layers):
        groups = {}
        for name, (in_features, parts) in LORA_PARTS.items():
            if (layer, name) in skip:
                empty = torch.empty(0)
                groups[name] = (empty, empty, empty, empty)
                continue
            ranks = torch.randint(0, max_rank + 1, (slots, len(parts)), generator=g)
            ranks[1] = torch.randint(1, max_rank + 1, (len(parts),), generator=g)
            a, b, ranks, ends = adapters(g, slots, in_features, parts, max_rank, ranks)
            groups[name] = (a, b * 3, ranks, ends)  # deltas large enough to matter
        out.append(groups)
    return out


def flat_lora(lora_layers) -> list[torch.Tensor]:
    return [t for groups in lora_layers for name in LORA_PARTS for t in groups[name]]


def test_the_forwards_lora_is_the_merged_adapters_forward() -> None:
    """Two requests in one step, one on adapter slot 1 and one on the base model: each one's
    hidden states are those of the forward over weights with its adapter merged in (or none),
    which places each delta right after its GEMM (qkv before the q/k norms and rotary, o before
    its bias). A layer's group whose a is empty adds nothing."""
    g = torch.Generator().manual_seed(0)
    layers = random_layers(g, 2)
    lora_layers = lora_weights(g, 2, slots=3, max_rank=8, skip={(1, "gate_up")})
    lengths = [7, 5]
    slots = torch.tensor([1] * 7 + [-1] * 5)
    with torch.inference_mode():
        adapted = llama_forward(flat_weights(layers), flat_lora(lora_layers), slots, lengths)
        base = llama_forward(flat_weights(layers), [], torch.empty(0, dtype=torch.int64), lengths)
        with_merged = llama_forward(
            flat_weights(merged(layers, lora_layers, 1)),
            [],
            torch.empty(0, dtype=torch.int64),
            lengths,
        )
    assert not torch.allclose(with_merged[:7], base[:7], atol=1e-2)  # the adapter matters
    torch.testing.assert_close(adapted[:7], with_merged[:7], rtol=1e-4, atol=1e-4)
    assert torch.equal(adapted[7:], base[7:])  # the base model's request: no delta at all


def test_the_forward_without_lora_is_the_base_forward() -> None:
    """No LoRA when `lora` is empty, when `lora_slots` is empty, or every token is the base
    model's: the same bits as the base forward."""
    g = torch.Generator().manual_seed(1)
    layers = flat_weights(random_layers(g, 2))
    lora = flat_lora(lora_weights(g, 2, slots=2, max_rank=4))
    lengths = [6]
    none = torch.empty(0, dtype=torch.int64)
    with torch.inference_mode():
        base = llama_forward(layers, [], none, lengths)
        assert torch.equal(llama_forward(layers, lora, none, lengths), base)
        assert torch.equal(
            llama_forward(layers, [], torch.zeros(6, dtype=torch.int64), lengths), base
        )
        assert torch.equal(llama_forward(layers, lora, torch.full((6,), -1), lengths), base)
        with pytest.raises(RuntimeError, match="lora must be empty or 16 tensors per layer"):
            llama_forward(layers, lora[:16], torch.zeros(6, dtype=torch.int64), lengths)


# Deltas of seeded operands through the build the environment picks, saved to argv[1].
SEEDED_DELTAS = """
import sys, torch
from tandem.ops import cpu_kernels
assert cpu_kernels.load().available
g = torch.Generator().manual_seed(0)
outs = []
for k, parts, slots, rank in [(576, [576, 192, 192], 8, 16), (100, [37, 5, 20], 3, 8)]:
    x, out = torch.randn(300, k, generator=g), torch.randn(300, sum(parts), generator=g)
    a = torch.randn(slots, len(parts), k, rank, generator=g)
    b = torch.randn(slots, rank, sum(parts), generator=g)
    ranks = torch.randint(0, rank + 1, (slots, len(parts)), generator=g)
    ids = torch.randint(-1, slots, (300,), generator=g)
    torch.ops.tandem.lora_add_(out, x, ids, a, b, ranks, torch.tensor(parts).cumsum(0))
    outs.append(out)
torch.save(outs, sys.argv[1])
"""


def test_the_avx2_and_native_builds_add_the_same_bits(tmp_path) -> None:
    """Each output is one lane's sums in a fixed order whatever the vector width: on an AVX-512
    machine the AVX2 build (its own build, cached, as tests/test_cpu_isa.py's) gives the native
    build's bits; on an AVX2 machine the two are one build."""
    outputs = {}
    for isa in ("avx2", "native"):
        path = tmp_path / f"{isa}.pt"
        env = {**os.environ, "TANDEM_CPU_ISA": isa}
        subprocess.run([sys.executable, "-c", SEEDED_DELTAS, str(path)], cwd=ROOT, env=env,
                       check=True, timeout=600)  # fmt: skip
        outputs[isa] = torch.load(path)
    for avx2, native in zip(outputs["avx2"], outputs["native"], strict=True):
        assert torch.equal(avx2, native)
