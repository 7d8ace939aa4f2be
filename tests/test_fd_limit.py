"""Descriptors never run out before the process limit (issue 15, item 6).

The real server runs with a low soft *and* hard ``RLIMIT_NOFILE`` (256, set
in the child before it execs the server). It starts processes until it
refuses: every refusal is the documented ``-32600``, the number started is
the documented derived limit, the server logs no traceback, and it keeps
serving (fs calls meanwhile, a start after some processes ended).
Unit tests cover the derivation and the EMFILE fallback over fakes.
"""

from __future__ import annotations

import errno
import sys
from typing import Any

import pytest

from execserver import fdlimit
from execserver.config import ServerConfig
from execserver.spawn import SpawnError
from tests.support.fakes import FakeSpawner, Harness, exec_params
from tests.support.harness import console_script
from tests.support.raw_server import RawServer

HARD_LIMIT = 256

_LIMITED = (
    "import os, resource, sys; "
    f"resource.setrlimit(resource.RLIMIT_NOFILE, ({HARD_LIMIT}, {HARD_LIMIT})); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def _limited_server(*args: str) -> RawServer:
    command = [sys.executable, "-c", _LIMITED, console_script("exec-server"), *args]
    return RawServer(command=command)


def _answer(server: RawServer, request_id: int, timeout: float = 30.0) -> dict[str, Any]:
    """The response to ``request_id``; notifications read meanwhile are dropped."""
    while True:
        message = server.read_message(timeout)
        if message.get("id") == request_id:
            return message


def _start(server: RawServer, process_id: str) -> dict[str, Any]:
    params = exec_params(process_id, argv=["sleep", "1000"], pipeStdin=True)
    return _answer(server, server.request("process/start", params))


# --- the derivation -----------------------------------------------------------------------


def test_process_limit_keeps_a_reserve_and_three_descriptors_per_process() -> None:
    assert fdlimit.process_limit(256) == (256 - 64) // 3 == 64
    assert fdlimit.process_limit(1024) == (1024 - 64) // 3 == 320
    assert fdlimit.process_limit(65536) == (65536 - 4096) // 3
    assert fdlimit.process_limit(10) == 0


# --- over fakes -----------------------------------------------------------------------------


def test_starts_beyond_the_derived_limit_are_refused_with_the_limit_error() -> None:
    h = Harness(config=ServerConfig(max_processes=100))
    h.session._process_limit = lambda: 2
    h.handshake()
    h.start("a")
    h.start("b")
    error = h.error("process/start", exec_params("c"))
    assert error["code"] == -32600
    assert error["message"].startswith(
        "too many running processes: the server already runs 2, the limit derived "
        "from its open-file limit ("
    )
    assert error["message"].endswith(" descriptors) is 2")
    # A closed process gives its descriptors back.
    h.process("a").exit(0)
    assert h.result("process/start", exec_params("c")) == {"processId": "c"}


def test_the_limit_counts_processes_of_every_session() -> None:
    h = Harness(config=ServerConfig(max_processes=100))
    h.handshake()
    other = Harness(spawner=h.spawner)
    other.dispatcher = h.dispatcher
    other.conn = h.dispatcher.connect(other.outbound, "other")
    for session in (h.session, other.session):
        session._process_limit = lambda: 1
    other.handshake()
    h.start("a")
    error = other.error("process/start", exec_params("b"))
    assert error["code"] == -32600
    assert "the server already runs 1" in error["message"]


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE])
@pytest.mark.parametrize("raised", ["oserror", "spawnerror"])
def test_running_out_of_descriptors_in_a_spawn_is_a_precise_error(code: int, raised: str) -> None:
    spawner = FakeSpawner()
    h = Harness(spawner=spawner)
    h.handshake()
    failure: BaseException = (
        OSError(code, "Too many open files")
        if raised == "oserror"
        else SpawnError("spawnFailed", code, "cannot start")
    )

    def fail(proto: Any, spec: Any) -> Any:
        raise failure

    spawner.spawn = fail  # type: ignore[method-assign]
    error = h.error("process/start", exec_params("p"))
    assert error["code"] == -32600
    assert error["message"].startswith(
        "too many open files: the server cannot start process p now ("
    )
    assert error["data"] == {"kind": "tooManyOpenFiles", "errno": code}
    assert h.dispatcher.stats.processes_open == 0
    assert "p" not in h.session.processes


# --- the real server ------------------------------------------------------------------------


def test_a_server_with_256_descriptors_refuses_starts_with_the_limit_error() -> None:
    server = _limited_server("--max-processes", "100000")
    server.handshake()
    limit = fdlimit.process_limit(HARD_LIMIT)
    started: list[str] = []
    refusals: list[dict[str, Any]] = []
    for i in range(limit + 20):
        answer = _start(server, f"p{i}")
        if "error" in answer:
            refusals.append(answer["error"])
        else:
            started.append(f"p{i}")
    assert len(started) == limit
    expected = (
        f"too many running processes: the server already runs {limit}, the limit derived "
        f"from its open-file limit ({HARD_LIMIT} descriptors) is {limit}"
    )
    assert refusals == [{"code": -32600, "message": expected}] * 20

    # The reserve keeps the rest of the server working at the limit.
    meta = _answer(server, server.request("fs/getMetadata", {"path": "/"}))
    assert meta["result"]["isDirectory"] is True

    # Processes that end give their descriptors back.
    for process_id in started[:3]:
        server.request("process/terminate", {"processId": process_id, "graceMs": 0})
    closed: set[str] = set()
    while len(closed) < 3:
        message = server.read_message(30.0)
        if message.get("method") == "process/closed":
            closed.add(message["params"]["processId"])
    assert closed == set(started[:3])
    assert _start(server, "again") == {"id": server._next_id - 1, "result": {"processId": "again"}}
    server.stop()
    log = server.stderr_text()
    assert f"open-file limit {HARD_LIMIT} descriptors: at most {limit} processes" in log


def test_metrics_report_descriptors_and_the_process_limit() -> None:
    from execserver import metrics

    h = Harness()
    h.handshake()
    h.start("a")
    samples = {
        line.split()[0]: float(line.split()[1])
        for line in metrics.render(h.dispatcher).decode().splitlines()
        if line and not line.startswith("#")
    }
    assert samples["exec_server_processes_open"] == 1
    assert samples["exec_server_max_fds"] == fdlimit.soft_limit()
    assert samples["exec_server_process_limit"] == fdlimit.process_limit()
    assert 3 <= samples["exec_server_open_fds"] <= fdlimit.soft_limit()
    assert samples["exec_server_websocket_partial_message_bytes"] == 0
    h.process("a").exit(0)
    assert b"exec_server_processes_open 0\n" in metrics.render(h.dispatcher)
