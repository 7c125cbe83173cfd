"""Tensor-parallel engines in the tests: their ranks forked from a fork server.

Spawned, each rank of each engine is a fresh interpreter that imports torch and transformers
(seconds of CPU per rank, for every one of the suite's tensor-parallel engines). Forked from a
server process that has imported the engine once, a rank starts in a fraction of a second and
runs the same code. A test that inspects how ranks are spawned sets "spawn" back itself.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tandem.execution import executor


@pytest.fixture(scope="module", autouse=True)
def ranks_from_a_fork_server() -> Iterator[None]:
    """Every tensor-parallel engine the module starts forks its ranks from the fork server."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(executor, "START_METHOD", "forkserver")
        yield
