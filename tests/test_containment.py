"""No process outlives its owner: escapees of every kind, through the real server.

Each kind of descendant leaves the leader's process group on purpose
(``setsid``, ``setpgid``, GNU ``timeout``, a double fork, a daemon). Each
runs ``sleep <marker>`` with a marker unique to the test, so its members are
found in ``/proc`` by their command line wherever they were reparented.
After each way a process can end (terminate, stdio EOF, WebSocket close,
wall timeout, server SIGTERM) none may be left, on both containment modes.
"""

from __future__ import annotations

import errno
import os
import re
import shlex
import shutil
import socket
import sys
from typing import Any

import pytest
import pytest_twisted

from tests.support.escapees import (
    CGROUP2,
    GRACE_MS,
    MODES,
    OWN_CGROUP_DIR,
    assert_gone,
    live,
    needs_cgroup,
    new_marker,
    server_args,
)
from tests.support.harness import DEFAULT_TIMEOUT, child_env, console_script, run_script
from tests.support.polling import until, until_blocking
from tests.support.raw_server import RawServer
from tests.support.stdio_server import ServerProcess
from tests.support.ws_harness import WsServerProcess, connect

needs_mount_namespace = pytest.mark.skipif(
    CGROUP2 is None or os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root, unshare and a cgroup v2 mount to hide",
)

PY = sys.executable

# Each escapes the process group of the leader it was started from; the
# leader then waits (or, for the daemon, exits at once: its process is closed
# while the daemon lives on).
SETPGID = "import os, sys; os.setpgid(0, 0); os.execvp('sleep', ['sleep', sys.argv[1]])"
DOUBLE_FORK = """
import os, sys
if os.fork() == 0:
    if os.fork() == 0:
        os.setpgid(0, 0)
        os.execvp('sleep', ['sleep', sys.argv[1]])
    os._exit(0)
os.wait()
os.execvp('sleep', ['sleep', sys.argv[1]])
"""
DAEMON = """
import os, sys
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.chdir('/')
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(3, 1024)
        os.execvp('sleep', ['sleep', sys.argv[1]])
    os._exit(0)
# Wait for the intermediate child (it has left the session by then): on a
# PTY the leader's exit hangs the terminal up, and a child still in its
# session would die of that SIGHUP before it could daemonise.
os.wait()
os._exit(0)
"""


def escape_argv(kind: str, marker: str) -> list[str]:
    if kind == "setsid":
        return ["sh", "-c", f"setsid sleep {marker} & wait"]
    if kind == "setpgid":
        return ["sh", "-c", f'{PY} -c "{SETPGID}" {marker} & wait']
    if kind == "timeout":
        return ["sh", "-c", f"timeout 1000 sleep {marker}; echo done"]
    if kind == "double-fork":
        return [PY, "-c", DOUBLE_FORK, marker]
    if kind == "daemon":
        return [PY, "-c", DAEMON, marker]
    raise AssertionError(kind)


KINDS = ["setsid", "setpgid", "timeout", "double-fork", "daemon"]
#: How many live processes carry the marker once each kind has started
#: (double fork: the leader and the grandchild both end up as sleeps).
EXPECTED = {"setsid": 1, "setpgid": 1, "timeout": 2, "double-fork": 2, "daemon": 1}


async def wait_started(markers: dict[str, str]) -> None:
    for kind, marker in markers.items():
        await until(
            lambda k=kind, m=marker: len(live(m)) >= EXPECTED[k],
            f"the {kind} escapee to start",
            timeout=DEFAULT_TIMEOUT,
        )


async def start_all(client: Any, markers: dict[str, str], **extra: Any) -> None:
    """Start every marked escapee and wait until each has spawned its escapees."""
    for kind, marker in markers.items():
        await client.start_process(kind, escape_argv(kind, marker), **extra)
    await wait_started(markers)


def check_mode_logged(server: Any, mode: str) -> None:
    assert f"process containment: {mode}".encode() in server.stderr_bytes()


# --- the matrix -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest_twisted.ensureDeferred
async def test_terminate_reaches_every_escapee(mode: str) -> None:
    server = ServerProcess.start(*server_args(mode))
    try:
        await server.handshake()
        # One at a time: the fallback attributes an orphan whose lineage it
        # never saw only when a single tree can own it (documented).
        for kind in KINDS:
            markers = {kind: new_marker()}
            await start_all(server, markers)
            # ``descendants``: a leader that already exited (the daemon's
            # exits at once) leaves its background jobs to the session
            # unless they are asked for (process-control.md, "Background
            # descendants"); without it, whether they die here would race
            # the leader's exit.
            result = await server.call(
                "process/terminate", {"processId": kind, "descendants": True}
            )
            if kind != "daemon":  # its leader exits at once; its tree runs on
                assert result == {"running": True}
            await server.wait_closed(kind)
            await assert_gone(markers, server.pid)
        check_mode_logged(server, mode)
    finally:
        await server.stop()


@pytest.mark.parametrize("mode", MODES)
@pytest_twisted.ensureDeferred
async def test_terminate_reaches_escapees_of_a_pty_process(mode: str) -> None:
    server = ServerProcess.start(*server_args(mode))
    try:
        await server.handshake()
        for kind in ("setsid", "daemon"):
            markers = {kind: new_marker()}
            await start_all(server, markers, tty=True)
            await server.call("process/terminate", {"processId": kind, "descendants": True})
            await server.wait_closed(kind)
            await assert_gone(markers, server.pid)
    finally:
        await server.stop()


@pytest.mark.parametrize("mode", MODES)
@pytest_twisted.ensureDeferred
async def test_stdio_eof_reaches_every_escapee(mode: str) -> None:
    markers = {kind: new_marker() for kind in KINDS}
    server = ServerProcess.start(*server_args(mode))
    try:
        await server.handshake()
        await start_all(server, markers)
    finally:
        code = await server.stop()
    assert code == 0
    await assert_gone(markers)


@pytest.mark.parametrize("mode", MODES)
@pytest_twisted.ensureDeferred
async def test_websocket_close_reaches_every_escapee(mode: str) -> None:
    markers = {kind: new_marker() for kind in KINDS}
    server = await WsServerProcess.start(*server_args(mode))
    try:
        client = await connect(server.url)
        await client.handshake()
        await start_all(client, markers)
        await client.close()
        # The server lives on: the session's end alone must clean up.
        await assert_gone(markers, server.pid)
        check_mode_logged(server, mode)
    finally:
        await server.stop()


@pytest.mark.parametrize("mode", MODES)
@pytest_twisted.ensureDeferred
async def test_wall_timeout_reaches_every_escapee(mode: str) -> None:
    markers = {kind: new_marker() for kind in KINDS}
    server = ServerProcess.start(*server_args(mode))
    try:
        await server.handshake()
        await start_all(server, markers, timeoutMs=1500)
        for kind in KINDS:
            await server.wait_closed(kind)
        await assert_gone(markers, server.pid)
    finally:
        await server.stop()


@pytest.mark.parametrize("mode", MODES)
@pytest_twisted.ensureDeferred
async def test_server_sigterm_reaches_every_escapee(mode: str) -> None:
    markers = {kind: new_marker() for kind in KINDS}
    server = ServerProcess.start(*server_args(mode))
    try:
        await server.handshake()
        await start_all(server, markers)
        server.kill("TERM")
        await server.stop()
    finally:
        await server.stop()
    await assert_gone(markers)


# --- choosing the mode; a crashed server --------------------------------------------------


def without_cgroup2(*args: str) -> list[str]:
    """exec-server ARGS in a mount namespace where cgroup v2 is not mounted."""
    script = console_script("exec-server")
    quoted = " ".join(shlex.quote(a) for a in (script, *args))
    return ["unshare", "--mount", "sh", "-c", f"umount -l {CGROUP2} && exec {quoted}"]


@needs_mount_namespace
def test_auto_falls_back_to_the_subreaper_and_warns() -> None:
    marker = new_marker()
    server = RawServer(command=without_cgroup2("--terminate-grace-ms", str(GRACE_MS)))
    try:
        server.handshake()
        server.call(
            "process/start",
            {
                "processId": "p",
                "argv": escape_argv("setsid", marker),
                "cwd": "/",
                "env": child_env(),
                "tty": False,
            },
        )
        until_blocking(lambda: live(marker), "the escapee to start", timeout=DEFAULT_TIMEOUT)
        server.call("process/terminate", {"processId": "p"})
        until_blocking(lambda: not live(marker), "the escapee to die of the terminate", timeout=10)
    finally:
        assert server.stop() == 0
    assert (
        "[execserver.containment#warn] process containment: subreaper "
        "(no usable cgroup v2: no cgroup v2 hierarchy is mounted)"
    ) in server.stderr_text()


@needs_mount_namespace
def test_cgroup_mode_refuses_to_start_without_cgroup_v2() -> None:
    server = RawServer(command=without_cgroup2("--process-containment", "cgroup"))
    server.expect_exit(1)
    assert server.proc.wait(DEFAULT_TIMEOUT) == 1
    assert server.stderr_text().strip() == (
        "exec-server: cannot start: cgroup containment is unavailable: "
        "no cgroup v2 hierarchy is mounted"
    )


@needs_cgroup
@pytest_twisted.ensureDeferred
async def test_a_restarted_server_kills_what_a_crashed_one_left_in_its_cgroups() -> None:
    markers = {"timeout": new_marker(), "daemon": new_marker()}
    crashed = ServerProcess.start(*server_args("cgroup"))
    await crashed.handshake()
    await start_all(crashed, markers)
    crashed.kill("KILL")
    await crashed.stop()
    # SIGKILL gives the server no chance: its processes live on in its
    # cgroups until a server starts in the same cgroup. (On a shared host
    # any server started meanwhile, e.g. by a parallel test run, may be the
    # one that cleans up, so neither the survivors nor the log line are
    # asserted here: only that nothing is left once ours has started.)
    leftover = [
        name
        for name in os.listdir(own_cgroup_dir())
        if name.startswith(f"exec-server-{crashed.pid}-ns")
    ]
    server = ServerProcess.start(*server_args("cgroup"))
    try:
        await server.handshake()
        await assert_gone(markers)
        for name in leftover:
            assert not os.path.exists(os.path.join(own_cgroup_dir(), name))
    finally:
        await server.stop()


@needs_cgroup
def test_a_server_that_cannot_listen_removes_its_cgroup() -> None:
    # Containment starts before the listeners: a listener that fails must not
    # leave the server's cgroup behind (until some later server cleans up).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_script(
            "exec-server",
            *server_args("cgroup"),
            "--listen",
            f"ws://127.0.0.1:{port}",
            text=True,
        )
    assert done.returncode == 1, done.stderr
    assert "exec-server: cannot start:" in done.stderr
    parent = re.search(r"process containment: cgroup \((/[^)]+)\)", done.stderr)
    assert parent is not None, done.stderr
    assert not os.path.exists(parent.group(1))


def own_cgroup_dir() -> str:
    assert OWN_CGROUP_DIR
    return OWN_CGROUP_DIR


@needs_cgroup
@pytest_twisted.ensureDeferred
async def test_a_process_that_cannot_get_a_cgroup_is_refused_not_started_uncontained() -> None:
    server = ServerProcess.start(*server_args("cgroup"))
    try:
        await server.handshake()
        (parent,) = [
            name
            for name in os.listdir(own_cgroup_dir())
            if name.startswith(f"exec-server-{server.pid}-ns")
        ]
        # One per-process cgroup at most under the server's.
        with open(os.path.join(own_cgroup_dir(), parent, "cgroup.max.descendants"), "w") as f:
            f.write("1")
        await server.start_process("first", ["sleep", "300"])
        response = await server.request(
            "process/start",
            {
                "processId": "second",
                "argv": ["sleep", "300"],
                "cwd": "/",
                "env": child_env(),
                "tty": False,
                "arg0": None,
            },
        )
        assert response["error"]["code"] == -32603
        assert response["error"]["message"] == (
            "cannot create a cgroup for the process: Resource temporarily unavailable"
        )
        assert response["error"]["data"] == {"kind": "spawnFailed", "errno": errno.EAGAIN}
        listed = await server.call("process/list", {})
        assert [p["processId"] for p in listed["processes"]] == ["first"]
        await server.call("process/terminate", {"processId": "first"})
        await server.wait_closed("first")
    finally:
        await server.stop()
