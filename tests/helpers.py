"""Small helpers shared by the engine tests."""

from __future__ import annotations

from pathlib import Path

from tandem import LLM, Engine, SamplingParams


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def make_llm(path: Path, **options) -> LLM:
    options.setdefault("dtype", "float32")
    options.setdefault("device", "cpu")
    return LLM(str(path), **options)


def assert_idle_and_balanced(engine: Engine) -> None:
    """Invariant 3: nothing in flight, every KV block and table row back, none owned."""
    s = engine.scheduler
    assert not engine.has_unfinished()
    assert not s.running and not s.waiting
    accounting = s.blocks.check()  # the pool's own invariants (no block listed twice, ...)
    assert accounting.used == 0 and s.blocks.num_free == s.blocks.size, s.blocks.owners()
    assert s.slots.num_free == s.slots.size, s.slots.owners()
    assert not s.blocks.owners() and not s.slots.owners()
    assert len(set(s.slots._free)) == s.slots.size  # no row listed free twice
