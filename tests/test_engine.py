"""Engine behaviour: seeds, stops, aborts, streaming, bad input, the async protocol's promises."""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
import threading

import pytest
import torch

from tandem import SamplingParams
from tandem.engine.detokenizer import IncrementalDetokenizer

from conftest import hf_greedy_reference_allowing_near_ties, random_prompts
from helpers import assert_idle_and_balanced, greedy, make_llm, run_both_loops


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return make_llm(tiny_llama, max_num_batched_tokens=64, block_size=8)


def run_collect(engine):
    """Run to completion; per request, every output seen (for exactly-once and stream checks)."""
    seen: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


def test_seeded_sampling_ignores_batch_company(llm):
    rng = random.Random(5)
    target = random_prompts(rng, 1, 1024, 30, 30)[0]
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate([target], params)[0].token_ids
    others = random_prompts(rng, 9, 1024, 1, 100)
    other_params = [SamplingParams(max_tokens=15, temperature=0.8, seed=i) for i in range(9)]
    for position in (0, 4, 9):
        prompts = others[:position] + [target] + others[position:]
        ps = other_params[:position] + [params] + other_params[position:]
        assert llm.generate(prompts, ps)[position].token_ids == alone
    # A different seed gives a different sample (the seed is really used).
    params.seed = 4321
    assert llm.generate([target], params)[0].token_ids != alone


def test_unseeded_requests_are_reproducible_per_engine_seed(tiny_llama):
    prompts = random_prompts(random.Random(1), 4, 1024, 5, 20)
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    runs = [
        [o.token_ids for o in make_llm(tiny_llama, seed=s).generate(prompts, params)]
        for s in (0, 0, 1)
    ]
    assert runs[0] == runs[1] != runs[2]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_stop_token_mid_flight_discards_the_extra_token(tiny_llama, async_scheduling):
    """Requests end on a stop id or on EOS; the speculative next token never reaches the user."""
    llm = make_llm(tiny_llama, async_scheduling=async_scheduling)
    engine = llm.engine
    rng = random.Random(2)
    prompts = random_prompts(rng, 8, 1024, 5, 60)
    # The stops cut a plain run of the same engine settings, itself checked against transformers.
    plain = make_llm(tiny_llama, async_scheduling=async_scheduling).generate(prompts, greedy(24))
    refs = [out.token_ids for out in plain]
    for prompt, ref in zip(prompts, refs, strict=True):
        assert ref == hf_greedy_reference_allowing_near_ties(tiny_llama, prompt, ref, 24)
    # Even requests: pretend a token they produce is EOS (the EOS path, on this engine only).
    engine.eos_token_ids.update(ref[3 + i] for i, ref in enumerate(refs) if i % 2 == 0)
    expected = {}
    for i, (prompt, ref) in enumerate(zip(prompts, refs, strict=True)):
        stop_ids = [ref[3 + i]] if i % 2 else []
        params = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=stop_ids)
        ends = [k for k, t in enumerate(ref) if t in engine.eos_token_ids or t in stop_ids]
        expected[engine.add_request(prompt, params)] = ref[: ends[0] + 1]
    seen = run_collect(engine)
    for request_id, outs in seen.items():
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        streamed = [t for o in outs for t in o.delta_token_ids]
        assert streamed == outs[-1].token_ids == expected[request_id]
        assert outs[-1].finish_reason == "stop"
    assert_idle_and_balanced(engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_stop_strings_are_cut_and_never_streamed(tiny_llama, async_scheduling):
    llm = make_llm(tiny_llama, async_scheduling=async_scheduling)
    prompts = [p for p in random_prompts(random.Random(3), 6, 1024, 5, 40)]
    full = [o.text for o in llm.generate(prompts, greedy(30))]
    engine = llm.engine
    expected = {}
    for prompt, text in zip(prompts, full, strict=True):
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        params = SamplingParams(
            max_tokens=30, temperature=0, ignore_eos=True, stop=["@@never@@", stop]
        )
        expected[engine.add_request(prompt, params)] = (text[: text.index(stop)], stop)
    for request_id, outs in run_collect(engine).items():
        want, stop = expected[request_id]
        assert outs[-1].text == want and outs[-1].finish_reason == "stop"
        assert "".join(o.delta_text for o in outs) == want
        assert all(stop not in o.text for o in outs)
    assert_idle_and_balanced(engine)


def test_detokenizer_never_splits_characters(llm):
    tokenizer = llm.get_tokenizer()
    text = " café naïve Zürich 🎉🚀 — ünïcödé ✓"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer.backend_tokenizer, [0], [], True)
    deltas = []
    for token in ids:
        detok.add(token)
        deltas.append(detok.delta(finished=False))
    assert "".join(deltas) + detok.delta(finished=True) == text
    assert not any("\ufffd" in d for d in deltas)
    assert len(ids) > len(text.split())  # multi-byte characters really span tokens


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_abort_waiting_running_and_in_flight(tiny_llama, async_scheduling):
    llm = make_llm(
        tiny_llama, async_scheduling=async_scheduling, max_num_seqs=4, max_num_batched_tokens=32
    )
    engine = llm.engine
    prompts = random_prompts(random.Random(4), 10, 1024, 10, 80)
    ids = [engine.add_request(p, greedy(20)) for p in prompts]
    seen: dict[str, list] = {}
    to_abort = {2: ids[0], 4: ids[9], 6: ids[3], 9: ids[5]}  # running, waiting, ...
    step = 0
    while engine.has_unfinished():
        if step in to_abort:
            engine.abort(to_abort[step])
            engine.abort(to_abort[step])  # twice: still ends once
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
        step += 1
    engine.abort(ids[1])  # already finished: nothing happens
    assert engine.step() == []
    for request_id, prompt in zip(ids, prompts, strict=True):
        outs = seen[request_id]
        assert sum(o.finished for o in outs) == 1 and outs[-1].finished
        tokens, aborted = outs[-1].token_ids, request_id in to_abort.values()
        ref = hf_greedy_reference_allowing_near_ties(
            tiny_llama, prompt, tokens, len(tokens) if aborted else 20
        )
        assert tokens == ref  # all 20 tokens, or an aborted request's prefix of them
        if aborted:
            assert outs[-1].finish_reason == "abort"
    assert_idle_and_balanced(engine)


def test_bad_requests_fail_alone(llm):
    engine = llm.engine
    good = random_prompts(random.Random(6), 3, 1024, 5, 30)
    ids = [engine.add_request(p, greedy(8)) for p in good]
    bad_cases = [
        ("", None, "empty"),
        ([], None, "empty"),
        ([5, 99999], None, "outside the vocabulary"),
        ([5] * engine.max_model_len, None, "no room"),
        ([5] * 10, SamplingParams(max_tokens=engine.max_model_len), "exceeds max_model_len"),
        ("hello", "not params", None),
    ]
    for prompt, params, message in bad_cases[:-1]:
        with pytest.raises(ValueError, match=message):
            engine.add_request(prompt, params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(good[0], greedy(4), request_id=ids[0])
    seen = run_collect(engine)
    for request_id, prompt in zip(ids, good, strict=True):
        tokens = seen[request_id][-1].token_ids
        path = llm.engine.model_path
        assert tokens == hf_greedy_reference_allowing_near_ties(path, prompt, tokens, 8)
    assert_idle_and_balanced(engine)
    with pytest.raises(ValueError, match="prompt 1: prompt is empty"):
        llm.generate(["fine", ""], greedy(4))
    assert not engine.has_unfinished()  # the valid prompt of a refused call never started


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": "x"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_invalid_sampling_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_launch_returns_while_the_device_is_busy_and_waits_once_per_step(tiny_llama):
    """Invariant 4: no hidden sync in launch; the loop waits exactly once per retired step."""
    llm = make_llm(tiny_llama, async_scheduling=True)
    engine, runner = llm.engine, llm.engine.runner
    gate = threading.Event()
    forward = runner.model.forward

    def slow_forward(*args, **kwargs):
        gate.wait(timeout=30)  # the "device" is busy until the test lets it go
        return forward(*args, **kwargs)

    waits = []
    launch = runner.launch

    def counting_launch(inputs):
        handle = launch(inputs)
        original_wait = handle.wait

        def wait():
            waits.append(inputs.step_id)
            return original_wait()

        handle.wait = wait
        return handle

    runner.model.forward = slow_forward
    runner.launch = counting_launch
    try:
        engine.add_request([5, 6, 7], greedy(6))
        assert engine.step() == []  # step 0 launched, nothing to retire yet
        assert len(engine._inflight) == 1 and not waits
        assert not engine._inflight[0].handle._done.is_set()  # still running on the device
        gate.set()
        outputs = list(engine.stream_outputs())
    finally:
        runner.model.forward = forward
        runner.launch = launch
    assert outputs[-1].finished and len(outputs[-1].token_ids) == 6
    steps = [r.step_id for r in engine.history.steps()]
    assert waits == steps == sorted(set(steps))


def test_async_overlaps_host_and_device(tiny_llama):
    """With a slow device and a host that takes 8 ms to build each step, the synchronous loop's
    device waits those 8 ms every step; the asynchronous one builds step N+1 while step N runs,
    so its idle time nearly vanishes."""
    import time

    results = {}
    for mode in (False, True):
        llm = make_llm(tiny_llama, async_scheduling=mode)
        forward, build = llm.engine.runner.model.forward, llm.engine.builder.build

        def slow_forward(*args, _forward=forward, **kwargs):
            time.sleep(0.03)  # well above the host's share per step, even on a loaded machine
            return _forward(*args, **kwargs)

        def slow_build(batch, _build=build):
            time.sleep(0.008)
            return _build(batch)

        llm.engine.runner.model.forward = slow_forward
        llm.engine.builder.build = slow_build
        prompts = random_prompts(random.Random(8), 4, 1024, 5, 10)
        mark = llm.engine.history.mark()
        llm.generate(prompts, greedy(16))
        results[mode] = llm.engine.history.summary(since=mark)
    sync, async_ = results[False], results[True]
    assert sync.num_steps == async_.num_steps
    assert sync.device_idle_fraction > 0.1  # 8 ms of every ~40
    assert 0 <= async_.device_idle_fraction < sync.device_idle_fraction / 3
    # The host's work per step is hidden: its device is busy nearly all the wall time.
    assert async_.device_busy_s / async_.wall_s > 0.9


def test_a_cpu_step_wakes_its_waiter_when_the_next_step_enters_its_forward():
    """A finished job with another queued behind it is held back until that job calls
    `wake_waiters` (a step, as it enters its forward), or ends; with nothing queued behind it,
    its waiter wakes at once. Errors are held back and raised alike."""
    from tandem.execution.streams import CPUStream

    stream = CPUStream()
    seen: dict[str, bool] = {}
    gates = [threading.Event() for _ in range(4)]

    def first():
        gates[0].wait(5)  # the test queues the second job behind this one first
        return "first"

    def second():
        seen["held"] = not held.wait(0.05)  # the first job's waiter is not woken yet
        stream.wake_waiters()  # as a step does before its forward
        seen["woken"] = held.wait(5)
        gates[1].wait(5)
        return "second"

    def failing():
        gates[2].wait(5)
        raise ValueError("the step failed")

    def plain():  # ends without waking: its end wakes the job before it
        seen["held by plain"] = not failed.wait(0.05)
        gates[3].wait(5)

    try:
        h1, h2 = stream.submit(first), stream.submit(second)
        held = h1._done
        gates[0].set()
        assert held.wait(5)
        assert h1.wait() == "first"  # woken by the second job while it still runs
        assert seen == {"held": True, "woken": True}
        assert not h2._done.is_set()
        gates[1].set()
        assert h2.wait() == "second"  # nothing queued behind it: woken at once

        h3, h4 = stream.submit(failing), stream.submit(plain)
        failed = h3._done
        gates[2].set()
        gates[3].set()
        assert failed.wait(5)  # at the latest when the job behind it ends
        with pytest.raises(ValueError, match="the step failed"):
            h3.wait()
        h4.wait()
        assert seen["held by plain"]

        last = threading.Event()
        h5 = stream.submit(lambda: last.wait(5))
        threading.Timer(0.2, last.set).start()  # ends once the stop is queued behind it
        stream.close()
        assert h5._done.wait(5)  # woken as the worker stops
    finally:
        for gate in gates:
            gate.set()
        stream.close()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_every_step_wakes_the_previous_steps_waiter_before_its_forward(
    tiny_llama, async_scheduling
):
    """The runner calls `wake_waiters` on the stream right before each forward, so a held-back
    step's results reach the host while the next forward runs, not while its inputs are made."""
    llm = make_llm(tiny_llama, async_scheduling=async_scheduling)
    runner = llm.engine.runner
    events: list[str] = []
    forward, wake = runner.model.forward, runner.stream.wake_waiters

    def recorded_forward(*args, **kwargs):
        events.append("forward")
        return forward(*args, **kwargs)

    def recorded_wake():
        events.append("wake")
        wake()

    runner.model.forward, runner.stream.wake_waiters = recorded_forward, recorded_wake
    outs = llm.generate(random_prompts(random.Random(3), 3, 1024, 4, 8), greedy(6))
    assert all(len(out.token_ids) == 6 for out in outs)
    assert events.count("forward") >= 6
    before_forwards = {before for before, now in itertools.pairwise(events) if now == "forward"}
    assert before_forwards == {"wake"}, events
    assert events[0] == "wake"


THAT = 323  # " that" in the tiny tokenizer: pushed to the top by logit_bias below


def _forced(**options) -> SamplingParams:
    """Greedy, THAT the argmax wherever it is not masked, up to 12 tokens."""
    return SamplingParams(max_tokens=12, temperature=0.0, logit_bias={THAT: 100.0}, **options)


@pytest.mark.parametrize(
    "params,skipped",
    [
        (_forced(min_tokens=3, stop_token_ids=[THAT]), 1),  # a stop id: the step after is dead
        (_forced(min_tokens=3, stop=[" that that"]), 0),  # a stop string: the host's alone
        (_forced(min_tokens=3, stop_token_ids=[THAT], ignore_eos=True), 1),
    ],
    ids=["stop-id", "stop-string", "stop-id-ignoring-eos"],
)
def test_the_step_after_a_lone_request_stopped_is_skipped(tiny_llama, params, skipped):
    """Async on a CPU: the step launched after a request's last one holds only that request;
    when the request ended on a stop id the device thread sees it and skips the step: nothing
    discarded, as many steps run as in the sync loop, blocks all back (run_both_loops)."""
    runs = run_both_loops(tiny_llama, [[5, 6, 7]], [params])
    (sync, sync_llm), (async_, async_llm) = runs[False], runs[True]
    assert [o.token_ids for o in async_] == [o.token_ids for o in sync]
    assert async_[0].finish_reason == "stop" and len(async_[0].token_ids) < 12
    a, s = async_llm.engine.summary(), sync_llm.engine.summary()
    assert (a.skipped_steps, a.discarded_tokens) == (skipped, 1 - skipped)
    assert a.num_steps == s.num_steps + 1 - skipped
    assert s.skipped_steps == 0


def test_a_stop_check_reads_each_requests_kept_tokens_only():
    """Two requests before: one decode (row 0), one verification of 3 rows that kept 2 (the
    count follows the ids). Its rejected third row holds a stop id, which stops nothing."""
    import numpy as np

    from tandem.execution.batch import StopCheck

    def check(items, stops):
        return StopCheck((1, 3), (False, True), items, tuple(frozenset(s) for s in stops))

    output = np.array([7, 4, 8, 9, 2])  # ids 7 | 4 8 (9 rejected) | kept 2
    assert check((0, 1), ({7}, {8})).all_stopped(output)
    assert not check((0, 1), ({7}, {9})).all_stopped(output)  # 9 was rejected
    assert not check((1,), ({5},)).all_stopped(output)
    assert check((1,), ({4, 5},)).all_stopped(output)
    assert not check((0,), ({7},)).all_stopped(output[:4])  # not that step's output
    assert not check((0,), ({7},)).all_stopped(np.zeros(0, np.int64))  # a skipped step's


def test_eos_ignored_or_a_request_still_running_keeps_the_next_step(tiny_llama):
    """EOS sampled under ignore_eos stops nothing, and a step with a request that goes on runs:
    the check must never skip a step the host would have needed (its tokens would be lost)."""
    eos = make_llm(tiny_llama).engine.eos_token_ids
    params = [
        SamplingParams(
            max_tokens=9, temperature=0.0, ignore_eos=True, logit_bias={next(iter(eos)): 100.0}
        ),
        _forced(min_tokens=2, stop_token_ids=[THAT]),
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    ]
    runs = run_both_loops(tiny_llama, [[5, 6, 7], [8, 9], [10, 11, 12]], params)
    (sync, _), (async_, async_llm) = runs[False], runs[True]
    assert [o.token_ids for o in async_] == [o.token_ids for o in sync]
    assert [len(o.token_ids) for o in async_] == [9, 3, 6]  # the first alone at the end
    assert async_llm.engine.summary().skipped_steps == 0


def test_a_dropped_engine_is_collected_and_stops_its_worker(tiny_llama):
    import gc
    import weakref

    llm = make_llm(tiny_llama)
    llm.generate([[5, 6]], greedy(2))
    runner = weakref.ref(llm.engine.runner)
    thread = llm.engine.runner.stream._thread
    del llm
    gc.collect()
    assert runner() is None  # its KV cache is gone with it
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_top_k_beyond_the_vocabulary_samples_the_whole_vocabulary(llm):
    base = dict(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)
    outs = llm.generate(
        [[5, 6, 7]] * 3,
        [SamplingParams(top_k=k, **base) for k in (0, 2**63, 1024)],
    )
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_steps_run_in_inference_mode(tiny_llama, async_scheduling):
    """No autograd bookkeeping on the stream: every forward runs under torch.inference_mode."""
    llm = make_llm(tiny_llama, async_scheduling=async_scheduling)
    forward, modes = llm.engine.runner.model.forward, []

    def recording_forward(*args, **kwargs):
        modes.append(torch.is_inference_mode_enabled())
        return forward(*args, **kwargs)

    llm.engine.runner.model.forward = recording_forward
    llm.generate([[5, 6, 7]], greedy(4))
    assert modes and all(modes)


def test_starting_an_engine_imports_no_compiler(tiny_llama):
    """torch.compile's machinery (torch._dynamo, and triton with it) costs every start-up about
    0.6 s; nothing on the CPU path needs it."""
    code = (
        "import sys; from tandem import LLM; LLM(model=sys.argv[1]).generate([[5, 6]]); "
        "print(sorted(m for m in ('torch._dynamo', 'triton') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tiny_llama)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
