"""What a decode step must read (the weights as held, the K and V up to each position) and the
share of bandwidth `tandem bench --profile` reports from it."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from tandem import LLM
from tandem.bench.roofline import decode_roofline, nominal_bandwidth, streaming_bandwidth
from tandem.cli import main
from tandem.engine.stats import kv_bytes_read
from tandem.metrics import StepRecord
from tandem.scheduling.scheduler import ScheduledBatch, ScheduledRequest

from gguf_files import tiny_hf_folder
from helpers import greedy


def item(start: int, num_tokens: int) -> ScheduledRequest:
    return ScheduledRequest(None, 0, start, num_tokens, True, 0)


def test_a_step_reads_each_request_s_kv_up_to_its_last_new_position_within_each_window():
    batch = ScheduledBatch(0, [item(5, 1), item(20, 1), item(0, 12)], num_decodes=2)
    # full layers: 6 + 21 + 12 positions; 8-key windowed layers: 6 + 8 + 8
    assert kv_bytes_read({None: 100, 8: 10}, batch) == 100 * 39 + 10 * 22


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return tiny_hf_folder(tmp_path_factory.mktemp("untied"), "LlamaForCausalLM")


def checkpoint_tensors(folder) -> dict[str, torch.Tensor]:
    with safe_open(folder / "model.safetensors", "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def test_weight_bytes_are_the_weights_as_held_and_each_step_records_its_kv(untied):
    """Float32: every tensor of the checkpoint but the embedding (a step reads a few rows of
    it). FP8: the decoder's linear layers as one byte a weight and a float32 scale a row. And
    each step's record holds its K and V bytes: one request, its positions up to the step's."""
    tensors = checkpoint_tensors(untied)
    read = {n: t for n, t in tensors.items() if "embed_tokens" not in n}
    options = {"enforce_eager": True, "num_kv_blocks": 32, "max_model_len": 64,
               "async_scheduling": False}  # fmt: skip
    llm = LLM(str(untied), **options)
    assert llm.engine.execution.weight_bytes == sum(t.numel() * 4 for t in read.values())
    llm.engine.history.mark()
    llm.generate([[1, 5, 9, 4, 7]], greedy(3))
    records = llm.engine.history.steps()
    spec = llm.engine.spec
    per_position = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 4
    assert [r.kv_bytes for r in records] == [per_position * n for n in (5, 6, 7)]
    llm.close()
    llm = LLM(str(untied), quantization="fp8", **options)
    decoder = [t for n, t in read.items() if ".layers." in n and t.dim() == 2]
    fp8 = sum(t.numel() + t.shape[0] * 4 for t in decoder)
    rest = sum(t.numel() * 4 for n, t in read.items() if not any(t is d for d in decoder))
    assert llm.engine.execution.weight_bytes == fp8 + rest
    llm.close()


def record(step: int, tokens: int, seqs: int, device_ms: float, kv: int, **extra) -> StepRecord:
    r = StepRecord(step, tokens, seqs, device=(step, step + device_ms / 1e3), kv_bytes=kv)
    for name, value in extra.items():
        setattr(r, name, value)
    return r


def test_the_roofline_counts_decode_steps_only():
    records = [
        record(0, 40, 4, 9.0, 999),  # prefill: left out
        record(1, 4, 4, 2.0, 100),
        record(2, 4, 4, 4.0, 300),
        record(3, 12, 4, 3.0, 999, drafted=8),  # a verification: left out
        record(4, 4, 4, 0.0, 999, skipped=True),  # never ran
    ]
    roofline = decode_roofline(records, 1000)
    assert roofline.steps == 2 and roofline.kv_bytes == 200
    assert roofline.device_s == pytest.approx(3e-3)
    assert roofline.reached_bytes_per_s == pytest.approx(1200 / 3e-3)
    assert roofline.fraction_of(4e6) == pytest.approx(0.1)
    assert roofline.fraction_of(None) is None
    assert decode_roofline(records[:1], 1000) is None  # no decode step
    assert decode_roofline(records, None) is None  # experts: no weight figure


def test_a_cpu_streams_and_has_no_datasheet_figure():
    assert streaming_bandwidth(torch.device("cpu"), 1, repeats=2) > 1e8
    assert nominal_bandwidth(torch.device("cpu")) is None


def test_bench_profile_on_a_cpu_reports_the_bytes_and_the_share_of_bandwidth(untied, capsys):
    args = ["bench", "--profile", "--model", str(untied), "--device", "cpu", "--num-requests",
            "4", "--prompt-len", "8", "--output-len", "6", "--modes", "sync", "--enforce-eager"]  # fmt: skip
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    weights = sum(t.numel() * 4 for n, t in checkpoint_tensors(untied).items() if "embed" not in n)
    assert f"decode step reads (MB): weights + KV │ {weights / 1e6:.1f} + " in out
    assert "bandwidth reached (GB/s)" in out and "% of streaming read (" in out
    assert "kernels per step" not in out  # the kernel timing is CUDA's
