"""One run of the agent-session workload on an engine: closed-loop submission, each session's
next turn added the moment its previous answer is complete (from the step that returned it,
before the next step is scheduled), as an agent does once its tool has run."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from rich.progress import Progress

from tandem.bench.agent import AgentShape, Conversations, common_prefix
from tandem.engine.engine import Engine
from tandem.metrics import RunSummary, StepRecord
from tandem.request import SamplingParams


@dataclass
class TurnRecord:
    session: int
    turn: int  # 0-based
    prompt_len: int
    # Tokens the turn adds to the previous turn's prompt and answer (a first turn: past the head
    # it shares with the first session; the first session's: all): an ideal cache's work.
    new_tokens: int
    # Tokens of the previous prompt and answer that this prompt writes otherwise (from where
    # it departs from them to where the added tokens begin): rendered prompts re-tokenize the
    # answer's text.
    rewritten: int
    submitted: float
    first_token: float | None = None
    finished: float | None = None
    cached_tokens: int = 0  # prompt tokens the prefix cache served
    output: list[int] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        return (self.first_token or self.submitted) - self.submitted

    @property
    def computed_tokens(self) -> int:
        return self.prompt_len - self.cached_tokens


@dataclass
class AgentRun:
    summary: RunSummary
    records: list[StepRecord]
    turns: list[TurnRecord]  # by session, then turn
    prefill_computed: int  # prompt tokens computed (recomputation after preemption included)
    prefill_saved: int  # prompt tokens served from the prefix cache
    peak_blocks: int  # KV blocks held by running requests at once, at most
    shared_head: int  # tokens the sessions' first prompts share
    respliced: int = 0  # exact prompts: turns the template did not extend, rendered anew

    @property
    def outputs(self) -> list[list[int]]:
        return [t.output for t in self.turns]

    def ttft_ms(self, later: bool, q: float) -> float:
        """TTFT percentile of first turns (later=False) or of the turns after them."""
        times = [t.ttft_s for t in self.turns if (t.turn > 0) == later]
        return 1e3 * float(np.percentile(times, q)) if times else float("nan")


def run_agent(
    engine: Engine,
    shape: AgentShape,
    conversations: Conversations,
    progress: Progress | None,
    label: str,
) -> AgentRun:
    """Every session's turns, greedy, EOS ignored, from a cold prefix cache."""
    mark = engine.history.mark()
    engine.reset_prefix_cache()
    before = engine.stats().prefix_cache
    params = SamplingParams(max_tokens=shape.output_len, temperature=0.0, ignore_eos=True)
    task = progress.add_task(label, total=shape.sessions * shape.turns) if progress else None
    records: dict[str, TurnRecord] = {}
    prompts: dict[str, list[int]] = {}
    firsts: list[list[int]] = []
    start = time.perf_counter()

    def submit(
        session: int, turn: int, prompt: list[int], new_tokens: int, rewritten: int = 0
    ) -> None:
        request_id = f"{label}-s{session}-t{turn}"
        records[request_id] = TurnRecord(
            session, turn, len(prompt), new_tokens, rewritten, time.perf_counter()
        )
        prompts[request_id] = prompt
        engine.add_request(prompt, params, request_id)

    started, peak = 0, 0
    while started < shape.sessions or engine.has_unfinished():
        now = time.perf_counter() - start
        while started < shape.sessions and shape.start_time(started) <= now:
            prompt = conversations.first(started)
            firsts.append(prompt)
            shared = common_prefix(prompt, firsts[0]) if started else 0
            submit(started, 0, prompt, len(prompt) - shared)
            started += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, shape.start_time(started) - now))
            continue
        outputs = engine.step()
        returned = time.perf_counter()
        peak = max(peak, engine.stats().kv_blocks_used)
        for out in outputs:
            record = records[out.request_id]
            if record.first_token is None and out.delta_token_ids:
                record.first_token = returned
            if not out.finished:
                continue
            record.finished, record.output = returned, list(out.token_ids)
            record.cached_tokens = out.num_cached_tokens
            if progress:
                progress.advance(task)
            if record.turn + 1 < shape.turns:
                before_turn = prompts[out.request_id]
                turn = record.turn + 1
                prompt, added = conversations.next(record.session, turn, before_turn, record.output)
                held = common_prefix(prompt, before_turn + record.output)
                submit(record.session, turn, prompt, added, max(0, len(prompt) - held - added))
    after = engine.stats().prefix_cache
    saved = after.hit_tokens - before.hit_tokens
    turns = sorted(records.values(), key=lambda t: (t.session, t.turn))
    return AgentRun(
        engine.history.summary(since=mark),
        engine.history.steps(since=mark),
        turns,
        after.query_tokens - before.query_tokens - saved,
        saved,
        peak,
        common_prefix(firsts[0], firsts[1]) if len(firsts) > 1 else 0,
        conversations.respliced,
    )
