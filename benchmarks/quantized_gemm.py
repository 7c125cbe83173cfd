"""Weight-bound decode GEMMs on the CPU: what PyTorch ships against Tandem's own kernels.

At decode sizes a forward's time goes into reading the weights from memory, so a format with
fewer bytes per weight (int8, int4) can only win if its kernel streams those bytes about as
fast as the machine can. This times y = x @ W.T for one forward of SmolLM2-135M (hidden 576,
intermediate 1536, 9 heads and 3 KV heads of 64, vocabulary 49152; per layer qkv [960, 576],
o [576, 576], gate_up [3072, 576], down [576, 1536]; 30 layers, then the logits [49152, 576]
once), at M = 1, 4, 32 and 128 rows, for each implementation that runs here:

    fp32 F.linear / bf16 F.linear / fp32 MKL packed (torch.ops.mkl._mkl_linear)
    fp32 Tandem GEMM (torch.ops.tandem.gemm over the weight packed in panels: Tandem's fast path)
    int8 per-channel weight-only (aten._weight_int8pack_mm), fp32 and bf16 activations
    int4 groups of 32 (aten._weight_int4pack_mm_for_cpu), bf16 and fp32 activations
    int4 dynamic (aten._dyn_quant_matmul_4bit; KleidiAI on Arm, a reference loop elsewhere)
    int8 fbgemm dynamic (torch.ao.nn.quantized.dynamic.Linear: activations quantized per call)
    Tandem int8 and int4 (tandem.ops.quantized: quantize_int8 or pack, quantized_linear), where
    it exists: rows in groups of 16, a scale per row and block of 32 columns (+ an offset, 4-bit);
    and both again with int8 activations (xint8: the integer products)

Every layer has its own copy of its weights (the model's ~135M weights, far beyond the caches),
so each forward reads its weights from memory as a real decode step does; the implementations
are interleaved in rounds (each once per round, median of --rounds). The machine may be shared:
a round during which other processes used more than --busy of the CPUs (from /proc/stat) is
discarded and run again, for up to --patience seconds per M. Per implementation:

    ms        median time of one forward's GEMMs (the Python calls included: ~121 per forward)
    GB/s      the format's weight bytes (codes + scales) / that time, beside the machine's
              streaming rate (x.sum() over 256 MiB fp32, once in each of the same rounds: the
              roofline for reading weights, taken under the same conditions)
    err       max |y - y64| over layer 0 and the logits, y64 in float64 from the fp32 weights
              (quantization error included)
    kern err  the same against float64 of the weights the format holds (the kernel's own
              error: activation rounding, accumulation)

    python benchmarks/quantized_gemm.py [--rows 1,4,32,128] [--rounds 7] [--budget 3]
                                        [--busy 0.1] [--patience 900] [--baseline DIR]
    python benchmarks/quantized_gemm.py --only "fp32 MKL packed,fp32 tandem gemm" \
        --rows 1,8,32,256,2048 --budget 20            # float32, decode to prefill sizes

An implementation whose first forward takes longer than --budget seconds gets that single run
as its time (marked *) instead of the rounds, and no larger M. An op that is missing or fails
is named with the reason and gets no row.

Where the native build has AMX tiles (Intel Sapphire Rapids and later), "int8 / int4 tandem
quantized_linear (no AMX)" is the same kernel with the tiles switched off for its forwards
(once per forward: the VNNI kernel, 8-bit codes widened), on the same prepared weights: its
ratio line is what the tiles gain.

`--baseline DIR` times a kernel change against the code before it in the same rounds: the CPU
kernels of another checkout (say `git worktree add /tmp/before HEAD~1`) are built beside this
one's, their ops under `torch.ops.tandem_baseline`, and each Tandem row gets a "(baseline)" twin
that reads the very same prepared weights (so the two must share the weights' layout; separate
copies of the same values, placed differently in memory, read up to 10% apart). The ratio of a row
to its twin, from interleaved rounds, is what a change gained: separate runs on a shared
machine differ by more than most kernel changes do.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import statistics
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from baseline_kernels import load_baseline

LAYERS = 30
LAYER_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LOGITS_SHAPE = (49152, 576)
INT4_GROUP = 32
STREAM_MIB = 256


@functools.cache
def stream_buffer() -> torch.Tensor:
    return torch.ones(STREAM_MIB * 2**20 // 4)  # far beyond any CPU's caches


def stream_once() -> float:
    """Seconds to read the buffer once on torch's threads (x.sum())."""
    x = stream_buffer()
    start = time.perf_counter()
    x.sum()
    return time.perf_counter() - start


def streaming_gbs(times: list[float]) -> float:
    return stream_buffer().nbytes / statistics.median(times) / 1e9


class Contention:
    """The share of the machine's CPU time that other processes used since it was made (Linux's
    /proc/stat less this process's own time; NaN elsewhere)."""

    def __init__(self) -> None:
        self.start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        try:
            with open("/proc/stat") as f:
                ticks = [int(v) for v in f.readline().split()[1:9]]
        except OSError:
            return float("nan"), 0.0, 0.0
        busy = sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
        own = os.times()
        return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system, time.perf_counter()

    def others(self) -> float:
        busy, own, wall = (b - a for a, b in zip(self.start, self._sample(), strict=True))
        return max(0.0, busy - own) / (wall * (os.cpu_count() or 1))


# ---- quantizers (symmetric; `held` is the weight the format represents, for `kern err`) ----


def int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(1).clamp(min=1e-12) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def int4_groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes in [-7, 7] as int32 [N, K], scales [N, K/group]."""
    n, k = w.shape
    grouped = w.view(n, k // group, group)
    scale = grouped.abs().amax(-1).clamp(min=1e-12) / 7
    codes = torch.round(grouped / scale[..., None]).clamp(-7, 7).to(torch.int32)
    return codes.view(n, k), scale


def int4_held(codes: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    n, k = codes.shape
    return (codes.view(n, k // group, group).double() * scale.double()[..., None]).view(n, k)


@dataclass
class Impl:
    name: str
    prepare: Callable[[torch.Tensor], object]  # fp32 W [N, K] -> what `run` takes
    run: Callable[[torch.Tensor, object], torch.Tensor]  # x [M, K] fp32 -> y [M, N]
    held: Callable[[torch.Tensor, object], torch.Tensor | None]  # the weights the format holds
    nbytes: Callable[[int, int], float]  # (N, K) -> codes + scales: what a forward must read
    # What its calls run within: a kernel setting switched once per forward, not per call (whose
    # Python would weigh on a forward of few rows)
    setting: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext


def int8_pack(dtype: torch.dtype) -> Impl:
    def prepare(w):
        q, s = int8_per_channel(w)
        return q, s.to(dtype)

    return Impl(
        f"int8 _weight_int8pack_mm x{str(dtype)[6:]}",
        prepare,
        lambda x, st: torch.ops.aten._weight_int8pack_mm(x.to(dtype), *st).float(),
        lambda w, st: st[0].double() * st[1].double()[:, None],
        lambda n, k: n * k + n * (2 if dtype == torch.bfloat16 else 4),
    )


def int4_tinygemm(dtype: torch.dtype) -> Impl:
    """scales_and_zeros [K/group, N, 2]; the kernel computes (code - 8) * scale + zero."""

    def prepare(w):
        codes, scale = int4_groups(w, INT4_GROUP)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes + 8, 1)
        sz = torch.stack([scale, torch.zeros_like(scale)], -1).transpose(0, 1).contiguous()
        return packed, sz.to(dtype), codes

    def run(x, st):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(dtype), st[0], INT4_GROUP, st[1]
        ).float()

    return Impl(
        f"int4 g{INT4_GROUP} _weight_int4pack_mm x{str(dtype)[6:]}",
        prepare,
        run,
        lambda w, st: int4_held(st[2], st[1].transpose(0, 1)[..., 0].float(), INT4_GROUP),
        lambda n, k: n * k / 2 + n * k / INT4_GROUP * 4,  # bf16 scale and zero per group
    )


def int4_dyn_quant() -> Impl:
    """uint8 [N, K/2], even k in the low nibble, code + 8; scales [N, K/group]."""

    def prepare(w):
        n, k = w.shape
        codes, scale = int4_groups(w, INT4_GROUP)
        u = (codes + 8).to(torch.uint8)
        nibbles = (u[:, 1::2] << 4 | u[:, ::2]).contiguous()
        packed = torch.ops.aten._dyn_quant_pack_4bit_weight(
            nibbles, scale.to(torch.bfloat16), None, INT4_GROUP, k, n
        )
        return packed, (n, k), codes, scale.to(torch.bfloat16).float()

    def run(x, st):
        n, k = st[1]
        return torch.ops.aten._dyn_quant_matmul_4bit(x, st[0], INT4_GROUP, k, n)

    return Impl(
        f"int4 g{INT4_GROUP} _dyn_quant_matmul_4bit",
        prepare,
        run,
        lambda w, st: int4_held(st[2], st[3], INT4_GROUP),
        lambda n, k: n * k / 2 + n * k / INT4_GROUP * 2,  # bf16 scale per group
    )


def fbgemm_dynamic() -> Impl:
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    def prepare(w):
        n, k = w.shape
        q, s = int8_per_channel(w)
        with warnings.catch_warnings():  # quantized tensors are deprecated; the op is not
            warnings.simplefilter("ignore", UserWarning)
            qw = torch._make_per_channel_quantized_tensor(q, s.double(), torch.zeros(n).long(), 0)
        lin = DynamicLinear(k, n, bias_=False, dtype=torch.qint8)
        lin.set_weight_bias(qw, None)
        return lin, q, s

    return Impl(
        f"int8 fbgemm dynamic ({torch.backends.quantized.engine})",
        prepare,
        lambda x, st: st[0](x),
        lambda w, st: st[1].double() * st[2].double()[:, None],
        lambda n, k: n * k + 4 * n,
    )


def tandem_quantized(bits: int, int8_activations: bool = False, baseline: bool = False) -> Impl:
    """Tandem's layout (rows in groups of 16, a scale per row and block of 32 columns, 4-bit with
    an offset too) through its fused kernel; int4 here is Q4_0-like: code + 8, offset -8 * scale.
    `int8_activations`: the runs-of-4 layout, activations rounded to int8, integer products."""
    from tandem.ops import cpu_kernels, quantized

    build = cpu_kernels.load()
    if not build.available:  # quantized_linear would fall back to F.linear on a dequantized copy
        raise RuntimeError(f"fused CPU kernels not built: {build.error}")

    def prepare(w):
        if bits == 8:
            q = quantized.quantize_int8(w)
        else:
            codes, scale = int4_groups(w, quantized.BLOCK_COLS)
            scale = scale.half()
            q = quantized.pack((codes + 8).to(torch.uint8), scale, -8 * scale, "int4")
        return quantized.for_int8_activations(q) if int8_activations else q

    n, k = LAYER_SHAPES["qkv"]
    q = prepare(torch.randn(n, k))
    per_weight = getattr(q, "nbytes", None) or tensor_bytes(q)  # what its object holds
    dequantize = getattr(quantized, "dequantize", None)
    no_bias = torch.empty(0)
    ops = torch.ops.tandem_baseline if baseline else torch.ops.tandem
    return Impl(
        f"int{bits} tandem quantized_linear"
        + (" xint8" if int8_activations else "")
        + (BASELINE if baseline else ""),
        prepare,
        lambda x, qw: ops.quantized_linear(x, *qw.flat(), no_bias),
        lambda w, qw: dequantize(qw).double() if dequantize else None,
        lambda n_, k_: n_ * k_ * per_weight / (n * k),
    )


def tensor_bytes(obj: object) -> int:
    """Bytes of the tensors an object holds (its attributes, tuples, lists, dicts)."""
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(o) for o in obj.values())
    if hasattr(obj, "__dict__"):
        return sum(tensor_bytes(v) for v in vars(obj).values())
    return 0


def tandem_gemm(baseline: bool = False) -> Impl:
    from tandem.ops import cpu_kernels
    from tandem.ops.linear import pack_panels

    build = cpu_kernels.load()
    if not build.available:
        raise RuntimeError(f"fused CPU kernels not built: {build.error}")
    no_bias = torch.empty(0)
    ops = torch.ops.tandem_baseline if baseline else torch.ops.tandem
    return Impl(
        "fp32 tandem gemm" + (BASELINE if baseline else ""),
        lambda w: (pack_panels(w), w.shape[0]),
        lambda x, st: ops.gemm(x, st[0], no_bias, st[1]),
        lambda w, st: w.double(),
        lambda n, k: 4 * n * k,
    )


BASELINE = " (baseline)"
NO_AMX = " (no AMX)"  # the same kernel with AMX tiles switched off: the VNNI kernel
TWINS = (BASELINE, NO_AMX)


def twin_of(name: str) -> str:
    """The row a twin is timed against (its name without the twin's suffix), or the name."""
    for suffix in TWINS:
        name = name.removesuffix(suffix)
    return name


def without_amx(bits: int) -> Impl:
    """Tandem with AMX tiles switched off for its forwards (the VNNI kernel; 8-bit codes
    widened), where the build and the CPU have them: the tiles' gain, timed in the same rounds
    on the same weights."""
    from tandem.ops import cpu_kernels

    impl = tandem_quantized(bits)
    if not cpu_kernels.amx_tiles():
        raise RuntimeError("no AMX tiles in this build or on this CPU")
    setting = functools.partial(cpu_kernels.using_amx_tiles, False)
    return dataclasses.replace(impl, name=impl.name + NO_AMX, setting=setting)


def implementations(baseline: bool = False) -> list[Impl]:
    fp32 = lambda w, st: w.double()  # noqa: E731
    fp32_bytes = lambda n, k: 4 * n * k  # noqa: E731
    impls = [
        Impl("fp32 F.linear", lambda w: w.clone(), lambda x, w: F.linear(x, w), fp32, fp32_bytes),
        Impl(
            "bf16 F.linear",
            lambda w: w.bfloat16(),
            lambda x, w: F.linear(x.bfloat16(), w).float(),
            lambda w, st: st.double(),
            lambda n, k: 2 * n * k,
        ),
        Impl(
            "fp32 MKL packed",
            lambda w: (torch.ops.mkl._mkl_reorder_linear_weight(w, 128), w.clone()),
            lambda x, st: torch.ops.mkl._mkl_linear(x, st[0], st[1], None, x.shape[0]),
            fp32,
            fp32_bytes,  # the packed copy is 2-7x larger here (padding); counted as 4 B/weight
        ),
    ]
    makers = {
        "fp32 tandem gemm": tandem_gemm,
        "int8 _weight_int8pack_mm xfloat32": lambda: int8_pack(torch.float32),
        "int8 _weight_int8pack_mm xbfloat16": lambda: int8_pack(torch.bfloat16),
        "int4 _weight_int4pack_mm xbfloat16": lambda: int4_tinygemm(torch.bfloat16),
        "int4 _weight_int4pack_mm xfloat32": lambda: int4_tinygemm(torch.float32),
        "int4 _dyn_quant_matmul_4bit": int4_dyn_quant,
        "int8 fbgemm dynamic": fbgemm_dynamic,
        "int8 tandem quantized_linear": lambda: tandem_quantized(8),
        "int4 tandem quantized_linear": lambda: tandem_quantized(4),
        "int8 tandem quantized_linear xint8": lambda: tandem_quantized(8, True),
        "int4 tandem quantized_linear xint8": lambda: tandem_quantized(4, True),
        "int8 tandem quantized_linear" + NO_AMX: lambda: without_amx(8),
        "int4 tandem quantized_linear" + NO_AMX: lambda: without_amx(4),
    }
    if baseline:
        makers |= {
            "fp32 tandem gemm" + BASELINE: lambda: tandem_gemm(baseline=True),
            **{
                f"int{bits} tandem quantized_linear{act}{BASELINE}": functools.partial(
                    tandem_quantized, bits, bool(act), baseline=True
                )
                for bits in (8, 4)
                for act in ("", " xint8")
            },
        }
    for name, make in makers.items():
        try:
            impls.append(make())
        except Exception as e:  # a missing op or module (ImportError, AttributeError, ...)
            print(f"not available: {name}: {type(e).__name__}: {e}")
    return impls


def forward_shapes() -> list[tuple[str, int]]:
    """(shape name, layer index) in the order one forward runs its GEMMs."""
    order = [(name, layer) for layer in range(LAYERS) for name in LAYER_SHAPES]
    return [*order, ("logits", 0)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,32,128", help="comma-separated M values")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--budget", type=float, default=3.0, help="seconds; see the docstring")
    parser.add_argument("--busy", type=float, default=0.1, help="see the docstring")
    parser.add_argument("--patience", type=float, default=900, help="seconds per M")
    parser.add_argument(
        "--only", default="", help="comma-separated implementation names (default: every one)"
    )
    parser.add_argument(
        "--baseline", metavar="DIR", help="a checkout whose kernels to time beside these"
    )
    args = parser.parse_args()
    if args.baseline:
        load_baseline(args.baseline)  # registers torch.ops.tandem_baseline
    only = {name.strip() for name in args.only.split(",") if name.strip()}
    rows = [int(m) for m in args.rows.split(",")]
    torch.manual_seed(0)

    shapes = {**LAYER_SHAPES, "logits": LOGITS_SHAPE}
    # y ~ N(0, 1) for x ~ N(0, 1): the errors below are relative to outputs of size ~1
    base = {name: torch.randn(n, k) / k**0.5 for name, (n, k) in shapes.items()}
    weights = sum(n * k for n, k in (shapes[key[0]] for key in forward_shapes()))
    threads = torch.get_num_threads()
    stream_once()  # touch every page first
    stream = streaming_gbs([stream_once() for _ in range(7)])
    print(
        f"torch {torch.__version__}, {threads} threads, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}; {weights / 1e6:.1f}M weights per forward "
        f"({LAYERS} layers + logits)"
    )
    print(f"streaming: {stream:.1f} GB/s (x.sum() over {STREAM_MIB} MiB fp32, median of 7)")

    prepared: dict[str, dict[tuple[str, int], object]] = {}
    impls = []
    available = implementations(baseline=bool(args.baseline))
    unknown = only - {impl.name for impl in available}
    if unknown:
        parser.error(f"--only: no implementation here is named {', '.join(sorted(unknown))}")
    for impl in available:
        if only and twin_of(impl.name) not in only:  # a row selects its twins
            continue
        try:
            start = time.perf_counter()
            twin = twin_of(impl.name)
            if twin != impl.name and twin in prepared:  # the very same memory as its twin's
                state = prepared[twin]
            else:
                state = {key: impl.prepare(base[key[0]]) for key in forward_shapes()}
            for name, (_, k) in shapes.items():  # does it run, and with the right shape?
                with impl.setting():
                    y = impl.run(torch.randn(1, k), state[(name, 0)])
                assert y.shape == (1, shapes[name][0]), f"output shape {tuple(y.shape)}"
        except Exception as e:
            print(f"not available: {impl.name}: {type(e).__name__}: {str(e).splitlines()[0]}")
            continue
        prepared[impl.name] = state
        impls.append(impl)
        print(f"prepared {impl.name} in {time.perf_counter() - start:.1f} s")

    too_slow: dict[str, int] = {}  # over --budget at this M: larger M are skipped
    for m in rows:
        xs = {k: torch.randn(m, k) for k in {576, 1536}}
        check = [*LAYER_SHAPES, "logits"]  # layer 0 and the logits
        ref = {name: xs[shapes[name][1]].double() @ base[name].double().T for name in check}
        active = []
        for impl in impls:
            if impl.name in too_slow:
                print(f"M={m}: {impl.name} skipped: over --budget at M={too_slow[impl.name]}")
            else:
                active.append(impl)

        def forward(impl: Impl, xs: dict[int, torch.Tensor] = xs) -> float:
            run, state = impl.run, prepared[impl.name]
            calls = [(xs[shapes[key[0]][1]], state[key]) for key in forward_shapes()]
            with impl.setting():
                start = time.perf_counter()
                for x, st in calls:
                    run(x, st)
                return time.perf_counter() - start

        # A round whose CPUs other processes shared (over --busy of them) is run again, until
        # --rounds quiet ones or --patience seconds; then the noisy ones count too. So is a
        # warm-up over --budget (its time is the figure then).
        deadline = time.perf_counter() + args.patience
        once = {}
        for impl in active:
            while True:
                meter = Contention()
                first = forward(impl)
                quiet = meter.others() <= args.busy
                if first <= args.budget or quiet or time.perf_counter() > deadline:
                    break
            if first > args.budget:
                once[impl.name] = first
                too_slow[impl.name] = m
        timed = [i for i in active if i.name not in once]
        times: dict[str, list[float]] = {i.name: [] for i in timed} | {"stream": []}
        noisy: dict[str, list[float]] = {i.name: [] for i in timed} | {"stream": []}
        tries, shares = 0, []
        while len(times["stream"]) < args.rounds:
            meter, shift = Contention(), tries % max(len(timed), 1)
            sample = {i.name: forward(i) for i in timed[shift:] + timed[:shift]}
            sample["stream"] = stream_once()  # the roofline, under the same conditions
            share, tries = meter.others(), tries + 1
            quiet = share <= args.busy
            if quiet:
                shares.append(share)
            for name, t in sample.items():
                (times if quiet else noisy)[name].append(t)
            if time.perf_counter() > deadline:
                break
        kept = len(times["stream"])
        if kept < args.rounds:
            for name in times:
                times[name] += noisy[name]
        note = (
            f"{kept} quiet rounds of {tries} (other processes at most {args.busy:.0%} of the "
            f"CPUs; {max(shares, default=0):.0%} in the worst kept)"
            if kept >= args.rounds
            else f"NOISY: {kept} quiet rounds of {tries}, the noisy ones included"
        )
        stream = streaming_gbs(times["stream"])
        print(
            f"\nM = {m}: one forward's GEMMs, median; {note}; streaming {stream:.1f} GB/s "
            "(median over the same rounds)"
        )
        header = (
            f"{'implementation':<38} {'MB':>6} {'ms':>9} {'spread':>7} {'GB/s':>5} "
            f"{'of stream':>9} {'err':>8} {'kern err':>8}"
        )
        print(header)
        print("-" * len(header))
        for impl in active:
            if impl.name in once:
                t, spread, mark = once[impl.name], "", "*"
            else:
                t, mark = statistics.median(times[impl.name]), " "
                spread = f"{(max(times[impl.name]) - min(times[impl.name])) / t:.0%}"
            mb = sum(impl.nbytes(*shapes[key[0]]) for key in forward_shapes()) / 1e6
            err = kern = 0.0
            for name in check:
                state = prepared[impl.name][(name, 0)]
                with impl.setting():
                    y = impl.run(xs[shapes[name][1]], state).double()
                err = max(err, (y - ref[name]).abs().max().item())
                held = impl.held(base[name], state)
                if held is None:
                    kern = float("nan")
                else:
                    y64 = xs[shapes[name][1]].double() @ held.T
                    kern = max(kern, (y - y64).abs().max().item())
            gbs = mb / 1e3 / t
            print(
                f"{impl.name:<38} {mb:6.1f} {t * 1e3:8.1f}{mark} {spread:>7} {gbs:5.1f} "
                f"{gbs / stream:9.0%} {err:8.1e} {kern:8.1e}"
            )
        for name in times:  # each timed round holds every row, so rounds pair up
            for suffix in TWINS:
                twin = name + suffix
                if twin in times:
                    ratio = statistics.median(
                        b / a for a, b in zip(times[name], times[twin], strict=True)
                    )
                    print(
                        f"{name}: {suffix.strip(' ()')} / current {ratio:.3f} "
                        "(median of the rounds' ratios)"
                    )
    print(
        "\nMB: the format's weight bytes per forward (codes + scales); GB/s = MB / ms; spread: "
        "(max - min) / median over the rounds; of stream: GB/s / the streaming rate, a x.sum() "
        "in each of the same rounds; * = over --budget: one run, and larger M skipped"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
