"""Ranks started by a launcher meet loud and fast (`execution/rendezvous.py`): a rank that never
comes is named after a bounded wait, a rank that cannot reach rank 0 says where it looked, ranks
started with other settings all stop with the difference field by field, and each rank logs the
address and interface it uses. (tests/test_launcher.py meets under torchrun, as two nodes.)"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tandem.config import EngineConfig
from tandem.execution.rendezvous import (
    RendezvousError,
    interface_of,
    meet,
    model_digest,
    settings_diff,
    settings_of,
)

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def launcher_env(monkeypatch) -> int:
    port = free_port()
    monkeypatch.setenv("TANDEM_RENDEZVOUS_TIMEOUT", "1.5")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # restored after the test whatever meet sets
    monkeypatch.delenv("TANDEM_HOST_IP", raising=False)
    return port


def test_a_rank_that_never_comes_is_named_after_the_timeout(launcher_env, caplog) -> None:
    caplog.set_level(logging.INFO, logger="tandem")
    began = time.monotonic()
    with pytest.raises(RendezvousError) as raised:
        meet(0, 3, "gloo", {"dtype": "'float32'"}, "127.0.0.1", launcher_env)
    assert 1.5 <= time.monotonic() - began < 10  # bounded: the timeout, not a hang
    message = str(raised.value)
    assert f"ranks 1, 2 of 3 did not join at 127.0.0.1:{launcher_env} within 1.5 s" in message
    assert "joined: 0 (127.0.0.1)" in message and "TANDEM_RENDEZVOUS_TIMEOUT" in message
    assert f"rank 0 of 3 on {socket.gethostname()}: address 127.0.0.1, interface lo" in caplog.text


def test_a_rank_that_cannot_reach_rank_0_says_where_it_looked(launcher_env) -> None:
    with pytest.raises(RendezvousError, match=f"rank 1 could not reach node 0 at 127.0.0.1:{launcher_env} within 1.5 s: is node 0 running"):  # fmt: skip
        meet(1, 2, "gloo", {}, "127.0.0.1", launcher_env)


def test_ranks_with_other_settings_stop_alike_with_the_difference(launcher_env) -> None:
    ours = {"tandem": "1", "block_size": "16", "dtype": "'float32'"}
    theirs = {"tandem": "1", "block_size": "32", "dtype": "'float32'", "extra": "1"}
    errors: dict[int, BaseException] = {}

    def rank(r: int, settings: dict[str, str]) -> None:
        try:
            meet(r, 2, "gloo", settings, "127.0.0.1", launcher_env)
        except RendezvousError as exc:
            errors[r] = exc

    threads = [threading.Thread(target=rank, args=(r, s)) for r, s in ((0, ours), (1, theirs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(errors) == [0, 1]  # both ranks stop, each with the same account
    for exc in errors.values():
        text = str(exc)
        assert "rank 1 on" in text and "runs with other settings than rank 0" in text
        assert "block_size: 16 != 32" in text and "extra: (unset) != 1" in text
        assert "dtype" not in text and "tandem:" not in text  # only what differs


def test_an_address_that_does_not_resolve_is_named(launcher_env, monkeypatch) -> None:
    with pytest.raises(
        RendezvousError, match="the rendezvous address 'no-such-host.invalid' cannot be reached"
    ):
        meet(1, 2, "gloo", {}, "no-such-host.invalid", launcher_env)


def test_a_wrong_timeout_setting_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_RENDEZVOUS_TIMEOUT", "soon")
    with pytest.raises(
        ValueError, match="TANDEM_RENDEZVOUS_TIMEOUT must be seconds > 0, got 'soon'"
    ):
        meet(0, 2, "gloo", {}, "127.0.0.1", 1)


def test_the_settings_compared_leave_out_what_may_differ_by_node(tiny_llama, tmp_path) -> None:
    config = EngineConfig(tensor_parallel_size=2, block_size=16)
    base = settings_of(config, tiny_llama)
    assert base["block_size"] == "16" and base["tensor_parallel_size"] == "2"
    assert base["model"].startswith(f"{tiny_llama.name} (") and "torch" in base
    per_node = replace(config, cpu_threads=3, kv_cache_memory_gib=2.0, model="/elsewhere")
    assert settings_of(per_node, tiny_llama) == base
    assert settings_diff(base, settings_of(replace(config, dtype="bfloat16"), tiny_llama)) == [
        "dtype: 'auto' != 'bfloat16'"
    ]
    copy = tmp_path / "copy"  # the same checkpoint in another folder is the same model
    copy.mkdir()
    (copy / "config.json").write_bytes((tiny_llama / "config.json").read_bytes())
    assert model_digest(copy) == model_digest(tiny_llama)
    (copy / "config.json").write_text("{}")
    assert model_digest(copy) != model_digest(tiny_llama)
    assert interface_of("127.0.0.1") == "lo" and interface_of("192.0.2.1") is None
