"""`tandem bench --workload llama8b-32x8k` (the blog's experiment) and `--profile`: the preset's sizes and model, the kernel-busy
arithmetic (on synthetic intervals: the profiler itself needs CUDA), and the refusal under tensor
parallelism (tests/test_roofline.py has `--profile`'s bandwidth figures, which a CPU gives)."""

from __future__ import annotations

import argparse

import pytest

from tandem.bench.cli import kernel_trace_path
from tandem.bench.kernel_profile import (
    EDGE_FRACTION,
    NAME_CHARS,
    KernelEvent,
    idle_by_kernel,
    long_gaps,
    measure,
    measure_events,
    short_name,
    union_busy,
)
from tandem.bench.workloads import (
    BLOG_OUTPUT_LEN,
    make_workload,
    profile_window,
    resolve_workload,
    shipped_model,
)
from tandem.cli import build_parser, engine_config, main


def _bench_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *flags])


# ------------------------------------------------------- the blog's preset
def test_blog_preset_sizes_and_model_by_device():
    args = _bench_args("--workload", "llama8b-32x8k")
    config = resolve_workload(args, engine_config(args), "cpu")
    assert (args.num_requests, args.prompt_len, args.output_len) == (32, 32, BLOG_OUTPUT_LEN["cpu"])
    assert config.model is None and config.load_format == "auto"  # the default model

    args = _bench_args("--workload", "llama8b-32x8k")
    config = resolve_workload(args, engine_config(args), "cuda")
    assert args.output_len == 8192 == BLOG_OUTPUT_LEN["cuda"]
    assert config.model == str(shipped_model("llama-3.1-8b")) and config.load_format == "dummy"

    args = _bench_args("--workload", "llama8b-32x8k", "--model", "/my/model", "--output-len", "100")
    config = resolve_workload(args, engine_config(args), "cuda")
    assert (config.model, config.load_format, args.output_len) == ("/my/model", "auto", 100)

    args = _bench_args()  # the other workloads keep their defaults
    resolve_workload(args, engine_config(args), "cuda")
    assert (args.num_requests, args.prompt_len, args.output_len) == (64, 128, 128)


def test_blog_workload_generates_exact_lengths_all_at_once():
    args = _bench_args("--workload", "llama8b-32x8k", "--output-len", "300")
    resolve_workload(args, engine_config(args), "cpu")
    workload = make_workload(args, 2048, 4096)
    assert len(workload.prompts) == 32 and set(workload.output_lens) == {300}
    assert set(workload.arrival_times) == {0.0}
    assert all(16 <= len(p) <= 48 for p in workload.prompts)  # short: 32 tokens +- 50%
    assert profile_window(workload) == (118, 182)  # 64 steps around the middle


def test_blog_preset_runs_scaled_down_on_cpu(tiny_llama, capsys):
    args = ["bench", "--workload", "llama8b-32x8k", "--model", str(tiny_llama), "--num-requests", "4",
            "--output-len", "6"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "4 requests x 6 output tokens (llama8b-32x8k)" in " ".join(out.split())
    assert "model: " in out and "4 heads (2 KV) of 16" in " ".join(out.split())


# ---------------------------------------------------------------------- --profile
def test_union_busy_counts_concurrent_kernels_once_and_clips_to_the_window():
    assert union_busy([]) == (0.0, 0.0)
    # Disjoint: busy 1 + 2 over the span 0..10.
    assert union_busy([(0, 1), (8, 10)]) == (3, 10)
    # Overlapping, nested, touching and unsorted kernels (two streams): one busy run 0..6.
    assert union_busy([(4, 6), (0, 3), (1, 2), (2.5, 4), (5, 5)]) == (6, 6)
    # Clipped to a window: of 0..3 and 5..9, the window 2..6 sees 2..3 and 5..6.
    assert union_busy([(0, 3), (5, 9)], (2, 6)) == (2, 4)
    assert union_busy([(0, 1)], (2, 4)) == (0, 2)  # nothing inside: all idle


def test_measure_leaves_out_the_window_edges():
    # 10 steps of 9 ms of kernels and 1 ms gaps, then a 50 ms stall at the end (the stop).
    kernels = [(i * 10e-3, i * 10e-3 + 9e-3) for i in range(10)] + [(149e-3, 150e-3)]
    window = measure(kernels, steps=10, pause_s=0.02)
    span = 150e-3
    assert window.wall_s == pytest.approx(span * (1 - 2 * EDGE_FRACTION))
    assert window.kernels == 11 and window.steps == 10
    assert window.span_s == pytest.approx(span) and window.measured_steps == pytest.approx(8)
    busy, wall = union_busy(kernels, (span * EDGE_FRACTION, span * (1 - EDGE_FRACTION)))
    assert window.busy_s == pytest.approx(busy) and 0 < window.idle_pct < 100
    assert window.idle_pct == pytest.approx(100 * (1 - busy / wall))
    assert measure([], 3, 0.0).kernels == 0


def test_long_gaps_are_told_apart_from_kernel_boundaries():
    """100 steps of 10 kernels of 9 us with 1 us between them, and once the next step 2 ms late
    (the host): the boundaries' idle is 10%, the late step is one long gap of 2 ms."""
    kernels, t = [], 0.0
    for step in range(100):
        t += 2e-3 if step == 50 else 0.0
        for _ in range(10):
            kernels.append((t, t + 9e-6))
            t += 10e-6
    window = measure(kernels, steps=100, pause_s=0.0)
    assert window.long_gaps == 1 and window.long_gap_s == pytest.approx(2e-3 + 1e-6)
    assert window.idle_pct > 25  # the late step, a fifth of the measured span, dominates
    assert window.boundary_idle_pct == pytest.approx(10.0, rel=0.02)
    assert long_gaps([(0, 1), (1.5, 2), (4, 5)], (0, 5), threshold=1.0) == (1, 2.0)
    assert long_gaps([(0, 1), (4, 5)], (2, 5), threshold=1.0) == (0, 0.0)  # cut by the window


def test_profile_with_tensor_parallelism_is_refused_with_a_clear_message(tiny_llama, capsys):
    args = ["bench", "--profile", "--model", str(tiny_llama), "--tensor-parallel-size", "2"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "tandem bench: error: --profile times one device" in err
    assert "Traceback" not in err


def test_kernel_trace_needs_profile_and_names_a_file_per_run(tiny_llama, capsys, tmp_path):
    assert main(["bench", "--model", str(tiny_llama), "--kernel-trace", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--kernel-trace writes the window --profile times: add --profile" in err
    assert "Traceback" not in err
    path = kernel_trace_path(str(tmp_path / "traces"), "async #2")
    assert path == str(tmp_path / "traces" / "async-2.json.gz")
    assert (tmp_path / "traces").is_dir()  # made for the profiler's export
    assert kernel_trace_path(None, "async") is None


def test_help_names_the_preset_and_profile(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "llama8b-32x8k" in text and "--profile" in text and "llama-3.1-8b" in text
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    assert "--load-format" in capsys.readouterr().out


def test_kernel_events_keep_only_the_device_kernels():
    """The filter over what torch.profiler records (fake events: the CPU build records no CUDA)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from tandem.bench.kernel_profile import kernel_events

    def event(name, kind, device=DeviceType.CUDA, start=0, duration=1000):
        return SimpleNamespace(
            name=lambda: name, activity_type=lambda: kind, device_type=lambda: device,
            start_ns=lambda: start, duration_ns=lambda: duration,
        )  # fmt: skip

    events = [
        event("gemm", "kernel", start=1000, duration=2000),
        event("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy"),
        event("Memset (Device)", "gpu_memset"),
        event("step", "gpu_user_annotation", duration=10**9),  # spans the gaps: never busy
        event("cudaLaunchKernel", "cuda_runtime", device=DeviceType.CPU),
        event("rms_norm", "kernel", start=5000, duration=500),
    ]
    profile = SimpleNamespace(
        profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: events))
    )
    kernels = kernel_events(profile)
    assert [k.name for k in kernels] == ["gemm", "rms_norm"]
    flat = [t for k in kernels for t in (k.start, k.end)]
    assert flat == pytest.approx([1e-6, 3e-6, 5e-6, 5.5e-6])


def test_idle_is_told_by_the_kernel_that_ends_each_gap():
    # One step of a 10 us window: gemm 0-4, norm 5-6 (1 us idle before it), a second stream's
    # copy kernel 5.2-5.8 inside it (no idle), gemm 9-10 (3 us idle), norm cut by the window.
    events = [
        KernelEvent("gemm", 0e-6, 4e-6),
        KernelEvent("norm", 5e-6, 6e-6),
        KernelEvent("copy", 5.2e-6, 5.8e-6),
        KernelEvent("gemm", 9e-6, 10e-6),
        KernelEvent("norm", 10.5e-6, 12e-6),
    ]
    shares = {s.name: s for s in idle_by_kernel(events, (0.0, 10e-6))}
    assert [s.name for s in idle_by_kernel(events, (0.0, 10e-6))] == ["gemm", "norm", "copy"]
    assert shares["gemm"].count == 2 and shares["gemm"].idle_before_s == pytest.approx(3e-6)
    assert shares["gemm"].busy_s == pytest.approx(5e-6)
    assert shares["norm"].count == 1 and shares["norm"].idle_before_s == pytest.approx(1e-6)
    assert shares["copy"].idle_before_s == 0
    busy, wall = union_busy([(e.start, e.end) for e in events], (0.0, 10e-6))
    assert sum(s.idle_before_s for s in shares.values()) == pytest.approx(wall - busy)
    # measure_events: the same window as measure's, with the shares of its span.
    window = measure_events(events, steps=1, pause_s=0.0)
    assert window.idle_pct == pytest.approx(
        measure([(e.start, e.end) for e in events], 1, 0).idle_pct
    )
    assert {s.name for s in window.shares} == {"gemm", "norm", "copy"}


def test_kernel_names_lose_their_signature():
    assert short_name("_rms_norm_kernel") == "_rms_norm_kernel"
    name = "void at::native::elementwise_kernel<128, 4, at::native::Op<float>(int)>(int, float*)"
    assert short_name(name) == "at::native::elementwise_kernel<128, 4, at::native::Op<float>(int)>"
    assert len(short_name("k" * 500)) == NAME_CHARS and short_name("k" * 500).endswith("...")


def test_profile_prints_the_kernels_the_device_idles_before():
    from rich.console import Console

    from tandem.bench.cli import kernel_share_table
    from tandem.bench.kernel_profile import KernelShare, KernelWindow

    shares = [
        KernelShare("nvjet_gemm", 128, 6.4e-3, 96e-6),
        KernelShare("_rms_norm", 64, 1e-4, 32e-6),
    ]
    # 5 steps profiled, of which the measured middle of the span holds 2
    window = KernelWindow(steps=5, kernels=192, busy_s=6.5e-3, wall_s=6.756e-3, pause_s=0.0,
                          span_s=6.756e-3 * 2.5)  # fmt: skip
    window.shares = shares
    console = Console(width=200, record=True)
    console.print(kernel_share_table("async", window))
    cells = [line.replace("│", " ").split() for line in console.export_text().splitlines()]
    rows = {c[0]: c[1:] for c in cells if c[:1] in (["nvjet_gemm"], ["_rms_norm"])}
    # per step: launches, busy us, idle before us, share of the window's 256 us of idle
    assert rows["nvjet_gemm"][:4] == ["64.0", "3200.0", "48.00", "37.5"]
    assert rows["_rms_norm"][:4] == ["32.0", "50.0", "16.00", "12.5"]
