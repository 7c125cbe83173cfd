"""`tandem bench --workload agent`: coding-agent sessions fed closed loop (each next turn added
when the previous answer is complete). Every turn's prompt begins with the previous prompt and
the answer as generated, so the prefix cache serves all of it but the last partial block, in
both loops, and the answers are the ones without caching."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tandem import Engine, EngineConfig
from tandem.bench.agent import (
    AgentShape,
    AgentTexts,
    ChatConversations,
    TokenConversations,
    common_prefix,
    make_conversations,
)
from tandem.bench.agent_run import AgentRun, run_agent
from tandem.cli import main
from tandem.engine.chat_template import render_chat_ids

from helpers import TEST_KV_CACHE_GIB, bench_table

BS = 16
SHAPE = AgentShape(sessions=3, turns=3, head_len=100, tool_result_len=30, output_len=7)


def test_the_shape_and_its_prompts(tiny_llama):
    with pytest.raises(ValueError, match="--turns"):
        AgentShape(1, 0, 10, 10, 10)
    with pytest.raises(ValueError, match="no room for a head"):
        SHAPE.head_that_fits(200)
    assert SHAPE.head_that_fits(4096) == 100
    assert SHAPE.head_that_fits(300) == 300 - SHAPE.final_len(0) < 100  # shortened to fit

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    texts = AgentTexts(tokenizer, 1000, 30, seed=0)
    assert '"name": "Bash"' in texts.system and texts.count(texts.system) <= 1000
    assert 20 <= texts.count(texts.tool_result(0, 1)) <= 30
    again, other = AgentTexts(tokenizer, 1000, 30, seed=0), AgentTexts(tokenizer, 1000, 30, seed=1)
    assert again.system == texts.system and again.tool_result(2, 1) == texts.tool_result(2, 1)
    # Another seed's head differs in its first line: a repeat finds nothing of an earlier one.
    assert other.system.split("\n")[0] != texts.system.split("\n")[0]

    answer = tokenizer("Reading the file next.", add_special_tokens=False).input_ids
    exact = ChatConversations(SHAPE, 100, tokenizer, 0, "exact")
    first = exact.first(0)
    assert first == render_chat_ids(tokenizer, exact.texts.first_messages(0))
    second, added = exact.next(0, 1, first, answer)
    assert second[: len(first) + len(answer)] == first + answer and added == len(second) - len(
        first
    ) - len(answer)
    rendered = ChatConversations(SHAPE, 100, tokenizer, 0, "rendered")
    assert rendered.first(0) == first
    again, added_again = rendered.next(0, 1, first, answer)
    assert again == render_chat_ids(tokenizer, rendered.messages[0]) and added_again == added
    assert exact.respliced == 0

    ids = TokenConversations(SHAPE, 100, 1024, 0)
    a, b = ids.first(0), ids.first(1)
    assert common_prefix(a, b) == 100 and len(a) == 130
    nxt, n = ids.next(0, 1, a, [5, 6])
    assert nxt[:132] == a + [5, 6] and n == 30 and len(nxt) == 162


def run(engine: Engine, mode: str, caching: bool = True) -> AgentRun:
    engine.configure(async_scheduling=mode == "async", enable_prefix_caching=caching)
    conversations = make_conversations(
        SHAPE, engine.tokenizer, engine.spec.vocab_size, engine.max_model_len, 0
    )
    return run_agent(engine, SHAPE, conversations, None, f"{mode}-{caching}")


def test_every_turn_computes_only_what_is_new(tiny_llama):
    engine = Engine(
        EngineConfig(
            model=str(tiny_llama), dtype="float32", device="cpu", block_size=BS,
            kv_cache_memory_gib=TEST_KV_CACHE_GIB,
        )
    )  # fmt: skip
    try:
        runs = {mode: run(engine, mode) for mode in ("sync", "async")}
        uncached = run(engine, "sync", caching=False)
    finally:
        engine.close()
    for agent in runs.values():
        turns = {(t.session, t.turn): t for t in agent.turns}
        assert len(turns) == SHAPE.sessions * SHAPE.turns
        assert agent.shared_head >= 100 and agent.respliced == 0
        for (session, turn), t in turns.items():
            assert len(t.output) == SHAPE.output_len and t.rewritten == 0
            if turn == 0:  # the head's full blocks, after the first session's
                cached = agent.shared_head // BS * BS if session else 0
                assert t.new_tokens == t.prompt_len - (agent.shared_head if session else 0)
            else:  # the previous prompt and answer, short of the answer's last token
                before = turns[session, turn - 1]
                cached = (before.prompt_len + SHAPE.output_len - 1) // BS * BS
                assert t.new_tokens == t.prompt_len - before.prompt_len - SHAPE.output_len
            assert t.cached_tokens == cached, (session, turn)
            assert t.computed_tokens - t.new_tokens < BS  # at most the last partial block
        assert agent.prefill_saved == sum(t.cached_tokens for t in agent.turns)
        assert agent.peak_blocks > 0
    assert runs["sync"].outputs == runs["async"].outputs == uncached.outputs
    assert uncached.prefill_saved == 0


def test_agent_bench_reports_reuse_and_the_sessions_that_fit(tiny_llama, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # one table row per line
    args = ["bench", "--workload", "agent", "--model", str(tiny_llama), "--sessions", "2",
            "--turns", "2", "--head-len", "64", "--tool-result-len", "24", "--output-len", "5",
            "--kv-cache-memory-gib", "0.03125"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    rows = bench_table(out)
    assert rows["outputs identical (all runs)"] == ["", "yes"]
    assert rows["later turns: earlier tokens written otherwise"] == ["0", "0"]
    new, computed = (int(x) for x in rows["later turns: new / computed tokens"][0].split(" / "))
    assert new <= computed < new + 2 * BS  # two later turns, each its last partial block
    assert float(rows["later turns: reuse efficiency % (new / computed)"][0]) > 50
    text = " ".join(out.split())
    assert "2 agent sessions x 2 turns" in text
    assert "in 0.03125 GiB (4096 blocks)" in text and "with the head's blocks shared" in text


def test_edit_sessions_with_speculation_off_and_on(cycling_llama, capsys, monkeypatch):
    """`--agent-task edit` asks for every file read back; with --speculative-config each loop
    runs with speculation off and on, with the same outputs, and reports the drafts and the
    ratio of output tokens/s."""
    tokenizer = AutoTokenizer.from_pretrained(cycling_llama)
    texts = AgentTexts(tokenizer, 200, 30, seed=0, task="edit")
    assert texts.first_messages(0)[1]["content"].startswith("Repeat the following file exactly")
    assert texts.turn_message(0, 1).endswith(texts.tool_result(0, 1))
    assert AgentTexts(tokenizer, 200, 30, seed=0).turn_message(0, 1) == texts.tool_result(0, 1)
    monkeypatch.setenv("COLUMNS", "300")
    args = ["bench", "--workload", "agent", "--model", str(cycling_llama), "--sessions", "1",
            "--turns", "2", "--head-len", "64", "--tool-result-len", "24", "--output-len", "24",
            "--agent-task", "edit", "--speculative-config", '{"method": "suffix"}',
            "--kv-cache-memory-gib", "0.03125"]  # fmt: skip
    assert main(args) == 0
    rows = bench_table(capsys.readouterr().out)
    assert rows["outputs identical (all runs)"] == ["", "", "", "yes"]
    drafted, accepted = (int(x) for x in rows["spec decode: draft / accepted tokens"][3].split("/"))
    assert 0 < accepted <= drafted
    ratios = rows["suffix vs off (output tokens/s)"]
    assert ratios[:2] == ["", ""] and all(r.endswith(")") for r in ratios[2:])
