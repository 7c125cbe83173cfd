"""Prefix caching and n > 1: shared KV blocks give the same tokens as private ones, prefill only
what is not cached, are evicted least recently used first, and the samples of one request share
its prompt's blocks, each with its own reproducible seed stream."""

from __future__ import annotations

import random

import pytest

from tandem import SamplingParams
from tandem.scheduling.block_pool import ROOT_HASH, BlockAccounting, BlockPool, chain_hash
from tandem.scheduling.scheduler import Scheduler

from conftest import hf_greedy_reference_allowing_near_ties as hf_reference
from conftest import random_prompts
from helpers import assert_idle_and_balanced, greedy
from helpers import make_llm as _make_llm

MODES = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


def make_llm(path, **options):
    """A cache of 512 blocks unless the test sizes it."""
    options.setdefault("num_kv_blocks", 512)
    return _make_llm(path, **options)


def shared_prefix_prompts(seed: int, num_prefixes: int, num_prompts: int, prefix_len: int):
    rng = random.Random(seed)
    prefixes = random_prompts(rng, num_prefixes, 1024, prefix_len, prefix_len)
    return [
        prefixes[i % num_prefixes] + suffix
        for i, suffix in enumerate(random_prompts(rng, num_prompts, 1024, 1, 40))
    ]


def record_items(engine) -> list:
    """(step id, ScheduledRequest) of everything the scheduler hands out, in order."""
    items = []
    schedule = engine.scheduler.schedule

    def recording():
        batch = schedule()
        items.extend((batch.step_id, item) for item in (batch.items if batch else []))
        return batch

    engine.scheduler.schedule = recording
    return items


def prefill_of(items, request_id: str, index: int = 0) -> list[tuple[int, int]]:
    """(start, num_tokens) of each chunk a request computed before its first sampled token."""
    chunks = []
    for _, item in items:
        r = item.request
        if r.request_id == request_id and r.index == index and item.output_index == 0:
            chunks.append((item.start, item.num_tokens))
    return chunks


# ------------------------------------------------------------------ the cache
def test_outputs_identical_with_caching_on_and_off_sync_and_async(tiny_llama):
    """Greedy (checked against HF too) and seeded sampling, chunked, with a cache that hits."""
    prompts = shared_prefix_prompts(1, 3, 18, 70)
    rng = random.Random(2)
    params = [greedy(12) for _ in prompts[:9]] + [
        SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=i, ignore_eos=True)
        for i in range(9)
    ]
    rng.shuffle(params)
    results = {}
    for async_scheduling in (False, True):
        for caching in (False, True):
            llm = make_llm(
                tiny_llama, block_size=8, max_num_batched_tokens=96, max_num_seqs=6,
                async_scheduling=async_scheduling, enable_prefix_caching=caching,
            )  # fmt: skip
            outs = llm.generate(prompts, params)
            results[async_scheduling, caching] = [o.token_ids for o in outs]
            stats = llm.engine.scheduler.stats
            assert (stats.hit_tokens > 0) == caching
            assert stats.queries == len(prompts)
            assert_idle_and_balanced(llm.engine)
    reference = results[False, False]
    assert all(tokens == reference for tokens in results.values())
    for prompt, p, tokens in zip(prompts, params, reference, strict=True):
        if p.greedy:
            assert tokens == hf_reference(tiny_llama, prompt, tokens, 12)


@MODES
def test_a_shared_prefix_is_prefilled_once(tiny_llama, async_scheduling):
    llm = make_llm(tiny_llama, block_size=16, async_scheduling=async_scheduling)
    engine = llm.engine
    items = record_items(engine)
    stats = engine.scheduler.stats
    rng = random.Random(3)
    shared, tail_a, tail_b = random_prompts(rng, 3, 1024, 30, 30)
    shared = (shared * 3)[:80]  # five full blocks
    a = shared + tail_a[:7]  # 87 tokens: 5 full blocks, then 7 of its own
    b = shared + tail_b  # 110 tokens

    out_a = llm.generate([a], greedy(20))[0]
    assert prefill_of(items, out_a.request_id) == [(0, 87)]
    assert stats.hit_tokens == 0

    out_b = llm.generate([b], greedy(6))[0]
    assert prefill_of(items, out_b.request_id) == [(80, 30)]  # only the new tokens
    assert (stats.hits, stats.hit_tokens, stats.query_tokens) == (1, 80, 87 + 110)
    assert out_b.token_ids == hf_reference(tiny_llama, b, out_b.token_ids, 6)

    # A's generated tokens are cached too: 87 prompt + 20 outputs wrote the KV of 106
    # positions, six full blocks; a prompt that continues A's text reuses all six.
    c = a + out_a.token_ids[:15] + tail_b[:5]
    out_c = llm.generate([c], greedy(6))[0]
    assert prefill_of(items, out_c.request_id) == [(96, len(c) - 96)]
    assert out_c.token_ids == hf_reference(tiny_llama, c, out_c.token_ids, 6)

    # A prompt cached in full (four of A's blocks) still computes its last token: it backs
    # off one whole block.
    d = shared[:64]
    out_d = llm.generate([d], greedy(3))[0]
    assert prefill_of(items, out_d.request_id) == [(48, 16)]
    assert out_d.token_ids == hf_reference(tiny_llama, d, out_d.token_ids, 3)
    assert_idle_and_balanced(engine)


@MODES
def test_a_request_waits_for_the_prefix_a_launched_step_computes(tiny_llama, async_scheduling):
    """A block is shareable only once the step that wrote it has retired: requests that arrive
    together with a common prefix wait for the first one's prefill instead of computing copies,
    and requests with other prefixes are not held up."""
    llm = make_llm(tiny_llama, block_size=8, async_scheduling=async_scheduling)
    engine = llm.engine
    items = record_items(engine)
    prompts = shared_prefix_prompts(4, 2, 6, 40)  # prefixes P0, P1, P0, P1, P0, P1
    outs = llm.generate(prompts, greedy(4))
    for out, prompt in zip(outs, prompts, strict=True):
        assert out.token_ids == hf_reference(tiny_llama, prompt, out.token_ids, 4)
    first = {}
    for step, item in items:
        first.setdefault(item.request.request_id, (step, item.start))
    steps, starts = zip(*(first[o.request_id] for o in outs), strict=True)
    assert starts == (0, 0, 40, 40, 40, 40)
    assert steps[0] == steps[1] == 0  # the two prefixes at once
    assert min(steps[2:]) > 0  # the others once those have been computed
    stats = engine.scheduler.stats
    assert stats.hit_tokens == 4 * 40
    assert_idle_and_balanced(engine)


def cached_after(prompt: list[int], answer: list[int], block_size: int) -> int:
    """Tokens of a next turn a previous turn leaves cached: the full blocks of its prompt and
    answer short of the answer's last token (sampled, never an input, so its KV is not
    written)."""
    return (len(prompt) + len(answer) - 1) // block_size * block_size


@MODES
def test_agent_turns_compute_only_their_new_tokens(tiny_llama, async_scheduling):
    """An agent's sessions: one head, then turns that each add the answer as generated and a
    tool result. A next turn and another session's first turn compute only what no earlier
    request held, from the last full block of it; every answer is the one without caching."""
    bs = 16
    rng = random.Random(9)
    head, task_a, task_b, tool_a, tool_b, tool_c = random_prompts(rng, 6, 1024, 30, 30)
    head = (head * 4)[:101]  # six full blocks and five tokens
    llm = make_llm(tiny_llama, block_size=bs, async_scheduling=async_scheduling)
    items = record_items(llm.engine)

    def turn(prompt: list[int], cached: int, n: int = 13):
        out = llm.generate([prompt], greedy(n))[0]
        assert out.num_cached_tokens == cached
        assert prefill_of(items, out.request_id) == [(cached, len(prompt) - cached)]
        return out

    a1 = turn(head + task_a, 0)
    b1 = turn(head + task_b, 96)  # the head's full blocks
    a2 = turn(head + task_a + a1.token_ids + tool_a, cached_after(head + task_a, a1.token_ids, bs))
    b2 = turn(head + task_b + b1.token_ids + tool_b, cached_after(head + task_b, b1.token_ids, bs))
    a2_prompt = head + task_a + a1.token_ids + tool_a
    a3 = turn(a2_prompt + a2.token_ids + tool_c, cached_after(a2_prompt, a2.token_ids, bs))
    stats = llm.engine.scheduler.stats
    # The head's 6 blocks; 131 + 13 - 1 tokens, twice; 174 + 13 - 1: in full blocks.
    assert stats.hit_tokens == 96 + 128 + 128 + 176
    assert_idle_and_balanced(llm.engine)

    prompts = [head + task_a, head + task_b, a2_prompt, head + task_b + b1.token_ids + tool_b,
               a2_prompt + a2.token_ids + tool_c]  # fmt: skip
    plain = make_llm(tiny_llama, block_size=bs, enable_prefix_caching=False)
    uncached = plain.generate(prompts, greedy(13))
    assert [o.token_ids for o in uncached] == [o.token_ids for o in (a1, b1, a2, b2, a3)]
    assert all(o.num_cached_tokens == 0 for o in uncached)


@MODES
def test_eviction_is_least_recently_used_and_tail_first(tiny_llama, async_scheduling):
    """20 blocks of 8: A's 8 cached blocks lose their last 3 to B; A then hits its first 5."""
    llm = make_llm(tiny_llama, block_size=8, num_kv_blocks=20, async_scheduling=async_scheduling)
    engine = llm.engine
    pool, stats = engine.scheduler.blocks, engine.scheduler.stats
    a, b = random_prompts(random.Random(5), 2, 1024, 64, 64)
    b = (b * 2)[:120]
    llm.generate([a], greedy(1))
    assert pool.check().free_cached == 8 and pool.num_evictions == 0
    llm.generate([b], greedy(1))  # 15 blocks: 12 never cached, then 3 evictions
    assert pool.num_evictions == 3
    hits = stats.hit_tokens
    out = llm.generate([a], greedy(5))[0]
    assert stats.hit_tokens - hits == 40
    assert out.token_ids == hf_reference(tiny_llama, a, out.token_ids, 5)
    assert_idle_and_balanced(engine)


@MODES
def test_preemption_with_shared_blocks_matches_hf(tiny_llama, async_scheduling):
    """Too few blocks for the shared-prefix requests: preemption must drop references exactly,
    and recomputation finds the blocks that are still cached."""
    prompts = shared_prefix_prompts(6, 2, 12, 48)
    llm = make_llm(
        tiny_llama, block_size=8, num_kv_blocks=30, max_num_batched_tokens=128,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    outs = llm.generate(prompts, greedy(24))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_reference(tiny_llama, prompt, out.token_ids, 24)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.stats.hit_tokens > 0
    assert_idle_and_balanced(llm.engine)


def test_block_pool_refcounts_and_errors():
    pool = BlockPool(4)
    a = pool.allocate(2, "a")
    assert pool.register(a[0], b"h0") and not pool.register(a[1], b"h0")  # content held by a[0]
    pool.share([a[0]], "b")
    assert pool.refcount(a[0]) == 2 and pool.owners()[a[0]] == {"a", "b"}
    with pytest.raises(RuntimeError, match="shared twice"):
        pool.share([a[0]], "b")
    with pytest.raises(RuntimeError, match="freed by 'c'"):
        pool.free([a[0]], "c")
    pool.free(a, "a")
    assert pool.num_free == 3 and pool.lookup([b"h0", b"h1"]) == [a[0]]
    pool.free([a[0]], "b")
    assert pool.check().free_cached == 1 and pool.num_free == 4
    with pytest.raises(RuntimeError, match="asked for 5"):
        pool.allocate(5, "x")
    pool.allocate(4, "x")  # evicts the cached block last
    assert pool.num_evictions == 1 and pool.lookup([b"h0"]) == []


def test_block_pool_keeps_each_sequence_in_one_run():
    """Sequences growing in lockstep do not interleave block by block: each grows into the block
    after its last, and a new one is centred in the longest free run. Accounting stays exact."""
    pool = BlockPool(64)
    seqs = {name: pool.allocate(2, name) for name in "abc"}
    assert seqs["a"] == [0, 1]  # block 0: nothing before it grows into the run
    assert seqs["b"] == [32, 33]  # centred in [2, 64): 30 free blocks on either side
    assert seqs["c"] == [16, 17]  # centred in the longest run left, [2, 32)
    for _ in range(6):
        for name, ids in seqs.items():
            ids += pool.allocate(1, name, after=ids[-1])
    for ids in seqs.values():
        assert ids == list(range(ids[0], ids[0] + 8))
    assert pool.check() == BlockAccounting(used=24, free_plain=40, free_cached=0, hashed=0)
    # A sequence whose next block is taken continues in the longest free run.
    taken = pool.allocate(1, "x", after=seqs["a"][-1])
    assert taken == [8]
    assert pool.allocate(1, "a", after=seqs["a"][-1]) == [51]  # centred in [40, 64)
    pool.free(seqs["b"], "b")
    assert pool.allocate(4, "d") == [35, 36, 37, 38]  # centred in [24, 51), b's run and its sides
    assert pool.check() == BlockAccounting(used=22, free_plain=42, free_cached=0, hashed=0)


def test_lockstep_requests_get_contiguous_blocks(tiny_llama, monkeypatch):
    """In the engine: requests decoding together each keep their blocks in one run."""
    finished = {}
    finish = Scheduler.finish

    def record(self, request, reason):
        finished[request.key] = list(request.block_ids[0])
        return finish(self, request, reason)

    monkeypatch.setattr(Scheduler, "finish", record)
    llm = make_llm(tiny_llama, block_size=4)
    prompts = random_prompts(random.Random(5), 6, 1024, 5, 12)
    llm.generate(prompts, greedy(40))
    assert len(finished) == 6
    for ids in finished.values():
        assert len(ids) >= 11 and ids == list(range(ids[0], ids[0] + len(ids)))
    assert_idle_and_balanced(llm.engine)


def test_block_hashes_are_stable_across_processes():
    """Not Python's hash, which is salted per process: a constant digest, whatever the process."""
    chain = chain_hash(chain_hash(ROOT_HASH, [1, 2, 3]), [4, 5])
    assert chain.hex() == "48bbca64fbfe5cd4fdf9f0863578bf91"
    assert chain_hash(ROOT_HASH, [1, 2]) != chain_hash(ROOT_HASH, [2, 1])
    assert chain_hash(chain_hash(ROOT_HASH, [1]), [2]) != chain_hash(ROOT_HASH, [1, 2])


# ------------------------------------------------------------------- n > 1
def sample_params(n: int, seed: int | None = 7, max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True)


@MODES
@pytest.mark.parametrize("caching", [True, False], ids=["cache", "no-cache"])
def test_n_samples_share_the_prompt_blocks(tiny_llama, async_scheduling, caching):
    """4 samples of a 200-token prompt (chunked over several steps): the leader prefills it, the
    others compute its last block only, and all four hold the same 24 prompt blocks."""
    llm = make_llm(
        tiny_llama, block_size=8, max_num_batched_tokens=64,
        async_scheduling=async_scheduling, enable_prefix_caching=caching,
    )  # fmt: skip
    engine = llm.engine
    items = record_items(engine)
    peak = {"used": 0, "shared": False}
    schedule = engine.scheduler.schedule

    def watching():
        batch = schedule()
        running = [r for r in engine.scheduler.running]
        peak["used"] = max(peak["used"], engine.scheduler.blocks.num_used)
        if len(running) == 4:
            prompt_blocks = {tuple(r.block_ids[0][:24]) for r in running}
            peak["shared"] = peak["shared"] or len(prompt_blocks) == 1
        return batch

    engine.scheduler.schedule = watching
    prompt = random_prompts(random.Random(8), 1, 1024, 200, 200)[0]
    out = llm.generate([prompt], sample_params(4))[0]
    samples = [o.token_ids for o in out.outputs]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert out.token_ids == samples[0] and out.text == out.outputs[0].text
    assert len({tuple(s) for s in samples}) == 4  # distinct seed streams
    assert peak["shared"]
    # 24 shared blocks + 3 of its own per sample (the prompt's partial block and two for the
    # outputs), against 4 x 27 for private copies.
    assert peak["used"] <= 24 + 4 * 3 < 4 * 27
    assert prefill_of(items, out.request_id, 0) == [(0, 64), (64, 64), (128, 64), (192, 8)]
    for i in (1, 2, 3):
        assert prefill_of(items, out.request_id, i) == [(192, 8)]
    assert_idle_and_balanced(engine)

    # Reproducible, and sample 0 is the n = 1 request with the same seed.
    again = llm.generate([prompt], sample_params(4))[0]
    assert [o.token_ids for o in again.outputs] == samples
    assert llm.generate([prompt], sample_params(1))[0].token_ids == samples[0]


def test_n_samples_async_equals_sync_and_caching_changes_nothing(tiny_llama):
    prompts = shared_prefix_prompts(9, 2, 6, 30)
    params = [sample_params(3, seed=i, max_tokens=8) for i in range(5)] + [
        SamplingParams(n=2, max_tokens=8, temperature=0, ignore_eos=True)
    ]
    results = []
    for async_scheduling in (False, True):
        for caching in (True, False):
            llm = make_llm(
                tiny_llama, block_size=4, max_num_batched_tokens=48, max_num_seqs=5,
                async_scheduling=async_scheduling, enable_prefix_caching=caching,
            )  # fmt: skip
            outs = llm.generate(prompts, params)
            results.append([[o.token_ids for o in out.outputs] for out in outs])
            assert_idle_and_balanced(llm.engine)
    assert all(r == results[0] for r in results)
    greedy_samples = results[0][-1]
    reference = hf_reference(tiny_llama, prompts[-1], greedy_samples[0], 8)
    assert greedy_samples[0] == greedy_samples[1] == reference
    assert all(len({tuple(s) for s in samples}) == 3 for samples in results[0][:5])


def test_unseeded_samples_are_distinct_and_reproducible_per_engine_seed(tiny_llama):
    prompt = random_prompts(random.Random(10), 1, 1024, 20, 20)[0]
    runs = [
        [
            o.token_ids
            for o in make_llm(tiny_llama, seed=s)
            .generate(prompt, sample_params(3, None))[0]
            .outputs
        ]
        for s in (0, 0, 1)
    ]
    assert runs[0] == runs[1] != runs[2]
    assert len({tuple(s) for s in runs[0]}) == 3


@MODES
def test_aborting_an_n_request_ends_every_sample_once(tiny_llama, async_scheduling):
    llm = make_llm(tiny_llama, block_size=4, async_scheduling=async_scheduling)
    engine = llm.engine
    prompt = random_prompts(random.Random(11), 1, 1024, 30, 30)[0]
    request_id = engine.add_request(prompt, sample_params(3, max_tokens=50))
    seen: dict[int, list] = {}
    step = 0
    while engine.has_unfinished():
        if step == 6:
            engine.abort(request_id)
            engine.abort(request_id)
        for out in engine.step():
            assert out.request_id == request_id
            seen.setdefault(out.index, []).append(out)
        step += 1
    assert sorted(seen) == [0, 1, 2]
    for outs in seen.values():
        assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
        assert outs[-1].finish_reason == "abort"
        assert [t for o in outs for t in o.delta_token_ids] == outs[-1].token_ids
    assert_idle_and_balanced(engine)
    # The id is free again once every sample has ended.
    engine.add_request(prompt, greedy(2), request_id=request_id)
    assert list(engine.stream_outputs())[-1].finished


def test_n_is_validated():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="n must be a positive integer"):
            SamplingParams(n=bad)
