"""Sliding-window layers keep only their window's KV blocks.

Layers are grouped by window (`scheduling/kv_groups.py`); a windowed group gives its blocks back
as the window moves past them, under both loops, and outputs stay transformers' own. The models:
a Qwen3 whose `layer_types` mix full and sliding attention (several block tables), and a
Mistral whose every layer is windowed (one table that drops blocks).
"""

from __future__ import annotations

import random

import pytest
import torch

from tandem.models.default_model import build_checkpoint
from tandem.request import SamplingParams
from tandem.scheduling.kv_groups import DROPPED, kv_groups

from conftest import NUM_SPECIAL_TOKENS, SLIDING_WINDOW, hf_greedy_reference
from helpers import assert_idle_and_balanced, greedy, make_llm

WINDOW = SLIDING_WINDOW


@pytest.fixture(scope="module")
def hybrid(sliding_qwen3):
    return sliding_qwen3


@pytest.fixture(scope="module")
def windowed_mistral(tmp_path_factory):
    return build_checkpoint(
        tmp_path_factory.mktemp("mistral-sliding"), "MistralForCausalLM",
        extra_config={"sliding_window": 5},
    )  # fmt: skip


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(NUM_SPECIAL_TOKENS, 1024) for _ in range(n)] for n in lengths]


def test_layers_group_by_window():
    g = kv_groups([None, 7, 7, 7, None, 7], max_model_len=64)
    assert g.places == 2 and g.num_groups == 3 and g.windowed
    assert [grp.layers for grp in g.groups] == [(0, 4), (1, 2), (3, 5)]
    assert [grp.window for grp in g.groups] == [None, 7, 7]
    assert g.layer_group == (0, 1, 1, 2, 0, 2) and g.layer_place == (0, 0, 1, 0, 1, 1)
    # A kind that does not divide evenly leaves a place unused in its last group.
    assert [grp.layers for grp in kv_groups([None, 3, 3, None, 3], 64).groups] == [
        (0, 3), (1, 2), (4,),
    ]  # fmt: skip
    # Every layer alike is one group of them all; a window as long as the context is none.
    assert kv_groups([5, 5, 5], 64).groups[0].layers == (0, 1, 2)
    assert not kv_groups([None, 64, 64], 64).windowed
    assert kv_groups([None, 64], 64).num_groups == 1
    # Blocks one request needs: full groups all of it, windowed ones the window and a chunk.
    assert g.first_needed_block(1, position=20, block_size=4) == 14 // 4
    assert g.max_blocks(100, block_size=4, chunk=8) == 25 + 2 * (-(-(6 + 8) // 4) + 1)
    assert g.max_length(35, block_size=4, chunk=8, limit=1000) == 4 * (35 - 10)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["fast", "eager"])
def test_hybrid_windows_equal_transformers(hybrid, async_scheduling, enforce_eager):
    """Prompts longer than the window, prefilled in chunks, then decoded well past it."""
    batch = prompts(0, (3, 20, 41))
    llm = make_llm(
        hybrid, block_size=4, async_scheduling=async_scheduling, enforce_eager=enforce_eager,
        max_num_batched_tokens=16,
    )  # fmt: skip
    assert llm.engine.scheduler.groups.num_groups == 4
    # Several windows and block tables: the one-call forward takes each layer's.
    assert llm.engine.execution.ops == ("portable" if enforce_eager else "fused-cpu")
    outs = llm.generate(batch, greedy(30))
    for prompt, out in zip(batch, outs, strict=True):
        assert out.token_ids == hf_greedy_reference(hybrid, prompt, 30)
    assert_idle_and_balanced(llm.engine)


def test_prompt_logprobs_equal_transformers(hybrid):
    from conftest import _load_hf_model

    prompt = prompts(1, (30,))[0]
    out = make_llm(hybrid, block_size=4).generate(
        [prompt], SamplingParams(max_tokens=1, prompt_logprobs=0)
    )[0]
    with torch.no_grad():
        logits = _load_hf_model(str(hybrid))(torch.tensor([prompt])).logits[0].float()
    expected = logits.log_softmax(-1)
    for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
        token = prompt[i]
        assert entry[token].logprob == pytest.approx(expected[i - 1, token].item(), abs=1e-4)


@pytest.mark.parametrize("model", ["qwen3", "gemma3"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_window_blocks_are_given_back_as_it_moves(
    hybrid, tiny_checkpoints, model, async_scheduling
):
    """Exact accounting at every step: a windowed group holds exactly the blocks from the one
    its step's first query reads to the one its last token lands in; a full group holds all.
    (Without prefix caching: with it, a block stays until it has joined the cache.) Both models
    have a window of 7: Qwen3 layers [full, 7, 7, 7], Gemma 3 [7, full, 7]."""
    path = hybrid if model == "qwen3" else tiny_checkpoints["Gemma3ForCausalLM"]
    llm = make_llm(
        path, block_size=4, async_scheduling=async_scheduling, max_num_batched_tokens=8,
        enable_prefix_caching=False,
    )  # fmt: skip
    engine, s = llm.engine, llm.engine.scheduler
    windows = [g.window for g in s.groups.groups]
    assert set(windows) == {None, WINDOW}
    schedule, seen = s.schedule, []

    def checked():
        batch = schedule()
        for item in batch.items if batch else []:
            end = -(-(item.start + item.num_tokens) // 4)
            first = max(0, item.start - WINDOW + 1) // 4
            for ids, window in zip(item.request.block_ids, windows, strict=True):
                held = [j for j, b in enumerate(ids) if b != DROPPED]
                assert held == list(range(0 if window is None else first, end)), item.start
                if window is not None:
                    seen.append(len(held))
        return batch

    s.schedule = checked
    prompt = prompts(2, (37,))[0]
    out = llm.generate([prompt], greedy(40))[0]
    assert out.token_ids == hf_greedy_reference(path, prompt, 40)
    # 77 positions in blocks of 4: the full group ends with 20, a windowed group never above 4.
    assert max(seen) <= -(-(WINDOW - 1 + 8) // 4) + 1 and seen[-1] <= 3
    assert_idle_and_balanced(engine)


@pytest.mark.parametrize("model", ["qwen3", "gemma3"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prefix_cache_n_and_preemption_with_windows(
    hybrid, tiny_checkpoints, model, async_scheduling
):
    """A cached prefix is reused where every group holds what its first computed position
    reads; n > 1 samples share the prompt; a small cache preempts. Outputs stay the reference."""
    path = hybrid if model == "qwen3" else tiny_checkpoints["Gemma3ForCausalLM"]
    shared = prompts(3, (26,))[0]
    batch = [shared + [100 + i] for i in range(3)] + prompts(4, (33,))
    llm = make_llm(
        path, block_size=4, async_scheduling=async_scheduling,
        num_kv_blocks=56 if model == "qwen3" else 40, max_num_batched_tokens=32,
    )  # fmt: skip
    first = llm.generate(batch[:1], greedy(20))[0]
    outs = llm.generate(batch, greedy(20))
    s = llm.engine.scheduler
    assert s.stats.hit_tokens >= 24  # the first prompt's blocks, in every group
    assert outs[0].token_ids == first.token_ids
    for prompt, out in zip(batch, outs, strict=True):
        assert out.token_ids == hf_greedy_reference(path, prompt, 20)
    sampled = llm.generate(batch[3:], SamplingParams(max_tokens=12, temperature=0.9, seed=3, n=3))
    again = make_llm(path, block_size=4, async_scheduling=not async_scheduling).generate(
        batch[3:], SamplingParams(max_tokens=12, temperature=0.9, seed=3, n=3)
    )
    assert [o.token_ids for o in sampled[0].outputs] == [o.token_ids for o in again[0].outputs]
    assert s.num_preemptions > 0
    assert_idle_and_balanced(llm.engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_prompt_the_cache_just_holds_finishes(tiny_checkpoints, async_scheduling):
    """A long prompt alone in a cache that holds it only once its windowed groups give back the
    blocks before the window, with prefix caching on, so that a block leaves only once it has
    joined the cache (when its step retires). The asynchronous loop used to preempt the request
    for its next chunk while the step that would free those blocks was in flight, and again on
    every re-admission: it never finished."""
    path = tiny_checkpoints["Gemma3ForCausalLM"]
    llm = make_llm(
        path, block_size=8, max_num_batched_tokens=64, num_kv_blocks=48,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    engine = llm.engine
    prompt = prompts(6, (177,))[0]
    assert engine.max_model_len >= len(prompt) + 4  # the cache holds the whole request
    engine.add_request(prompt, greedy(4), "long")
    tokens, steps = [], 0
    while engine.has_unfinished() and steps < 50:
        tokens += [t for out in engine.step() for t in out.delta_token_ids]
        steps += 1
    assert not engine.has_unfinished() and engine.scheduler.num_preemptions == 0
    assert tokens == hf_greedy_reference(path, prompt, 4)
    assert_idle_and_balanced(engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_one_windowed_group_drops_blocks(windowed_mistral, async_scheduling):
    """Mistral: every layer windowed, one block table whose early blocks go back (chunks of a
    long prompt read only the window before them); ngram drafts (positions known on the device
    only) never lose a block they read."""
    batch = prompts(5, (4, 23))
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}):
        llm = make_llm(
            windowed_mistral, block_size=2, async_scheduling=async_scheduling,
            speculative_config=spec, max_num_batched_tokens=8,
        )  # fmt: skip
        assert llm.engine.scheduler.groups.windowed
        for prompt, out in zip(batch, llm.generate(batch, greedy(25)), strict=True):
            assert out.token_ids == hf_greedy_reference(windowed_mistral, prompt, 25)
        assert_idle_and_balanced(llm.engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_ngram_drafts_across_block_tables(hybrid, async_scheduling):
    """A verification's tokens get their KV slots in every group's table, placed on the device;
    outputs are those without drafts. A draft model (it reads every earlier position through
    the target's blocks) is refused for a windowed model, at start and by configure."""
    batch = prompts(6, (5, 30))
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
             "adaptive": False}  # fmt: skip
    llm = make_llm(hybrid, block_size=4, async_scheduling=async_scheduling,
                   speculative_config=ngram)  # fmt: skip
    for prompt, out in zip(batch, llm.generate(batch, greedy(30)), strict=True):
        assert out.token_ids == hf_greedy_reference(hybrid, prompt, 30)
    assert llm.engine.stats().speculative.drafted_tokens
    assert_idle_and_balanced(llm.engine)
    draft = {"method": "draft_model", "model": str(hybrid), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="draft_model"):
        make_llm(hybrid, speculative_config=draft)
    with pytest.raises(ValueError, match="draft_model"):
        llm.engine.configure(speculative_config=draft)


@pytest.mark.parametrize("window", [None, 6])
def test_in_place_decode_attention_equals_the_portable_op(window):
    """The op-by-op CPU path's attention (decodes read the cache in place, from the window's
    start) against the portable one, on a step of decodes and prefill chunks."""
    from tandem.ops import cpu_elementwise, cpu_kernels
    from tandem.ops.attention import paged_attention, write_kv
    from tandem.ops.attention_metadata import AttentionMetadata, PrefillSegment

    assert cpu_kernels.load().available
    g = torch.Generator().manual_seed(0)
    bs, blocks, kv_heads, dim = 4, 40, 2, 32
    caches = [torch.randn(blocks, bs, kv_heads, dim, generator=g) for _ in range(2)]
    tables = torch.randperm(blocks, generator=g)[:30].view(3, 10)
    # Two decodes at lengths 19 and 33, one chunk of 5 tokens ending at 26.
    lens = torch.tensor([19, 33, 26])
    tokens = 2 + 5
    q = torch.randn(tokens, 2 * kv_heads, dim, generator=g)
    k, v = (torch.randn(tokens, kv_heads, dim, generator=g) for _ in range(2))
    positions = torch.cat([lens[:2] - 1, torch.arange(21, 26)])
    rows = torch.tensor([0, 1, 2, 2, 2, 2, 2])
    slots = tables[rows, positions // bs] * bs + positions % bs
    meta = AttentionMetadata(slots, tables, lens, 2, 9, [PrefillSegment(2, 5, 26, 2)], bs)
    write_kv(k, v, *caches, slots)  # the step's K/V go in first (`rotary_and_cache`)
    expected = paged_attention(q, k, v, *[c.clone() for c in caches], meta, 0.2, window)
    got = cpu_elementwise.paged_attention(q, k, v, *caches, meta, 0.2, window)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
