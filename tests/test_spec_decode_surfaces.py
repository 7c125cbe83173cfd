"""Speculative decoding on the surfaces: `--speculative-config` on every command (vLLM's flag and
JSON), refused at parse time when wrong; `LLM(speculative_config=...)`; and the server's
/metrics: vLLM's spec_decode counters and Tandem's acceptance gauges, per engine, zeros on a
server without speculation, moving on one with it (`tandem serve --speculative-config`, real
processes)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_server import LiveServer, metric_samples, server_fixtures, wait_until
from test_server_processes import ONE_THREAD, Served, clean_up, every, spawn, wait_healthy

from tandem import LLM, SamplingParams
from tandem.cli import build_parser, engine_config, main
from tandem.config import SpeculativeConfig

NGRAM3 = '{"method":"ngram","num_speculative_tokens":3}'
COUNTERS = (
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
)
GAUGES = ("tandem_spec_decode_acceptance_rate", "tandem_spec_decode_mean_accepted_length")
SUFFIX = '{"method":"suffix","num_speculative_tokens":6}'
CONFIGS = [NGRAM3, SUFFIX]
REPEATING = list(range(100, 108)) * 6  # 8 token ids, 6 times: the n-gram lookup's easy case

live, offline, model = server_fixtures("module")


# ------------------------------------------------------------------ the flag
@pytest.mark.parametrize("command", ["generate", "chat", "serve", "bench"])
def test_every_command_takes_the_flag(command: str) -> None:
    args = build_parser().parse_args([command, "--speculative-config", NGRAM3])
    assert engine_config(args).speculative_config == SpeculativeConfig(num_speculative_tokens=3)
    assert engine_config(build_parser().parse_args([command])).speculative_config is None


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ('{"method": "ngram"', "not valid JSON"),
        ('["ngram"]', "must be a dict"),
        ('{"method": "eagle"}', "method must be one of ngram, suffix, draft_model, got 'eagle'"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be a positive integer"),
        ('{"num_speculative_tokens": 4, "lookahead": 2}', "unknown fields: lookahead"),
        ('{"method": "draft_model"}', "model is given with method 'draft_model' only"),
    ],
)
def test_a_bad_config_is_a_usage_error(value: str, problem: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--speculative-config", value, "hello"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "tandem generate: error: argument --speculative-config:" in err and problem in err
    assert "Traceback" not in err


def test_serve_refuses_a_missing_draft_model_before_starting(capsys) -> None:
    flag = '{"method": "draft_model", "model": "/nonexistent-draft"}'
    assert main(["serve", "--speculative-config", flag]) == 2
    err = capsys.readouterr().err
    assert "tandem serve: error: speculative_config.model:" in err
    assert "'/nonexistent-draft' does not exist" in err


def test_llm_takes_speculative_config(tiny_llama: Path) -> None:
    """Needs the engine's speculative decoding: greedy tokens as without it."""
    options = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 64, "cpu_threads": 1}
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = LLM(str(tiny_llama), **options)
    expected = plain.generate([REPEATING], params, use_tqdm=False)[0].token_ids
    plain.close()
    llm = LLM(str(tiny_llama), speculative_config={"num_speculative_tokens": 3}, **options)
    try:
        assert llm.engine.config.speculative_config == SpeculativeConfig(num_speculative_tokens=3)
        assert llm.engine.speculative_config == SpeculativeConfig(num_speculative_tokens=3)
        assert llm.generate([REPEATING], params, use_tqdm=False)[0].token_ids == expected
    finally:
        llm.close()


# ------------------------------------------------------------------ /metrics
def _spec_figures(url: str, method: str = "") -> dict[str, float]:
    """Engine 0's figures, labelled with its drafting method ("": none)."""
    samples = metric_samples(url)
    labels = (("engine", "0"), ("method", method))
    return {name: samples[(name, labels)] for name in COUNTERS + GAUGES}


def test_a_server_without_speculation_reports_zeros(live: LiveServer, model: str) -> None:
    out = live.client().completions.create(
        model=model, prompt=REPEATING, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 8
    wait_until(lambda: live.stats.num_running == 0, 10, "an idle engine")
    text = httpx.get(f"{live.url}/metrics").text
    for name in COUNTERS:
        assert f"# TYPE {name} counter" in text
    assert "# TYPE tandem_spec_decode_acceptance_rate gauge" in text
    assert _spec_figures(live.url) == dict.fromkeys(COUNTERS + GAUGES, 0.0)


@pytest.fixture(scope="module")
def speculating(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """`tandem serve --speculative-config CONFIG`, one server per config, started together (the
    starts overlap); each test waits for its own."""
    logs = tmp_path_factory.mktemp("speculating")
    servers: dict[str, Served] = {}
    try:
        for i, config in enumerate(CONFIGS):
            flags = ("--speculative-config", config, *ONE_THREAD)
            servers[config] = spawn(tiny_llama, logs / f"serve-{i}.log", *flags)
        yield servers
    finally:
        for server in servers.values():
            clean_up(server)


@pytest.mark.parametrize("config", CONFIGS)
def test_speculating_server_counts_drafts(config: str, speculating: dict) -> None:
    """`tandem serve --speculative-config`: the flag reaches the core, and a prompt that repeats
    itself gets drafts, counted under the method's label and in the response's usage. Needs
    the engine's speculative decoding."""
    method = SpeculativeConfig.of(config).method
    server = speculating[config]
    wait_healthy(server)
    assert _spec_figures(server.url, method) == dict.fromkeys(COUNTERS + GAUGES, 0.0)
    with server.client() as client:
        out = client.completions.create(
            model=server.model, prompt=REPEATING, max_tokens=24, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
    assert out.usage.completion_tokens == 24
    drafted_tokens = COUNTERS[1]
    counted = every(0.2, lambda: _spec_figures(server.url, method)[drafted_tokens] > 0)
    wait_until(counted, 10, "drafts counted")
    figures = _spec_figures(server.url, method)
    drafts, drafted, accepted = (figures[name] for name in COUNTERS)
    assert drafted > 0 and 0 <= accepted <= drafted
    assert 0 < drafts <= drafted
    assert figures["tandem_spec_decode_acceptance_rate"] == pytest.approx(accepted / drafted)
    mean_length = figures["tandem_spec_decode_mean_accepted_length"]
    assert mean_length == pytest.approx(1 + accepted / drafts)
    # The one request's own figures, as the engine counted them.
    own = out.usage.model_extra["speculative_decoding"]
    assert (own["draft_tokens"], own["accepted_tokens"]) == (drafted, accepted)
    assert own["verifications"] == drafts
    assert own["mean_accepted_length"] == pytest.approx(mean_length, abs=1e-3)
