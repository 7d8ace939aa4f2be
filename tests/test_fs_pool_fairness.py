"""``--max-fs-ops-per-session``: one connection cannot occupy every fs thread.

Real threads, fake time (as ``test_fs_safety_units.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import pytest_twisted
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from execserver import fs
from execserver.errors import RpcError
from execserver.service import Options
from tests.support.harness import reactor, with_timeout


@pytest.fixture
def pool() -> Iterator[tuple[fs.PoolRunner, Clock, threading.Event]]:
    clock = Clock()
    runner = fs.PoolRunner(reactor, threads=4, wait_timeout=5.0, clock=clock, per_owner=2)
    release = threading.Event()
    try:
        yield runner, clock, release
    finally:
        release.set()
        runner.stop()


@pytest_twisted.ensureDeferred
async def test_one_owner_runs_at_most_per_owner_jobs_and_others_are_served(
    pool: tuple[fs.PoolRunner, Clock, threading.Event],
) -> None:
    runner, clock, release = pool

    def block() -> str:
        assert release.wait(30)
        return "slow"

    slow = [runner(block, owner="attacker") for _ in range(50)]
    # Two threads are left free although the attacker has 48 more waiting.
    assert (runner.running, runner.queued) == (2, 48)
    for n in range(10):
        got = await with_timeout(runner(lambda n=n: n, owner="victim"), 10, "the victim's op")
        assert got == n
    # The attacker's waiting operations time out with the cause named.
    clock.advance(5.0)
    failures: list[Failure] = []
    for d in slow[2:]:
        d.addErrback(failures.append)
    assert len(failures) == 48
    error = failures[0].value
    assert isinstance(error, RpcError)
    assert error.data == {"kind": "busy"}
    assert error.message == (
        "filesystem busy: no worker thread became free within 5000 ms (this connection "
        "already runs 2 fs operations, the limit set by --max-fs-ops-per-session; "
        "--fs-wait-timeout-ms); retry later"
    )
    release.set()
    assert [await with_timeout(d, 10, "the running jobs") for d in slow[:2]] == ["slow"] * 2


@pytest_twisted.ensureDeferred
async def test_an_owners_queued_job_starts_when_its_own_job_ends(
    pool: tuple[fs.PoolRunner, Clock, threading.Event],
) -> None:
    runner, _clock, release = pool
    gates = [threading.Event() for _ in range(2)]
    first: list[Deferred[Any]] = [
        runner(lambda gate=gate: gate.wait(30), owner="a") for gate in gates
    ]
    third = runner(lambda: "third", owner="a")
    assert (runner.running, runner.queued) == (2, 1)
    gates[0].set()
    assert await with_timeout(first[0], 10, "a's first") is True
    assert await with_timeout(third, 10, "a's queued job") == "third"
    gates[1].set()
    assert await with_timeout(first[1], 10, "a's second") is True
    assert (runner.running, runner.queued) == (0, 0)
    release.set()


def test_flag() -> None:
    options = Options()
    options.parseOptions(["--max-fs-ops-per-session", "3"])
    assert options.config().max_fs_ops_per_session == 3
