"""LoRA adapters per request, against transformers + peft token for token.

Random PEFT adapters (tests/lora_adapters.py: ranks 4-16, different target modules, two with
the same target) on the tiny models; requests of several adapters and of the base model share
steps, in both loops, on the one-call forward (the CPU kernels) and the op-by-op one; slots
beyond `max_loras` are reused least recently used first; preemption and the prefix cache (keyed
by adapter) keep outputs exact; bad adapters are refused by name and harm nothing; two
tensor-parallel ranks equal one process.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem import LoRARequest
from tandem.lora import LoraError, LoraNotFound
from tests.shared_tp import ranks_from_a_fork_server  # noqa: F401

from conftest import hf_greedy_reference_allowing_near_ties, random_prompts
from helpers import assert_idle_and_balanced, greedy, make_llm
from lora_adapters import (
    ALL_PROJECTIONS,
    make_adapter,
    make_wrong_shape_adapter,
    peft_greedy_allowing_near_ties,
    remove_adapter_weights,
)

TOKENS = 10


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory) -> dict[str, LoRARequest]:
    """Four adapters of tiny_llama: every projection at rank 8, q/v at rank 4 with rsLoRA,
    the MLP at rank 16, and q/v again (the same targets as the second) at rank 8."""
    root = tmp_path_factory.mktemp("lora")
    specs = {
        "all8": {"rank": 8, "targets": ALL_PROJECTIONS},
        "qv4": {"rank": 4, "targets": ["q_proj", "v_proj"], "rslora": True},
        "mlp16": {"rank": 16, "targets": ["gate_proj", "up_proj", "down_proj"]},
        "qv8": {"rank": 8, "targets": ["q_proj", "v_proj"], "alpha": 4.0},
    }
    return {
        name: LoRARequest(
            name, i + 1, str(make_adapter(tiny_llama, root / name, seed=i + 1, **spec))
        )
        for i, (name, spec) in enumerate(specs.items())
    }


def check_outputs(base: Path, prompts, loras, outputs) -> None:
    """Each output equals peft's (or transformers' for the base model) greedy tokens."""
    for prompt, lora, output in zip(prompts, loras, outputs, strict=True):
        got = output.outputs[0].token_ids if output.outputs else output.token_ids  # LLM, Engine
        if lora is None:
            want = hf_greedy_reference_allowing_near_ties(base, prompt, got, TOKENS)
        else:
            want = peft_greedy_allowing_near_ties(base, Path(lora.lora_path), prompt, TOKENS, got)
        assert got == want, (lora and lora.lora_name, prompt)


def mixed(adapters, n: int, seed: int = 0):
    """n prompts over the base model and every adapter, in a random order."""
    rng = random.Random(seed)
    prompts = random_prompts(rng, n, 1024, 2, 40)
    choices = [None, *adapters.values()]
    return prompts, [choices[i % len(choices)] for i in range(n)]


@pytest.mark.parametrize("fast_path", [True, False], ids=["one-call", "op-by-op"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_mixed_batches_equal_peft(tiny_llama, adapters, fast_path, async_scheduling):
    prompts, loras = mixed(adapters, 10)
    llm = make_llm(
        tiny_llama, enable_lora=True, max_loras=4, max_lora_rank=16,
        async_scheduling=async_scheduling, enforce_eager=not fast_path,
    )  # fmt: skip
    assert (llm.engine.runner.model._fused_weights is not None) == fast_path
    outputs = llm.generate(prompts, greedy(TOKENS), lora_request=loras)
    check_outputs(tiny_llama, prompts, loras, outputs)
    assert_idle_and_balanced(llm.engine)
    slots = llm.engine.scheduler.lora_slots
    assert slots._users == {} and len(slots.resident) == 4 and slots.num_loads == 4


def test_slots_reused_least_recently_used_first(tiny_llama, adapters):
    """Four adapters through one slot: each waits for the slot, never for another's requests'
    end in the queue order, and every output is still exact."""
    prompts, loras = mixed(adapters, 9, seed=1)
    llm = make_llm(tiny_llama, enable_lora=True, max_loras=1, max_lora_rank=16)
    outputs = llm.generate(prompts, greedy(TOKENS), lora_request=loras)
    check_outputs(tiny_llama, prompts, loras, outputs)
    slots = llm.engine.scheduler.lora_slots
    assert len(slots.resident) == 1 and slots.num_loads >= 4
    assert_idle_and_balanced(llm.engine)

    # Two slots: A, B resident; C takes the least recently used one (A's), so B stays.
    llm = make_llm(tiny_llama, enable_lora=True, max_loras=2, max_lora_rank=16)
    a, b, c = adapters["all8"], adapters["qv4"], adapters["mlp16"]
    for lora in (a, b, c):
        llm.generate([prompts[0]], greedy(2), lora_request=lora)
    resident = llm.engine.scheduler.lora_slots.resident
    keys = {llm.engine.adapters._by_name[x.lora_name].cache_key: x.lora_name for x in (a, b, c)}
    assert sorted(keys[k] for k in resident) == ["mlp16", "qv4"]


def test_preemption_keeps_adapter_outputs_exact(tiny_llama, adapters):
    rng = random.Random(2)
    prompts = random_prompts(rng, 8, 1024, 30, 60)
    loras = [[None, *adapters.values()][i % 5] for i in range(8)]
    for async_scheduling in (False, True):
        llm = make_llm(
            tiny_llama, enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=24,
            block_size=4, async_scheduling=async_scheduling,
        )  # fmt: skip
        outputs = llm.generate(prompts, greedy(TOKENS), lora_request=loras)
        check_outputs(tiny_llama, prompts, loras, outputs)
        assert llm.engine.scheduler.num_preemptions > 0
        assert_idle_and_balanced(llm.engine)


def test_prefix_cache_is_keyed_by_adapter(tiny_llama, adapters):
    """A prompt cached under one adapter is a hit for that adapter only."""
    llm = make_llm(tiny_llama, enable_lora=True, max_loras=2, max_lora_rank=16, block_size=4)
    prompt = list(range(10, 50))
    a, b = adapters["all8"], adapters["qv4"]

    def hit_tokens(lora) -> int:
        before = llm.engine.stats().prefix_cache.hit_tokens
        output = llm.generate([prompt], greedy(TOKENS), lora_request=lora)
        check_outputs(tiny_llama, [prompt], [lora], output)
        return llm.engine.stats().prefix_cache.hit_tokens - before

    assert hit_tokens(a) == 0
    assert hit_tokens(b) == 0  # a's blocks hold a's K/V: none is b's
    assert hit_tokens(None) == 0
    assert hit_tokens(a) == 36  # its own: every full block short of the last token
    assert hit_tokens(None) == 36
    assert_idle_and_balanced(llm.engine)


def test_bad_adapters_are_refused_by_name(tiny_llama, adapters, tmp_path):
    llm = make_llm(tiny_llama, enable_lora=True, max_loras=2, max_lora_rank=8)
    prompt = list(range(5, 20))
    wrong = make_wrong_shape_adapter(tmp_path / "wrong")
    missing = remove_adapter_weights(make_adapter(tiny_llama, tmp_path / "gone", rank=4,
                                                  targets=["q_proj"]))  # fmt: skip
    cases = {
        LoRARequest("wrong", 7, str(wrong)): "do not fit the base model",
        LoRARequest("big", 8, adapters["mlp16"].lora_path): "rank 16 is above max_lora_rank 8",
        LoRARequest("gone", 9, str(missing)): "no adapter_model.safetensors",
        LoRARequest("nowhere", 10, str(tmp_path / "nowhere")): "no adapter_config.json",
    }
    for lora, message in cases.items():
        with pytest.raises(LoraError, match=message) as raised:
            llm.generate([prompt, prompt], greedy(TOKENS), lora_request=[None, lora])
        assert repr(lora.lora_name) in str(raised.value)
    assert llm.engine.adapters.list() == []
    # Nothing was queued, and the engine serves the base model and good adapters as before.
    a = adapters["all8"]
    outputs = llm.generate([prompt, prompt], greedy(TOKENS), lora_request=[None, a])
    check_outputs(tiny_llama, [prompt, prompt], [None, a], outputs)
    assert_idle_and_balanced(llm.engine)


def test_adapters_load_list_and_unload(tiny_llama, adapters):
    llm = make_llm(tiny_llama, enable_lora=True, max_loras=1, max_lora_rank=16)
    engine = llm.engine
    a, b = adapters["all8"], adapters["qv4"]
    engine.adapters.add(a)
    engine.adapters.add(a)  # the same again: nothing to do
    with pytest.raises(LoraError, match="is loaded already"):
        engine.adapters.add(LoRARequest("all8", 1, b.lora_path))
    with pytest.raises(LoraError, match="lora_int_id 1 is 'all8'"):
        engine.adapters.add(LoRARequest("other", 1, b.lora_path))
    engine.adapters.add(b)
    assert [x.lora_name for x in engine.adapters.list()] == ["all8", "qv4"]
    prompt = list(range(3, 30))
    # Queued under `a`, then `a` is unloaded: the queued request still finishes under it.
    engine.add_request(prompt, greedy(TOKENS), "queued", lora_request=a)
    engine.adapters.remove("all8")
    with pytest.raises(LoraNotFound, match="'all8'"):
        engine.adapters.remove("all8")
    outputs = {o.request_id: o for o in engine.stream_outputs() if o.finished}
    check_outputs(tiny_llama, [prompt], [a], [outputs["queued"]])
    assert engine.adapters.get("all8") is None and engine.adapters.get("qv4") == b
    llm.generate([prompt], greedy(2))  # the next step gives up a's slot, now unused
    assert engine.scheduler.lora_slots.resident == {}
    assert set(engine.adapters._by_key) == {engine.adapters._by_name["qv4"].cache_key}
    assert_idle_and_balanced(engine)


def test_an_adapter_loaded_meanwhile_by_another_thread(tiny_llama, adapters, monkeypatch):
    """Two threads read one adapter at once: the second to finish keeps the first's copy (and
    takes the lock once more, not twice)."""
    import threading

    import tandem.engine.lora as engine_lora

    llm = make_llm(tiny_llama, enable_lora=True)
    engine, a = llm.engine, adapters["all8"]
    first = engine_lora.read_adapter(a, engine.spec, 16)
    read = engine_lora.read_adapter

    def read_while_another_loads(request, spec, max_rank):
        engine.adapters._by_name[request.lora_name] = first  # the other thread's, done first
        return read(request, spec, max_rank)

    monkeypatch.setattr(engine_lora, "read_adapter", read_while_another_loads)
    got = []
    loader = threading.Thread(target=lambda: got.append(engine.adapters.add(a)), daemon=True)
    loader.start()
    loader.join(10)
    assert got == [first]


def test_lora_off_refuses_adapters(tiny_llama, adapters):
    llm = make_llm(tiny_llama)
    with pytest.raises(LoraError, match="enable_lora=True"):
        llm.generate([[1, 2, 3]], greedy(2), lora_request=adapters["all8"])


def test_other_families(tiny_checkpoints, tmp_path):
    """Qwen2 (q/k/v biases, sharded checkpoint; rank 64), Qwen3 (q/k norms), Gemma 3 (GeGLU,
    its norms, per-layer windows) and a mixture of experts (attention only) under adapters."""
    cases = {
        "Qwen2ForCausalLM": (ALL_PROJECTIONS, 64),
        "Qwen3ForCausalLM": (["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"], 8),
        "Gemma3ForCausalLM": (ALL_PROJECTIONS, 8),
        "Qwen3MoeForCausalLM": (["q_proj", "v_proj", "o_proj"], 8),
    }
    rng = random.Random(3)
    for arch, (targets, rank) in cases.items():
        base = tiny_checkpoints[arch]
        folder = make_adapter(base, tmp_path / arch, rank=rank, targets=targets, seed=5)
        lora = LoRARequest(arch, 1, str(folder))
        prompts = random_prompts(rng, 4, 1024, 2, 30)
        loras = [lora, None, lora, lora]
        llm = make_llm(base, enable_lora=True, max_lora_rank=rank)
        outputs = llm.generate(prompts, greedy(TOKENS), lora_request=loras)
        check_outputs(base, prompts, loras, outputs)
        assert_idle_and_balanced(llm.engine)


def test_moe_refuses_adapters_on_experts(tiny_checkpoints, tmp_path):
    """An adapter of a sparse layer's MLP (layer 0's: its experts')."""
    base = tiny_checkpoints["Qwen3MoeForCausalLM"]
    folder = make_adapter(base, tmp_path / "moe", rank=4, targets=["q_proj"])
    weights = folder / "adapter_model.safetensors"
    tensors = load_file(weights)
    prefix = "base_model.model.model.layers.0.mlp.gate_proj.lora_"
    tensors[prefix + "A.weight"] = torch.zeros(4, 64)
    tensors[prefix + "B.weight"] = torch.zeros(128, 4)
    save_file(tensors, weights)
    llm = make_llm(base, enable_lora=True)
    with pytest.raises(LoraError, match="mixture of experts' MLP is not supported"):
        llm.engine.adapters.add(LoRARequest("moe", 1, str(folder)))


def test_tensor_and_pipeline_parallel_equal_one_process(tiny_llama, adapters):
    """Two ranks, each with its slice of every adapter (B's rows of q/k/v and gate/up, A's
    columns of o and down), or two pipeline stages, each with its layers' part of every
    adapter, give one process's outputs, and peft's."""
    prompts, loras = mixed(adapters, 6, seed=4)
    outputs = {}
    layouts = {
        "one": {},
        "tp2": {"tensor_parallel_size": 2},
        "pp2": {"pipeline_parallel_size": 2},
        "pp2 op-by-op": {"pipeline_parallel_size": 2, "enforce_eager": True},
    }
    for name, layout in layouts.items():
        llm = make_llm(tiny_llama, enable_lora=True, max_loras=2, max_lora_rank=16, **layout)
        try:
            outputs[name] = [
                o.outputs[0].token_ids
                for o in llm.generate(prompts, greedy(TOKENS), lora_request=loras)
            ]
        finally:
            llm.close()
    assert outputs["tp2"] == outputs["one"]
    assert outputs["pp2"] == outputs["one"]
    for name in ("one", "pp2 op-by-op"):
        check_outputs(tiny_llama, prompts, loras, [_Tokens(t) for t in outputs[name]])


class _Tokens:
    """An output as `check_outputs` reads it, from its token ids."""

    def __init__(self, token_ids: list[int]):
        self.outputs, self.token_ids = [], token_ids


def test_speculative_decoding_under_adapters(tiny_llama, adapters):
    """N-gram drafts verified under each request's adapter: the outputs of no speculation."""
    prompts, loras = mixed(adapters, 6, seed=5)
    prompts = [p + p[:8] + p for p in prompts]  # repeats for the n-gram drafts to find
    llm = make_llm(
        tiny_llama, enable_lora=True, max_loras=4, max_lora_rank=16,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )  # fmt: skip
    outputs = llm.generate(prompts, greedy(TOKENS), lora_request=loras)
    check_outputs(tiny_llama, prompts, loras, outputs)
    assert llm.engine.stats().speculative.drafted_tokens > 0
    assert_idle_and_balanced(llm.engine)
