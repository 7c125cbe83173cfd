"""Random-weight GGUF files (`tandem/bench/random_gguf.py`) and `tandem bench --workload batches`.

The files are written as llama.cpp's converter names and describes a qwen3moe model, with random
blocks in place of quantized weights and SmolLM2's vocabulary: gguf's reader reads them back,
Tandem loads and runs them, and llama.cpp's llama-batched-bench runs them beside Tandem in the
workload's report where its binaries are built (benchmarks/setup_llama_server.sh; the suite
builds none, so the side-by-side report is the benchmark's own run, docs/performance.md)."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from rich.console import Console

from tandem import LLM, SamplingParams
from tandem.bench.batches import llama_cpp_for
from tandem.bench.cli import random_model
from tandem.bench.random_gguf import (
    BLOCK_TYPES,
    WEIGHT_SCALE,
    cached_random_gguf,
    write_random_gguf,
)
from tandem.cli import build_parser, engine_config, main

from helpers import packaged_model

# Qwen3-30B-A3B's kind of config, tiny: rows of 256 suit every block type (Q4_K's super-blocks).
TINY_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}
SMOLLM2_VOCAB = 49152


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The config folder (the vocabulary comes from the packaged SmolLM2 GGUF)."""
    packaged_model("smollm2-135m-instruct", "SmolLM2-135M-Instruct (the random GGUF's tokenizer)")
    folder = tmp_path_factory.mktemp("tiny-qwen3-moe")
    (folder / "config.json").write_text(json.dumps(TINY_MOE), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def files(tiny_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("random-gguf")
    return {t: write_random_gguf(tiny_moe, out / f"{t}.gguf", t) for t in BLOCK_TYPES}


@pytest.mark.parametrize("block_type", BLOCK_TYPES)
def test_random_gguf_reads_back_as_llama_cpps_qwen3moe(files, block_type):
    reader = gguf.GGUFReader(files[block_type])
    meta = {f.name: f.contents() for f in reader.fields.values()}
    assert meta["general.architecture"] == "qwen3moe"
    for key, value in (("block_count", 2), ("embedding_length", 256), ("expert_count", 4),
                       ("expert_used_count", 2), ("expert_feed_forward_length", 256),
                       ("attention.head_count", 4), ("attention.head_count_kv", 2),
                       ("attention.key_length", 64)):  # fmt: skip
        assert meta[f"qwen3moe.{key}"] == value, key
    assert len(meta["tokenizer.ggml.tokens"]) == SMOLLM2_VOCAB
    assert meta["tokenizer.ggml.model"] == "gpt2"
    tensors = {t.name: t for t in reader.tensors}
    # PyTorch's order (rows last): the experts stacked [experts, rows, columns].
    expected = {
        "token_embd.weight": ((SMOLLM2_VOCAB, 256), block_type),
        "output.weight": ((SMOLLM2_VOCAB, 256), block_type),
        "output_norm.weight": ((256,), "F32"),
        "blk.1.attn_q.weight": ((256, 256), block_type),
        "blk.1.attn_k.weight": ((128, 256), block_type),
        "blk.1.attn_q_norm.weight": ((64,), "F32"),
        "blk.1.ffn_gate_inp.weight": ((4, 256), "F32"),
        "blk.1.ffn_gate_exps.weight": ((4, 256, 256), block_type),
        "blk.1.ffn_up_exps.weight": ((4, 256, 256), block_type),
        "blk.1.ffn_down_exps.weight": ((4, 256, 256), block_type),
    }
    for name, (shape, kind) in expected.items():
        tensor = tensors[name]
        assert tuple(reversed(tensor.shape.tolist())) == shape, name
        assert tensor.tensor_type.name == kind, name
    assert len(tensors) == 3 + 12 * 2  # embeddings, final norm, output; 12 per layer
    experts = tensors["blk.0.ffn_down_exps.weight"]
    values = gguf.quants.dequantize(experts.data, experts.tensor_type)
    assert np.isfinite(values).all()
    assert np.abs(values).max() <= WEIGHT_SCALE * 1.01
    assert abs(values.mean()) < WEIGHT_SCALE / 10 and values.std() > WEIGHT_SCALE / 10
    norm = tensors["blk.0.attn_norm.weight"]
    assert (np.asarray(norm.data) == 1.0).all()


@pytest.mark.parametrize("block_type", BLOCK_TYPES)
def test_random_gguf_runs_in_tandem(files, block_type):
    llm = LLM(model=str(files[block_type]), max_model_len=128, num_kv_blocks=16, cpu_threads=1)
    try:
        assert llm.engine.spec.vocab_size == SMOLLM2_VOCAB
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        (out,) = llm.generate(["The capital of France is"], params)
    finally:
        llm.close()
    assert len(out.outputs[0].token_ids) == 6
    assert isinstance(out.outputs[0].text, str)


def test_a_dense_llama_with_llama3_rope(tmp_path):
    """A dense config (llama: no q/k norms, Llama 3's rope divisors as rope_freqs) loads too."""
    packaged_model("smollm2-135m-instruct", "SmolLM2-135M-Instruct (the random GGUF's tokenizer)")
    config = {key: TINY_MOE[key] for key in ("hidden_size", "intermediate_size",
              "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "max_position_embeddings", "rms_norm_eps")}  # fmt: skip
    rope = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}
    config |= {"architectures": ["LlamaForCausalLM"], "rope_theta": 500000.0,
               "rope_scaling": rope, "tie_word_embeddings": True}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    path = write_random_gguf(tmp_path, tmp_path / "llama.gguf", "Q8_0")
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    assert "output.weight" not in tensors and "blk.0.attn_q_norm.weight" not in tensors
    factors = np.asarray(tensors["rope_freqs.weight"].data)
    assert factors.shape == (32,) and factors[0] == 1.0 and factors[-1] == 8.0
    assert reader.fields["llama.vocab_size"].contents() == SMOLLM2_VOCAB
    llm = LLM(model=str(path), max_model_len=128, num_kv_blocks=16, cpu_threads=1)
    try:
        (out,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    finally:
        llm.close()
    assert len(out.outputs[0].token_ids) == 4


def test_cache_names_the_file_and_reuses_it(tiny_moe, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    logged: list[str] = []
    path = cached_random_gguf(tiny_moe, "Q8_0", {"num_hidden_layers": 1}, log=logged.append)
    assert path.parent == tmp_path / "models"
    assert re.fullmatch(rf"random-{tiny_moe.name}-1layers-q8_0-[0-9a-f]{{8}}\.gguf", path.name)
    written = path.stat().st_mtime_ns
    assert cached_random_gguf(tiny_moe, "Q8_0", {"num_hidden_layers": 1}, log=logged.append) == path
    assert path.stat().st_mtime_ns == written
    assert ["writing" in line for line in logged] == [True, False]
    assert len(gguf.GGUFReader(path).tensors) == 3 + 12
    other = cached_random_gguf(tiny_moe, "Q8_0", log=logged.append)  # the config's 2 layers
    assert other != path and "-2layers-" in other.name
    assert not list((tmp_path / "models").glob("*.partial"))


def _rows(out: str) -> list[list[str]]:
    """The report's table rows, cells stripped."""
    return [[c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines() if "│" in line]


# The shortest output there is (a token to prefill, one to decode): the warm-up fits it too.
BENCH = ["bench", "--workload", "batches", "--batch-sizes", "1,2", "--prompt-len", "8",
         "--output-len", "2", "--cpu-threads", "1"]  # fmt: skip


def test_random_gguf_flag_writes_into_the_cache(tiny_moe, tmp_path, monkeypatch):
    """--random-gguf's file: --model's shape, --num-layers over it, cached in TANDEM_CACHE_DIR.
    (The engines that run it are spawned with the environment: a cache folder of the test's own
    would also rebuild the fused kernels there, so the report's tests run files given.)"""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    flags = ["bench", "--workload", "batches", "--model", str(tiny_moe), "--random-gguf", "Q4_0"]
    args = build_parser().parse_args([*flags, "--num-layers", "1"])
    path = random_model(args, engine_config(args), Console(file=io.StringIO()))
    assert path.parent == tmp_path / "models" and "-1layers-q4_0-" in path.name
    assert gguf.GGUFReader(path).fields["qwen3moe.block_count"].contents() == 1
    dummy = build_parser().parse_args([*flags, "--load-format", "dummy"])
    with pytest.raises(ValueError, match="drop --load-format dummy"):
        random_model(dummy, engine_config(dummy), Console(file=io.StringIO()))
    # Refused before any engine loads: the layers of a file not asked for, a bad batch size.
    assert main(["bench", "--workload", "batches", "--num-layers", "1"]) == 2
    assert main([*flags, "--batch-sizes", "0"]) == 2
    assert not list((tmp_path / "models").glob("*-2layers-*"))
    # No llama.cpp in this cache: the report says so rather than failing.
    bin_dir, note = llama_cpp_for("auto", path)
    assert bin_dir is None and f"no llama-batched-bench in {tmp_path}" in note


def test_batches_report_without_llama_cpp(files, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    file = files["Q4_0"]
    assert main([*BENCH, "--model", str(file), "--llama-cpp", "none"]) == 0
    out = capsys.readouterr().out
    print(out)
    rows = _rows(out)
    assert [r[:3] for r in rows] == [["Tandem", "1", "1"], ["Tandem", "2", "1"]]
    for row in rows:
        prefill, decode, loaded, peak, per_file = map(float, row[3:])
        assert prefill > 0 and decode > 0
        assert 0 < loaded <= peak
        assert per_file == pytest.approx(peak * 1024**3 / file.stat().st_size, rel=0.02)
    assert "llama.cpp: not run (--llama-cpp none)" in out
    # At batch 1 the decode rate against streaming the token's weights (top-k experts) once.
    assert re.search(r"Tandem at batch 1: a token reads \d+ MB of weights .* GB/s", out)
    assert "2 layers, hidden 256" in out
