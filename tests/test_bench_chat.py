"""`tandem bench --workload chat` and the speculative tokens the asynchronous loop discards.

The async loop schedules step N+1 before step N's tokens are known, so a request that stops in
step N already holds a token in step N+1, dropped at retirement: RunSummary.discarded_tokens
counts them (exactly one per request stopped before its cap, unless that step was skipped;
none in the sync loop)."""

from __future__ import annotations

import argparse
import re
import shutil

import pytest
from transformers import AutoTokenizer

from tandem import SamplingParams
from tandem.bench.run import run_workload
from tandem.bench.workloads import (
    CHAT_OUTPUT_LEN,
    chat_prompt_ids,
    chat_questions,
    make_chat_workload,
    resolve_workload,
)
from tandem.cli import build_parser, engine_config, main

from helpers import make_llm, run_both_loops

FORCED = 100  # an ordinary id of the tiny tokenizer, pushed to the top by logit_bias


def _stop_at(k: int, max_tokens: int = 32) -> SamplingParams:
    """Greedy; FORCED is the argmax once unmasked at output index k: ends as token k + 1."""
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logit_bias={FORCED: 100.0},
        min_tokens=k, stop_token_ids=[FORCED],
    )  # fmt: skip


def _bench_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *flags])


# ------------------------------------------------------------------ the counter
def test_async_discards_one_token_per_request_stopped_sync_none(tiny_llama):
    stops = [2, 5, 9, 13]  # each request stops at its own step
    params = [_stop_at(k) for k in stops] + [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 20)
    ]
    prompts = [[5 + i, 40 + i, 300 + 7 * i] for i in range(len(params))]
    runs = run_both_loops(tiny_llama, prompts, params)
    (sync, sync_llm), (async_, async_llm) = runs[False], runs[True]
    assert [o.token_ids for o in async_] == [o.token_ids for o in sync]
    reasons = [o.finish_reason for o in async_]
    assert reasons == [o.finish_reason for o in sync] == ["stop"] * 4 + ["length"] * 2
    for out, k in zip(async_, stops, strict=False):
        assert len(out.token_ids) == k + 1 and out.token_ids[-1] == FORCED
    assert async_llm.engine.summary().discarded_tokens == reasons.count("stop") == 4
    assert sync_llm.engine.summary().discarded_tokens == 0
    # One discard in the step after each stop, on its own step record.
    assert sorted(s.discarded for s in async_llm.engine.history.steps() if s.discarded) == [1] * 4


def test_a_stop_on_the_last_allowed_token_discards_nothing(tiny_llama):
    """The scheduler never schedules past max_tokens: such a request holds no speculative token."""
    params = [_stop_at(3, max_tokens=4), SamplingParams(max_tokens=8, ignore_eos=True)]
    runs = run_both_loops(tiny_llama, [[5, 6, 7], [8, 9, 10]], params)
    out, llm = runs[True]
    assert out[0].finish_reason == "stop" and len(out[0].token_ids) == 4
    assert llm.engine.summary().discarded_tokens == 0


def test_summary_windows_count_their_own_discards(tiny_llama):
    """A request running on past the stops keeps each next step alive (one of stopped requests
    alone is skipped: tests/test_engine.py)."""
    llm = make_llm(tiny_llama)
    on = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm.generate([[5, 6], [7, 8], [1, 2]], [_stop_at(2), _stop_at(4), on])
    mark = llm.engine.history.mark()
    llm.generate([[9, 10], [3, 4]], [_stop_at(1), on])
    assert llm.engine.history.summary(since=mark).discarded_tokens == 1
    assert llm.engine.summary().discarded_tokens == 3
    assert llm.engine.summary().skipped_steps == 0


# ------------------------------------------------------------------ the workload
def test_chat_prompts_are_the_template_rendering(tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    questions = chat_questions()
    assert len(questions) >= 64 and len(set(questions)) == len(questions)
    prompts = chat_prompt_ids(tokenizer, len(questions) + 2)
    for question, ids in zip(questions, prompts, strict=False):
        messages = [{"role": "user", "content": question}]
        expected = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert ids == expected
        assert question in tokenizer.decode(ids)
    assert prompts[len(questions) :] == prompts[:2]  # --num-requests beyond them: cycling

    args = _bench_args("--workload", "chat", "--num-requests", "4", "--output-len", "16")
    resolve_workload(args, engine_config(args), "cpu")
    work = make_chat_workload(args, tokenizer, 2048)
    assert work.prompts == prompts[:4] and work.output_lens == [16] * 4
    assert not work.ignore_eos and work.arrival_times == [0.0] * 4
    args = _bench_args("--workload", "chat")
    resolve_workload(args, engine_config(args), "cpu")
    assert args.output_len == CHAT_OUTPUT_LEN


def test_chat_needs_a_tokenizer_with_a_template(tiny_llama, tmp_path, capsys):
    with pytest.raises(ValueError, match="has no tokenizer files"):
        chat_prompt_ids(None, 4)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        chat_prompt_ids(tokenizer, 4)
    shutil.copy(tiny_llama / "config.json", tmp_path / "config.json")  # dummy weights only
    flags = ["--model", str(tmp_path), "--load-format", "dummy", "--num-requests", "2"]
    assert main(["bench", "--workload", "chat", *flags]) == 2
    err = capsys.readouterr().err
    assert "tandem bench: error: the chat workload" in err and "no tokenizer files" in err


def test_chat_bench_runs_and_reports_discards(tiny_llama, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # one table row per line
    args = ["bench", "--workload", "chat", "--model", str(tiny_llama), "--num-requests", "4",
            "--output-len", "16"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    print(out)
    finish = re.search(r"requests finished by stop / length\s*│\s*(\d+) / (\d+)\s*│", out)
    assert finish and int(finish[1]) + int(finish[2]) == 4
    discarded = re.search(r"speculative tokens discarded\s*│\s*(\d+) \(([\d.]+) / request\)", out)
    assert discarded and discarded[1] == "0"  # the sync column
    skipped = re.search(
        r"steps skipped \(their requests had stopped\)\s*│\s*(\d+)\s*│\s*(\d+)", out
    )
    assert skipped and skipped[1] == "0"  # the sync loop has no step in flight to skip


def test_bench_run_counts_discards_on_the_chat_workload(tiny_llama):
    """Whatever the random weights answer: async discards one per stop before the cap, but for
    the requests of a step skipped because they had all stopped."""
    llm = make_llm(tiny_llama)
    args = _bench_args("--workload", "chat", "--num-requests", "4", "--output-len", "16")
    resolve_workload(args, engine_config(args), "cpu")
    work = make_chat_workload(args, llm.engine.tokenizer, llm.engine.max_model_len)
    runs = {}
    for mode in ("sync", "async"):
        llm.engine.configure(async_scheduling=mode == "async")
        runs[mode] = run_workload(llm.engine, work, 0.0, None, mode)
    assert runs["sync"].outputs == runs["async"].outputs
    assert runs["sync"].finish_reasons == runs["async"].finish_reasons
    early = sum(
        reason == "stop" and len(out) < cap
        for reason, out, cap in zip(
            runs["async"].finish_reasons, runs["async"].outputs, work.output_lens, strict=True
        )
    )
    skipped = sum(s.num_seqs for s in llm.engine.history.steps() if s.skipped)  # async only
    assert runs["async"].summary.discarded_tokens + skipped == early
    assert runs["sync"].summary.discarded_tokens == 0
    print(f"chat workload: {runs['async'].finish_reasons}, async discarded {early}")
