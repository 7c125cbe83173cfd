"""The engine's public figures: `Engine.stats()` counts requests and KV blocks exactly, and
`Engine.history` gives windows by mark without clearing what other readers see."""

from __future__ import annotations

import pytest

from tandem.engine.stats import StepHistory
from tandem.metrics import RequestTiming, StepRecord

from helpers import assert_idle_and_balanced, greedy, make_llm


def test_stats_count_requests_and_blocks_exactly(tiny_llama):
    llm = make_llm(tiny_llama, block_size=4, num_kv_blocks=64, max_num_seqs=2)
    engine = llm.engine
    idle = engine.stats()
    assert (idle.num_running, idle.num_waiting, idle.kv_blocks_used) == (0, 0, 0)
    assert idle.kv_blocks_total == 64
    prompt = list(range(5, 15))  # 10 tokens: 3 blocks of 4
    engine.add_request(prompt, greedy(2), "first")
    engine.step()  # admitted; its prompt is in flight
    running = engine.stats()
    assert (running.num_running, running.num_waiting, running.kv_blocks_used) == (1, 0, 3)
    list(engine.stream_outputs())
    done = engine.stats()
    assert (done.num_running, done.num_waiting, done.kv_blocks_used) == (0, 0, 0)
    # Positions 0-7 filled two blocks, which stay cached; the third (8-10) was never full.
    assert done.kv_blocks_cached == 2
    for i in range(3):  # max_num_seqs 2: one of them waits
        engine.add_request(prompt, greedy(2), f"again-{i}")
    engine.step()
    busy = engine.stats()
    assert (busy.num_running, busy.num_waiting) == (2, 1)
    assert busy.kv_blocks_used == 2 + 2  # the two cached blocks, shared, and a third each
    list(engine.stream_outputs())
    cache = engine.stats().prefix_cache
    assert (cache.queries, cache.hits, cache.hit_tokens) == (4, 3, 3 * 8)
    assert_idle_and_balanced(engine)


def test_history_windows_by_mark(tiny_llama):
    llm = make_llm(tiny_llama)
    engine = llm.engine
    llm.generate([[5, 6, 7]], greedy(4))
    first = len(engine.history.steps())
    mark = engine.history.mark()
    assert engine.history.steps(since=mark) == [] and engine.history.requests(since=mark) == []
    llm.generate([[8, 9], [10, 11, 12]], greedy(3))
    window = engine.history.steps(since=mark)
    assert window and len(engine.history.steps()) == first + len(window)
    summary = engine.history.summary(since=mark)
    assert summary.output_tokens == 6 and len(summary.ttft_s) == 2
    assert engine.summary().output_tokens == 4 + 6  # the whole history is still there


def test_history_is_bounded_and_marks_survive_eviction():
    history = StepHistory(length=3)
    mark = history.mark()
    for i in range(5):
        history.add_step(StepRecord(i, 1, 1))
        history.add_request(RequestTiming(0.0, [float(i)]))
    assert [r.step_id for r in history.steps()] == [2, 3, 4]
    assert [r.step_id for r in history.steps(since=mark)] == [2, 3, 4]  # what is still kept
    later = history.mark()
    history.add_step(StepRecord(5, 1, 1))
    assert [r.step_id for r in history.steps(since=later)] == [5]
    assert [t.token_times for t in history.requests(since=later)] == []


def test_history_keep_trims_to_the_latest_records():
    history = StepHistory(length=10)
    for i in range(6):
        history.add_step(StepRecord(i, 1, 1))
        history.add_request(RequestTiming(0.0, [float(i)]))
    mark = history.mark()
    history.keep(steps=3, requests=1)
    assert [r.step_id for r in history.steps()] == [3, 4, 5]
    assert [t.token_times for t in history.requests()] == [[5.0]]
    for i in range(6, 9):
        history.add_step(StepRecord(i, 1, 1))
    assert [r.step_id for r in history.steps(since=mark)] == [6, 7, 8]
    assert [r.step_id for r in history.steps()] == [6, 7, 8]


def test_a_server_core_keeps_a_short_history(tiny_llama, monkeypatch):
    """The server's gauge reads one window at a time, so its engine core holds only a bounded
    tail of records: a server running for days does not hold the offline history in memory."""
    from tandem.server.core import process as core

    monkeypatch.setattr(core, "GAUGE_HISTORY_STEPS", 5)
    llm = make_llm(tiny_llama)
    core.CoreLoop(llm.engine, sock=None, engine_index=0)
    llm.generate([[5, 6, 7], [8, 9]], greedy(12))
    assert len(llm.engine.history.steps()) == 5
    assert len(llm.engine.history.requests()) == 2  # below core.GAUGE_HISTORY_REQUESTS


def _step(i: int, scheduled: float, device: tuple[float, float]) -> StepRecord:
    record = StepRecord(i, 1, 1)
    record.spans = {"schedule": (scheduled, scheduled + 0.001), "update": (device[1], device[1])}
    record.device = device
    return record


def test_windows_tile_the_device_timeline():
    """Under the async loop a step is scheduled while its predecessor computes: a window must
    not count that step ahead as idle. A device busy back to back reads 0 in every window; one
    that waits 0.25 of each 1.25 s step (a synchronous host) reads 0.2 in every window."""
    for lead, gap in ((1.0, 0.0), (0.0, 0.25)):
        history = StepHistory()
        readings = []
        mark = history.mark()
        t = 0.0
        for i in range(12):
            start = t + gap
            # The first step is scheduled just before it runs; each later one, a step ahead.
            scheduled = start - lead if lead and i else t
            history.add_step(_step(i, scheduled, (start, start + 1.0)))
            t = start + 1.0
            if i % 3 == 2:  # a window of three steps
                readings.append(history.summary(since=mark).device_idle_fraction)
                mark = history.mark()
        expected = gap / (1.0 + gap)
        assert readings == pytest.approx([expected] * 4, abs=1e-9), (lead, gap, readings)


def test_a_window_after_a_pause_starts_with_its_own_work():
    """Time with nothing to do is not host overhead: after a pause, a window starts with its
    first step's scheduling, not with the last step before the pause."""
    history = StepHistory()
    history.add_step(_step(0, 0.0, (0.0, 1.0)))
    mark = history.mark()
    history.add_step(_step(1, 10.0, (10.0, 11.0)))
    assert history.summary(since=mark).device_idle_fraction == pytest.approx(0.0)
