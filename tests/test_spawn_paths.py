"""The two spawn paths: the fast path's guard (import check, startup probe) and the stock path.

The process-tree, flow-control and PTY integration tests run on both paths
in CI (``EXEC_SERVER_SPAWN_PATH=stock``, see ``.ci/run``); these tests cover
what decides between them.
"""

from __future__ import annotations

import base64
import json
import os
import select
import subprocess
import sys
import time
import types
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

from execserver import spawn
from execserver.spawn import PosixSpawner, ProcessSpec, overrides
from tests.support.harness import server_env

TIMEOUT = 20.0

# The child reports the ids the test checks, without a shell in between.
REPORT_IDS = "import os; print(os.getpid(), os.getpgid(0), os.getsid(0), os.getcwd())"


def test_the_private_hooks_of_this_twisted_are_as_relied_on() -> None:
    assert overrides.PROBLEM is None
    assert overrides.check_private_hooks() is None


def test_each_changed_hook_is_named() -> None:
    import twisted.internet.process as real

    fake = types.SimpleNamespace(**vars(real))

    class Base(real._BaseProcess):
        def _trySpawnInsteadOfFork(  # type: ignore[override]
            self, path: Any, executable: Any, kwargs: Any
        ) -> bool:
            return False

    fake._BaseProcess = Base
    del fake._getFileActions
    problem = overrides.check_private_hooks(fake)
    assert problem is not None
    assert "_trySpawnInsteadOfFork" in problem
    assert "_getFileActions" in problem
    assert "fdmap" not in problem


class Collect(ProcessProtocol):
    def __init__(self) -> None:
        self.output = b""
        self.ended: Deferred[None] = Deferred()

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        self.output += data

    def processEnded(self, reason: Failure) -> None:
        self.ended.callback(None)


@pytest.mark.parametrize("path", spawn.SPAWN_PATHS)
@pytest.mark.parametrize("tty", [False, True])
@pytest_twisted.ensureDeferred
async def test_each_path_starts_a_session_leader_in_cwd_with_arg0(
    path: spawn.SpawnPath, tty: bool, tmp_path: Any
) -> None:
    spawner = PosixSpawner(reactor, requested=path)
    assert spawner.path == path
    code = REPORT_IDS + "; import sys; print(sys.argv[0])"
    spec = ProcessSpec(
        argv=(sys.executable, "-c", code),
        cwd=str(tmp_path),
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        tty=tty,
        arg0="renamed",
    )
    proto = Collect()
    transport = spawner.spawn(proto, spec)
    pid = transport.pid
    await proto.ended.addTimeout(TIMEOUT, reactor)
    lines = proto.output.replace(b"\r\n", b"\n").decode().split("\n")
    child, group, session, cwd = lines[0].split()
    assert (int(child), int(group), int(session)) == (pid, pid, pid)
    assert cwd == str(tmp_path)
    assert lines[1] == "-c"  # python's argv[0] for -c; the process was started as "renamed"


def test_a_failing_probe_falls_back_to_the_stock_path_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    answers = iter([False, True])
    monkeypatch.setattr(spawn, "leads_own_group", lambda pid: next(answers))
    warnings: list[str] = []
    monkeypatch.setattr(spawn.log, "warn", lambda fmt, **kw: warnings.append(fmt.format(**kw)))
    spawner = PosixSpawner(reactor)
    spawner.check()
    assert spawner.path == "stock"
    assert len(warnings) == 1
    assert "does not lead its own session and process group" in warnings[0]
    assert "using the stock path" in warnings[0]


def test_no_working_path_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spawn, "leads_own_group", lambda pid: False)
    monkeypatch.setattr(spawn.log, "warn", lambda fmt, **kw: None)
    spawner = PosixSpawner(reactor)
    with pytest.raises(spawn.SpawnPathError, match="stock spawn path does not work"):
        spawner.check()


# --- a server whose Twisted lost a private hook -------------------------------------

# A Twisted release that renamed the hook the fast path overrides: ``_fork``
# calls ``_trySpawn`` instead, so an override of the old name would never run
# and every child would share the server's process group.
BROKEN_SERVER = """
import inspect, sys, textwrap
import twisted.internet.process as process
for cls in (process._BaseProcess, process.Process):
    cls._trySpawn = cls.__dict__["_trySpawnInsteadOfFork"]
    delattr(cls, "_trySpawnInsteadOfFork")
source = textwrap.dedent(inspect.getsource(process._BaseProcess._fork))
exec(source.replace("_trySpawnInsteadOfFork", "_trySpawn"), vars(process))
process._BaseProcess._fork = process._fork
from execserver.cli import main
main(sys.argv[1:])
"""


class Lines:
    """Lines from a descriptor, every wait bounded."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.data = b""

    def next(self) -> bytes:
        deadline = time.monotonic() + TIMEOUT
        while b"\n" not in self.data:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no line within {TIMEOUT}s; so far {self.data!r}"
            ready, _, _ = select.select([self.fd], [], [], remaining)
            if ready:
                chunk = os.read(self.fd, 65536)
                assert chunk, f"end of output; so far {self.data!r}"
                self.data += chunk
        line, self.data = self.data.split(b"\n", 1)
        return line


def test_a_missing_private_hook_gives_one_warning_and_a_working_stock_path(tmp_path: Any) -> None:
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            BROKEN_SERVER,
            "--listen",
            "stdio://",
            "--process-containment",
            "none",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=server_env({"EXEC_SERVER_SPAWN_PATH": "fast"}),
    )
    assert server.stdin is not None and server.stdout is not None
    try:
        replies = Lines(server.stdout.fileno())

        def send(message: dict[str, Any]) -> None:
            assert server.stdin is not None
            server.stdin.write(json.dumps(message).encode() + b"\n")
            server.stdin.flush()

        send({"id": 1, "method": "initialize", "params": {"clientName": "test"}})
        assert "result" in json.loads(replies.next())
        send({"method": "initialized"})
        send(
            {
                "id": 2,
                "method": "process/start",
                "params": {
                    "processId": "p",
                    "argv": [sys.executable, "-c", REPORT_IDS],
                    "cwd": str(tmp_path),
                    "env": {},
                    "tty": False,
                },
            }
        )
        output = b""
        exited = None
        while exited is None:
            message = json.loads(replies.next())
            if message.get("method") == "process/output":
                output += base64.b64decode(message["params"]["chunk"])
            elif message.get("method") == "process/exited":
                exited = message["params"]
            else:
                assert message.get("result") == {"processId": "p"}, message
        assert exited["exitCode"] == 0
        child, group, session, cwd = output.decode().split()
        assert child == group == session
        assert cwd == str(tmp_path)
    finally:
        server.stdin.close()
        server.wait(TIMEOUT)
    stderr = server.stderr.read().decode() if server.stderr else ""
    warnings = [line for line in stderr.splitlines() if "private process hooks changed" in line]
    assert len(warnings) == 1, stderr
    assert "_trySpawnInsteadOfFork" in warnings[0]
    assert "using the stock path" in warnings[0]


@pytest.mark.parametrize("path", spawn.SPAWN_PATHS)
def test_each_path_reports_the_same_errors_before_any_process_exists(
    path: spawn.SpawnPath, tmp_path: Any
) -> None:
    spawner = PosixSpawner(reactor, requested=path)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    not_a_program = tmp_path / "data"
    not_a_program.write_bytes(b"echo this is no executable format\n")
    not_a_program.chmod(0o755)
    cases = [
        (
            ProcessSpec(argv=(str(not_a_program),), cwd="/", env=env, tty=False),
            "spawnExecFormatError",
        ),
        (
            ProcessSpec(argv=("true",), cwd=str(tmp_path / "gone"), env=env, tty=False),
            "cwdNotFound",
        ),
        (ProcessSpec(argv=("no-such-program-here",), cwd="/", env=env, tty=False), "spawnNotFound"),
        (
            ProcessSpec(argv=("true", "x" * (1 << 17)) * 40, cwd="/", env=env, tty=False),
            "spawnArgumentListTooLong",
        ),
    ]
    for spec, kind in cases:
        with pytest.raises(spawn.SpawnError) as caught:
            spawner.spawn(Collect(), spec)
        assert caught.value.kind == kind, (spec.argv[0], caught.value)
