"""Pipeline parallelism on the CPU: the layers split over stages (gloo, one process a stage).

Outputs equal one process's token for token (greedy and seeded, both loops; tied embeddings,
sliding windows, experts, grammars, penalties and logprobs, chunked prefill, preemption, and
tensor parallelism within each stage). The scheduler keeps one micro-batch of other requests
per stage in flight, so that a request's next step never waits for its token to leave the last
stage. Over two machines: `test_multi_node.py`.
"""

from __future__ import annotations

from dataclasses import replace

import openai
import pytest
import torch
from test_server_processes import OFFLINE_OPTIONS, clean_up, spawn, wait_healthy

from tandem import LLM, SamplingParams
from tandem.models.loader import build_model, read_config
from tandem.models.parallel import (
    LAYER_PARTITION_ENV,
    PipelineStage,
    balanced_split,
    logits_in_layers,
    pipeline_stage,
)
from tandem.request import Request
from tandem.scheduling.scheduler import Scheduler
from tests.shared_tp import ranks_from_a_fork_server  # noqa: F401

from gguf_files import tiny_hf_folder, write_gguf
from helpers import make_llm

PROMPTS = ["Hello world", "The quick brown fox", "Once upon a time, in a land far away", "a b c"]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
PP2 = {"pipeline_parallel_size": 2, "cpu_threads": 1}


N_SAMPLES = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)


def outputs(llm, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def samples(llm, prompts, params) -> list[list[list[int]]]:
    """Every sample of every prompt (n > 1: samples share their prompt's blocks)."""
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]


# ------------------------------------------------------------------- the split
def test_layers_split_so_the_costliest_stage_costs_least(tiny_llama, monkeypatch):
    """The last stage's logits count as layers: SmolLM2-135M's (8 layers' worth) leave it 11 of
    30 layers, Gemma 3 270M's (30 layers' worth) 1 of 18; the environment overrides."""
    assert balanced_split(8, 3, 0.0) == [3, 3, 2]
    assert balanced_split(30, 2, 8.0) == [19, 11]
    assert balanced_split(18, 2, 30.1) == [17, 1]
    assert balanced_split(4, 4, 5.0) == [1, 1, 1, 1]
    _, spec, _ = read_config(tiny_llama)
    q, kv, hidden = (
        spec.num_heads * spec.head_dim,
        spec.num_kv_heads * spec.head_dim,
        spec.hidden_size,
    )
    layer = hidden * (2 * q + 2 * kv) + 3 * hidden * spec.intermediate_size
    assert logits_in_layers(spec) == pytest.approx(spec.vocab_size * hidden / layer)
    spec = replace(spec, num_layers=8)
    stages = [pipeline_stage(i, 2, spec) for i in range(2)]
    counts = balanced_split(8, 2, logits_in_layers(spec))
    assert [len(s.layers(8)) for s in stages] == counts and stages[1].stop == 8
    assert pipeline_stage(0, 1, spec).layers(8) == range(8)
    with pytest.raises(ValueError, match="pipeline_parallel_size 9 exceeds the model's 8 layers"):
        pipeline_stage(0, 9, spec)
    monkeypatch.setenv(LAYER_PARTITION_ENV, "5,3")
    assert pipeline_stage(1, 2, spec) == PipelineStage(1, 2, 5, 8)
    for bad in ("4,3", "8,0", "x,y", "2,2,4"):
        monkeypatch.setenv(LAYER_PARTITION_ENV, bad)
        with pytest.raises(ValueError, match=f"{LAYER_PARTITION_ENV}='{bad}' must be 2 positive"):
            pipeline_stage(0, 2, spec)


def test_a_stage_holds_only_its_layers_and_ends(tiny_checkpoints):
    """Untied: the embedding on the first stage, the norm and the LM head on the last; tied, the
    last stage holds the embedding too (its logits read it)."""
    for arch, tied in (("LlamaForCausalLM", False), ("MistralForCausalLM", True)):
        path, spec, hf_config = read_config(tiny_checkpoints[arch])
        first, last = (pipeline_stage(i, 2, spec) for i in range(2))
        models = [
            build_model(path, spec, hf_config, torch.float32, torch.device("cpu"), stage=s)
            for s in (first, last)
        ]
        for model, stage in zip(models, (first, last), strict=True):
            names = set(model.checkpoint_shapes())
            layers = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
            assert layers == set(stage.layers(spec.num_layers))
            assert ("model.norm.weight" in names) == stage.is_last
            assert ("lm_head.weight" in names) == (stage.is_last and not tied)
            embeds = stage.is_first or (tied and stage.is_last)
            assert ("model.embed_tokens.weight" in names) == embeds
            assert (model.embed.weight.shape[0] > 0) == embeds
            held = sum(p.numel() for p in model.layers.parameters())
            one = sum(p.numel() for p in model.layers[stage.start].parameters())
            assert held == one * len(stage.layers(spec.num_layers))  # no other stage's weights


# ------------------------------------------------------------------- scheduling
def _request(i: int, prompt_len: int = 4, max_tokens: int = 8) -> Request:
    params = SamplingParams(max_tokens=max_tokens)
    return Request(str(i), list(range(1, prompt_len + 1)), params, 0, (0.0, 0, 1.0, 0.0, 0),
                   max_tokens, 0.0)  # fmt: skip


def _retire(scheduler: Scheduler, batch) -> None:
    scheduler.retire_step(batch)
    for item in batch.sampled:
        scheduler.settle(item, 1)
        item.request.output_token_ids.append(7)


def test_two_stages_keep_two_micro_batches_of_other_requests_in_flight():
    scheduler = Scheduler(64, 16, 8, 256, 128, pipeline_stages=2)
    assert scheduler.use_loop(asynchronous=False) == 0  # synchronous: one whole step at a time
    assert scheduler.use_loop(asynchronous=True) == 2  # one step per stage in flight
    requests = [_request(i) for i in range(4)]
    for r in requests:
        scheduler.add(r)
    names = lambda batch: [item.request.request_id for item in batch.items]  # noqa: E731
    inflight = [scheduler.schedule(), scheduler.schedule()]
    assert [names(b) for b in inflight] == [["0", "1"], ["2", "3"]]  # each its share
    for step in range(2, 8):  # the loop: launch step N, retire step N - 2
        batch = scheduler.schedule()
        # A micro-batch takes the requests of the oldest step in flight, which leaves the last
        # stage as this one enters the first: the first stage waits for no later step's ids.
        assert names(batch) == names(inflight[0])
        assert batch.reads_through == step - 2
        inflight.append(batch)
        _retire(scheduler, inflight.pop(0))
    # One request alone: its next step waits for its token (nothing else could run meanwhile).
    lone = Scheduler(64, 16, 8, 256, 128, pipeline_stages=2)
    lone.use_loop(asynchronous=True)
    lone.add(_request(9))
    first = lone.schedule()
    assert lone.schedule() is None  # its token is still in the pipeline
    _retire(lone, first)
    again = lone.schedule()
    assert names(again) == ["9"] and again.reads_through == first.step_id


def test_one_stage_schedules_as_before():
    scheduler = Scheduler(64, 16, 8, 256, 128)
    assert scheduler.use_loop(asynchronous=True) == 1
    for i in range(4):
        scheduler.add(_request(i))
    first, second = scheduler.schedule(), scheduler.schedule()
    assert len(first.items) == len(second.items) == 4 and second.reads_through == 0


# ------------------------------------------------------------------- equality
@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    from tandem.models.default_model import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("four-layers"), num_hidden_layers=4)


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_two_stages_equal_one_process(four_layers, loop):
    """Greedy and seeded, with penalties and logprobs (the last stage reads input ids the first
    stage's table never sampled), a chunked prefill, and n > 1 samples of each prompt."""
    ref = make_llm(four_layers, cpu_threads=1, max_num_batched_tokens=128)
    extras = SamplingParams(max_tokens=12, temperature=0.8, seed=3, repetition_penalty=1.3,
                            presence_penalty=0.5, logprobs=2, ignore_eos=True)  # fmt: skip
    long_prompt = [list(range(5, 300))]
    want = [outputs(ref, PROMPTS, GREEDY), outputs(ref, PROMPTS, SEEDED)]
    want_extras = [o.outputs[0] for o in ref.generate(PROMPTS, extras)]
    want.append(outputs(ref, long_prompt, GREEDY))
    want.append(samples(ref, PROMPTS, N_SAMPLES))
    ref.close()
    llm = make_llm(four_layers, async_scheduling=loop == "async", max_num_batched_tokens=128,
                   **PP2)  # fmt: skip
    try:
        assert "pipeline parallel: 2 stages" in llm.engine.execution.describe()
        got = [outputs(llm, PROMPTS, GREEDY)]
        if loop == "async":  # decode steps of half the requests each: two micro-batches
            steps = [s for s in llm.engine.history.steps() if s.num_tokens == s.num_seqs]
            assert steps and max(s.num_seqs for s in steps) == len(PROMPTS) // 2
        got.append(outputs(llm, PROMPTS, SEEDED))
        got_extras = [o.outputs[0] for o in llm.generate(PROMPTS, extras)]
        got.append(outputs(llm, long_prompt, GREEDY))
        got.append(samples(llm, PROMPTS, N_SAMPLES))
        assert got == want
        for g, w in zip(got_extras, want_extras, strict=True):  # the same floats, bit for bit
            assert g.token_ids == w.token_ids
            assert [{k: v.logprob for k, v in d.items()} for d in g.logprobs] == [
                {k: v.logprob for k, v in d.items()} for d in w.logprobs
            ]
    finally:
        llm.close()


@pytest.mark.parametrize(
    "arch", ["MistralForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"]
)  # tied embeddings; sliding windows (layer groups); experts
def test_two_stages_equal_one_process_for_other_families(tiny_checkpoints, arch):
    assert_two_stages_greedy_and_seeded_as_one_process(tiny_checkpoints[arch])


def assert_two_stages_greedy_and_seeded_as_one_process(path) -> None:
    ref = make_llm(path, cpu_threads=1)
    want = outputs(ref, PROMPTS, GREEDY), outputs(ref, PROMPTS, SEEDED)
    ref.close()
    llm = make_llm(path, **PP2)
    try:
        assert (outputs(llm, PROMPTS, GREEDY), outputs(llm, PROMPTS, SEEDED)) == want
    finally:
        llm.close()


def test_a_gguf_s_embedding_stays_in_its_blocks_on_both_stages(tmp_path):
    """Tied Q4_K: the first stage looks tokens up in its copy of the embedding's blocks (no
    float table), the last multiplies by the logits' own."""
    folder = tiny_hf_folder(tmp_path / "hf", "LlamaForCausalLM", tie_word_embeddings=True)
    path = write_gguf(folder, tmp_path / "m.gguf", "Q4_K")
    _, spec, hf_config = read_config(path)
    first, last = (
        build_model(path, spec, hf_config, torch.float32, torch.device("cpu"), stage=stage)
        for stage in (pipeline_stage(i, 2, spec) for i in range(2))
    )
    assert first.embedding_blocks is not None and first.embed.weight.numel() == 0
    assert first.tied_logits is None and last.tied_logits is not None
    assert not last.lookups_in_blocks
    assert_two_stages_greedy_and_seeded_as_one_process(path)


@pytest.mark.parametrize(
    "options", [{}, {"kv_cache_dtype": "int8"}, {"quantization": "int8"}], ids=str
)
def test_prompt_logprobs_quantized_caches_and_weights_through_two_stages(four_layers, options):
    """Prompt logprobs come from the last stage's hidden states of prompt positions; an int8 KV
    cache and int8 weights are each stage's own."""
    params = SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=2, logprobs=1,
                            ignore_eos=True)  # fmt: skip

    def run(llm) -> list:
        return [
            (o.outputs[0].token_ids,
             [d and {k: v.logprob for k, v in d.items()} for d in o.prompt_logprobs])
            for o in llm.generate(PROMPTS, params)
        ]  # fmt: skip

    ref = make_llm(four_layers, cpu_threads=1, **options)
    want = run(ref)
    ref.close()
    llm = make_llm(four_layers, **options, **PP2)
    try:
        assert run(llm) == want
    finally:
        llm.close()


def test_grammars_and_preemption_through_two_stages(four_layers):
    """A JSON schema's bitmask reaches the last stage only; a cache too small for every request
    preempts and recomputes."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    constrained = SamplingParams(max_tokens=24, temperature=0, structured_outputs={"json": schema})
    small = {"num_kv_blocks": 12, "block_size": 8, "max_num_seqs": 4}
    prompts = [p * 3 for p in PROMPTS]
    ref = make_llm(four_layers, cpu_threads=1, **small)
    want = [o.outputs[0].text for o in ref.generate(PROMPTS, constrained)]
    want_preempted = outputs(ref, prompts, SamplingParams(max_tokens=40, temperature=0,
                                                          ignore_eos=True))  # fmt: skip
    ref.close()
    llm = make_llm(four_layers, **small, **PP2)
    try:
        assert [o.outputs[0].text for o in llm.generate(PROMPTS, constrained)] == want
        preempted = outputs(llm, prompts, SamplingParams(max_tokens=40, temperature=0,
                                                          ignore_eos=True))  # fmt: skip
        assert preempted == want_preempted
        assert llm.engine.scheduler.num_preemptions > 0
    finally:
        llm.close()


def test_four_stages_equal_one_process(four_layers):
    """Two middle stages, each receiving the stream and (for its row lengths) the last stage's
    ids, which the last stage sends to three stages without waiting for any: a stage takes them
    only when a step reads them. Greedy, then with ngram drafts."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    prompts = [p + " " + p for p in PROMPTS]
    for options in ({}, {"speculative_config": spec}):
        ref = make_llm(four_layers, cpu_threads=1, **options)
        want = outputs(ref, prompts, GREEDY), outputs(ref, prompts[:2], SEEDED)
        ref.close()
        llm = make_llm(four_layers, pipeline_parallel_size=4, cpu_threads=1, **options)
        try:
            assert "pipeline parallel: 4 stages" in llm.engine.execution.describe()
            assert (outputs(llm, prompts, GREEDY), outputs(llm, prompts[:2], SEEDED)) == want
        finally:
            llm.close()


def test_tensor_parallel_within_each_of_two_stages(four_layers):
    """Four ranks: two stages of two; each stage's all-reduces stay in its own group."""
    ref = make_llm(four_layers, cpu_threads=1)
    want = outputs(ref, PROMPTS, GREEDY)
    ref.close()
    llm = make_llm(four_layers, tensor_parallel_size=2, **PP2)
    try:
        assert "pipeline parallel: 2 stages of 2 process(es)" in llm.engine.execution.describe()
        assert outputs(llm, PROMPTS, GREEDY) == want
    finally:
        llm.close()


def test_what_a_pipeline_does_not_run_is_refused(four_layers, tmp_path):
    with pytest.raises(ValueError, match="pipeline_parallel_size must be >= 1"):
        make_llm(four_layers, pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="pipeline_parallel_size 5 exceeds the model's 4 layers"):
        make_llm(four_layers, pipeline_parallel_size=5)
    with pytest.raises(ValueError, match="pipeline_parallel_size 2 does not run with .*external"):
        make_llm(four_layers, distributed_executor_backend="external_launcher", **PP2)
    draft = {"method": "draft_model", "model": str(four_layers), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="'draft_model' runs in one process"):
        make_llm(four_layers, speculative_config=draft, **PP2)


@pytest.mark.parametrize("loop", ["sync", "async"])
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculative_decoding_through_two_stages(four_layers, loop, method):
    """Every stage places a verification's tokens by its rows' lengths, which the last stage's
    kept counts advance on every stage (and drafts ngrams from its own table, alike): the
    outputs, greedy and seeded, equal one process's with the same drafts, and a JSON grammar
    over drafts too (the last stage hands the drafts to the host)."""
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    json = SamplingParams(max_tokens=24, temperature=0, structured_outputs={"json": schema})
    prompts = [p + " " + p for p in PROMPTS]  # repeats: drafts that get accepted
    params = (GREEDY, SEEDED, json)
    ref = make_llm(four_layers, cpu_threads=1, speculative_config=spec)
    want = [outputs(ref, prompts, p) for p in params]
    ref.close()
    llm = make_llm(four_layers, speculative_config=spec, async_scheduling=loop == "async", **PP2)
    try:
        assert [outputs(llm, prompts, p) for p in params] == want
        assert llm.engine.stats().speculative.accepted_tokens > 0
    finally:
        llm.close()


def test_a_server_streams_through_two_stages(four_layers, tmp_path):
    """`tandem serve --pipeline-parallel-size 2`, streamed to the official client, answers as
    one process does."""
    offline = LLM(str(four_layers), **OFFLINE_OPTIONS)
    want = [o.outputs[0].text for o in offline.generate(PROMPTS, GREEDY)]
    offline.close()
    server = spawn(four_layers, tmp_path / "serve.log", "--pipeline-parallel-size", "2",
                   "--cpu-threads", "1")  # fmt: skip
    try:
        wait_healthy(server)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        for prompt, text in zip(PROMPTS, want, strict=True):
            stream = client.completions.create(
                model=server.model, prompt=prompt, max_tokens=GREEDY.max_tokens, temperature=0,
                stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert "".join(c.choices[0].text for c in stream if c.choices) == text
        assert "pipeline parallel: 2 stages" in server.output()
    finally:
        clean_up(server)
