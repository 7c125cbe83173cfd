"""The engine's public figures: `Engine.stats()` counts requests and KV blocks exactly, and
`Engine.history` gives windows by mark without clearing what other readers see."""

from __future__ import annotations

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


def test_a_server_loop_keeps_a_short_history(tiny_llama, monkeypatch):
    """The server's gauge reads one window at a time, so its engine holds only a bounded tail of
    records: a server running for days does not hold the offline history in memory."""
    from tandem.server import loop

    monkeypatch.setattr(loop, "GAUGE_HISTORY_STEPS", 5)
    llm = make_llm(tiny_llama)
    loop.EngineLoop(llm.engine, on_outputs=lambda deltas: None, on_crash=lambda exc: None)
    llm.generate([[5, 6, 7], [8, 9]], greedy(12))
    assert len(llm.engine.history.steps()) == 5
    assert len(llm.engine.history.requests()) == 2  # below GAUGE_HISTORY_REQUESTS
