"""Randomized schedules (hypothesis): arrivals, lengths, budgets, block sizes, aborts, both loops.

After every step: no KV block is owned twice, and a block is never handed out while a step that
used it may still be in flight. After the run: every request ended exactly once, its output equals
the reference (a prefix of it when aborted), and every block is free again.
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


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    requests=st.lists(request_strategy, min_size=1, max_size=8),
    block_size=st.sampled_from([1, 2, 4, 8, 16]),
    extra_blocks=st.integers(0, 6) | st.integers(0, 40),
    max_num_batched_tokens=st.integers(8, 128),
    max_num_seqs=st.integers(1, 8),
    async_scheduling=st.booleans(),
)
def test_random_schedules_keep_the_invariants(
    tiny_llama, requests, block_size, extra_blocks, max_num_batched_tokens, max_num_seqs,
    async_scheduling,
):  # fmt: skip
    longest = max(len(r["prompt"]) + r["max_tokens"] for r in requests)
    llm = make_llm(
        tiny_llama,
        block_size=block_size,
        num_kv_blocks=-(-longest // block_size) + extra_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        async_scheduling=async_scheduling,
    )
    engine = llm.engine
    scheduler = engine.scheduler
    last_use: dict[int, int] = {}  # block -> last step whose batch covered it
    allocate = scheduler.blocks.allocate

    def checked_allocate(n, owner):
        blocks = allocate(n, owner)
        for b in blocks:  # handed out only once no in-flight step can still touch it
            assert last_use.get(b, -1) <= scheduler.last_retired_step, (b, last_use[b])
        return blocks

    scheduler.blocks.allocate = checked_allocate
    schedule = scheduler.schedule

    def recording_schedule():
        batch = schedule()
        for item in batch.items if batch else []:
            for b in item.request.block_ids:
                last_use[b] = batch.step_id
        return batch

    scheduler.schedule = recording_schedule

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
        owners = scheduler.blocks.owners()
        owned = [b for r in scheduler.running + list(scheduler.waiting) for b in r.block_ids]
        assert len(owned) == len(set(owned))  # no block owned twice
        assert all(owners[b] for b in owned)
        step += 1
        assert step < 2000, "the engine stopped making progress"

    for i, r in enumerate(requests):
        outs = finished[ids[i]]
        assert len(outs) == 1  # ended exactly once
        out = outs[0]
        reference = hf_greedy_reference(tiny_llama, r["prompt"], r["max_tokens"])
        if out.finish_reason == "abort":
            assert r["abort_step"] is not None
            assert out.token_ids == reference[: len(out.token_ids)]
        else:
            assert out.finish_reason == "length"
            assert out.token_ids == reference
    assert_idle_and_balanced(engine)
