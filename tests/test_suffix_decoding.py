"""Suffix decoding: the host's trees (request's own and global), the device's check that a
proposal still holds, and the engine's drafts from other requests' outputs.

Exactness under both loops, every sampling mode, chunked prefill, preemption, grammars and two
ranks is tested beside n-gram's in test_speculative.py (its `method` fixture)."""

from __future__ import annotations

import resource

import numpy as np
import pytest
import torch

from tandem import SamplingParams
from tandem.config import SpeculativeConfig
from tandem.engine.grammar import allowed_prefix, grammar_of
from tandem.execution.drafting import ngram_drafts, proposed_drafts
from tandem.request import Request, StructuredOutputsParams
from tandem.sampler.inputs import VerifyRows
from tandem.scheduling.suffix_proposer import SuffixProposer

from helpers import assert_idle_and_balanced, greedy, make_llm


def request(prompt: list[int], name: str = "r") -> Request:
    return Request(name, prompt, SamplingParams(), 0, (0.0, 0, 1.0, 0.0, 0), 64, 0.0)


def proposer(**fields) -> SuffixProposer:
    return SuffixProposer(SpeculativeConfig(method="suffix", **fields))


def test_a_proposal_continues_the_requests_own_history():
    p = proposer()
    r = request([7, 1, 2, 3, 4, 5, 6, 9, 1, 2, 3])
    proposal = p.propose(r, 8)
    assert proposal.start == 11
    assert proposal.tokens.tolist()[:3] == [4, 5, 6]  # what followed 1, 2, 3 before
    r.output_token_ids += [4, 5]  # retired: the next proposal starts after them
    assert p.propose(r, 8).start == 13 and p.propose(r, 8).tokens.tolist()[0] == 6


def test_a_proposal_runs_past_the_tokens_in_flight():
    """Under the async loop a request's in-flight tokens are not retired yet: the proposal
    covers them (every draft kept) and the drafts after them."""
    p = proposer()
    r = request(list(range(10, 40)) + list(range(10, 14)))
    r.num_inflight = 5
    assert p.propose(r, 4).tokens.tolist() == list(range(14, 23))


def test_other_requests_outputs_are_proposed_and_bounded():
    """Outputs of ended requests join the global tree (the last `max_cached_requests` only);
    prompts do not."""
    p = proposer(suffix_decoding_max_cached_requests=2)
    first = request([1, 2], "a")
    first.output_token_ids = [50, 51, 52, 53, 54, 55]
    p.finish(first)
    other = request([9, 8, 50, 51, 52], "b")
    assert p.propose(other, 4).tokens.tolist()[:3] == [53, 54, 55]
    p.finish(other)
    assert p.num_active == 0 and p.num_cached == 2
    for name in "cd":  # two more: the first output leaves the global tree
        ended = request([3], name)
        ended.output_token_ids = [60, 61]
        p.finish(ended)
    assert p.num_cached == 2
    assert p.propose(request([50, 51, 52], "e"), 4).tokens.size == 0
    none = proposer(suffix_decoding_max_cached_requests=0)
    none.finish(first)
    assert none.num_cached == 0
    assert none.propose(request([50, 51, 52], "f"), 4).tokens.size == 0


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def test_trees_do_not_grow_over_ten_thousand_requests():
    """Each request's tree is dropped when it ends, and the global tree holds a bounded number
    of outputs: memory after 10k requests is what it was after 2k."""
    p = proposer(suffix_decoding_max_cached_requests=100)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 5000, (10_000, 96), generator=g).tolist()
    for i, row in enumerate(tokens):
        r = request(row[:64], str(i))
        p.propose(r, 8)
        r.output_token_ids = row[64:]
        p.propose(r, 8)
        p.finish(r)
        if i == 1999:
            warm = rss_bytes()
    assert p.num_active == 0 and p.num_cached == 100
    assert rss_bytes() - warm < 8 << 20


def verify_rows(proposals, start, known, rows, num_drafts, history_len) -> VerifyRows:
    n = len(rows)
    t = torch.tensor
    none = torch.zeros(0, dtype=torch.int64)
    return VerifyRows(
        table_rows=t(rows), num_drafts=t(num_drafts), prompt_lens=torch.zeros(n, dtype=torch.int64),
        token_item=none, token_offset=none, token_batch=none, sample_rows=none, draft_batch=none,
        draft_item=none, draft_index=none, check_rows=none, pass_items=none, item_batch=none,
        item_row=none, pass_sizes=[], max_drafts=max(num_drafts), history_len=history_len,
        method="suffix", lookup=(2, 1), proposals=t(proposals), proposal_start=t(start),
        proposal_len=t(known),
    )  # fmt: skip


def test_the_device_takes_a_proposal_only_where_it_still_holds():
    """Row 0: the host knew the whole row (sync), drafts are the proposal's first. Row 1: the
    step in flight kept what the proposal expected, drafts follow on. Row 2: it sampled
    something else, and row 3's proposal is too short: n-gram drafts from their own history."""
    max_len = 16
    table = torch.zeros(4 * max_len, dtype=torch.int64)
    history = [1, 2, 3, 4, 1, 2, 3]
    for row in range(4):
        table[row * max_len : row * max_len + 7] = torch.tensor(history)
    table[1 * max_len + 7 : 1 * max_len + 9] = torch.tensor([70, 71])  # in flight: as proposed
    table[2 * max_len + 7 : 2 * max_len + 9] = torch.tensor([70, 99])  # in flight: not
    lengths = torch.tensor([7, 9, 9, 7])
    v = verify_rows(
        proposals=[[50, 51, 52, 0, 0], [70, 71, 72, 73, 74], [70, 71, 72, 73, 74], [80, 0, 0, 0, 0]],
        start=[7, 7, 7, 7],
        known=[3, 5, 5, 1],
        rows=[0, 1, 2, 3],
        num_drafts=[2, 2, 2, 2],
        history_len=9,
    )  # fmt: skip
    drafts = proposed_drafts(table, v, lengths, max_len)
    fallback = ngram_drafts(table, v, lengths, max_len)
    assert drafts[0].tolist() == [50, 51] and drafts[1].tolist() == [72, 73]
    assert torch.equal(drafts[2:], fallback[2:])
    assert drafts[3].tolist() == [4, 1]  # after 1, 2, 3 came 4 in its own history


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_drafts_come_from_an_earlier_requests_output(cycling_llama, async_scheduling):
    """A request whose own history holds no repeat yet drafts from an earlier request's output
    in the global tree: the same prompt again accepts more drafts than the first time (and than
    with the global tree off), with the tokens of decoding without drafts."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(20, 1000, (23,), generator=g).tolist()
    reference = make_llm(cycling_llama).generate([prompt], greedy(30))[0].outputs[0].token_ids
    accepted = {}
    for cached in (0, 16):
        spec = {"method": "suffix", "suffix_decoding_max_cached_requests": cached}
        llm = make_llm(cycling_llama, speculative_config=spec, async_scheduling=async_scheduling)
        counts = []
        for _ in range(2):
            before = llm.engine.stats().speculative.accepted_tokens
            out = llm.generate([prompt], greedy(30))[0]
            assert out.outputs[0].token_ids == reference
            counts.append(llm.engine.stats().speculative.accepted_tokens - before)
            if counts[-1]:  # the request's own figures are the engine's for its run
                assert out.speculative.accepted_tokens == counts[-1]
        accepted[cached] = counts
        assert_idle_and_balanced(llm.engine)
        llm.engine.close()
    assert accepted[16][1] > accepted[16][0] and accepted[16][1] > accepted[0][1]


def test_a_proposal_is_cut_where_the_grammar_refuses(cycling_llama):
    """A request under a grammar never verifies a draft the grammar refuses: its proposal ends
    before the first such token, and the matcher is left where its retired tokens put it."""
    llm = make_llm(cycling_llama, speculative_config={"method": "suffix"})
    tokenizer = llm.get_tokenizer()
    regex = StructuredOutputsParams(regex="[a-z ]{0,40}")
    request = llm.engine.make_request([5, 6, 7], SamplingParams(structured_outputs=regex))
    lower = tokenizer("hello world", add_special_tokens=False).input_ids
    upper = tokenizer("HELLO", add_special_tokens=False).input_ids
    tokens = np.array(lower + upper + lower)
    assert allowed_prefix(request, tokens) == len(lower)
    assert allowed_prefix(request, tokens) == len(lower)  # rolled back: the same walk again
    assert grammar_of(request).num_accepted == 0
    free = llm.engine.make_request([5, 6, 7], SamplingParams())
    assert allowed_prefix(free, tokens) == len(tokens)
    cut = SuffixProposer(SpeculativeConfig(method="suffix"), allowed_prefix)
    request.prompt_token_ids = (lower + upper) * 2 + lower[:2]  # proposes lower[2:], upper
    assert cut.propose(request, 16).tokens.tolist() == lower[2:]
    llm.engine.close()
