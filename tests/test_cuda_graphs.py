"""The CUDA-graph decode path's logic, run eagerly on a CPU.

Capture and replay need a GPU (benchmarks/cuda_check.py runs them there). Everything else a
captured step does is checked here: which steps qualify and with which sampler variant, the
padded layout of the static buffers, the spare KV block and token-table entry that padded rows
write to, and the graph's step body. The body runs from the static buffers instead of a replay,
and a whole generation through it must give exactly the eager path's tokens.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem import SamplingParams
from tandem.config import SpeculativeConfig
from tandem.execution.cuda_graphs import (
    _FLOATS,
    _INTS,
    _VERIFY_INTS,
    MODES,
    DecodeGraphs,
    capture_sizes,
    graph_mode,
    graph_sizes,
    table_width,
    verify_shape,
)
from tandem.execution.fast_path import ExecutionPlan

from conftest import random_prompts
from helpers import assert_idle_and_balanced, greedy, make_llm

CUDA_CHECK = Path(__file__).resolve().parent.parent / "benchmarks" / "cuda_check.py"
# The decode runs of the dry run under both GEMMs: graphs on under each, off under the default.
BLOG = [
    f"blog {m}, graphs {g}" for g in ("on", "on, triton GEMMs", "off") for m in ("sync", "async")
]
FP8 = [f"fp8 check: {w}{g}" for g in ("", ", triton GEMMs") for w in ("bf16", "fp8")]


class EagerGraphs(DecodeGraphs):
    """Replays by running the step body on the static buffers (what the graph captured)."""

    def __init__(self, body, *args):
        super().__init__(*args)
        self.body = body

    def replay(self, key, words, x):
        size, mode, history = key
        self.load(size, words, table_width(x))
        self.replays[key] = self.replays.get(key, 0) + 1
        with torch.inference_mode():
            return self.output(self.body(self.views(size), mode, history), size, x)


def _with_eager_graphs(llm, sizes: list[int]) -> EagerGraphs:
    runner, engine = llm.engine.runner, llm.engine
    width = -(-engine.max_model_len // engine.config.block_size)
    spare = runner.kv_caches[0].shape[1] - 1
    verify = verify_shape(
        engine.config.speculative_config, engine.max_model_len, engine.config.max_num_seqs
    )
    runner.graphs = EagerGraphs(
        runner._graph_step, sizes, width, spare, engine.config.block_size,
        _token_sink(llm), len(runner.lengths) - 1, runner.device, verify,
    )  # fmt: skip
    return runner.graphs


def _record_eager_verifications(graphs: DecodeGraphs) -> list:
    """The verification steps `graphs` leaves to the eager path, as they are looked up."""
    eager, key_for = [], graphs.key_for

    def recording(x):
        key = key_for(x)
        if key is None and x.sampler.verify is not None:
            eager.append(x)
        return key

    graphs.key_for = recording
    return eager


def _token_sink(llm) -> int:
    """The token table's spare row (after every table row), where padded rows read and write."""
    return (len(llm.engine.runner.lengths) - 1) * llm.engine.max_model_len


def test_capture_sizes_and_where_graphs_apply():
    assert capture_sizes(128) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(1000)[-1] == 256
    assert graph_sizes(torch.device("cpu"), False, 128) == []  # nothing to capture on a CPU


def test_verification_graph_bands():
    """ngram verifications get graphs in bands of history up to the context limit; a draft
    model's none; the execution line names them."""
    ngram = SpeculativeConfig(method="ngram", prompt_lookup_max=3, prompt_lookup_min=1)
    assert verify_shape(None, 4096, 8) is None
    assert verify_shape(SpeculativeConfig(method="draft_model", model="m"), 4096, 8) is None
    assert verify_shape(ngram, 8272, 8).histories == (1024, 4096, 8272)
    assert verify_shape(ngram, 1000, 8).histories == (1000,)
    assert verify_shape(ngram, 131072, 8).histories == (1024, 4096, 16384)  # longer: eager
    graphs = DecodeGraphs([1, 32, 64, 80], 4, 9, 16, 100, 10, torch.device("cpu"),
                          verify_shape(ngram, 2048, 80))  # fmt: skip
    keys = graphs.capture_keys()
    assert graphs.verify.sizes == (1, 2, 4, 8, 16, 32, 48, 64)  # tokens: at most 64
    assert len(keys) == 3 * (4 + 8 * 2)  # every verification size, in both bands
    assert {h for size, _, h in keys if size == 80} == {None}
    assert [size for size, _, _ in keys] == sorted((size for size, _, _ in keys), reverse=True)
    assert verify_shape(ngram, 1000, 8).lookup == (3, 1)
    # One request verifying 4 drafts is 5 tokens: it has graphs of its own beyond size 1.
    one = verify_shape(SpeculativeConfig(method="ngram", num_speculative_tokens=4), 2048, 1)
    assert one.sizes == (1, 2, 4, 5)
    assert verify_shape(SpeculativeConfig(num_speculative_tokens=16), 2048, 4).sizes[-1] == 64
    plan = ExecutionPlan(ops="fused-triton", packed_gemm=False, kernels=None,
                         cuda_graph_sizes=[1, 2, 4], cuda_graph_histories=(1024, 2048),
                         cuda_graph_verify_tokens=20)  # fmt: skip
    text = plan.describe()
    assert "ngram verifications of up to 20 tokens (histories up to 1024, 2048 tokens)" in text


def test_graph_step_gives_the_eager_tokens(tiny_llama):
    """Greedy, seeded sampling, top-k / top-p rows mixed with plain ones, requests joining
    and leaving: every decode step through the graph body, padded to the next size, gives
    the eager path's tokens, and the padded rows touch no block of any request."""
    prompts = random_prompts(random.Random(2), 9, 1024, 3, 40)
    params = [
        greedy(14),
        SamplingParams(max_tokens=11, temperature=0.8, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=14, temperature=1.0, top_p=0.7, seed=2, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.7, top_k=5, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=14, temperature=0.9, min_p=0.1, seed=4, ignore_eos=True),
    ] * 2
    options = dict(num_kv_blocks=64, max_num_seqs=6, max_num_batched_tokens=64)
    reference = make_llm(tiny_llama, **options).generate(prompts, params[:9])
    for async_scheduling in (False, True):
        llm = make_llm(tiny_llama, async_scheduling=async_scheduling, **options)
        graphs = _with_eager_graphs(llm, [1, 2, 4, 8])
        spare = graphs.pad_block
        cache_before = [c[:, spare].clone() for c in llm.engine.runner.kv_caches]
        outs = llm.generate(prompts, params[:9])
        assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
        assert_idle_and_balanced(llm.engine)
        modes = {mode for _, mode, _ in graphs.replays}
        assert "sample-filtered" in modes and modes <= {"sample", "sample-filtered"}
        assert {size for size, _, _ in graphs.replays} >= {2, 8}  # padded: 6 requests -> 8
        # The padded rows wrote only the spare block.
        assert any(not torch.equal(c[:, spare], b) for c, b in zip(
            llm.engine.runner.kv_caches, cache_before, strict=True))  # fmt: skip


def test_all_greedy_steps_use_the_greedy_variant(tiny_llama):
    prompts = random_prompts(random.Random(3), 3, 1024, 3, 20)
    llm = make_llm(tiny_llama, num_kv_blocks=32)
    reference = [o.token_ids for o in make_llm(tiny_llama).generate(prompts, greedy(8))]
    graphs = _with_eager_graphs(llm, [1, 2, 4])
    assert [o.token_ids for o in llm.generate(prompts, greedy(8))] == reference
    assert {mode for _, mode, _ in graphs.replays} == {"greedy"}
    assert (4, "greedy", None) in graphs.replays  # 3 requests padded to 4
    sampled = [SamplingParams(max_tokens=8, temperature=1.0, seed=i) for i in range(3)]
    reference = [o.token_ids for o in make_llm(tiny_llama).generate(prompts, sampled)]
    graphs.replays.clear()
    assert [o.token_ids for o in llm.generate(prompts, sampled)] == reference
    assert {mode for _, mode, _ in graphs.replays} == {"sample"}


def test_padded_layout(tiny_llama):
    """A step packed for a graph of 4 rows: each array padded, the floats' words after the
    ints', the block tables only as wide as the step needs, then the sync loop's known tokens;
    loaded, the static table's later columns keep what a wider step wrote there."""
    llm = make_llm(tiny_llama, num_kv_blocks=32, async_scheduling=False)
    engine = llm.engine
    graphs = _with_eager_graphs(llm, [4])
    captured = []
    real_pack = graphs.pack
    graphs.pack = lambda x, size: captured.append((x, real_pack(x, size))) or captured[-1][1]
    graphs.block_tables[:, 1:] = 17  # what an earlier, wider step wrote
    llm.generate([[5, 6, 7], [8, 9]], greedy(3))
    x, words = captured[0]
    n, ints = x.num_tokens, len(_INTS) + len(_VERIFY_INTS)
    cap = 5  # every array holds the padded size's 4 rows and one past them
    fields = words[: len(_INTS) * cap].reshape(len(_INTS), cap)  # _INTS order
    assert n == 2 and np.array_equal(fields[0, :n], x.token_index)
    sink = _token_sink(llm)
    assert (fields[0, n:] == sink).all() and (fields[4, n:] == sink).all()  # read, write: sink
    assert (fields[2, n:] == graphs.pad_block * engine.config.block_size).all()  # spare block
    assert (fields[3, n:] == 1).all()  # context 1: the spare slot itself
    assert (
        len(x.length_rows) == 0
        and (fields[_INTS.index("length_rows")] == len(engine.runner.lengths) - 1).all()
    )  # no speculation: every row writes the spare length
    verify = words[len(_INTS) * cap : ints * cap]
    verify = dict(zip(_VERIFY_INTS, verify.reshape(-1, cap), strict=True))
    assert (verify["table_rows"] == len(engine.runner.lengths) - 1).all()  # no verification
    assert (verify["token_batch"] == 4).all() and (verify["draft_item"] == 4).all()  # past end
    float_words = -(-len(_FLOATS) * cap // 2)
    floats = words[ints * cap : ints * cap + float_words].view(np.float32)
    temperature, top_p = floats[:cap], floats[cap : 2 * cap]
    assert (temperature[n:] == 0).all() and (top_p[n:] == 1).all()
    width = x.block_tables.shape[1]
    assert width == 1 < graphs.width  # 3 tokens: one block, of a table as wide as 4
    start = ints * cap + float_words
    tables = words[start : start + cap * width].reshape(cap, width)
    assert np.array_equal(tables[:n], x.block_tables) and (tables[n:] == graphs.pad_block).all()
    # Then the sync loop's host-known last samples, written into the table before the replay.
    tail = words[start + cap * width :]
    assert len(x.known_index) == n and np.array_equal(tail, np.r_[x.known_index, x.known_tokens])
    assert graph_mode(x) == "greedy"
    graphs.load(4, torch.from_numpy(words), width)
    assert torch.equal(graphs.block_tables[:cap, :width], torch.from_numpy(tables))
    assert (graphs.block_tables[:, 1:] == 17).all()  # unsent columns: unread, left alone


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """benchmarks/cuda_check.py is run on a GPU rarely and at a cost: its --cpu-dry-run runs
    every section here at tiny sizes, under both GEMMs, so a broken script is found before a GPU
    run. One run, which the two tests below judge; its output and its JSON."""
    out = tmp_path_factory.mktemp("cuda-check") / "results" / "dry-run.json"
    done = subprocess.run(
        [sys.executable, str(CUDA_CHECK), "--cpu-dry-run", "--gemms", "default,triton", "--json",
         str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, out


def test_cuda_check_script_runs_on_a_cpu(dry_run):
    """Every section runs, and the JSON holds every run's figures."""
    done, out = dry_run
    table = done.stdout[done.stdout.rindex("-" * 100) :]
    assert "FAILED" not in table
    for section in ("equivalence", "features", "blog", "fp8", "speculative", "serve", "hf"):
        assert f"\n{section}" in table, table
    assert "\ntargets" in table, table
    results = json.loads(out.read_text())
    assert results["machine"]["torch"] == torch.__version__
    names = [r["name"] for r in results["runs"]]
    speculative = [f"speculative {d}, {m}, batch {b}" for b in (1, 4) for m in ("async", "sync")
                   for d in ("off", "ngram", "ngram, 4 every step")]  # fmt: skip
    assert names == BLOG + FP8 + speculative + ["serve async", "serve sync"]
    runs = {r["name"]: r for r in results["runs"]}
    for run in results["runs"]:
        assert run["tokens_per_s"] > 0
    for name in BLOG + FP8:
        assert runs[name]["weight_bytes"] > 0
        assert runs[name]["fraction_of_streaming"] > 0 and runs[name]["nominal_gbs"] is None
    assert runs["fp8 check: fp8"]["weight_bytes"] < runs["fp8 check: bf16"]["weight_bytes"]
    for mode in ("async", "sync"):
        run = runs[f"speculative ngram, 4 every step, {mode}, batch 1"]
        assert run["drafted"] > 0 and run["verifications"] > 0
    for mode in ("async", "sync"):
        assert runs[f"serve {mode}"]["errors"] == 0 and runs[f"serve {mode}"]["steps"] > 0
    assert 0 <= results["fp8"]["greedy_same_token_share"] <= 1
    assert len(results["checks"]) == table.count("\n") - 1


def test_cuda_check_runs_both_gemms_on_a_cpu(dry_run):
    """`--gemms default,triton` runs the blog (graphs on) and FP8 sections under each GEMM,
    named apart (`BLOG`, `FP8`), and compares the Triton GEMMs' bf16 outputs with the default's
    (on a CPU both are the same GEMMs: no distance); an unknown GEMM is refused."""
    results = json.loads(dry_run[1].read_text())
    same = results["bf16, triton GEMMs vs bf16"]
    assert same["prompt_logprob_max_abs_diff"] == 0 and same["greedy_same_token_share"] == 1
    assert "fp8, triton GEMMs vs bf16, triton GEMMs" in results and "fp8" in results
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run([sys.executable, str(CUDA_CHECK), "--cpu-dry-run", "--gemms", "cutlass"],
                       check=True, capture_output=True, timeout=60)  # fmt: skip


def test_capture_runs_touch_nothing_real(tiny_llama):
    """What capture runs (every graph's body on buffers that are all padding, with requests
    in flight around it) writes only the spare block, the token table's spare row and the
    spare length, whatever the sink's length had grown to."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    llm = make_llm(tiny_llama, speculative_config=ngram, num_kv_blocks=64)
    graphs = _with_eager_graphs(llm, [1, 4])
    runner, sink = llm.engine.runner, _token_sink(llm)
    llm.generate([[5, 6, 7] * 5, [8, 9] * 6], greedy(6))  # rows, lengths and blocks in use
    runner.lengths[-1] = 10**6  # a spare length grown by earlier padded verifications
    table, lengths = runner.token_table.clone(), runner.lengths.clone()
    caches = [c.clone() for c in runner.kv_caches]
    for size, mode, history in graphs.capture_keys():
        with torch.inference_mode():
            out = runner._graph_step(graphs.padded(size), mode, history)
        assert len(out) == (size if history is None else 2 * size + 1)
    assert {h for _, _, h in graphs.capture_keys()} == {None, *graphs.verify.histories}
    assert torch.equal(runner.token_table[:sink], table[:sink])
    assert torch.equal(runner.lengths[:-1], lengths[:-1])
    spare = graphs.pad_block
    for cache, before in zip(runner.kv_caches, caches, strict=True):
        assert torch.equal(cache[:, :spare], before[:, :spare])


def test_a_verification_graph_that_fails_to_capture_leaves_verifications_eager(monkeypatch, caplog):
    """Capturing a verification graph that fails (out of memory, say) drops the verification
    graphs with a warning and keeps the decode graphs; a decode graph that fails stops start-up."""
    ngram = SpeculativeConfig(method="ngram")
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def graphs_capturing(fails) -> DecodeGraphs:
        graphs = DecodeGraphs([1, 2], 4, 9, 16, 100, 10, torch.device("cpu"),
                              verify_shape(ngram, 2048, 2))  # fmt: skip

        def capture_one(key, body, pool):
            if fails(key):
                raise torch.OutOfMemoryError("CUDA out of memory")
            return "graph", "out"

        graphs._capture_one = capture_one
        return graphs

    graphs = graphs_capturing(lambda key: key == (1, "sample", 2048))
    with caplog.at_level("WARNING"):
        graphs.capture(None)
    assert sorted(graphs.graphs) == sorted((s, m, None) for s in (1, 2) for m in MODES)
    assert graphs.verify is None and "ngram verifications run eagerly" in caplog.text
    graphs = graphs_capturing(lambda key: key == (2, "greedy", None))
    with pytest.raises(torch.OutOfMemoryError):
        graphs.capture(None)


def test_speculation_through_graphs(tiny_llama):
    """Under ngram speculation every decode step goes through a graph body: a step without
    drafts in flight writes its rows' lengths there, and a verification places its tokens by
    the device's lengths, drafts, samples and counts what is kept, in the band of history its
    requests' lengths fall in (a prompt past 1024 tokens takes the second). The outputs equal
    decoding without drafts, greedy and seeded, sync and async, while drafts are accepted and
    rejected; the padded entries touch no request's blocks or rows. A draft model's steps stay
    eager (its forward over every step's tokens is not in the graph)."""
    rng = random.Random(7)
    spans = [[rng.randrange(3, 1024) for _ in range(rng.randint(3, 12))] for _ in range(5)]
    prompts = [span * 4 for span in spans] + [spans[0] * (1100 // len(spans[0]) + 1)]
    params = [SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 0.8, seed=i,
                             ignore_eos=True) for i in range(len(prompts))]  # fmt: skip
    options = dict(num_kv_blocks=256, max_num_seqs=6, max_num_batched_tokens=256)
    reference = [o.token_ids for o in make_llm(tiny_llama, **options).generate(prompts, params)]
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    for async_scheduling in (False, True):
        llm = make_llm(tiny_llama, async_scheduling=async_scheduling, speculative_config=ngram,
                       **options)  # fmt: skip
        graphs = _with_eager_graphs(llm, [1, 2, 4, 8, 16, 32])
        eager = _record_eager_verifications(graphs)
        assert graphs.verify.histories == (1024, llm.engine.max_model_len)
        assert [o.token_ids for o in llm.generate(prompts, params)] == reference
        stats = llm.engine.stats().speculative
        assert 0 < stats.accepted_tokens < stats.drafted_tokens
        bands = {history for _, _, history in graphs.replays}
        assert None in bands and bands >= set(graphs.verify.histories), bands
        # Only verifications that share their step with a prompt's chunk run eagerly.
        assert all(x.prefills for x in eager)
        assert llm.engine.runner.eager_verifications == len(eager)
        assert_idle_and_balanced(llm.engine)
    draft = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 2}
    llm = make_llm(tiny_llama, speculative_config=draft, **options)
    graphs = _with_eager_graphs(llm, [1, 2, 4, 8])
    assert graphs.verify is None
    assert [o.token_ids for o in llm.generate(prompts, params)] == reference
    assert not graphs.replays and llm.engine.runner.eager_verifications > 0


def test_one_request_verifies_its_drafts_through_a_graph(tiny_llama):
    """At one request a verification of 4 drafts holds 5 tokens, more rows than any decode
    graph has: it replays a verification graph of its own size instead of running eagerly, and
    gives the tokens decoding without drafts gives."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 1024) for _ in range(6)] * 5 for _ in range(2)]
    params = [greedy(20), SamplingParams(max_tokens=20, temperature=0.8, seed=5, ignore_eos=True)]
    options = dict(num_kv_blocks=64, max_num_seqs=1)
    reference = [o.token_ids for o in make_llm(tiny_llama, **options).generate(prompts, params)]
    fixed = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    llm = make_llm(tiny_llama, speculative_config=fixed, **options)
    graphs = _with_eager_graphs(llm, capture_sizes(1))
    assert graphs.sizes == [1] and graphs.verify.sizes == (1, 2, 4, 5)
    assert [o.token_ids for o in llm.generate(prompts, params)] == reference
    verified = {size for size, _, history in graphs.replays if history is not None}
    assert 5 in verified, graphs.replays
    assert llm.engine.runner.eager_verifications == 0
    assert_idle_and_balanced(llm.engine)


def test_plain_decode_steps_are_marked_for_the_fused_attention(tiny_llama):
    """The attention metadata marks a step plain (`distinct_decodes`: each decode row another
    request's one new token) exactly when no request verifies drafts, eager or through a graph:
    CUDA's decode kernel then rotates and caches the step's keys itself."""
    prompts = [[5, 6, 7] * 4, [8, 9] * 5, [11, 12, 13, 14] * 3]
    fixed = {"method": "ngram", "num_speculative_tokens": 2, "adaptive": False}
    for spec, graphs in ((None, True), (None, False), (fixed, False), (fixed, True)):
        llm = make_llm(tiny_llama, num_kv_blocks=64, speculative_config=spec)
        if graphs:
            _with_eager_graphs(llm, [1, 2, 4])
        model, seen = llm.engine.runner.model, []
        forward = model.forward

        def recorded(input_ids, positions, caches, meta, forward=forward, seen=seen):
            if meta.num_decodes:
                seen.append(meta.distinct_decodes)
            return forward(input_ids, positions, caches, meta)

        model.forward = recorded
        llm.generate(prompts, greedy(6))
        runner = llm.engine.runner
        replayed = runner.graphs.replays.items() if graphs else ()
        verifications = runner.eager_verifications + sum(n for k, n in replayed if k[2])
        assert seen.count(False) == verifications and (verifications > 0) == (spec is not None)
        assert True in seen and (not graphs or replayed)
