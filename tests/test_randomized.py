"""Randomized schedules (hypothesis): arrivals, lengths, budgets, block sizes, aborts.

Each schedule runs through both loops. After every step: no KV block is owned twice, and a block
is never handed out while a step that used it may still be in flight. After each run: every
request ended exactly once, its output equals the reference (a prefix of it when aborted), and
every block is free again. Requests that were not aborted get the same tokens from both loops.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import NUM_SPECIAL_TOKENS, hf_greedy_reference
from helpers import assert_idle_and_balanced, greedy, make_llm

request_strategy = st.fixed_dictionaries(
    {
        "prompt": st.lists(st.integers(NUM_SPECIAL_TOKENS, 1023), min_size=1, max_size=60),
        "max_tokens": st.integers(1, 12),
        "arrival_step": st.integers(0, 10),
        "abort_step": st.none() | st.integers(0, 20),
    }
)


def run_schedule(path, requests, async_scheduling, **options):
    """Feed `requests` by step number; returns each request's finished output, in order."""
    engine = make_llm(path, async_scheduling=async_scheduling, **options).engine
    scheduler = engine.scheduler
    last_use: dict[int, int] = {}  # block -> last step whose batch covered it
    allocate, schedule = scheduler.blocks.allocate, scheduler.schedule

    def checked_allocate(n, owner):
        blocks = allocate(n, owner)
        for b in blocks:  # handed out only once no in-flight step can still touch it
            assert last_use.get(b, -1) <= scheduler.last_retired_step, (b, last_use[b])
        return blocks

    def recording_schedule():
        batch = schedule()
        for item in batch.items if batch else []:
            for b in item.request.block_ids:
                last_use[b] = batch.step_id
        return batch

    scheduler.blocks.allocate, scheduler.schedule = checked_allocate, recording_schedule
    ids: dict[int, str] = {}
    finished: dict[str, list] = {}
    step = 0
    while len(ids) < len(requests) or engine.has_unfinished():
        for i, r in enumerate(requests):
            if r["arrival_step"] == step:
                ids[i] = engine.add_request(r["prompt"], greedy(r["max_tokens"]))
            if r["abort_step"] == step and i in ids:
                engine.abort(ids[i])
        for out in engine.step():
            if out.finished:
                finished.setdefault(out.request_id, []).append(out)
        owned = [b for r in scheduler.running + list(scheduler.waiting) for b in r.block_ids]
        assert len(owned) == len(set(owned))  # no block owned twice
        assert set(owned) <= set(scheduler.blocks.owners())
        step += 1
        assert step < 2000, "the engine stopped making progress"
    assert_idle_and_balanced(engine)
    outputs = []
    for i in range(len(requests)):
        assert len(finished[ids[i]]) == 1  # ended exactly once
        outputs.append(finished[ids[i]][0])
    return outputs


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    requests=st.lists(request_strategy, min_size=1, max_size=8),
    block_size=st.sampled_from([1, 2, 4, 8, 16]),
    extra_blocks=st.integers(0, 6) | st.integers(0, 40),
    max_num_batched_tokens=st.integers(8, 128),
    max_num_seqs=st.integers(1, 8),
)
def test_random_schedules_keep_the_invariants_in_both_loops(
    tiny_llama, requests, block_size, extra_blocks, max_num_batched_tokens, max_num_seqs
):
    longest = max(len(r["prompt"]) + r["max_tokens"] for r in requests)
    options = dict(
        block_size=block_size,
        num_kv_blocks=-(-longest // block_size) + extra_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
    )
    sync = run_schedule(tiny_llama, requests, False, **options)
    async_ = run_schedule(tiny_llama, requests, True, **options)
    for r, out_sync, out_async in zip(requests, sync, async_, strict=True):
        reference = hf_greedy_reference(tiny_llama, r["prompt"], r["max_tokens"])
        for out in (out_sync, out_async):
            if out.finish_reason == "abort":
                assert r["abort_step"] is not None
                assert out.token_ids == reference[: len(out.token_ids)]
            else:
                assert out.finish_reason == "length"
                assert out.token_ids == reference
        if "abort" not in (out_sync.finish_reason, out_async.finish_reason):
            assert out_sync.token_ids == out_async.token_ids
