"""A confined command must not reach the server's own ``unix://`` listener.

Landlock cannot refuse ``connect()`` on a Unix socket: before the fix, a
Landlock-confined command with the network enabled connected to the
server's ``--listen unix://PATH``, did the handshake and started an
unconfined process (a full escape; the marker file below, outside every
writable root, was written). Under bubblewrap the socket's path is masked,
but a hard link to the socket elsewhere (made on the host) reached it the
same way. The listener now reads the peer's credentials on every accepted
connection and closes, before any HTTP or JSON-RPC, a connection whose
peer is a confined command of this server or any process of its tree.
Through the real installed server; each escape test failed before the fix.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import reactor

from execserver.client import connect_websocket
from tests.support.harness import DEFAULT_TIMEOUT, RpcTestClient, with_timeout
from tests.support.polling import until
from tests.support.sandbox import CHILD_PATH, Dirs, dirs, env_for, profile_for, uri
from tests.support.ws_harness import WsServerProcess, connect, get_request, http_get

__all__ = ["dirs"]

#: The attacker: connect to the socket, initialize, start an unconfined
#: command that writes MARKER, wait for its exit. One RESULT line says how
#: far it got. ``child``: the attempt runs in a child of the command;
#: ``grandchild``: in a grandchild of the command, in a new session, whose
#: parent has exited (an orphan).
ATTACK = r"""
import json, os, sys
from websockets.sync.client import unix_connect

sock, marker, how, report = sys.argv[1:5]

def attempt():
    try:
        ws = unix_connect(sock, uri="ws://localhost/", open_timeout=20, close_timeout=1)
    except Exception as exc:
        return f"REFUSED {type(exc).__name__}: {exc}"
    try:
        ws.send(json.dumps({"id": 1, "method": "initialize",
                            "params": {"clientName": "attacker"}}))
        json.loads(ws.recv(timeout=20))
        ws.send(json.dumps({"method": "initialized", "params": {}}))
        ws.send(json.dumps({"id": 2, "method": "process/start", "params": {
            "processId": "escape", "argv": ["sh", "-c", 'echo pwned > "$0"', marker],
            "cwd": "/", "env": {"PATH": "/usr/bin:/bin"}, "tty": False, "arg0": None}}))
        while True:
            msg = json.loads(ws.recv(timeout=20))
            if msg.get("id") == 2 and "error" in msg:
                return "START-REFUSED " + json.dumps(msg["error"])
            if msg.get("method") == "process/exited":
                return "STARTED"
    except Exception as exc:
        return f"DROPPED {type(exc).__name__}: {exc}"
    finally:
        ws.close()

if how == "leave-cgroup":
    # Root given the cgroup files tries to move itself to the hierarchy's
    # root (the cgroup file systems stay read-only to a confined command).
    mount = next(line.split()[1] for line in open("/proc/self/mounts")
                 if line.split()[2] == "cgroup2")
    try:
        with open(os.path.join(mount, "cgroup.procs"), "w") as f:
            f.write("0")
        left = "left"
    except OSError as exc:
        left = f"stayed ({exc.strerror})"
    cgroup = next(line for line in open("/proc/self/cgroup") if line.startswith("0::"))
    print("RESULT", f"{left} in {cgroup.strip()}:", attempt(), flush=True)
elif how == "child":
    # A child in the command's session, its parent waiting for it.
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(reader)
        os.write(writer, attempt().encode())
        os._exit(0)
    os.close(writer)
    said = b""
    while chunk := os.read(reader, 4096):
        said += chunk
    os.waitpid(child, 0)
    print("RESULT", said.decode(), flush=True)
elif how == "daemon":
    # A daemon left in the command's session, in a process group of its
    # own (as a shell's background job: the command's group empties, so
    # its record is finished); the command exits at once. It attacks once
    # the test opens the FIFO REPORT.go.
    go = report + ".go"
    os.mkfifo(go)
    if os.fork() == 0:
        os.setpgid(0, 0)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        with open(go) as f:
            f.read()
        said = attempt()
        with open(report + ".part", "w") as f:
            f.write(said)
        os.rename(report + ".part", report)
        os._exit(0)
    print("RESULT daemon left", flush=True)
elif how == "grandchild":
    reader, writer = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.close(reader)
            with open(report, "w") as f:
                f.write(attempt())
            os._exit(0)
        os._exit(0)
    os.close(writer)
    os.wait()
    # The grandchild closes its end when it exits: it has written its report.
    os.read(reader, 1)
    with open(report) as f:
        print("RESULT", f.read(), flush=True)
else:
    print("RESULT", attempt(), flush=True)
"""


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # Short (a socket path has at most 107 bytes) and outside every writable root.
    path = Path(tempfile.mkdtemp(prefix="es-sock-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def _control(server: WsServerProcess) -> Any:
    url = next(u for u in server.urls if u.startswith("ws://"))
    client = await connect(url)
    await client.call("initialize", {"clientName": "sandbox-listener"})
    client.notify("initialized", {})
    return client


async def _attack(
    client: RpcTestClient,
    dirs: Dirs,
    mechanism: str,
    sock: Path,
    *,
    how: str = "direct",
    sandbox: Any = "profile",
    network: str = "enabled",
) -> str:
    script = dirs.work / "attack.py"
    script.write_text(ATTACK)
    report = dirs.work / "report.txt"
    if sandbox == "profile":
        sandbox = profile_for(dirs, mechanism, network=network)
        if mechanism == "landlock":
            sandbox["useLegacyLandlock"] = True
    pid = f"attack-{how}-{network}"
    await client.start_process(
        pid,
        [sys.executable, "-I", str(script), str(sock), str(dirs.outside / "marker"), how,
         str(report)],
        cwd=uri(dirs.work),
        env=env_for(dirs, mechanism),
        sandbox=sandbox,
    )  # fmt: skip
    exited = await client.wait_notification("process/exited", pid, timeout=60)
    await client.wait_closed(pid, timeout=30)
    output = client.output_of(pid).decode(errors="replace")
    assert exited["exitCode"] == 0, output
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert lines, output
    return lines[-1][len("RESULT ") :]


async def _refused_counts(server: WsServerProcess) -> dict[str, int]:
    """``exec_server_sandbox_peer_refused_total`` by reason, from ``/metrics``."""
    status, _, body = await http_get(*server.host_port, get_request("/metrics"))
    assert status == 200, body
    found = re.findall(rb'exec_server_sandbox_peer_refused_total\{reason="(\w+)"\} (\d+)', body)
    return {reason.decode(): int(count) for reason, count in found}


async def _server(sock: Path, mechanism: str, *extra: str) -> WsServerProcess:
    return await WsServerProcess.start(
        "--listen", "ws://127.0.0.1:0", "--listen", f"unix://{sock}",
        "--sandbox-mechanism", "auto" if mechanism == "landlock" else mechanism, *extra,
        listeners=2,
    )  # fmt: skip


@asynccontextmanager
async def _controlled(
    sock: Path, mechanism: str, *extra: str
) -> AsyncIterator[tuple[WsServerProcess, Any]]:
    """A server on ``sock`` and a control client of it; both closed after (the server: exit 0)."""
    server = await _server(sock, mechanism, *extra)
    try:
        client = await _control(server)
        try:
            yield server, client
        finally:
            await client.close()
    finally:
        assert await server.stop() == 0


@pytest.mark.parametrize(
    ("containment", "how"),
    [
        ("cgroup", "direct"),
        ("cgroup", "grandchild"),
        ("subreaper", "direct"),
        ("subreaper", "grandchild"),
        ("none", "direct"),
        ("none", "child"),
        ("cgroup/stock", "grandchild"),
    ],
)
@pytest_twisted.ensureDeferred
async def test_a_landlock_confined_command_cannot_use_the_unix_listener(
    dirs: Dirs, sock_dir: Path, how: str, containment: str
) -> None:
    sock = sock_dir / "exec.sock"
    mode, _, spawn_path = containment.partition("/")
    server = await _server(
        sock, "landlock", "--process-containment", mode, "--spawn-path", spawn_path or "fast"
    )
    try:
        client = await _control(server)
        try:
            result = await _attack(client, dirs, "landlock", sock, how=how)
        finally:
            await client.close()
        # The one connection refused is counted (/metrics).
        counted = await _refused_counts(server)
    finally:
        assert await server.stop() == 0
    assert not (dirs.outside / "marker").exists(), result
    assert result.startswith(("REFUSED", "DROPPED")), result
    assert "refusing a connection on unix://" in server.stderr.decode(), server.stderr
    assert counted == {"confined": 1, "exited": 0}, counted


@pytest_twisted.ensureDeferred
async def test_without_containment_a_daemon_is_refused_once_its_record_is_gone(
    dirs: Dirs, sock_dir: Path
) -> None:
    # --process-containment none: the confined command leaves a daemon in
    # its session and exits; its record is dropped (exit retention); then
    # the daemon connects. Before the fix the leader was forgotten with the
    # record, and the daemon was admitted (once the record was collected).
    sock = sock_dir / "exec.sock"
    report = dirs.work / "report.txt"
    async with _controlled(
        sock, "landlock", "--process-containment", "none", "--exit-retention-ms", "1"
    ) as (_, client):
        left = await _attack(client, dirs, "landlock", sock, how="daemon")
        assert left == "daemon left", left

        async def dropped() -> bool:
            reply = await client.request("process/read", {"processId": "attack-daemon-enabled"})
            return "error" in reply

        await until(dropped, "the command's record dropped", timeout=30)

        def opened() -> bool:
            try:
                os.close(os.open(f"{report}.go", os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                return False  # ENXIO: the daemon has not opened it yet
            return True

        await until(opened, "the daemon told to attack", timeout=30)
        await until(report.exists, "the daemon's report", timeout=60)
    result = report.read_text()
    assert not (dirs.outside / "marker").exists(), result
    assert result.startswith(("REFUSED", "DROPPED")), result


@pytest_twisted.ensureDeferred
async def test_a_confined_command_that_left_its_cgroup_is_still_refused(
    dirs: Dirs, sock_dir: Path
) -> None:
    # Root (CI runs as root) whose profile makes the cgroup files writable
    # could leave its cgroup before the cgroup file systems were kept
    # read-only (then its lineage still led to a confined tree); now it
    # stays in its cgroup, and is refused.
    sock = sock_dir / "exec.sock"
    async with _controlled(sock, "landlock", "--process-containment", "cgroup") as (_, client):
        sandbox = profile_for(dirs, "landlock", network="enabled")
        sandbox["useLegacyLandlock"] = True
        sandbox["permissions"]["file_system"]["entries"].append(
            {"path": {"type": "path", "path": "/sys/fs/cgroup"}, "access": "write"}
        )
        result = await _attack(client, dirs, "landlock", sock, how="leave-cgroup",
                               sandbox=sandbox)  # fmt: skip
    assert not (dirs.outside / "marker").exists(), result
    assert result.startswith("stayed (Permission denied) in 0::"), result
    assert "/exec-server-" in result.split(": ", 1)[0], result
    assert result.split(": ", 1)[1].startswith(("REFUSED", "DROPPED")), result


@pytest_twisted.ensureDeferred
async def test_a_bwrap_confined_command_cannot_use_a_hard_link_to_the_socket(
    dirs: Dirs, sock_dir: Path
) -> None:
    # bwrap masks the socket's path with /dev/null; a hard link to the
    # same socket elsewhere (here: in the writable root) is not masked.
    sock = sock_dir / "exec.sock"
    async with _controlled(sock, "bwrap") as (_, client):
        link = dirs.work / "link.sock"
        os.link(sock, link)
        masked = await _attack(client, dirs, "bwrap", sock)
        linked = await _attack(client, dirs, "bwrap", link, how="direct-link")
    assert not (dirs.outside / "marker").exists(), (masked, linked)
    assert masked.startswith("REFUSED"), masked
    assert linked.startswith(("REFUSED", "DROPPED")), linked


@pytest_twisted.ensureDeferred
async def test_with_the_network_restricted_connect_itself_is_refused(
    dirs: Dirs, sock_dir: Path
) -> None:
    # The seccomp filter of a restricted network refuses connect() even on
    # a Unix socket (EPERM): the listener never sees the attempt.
    sock = sock_dir / "exec.sock"
    async with _controlled(sock, "landlock") as (_, client):
        result = await _attack(client, dirs, "landlock", sock, network="restricted")
    assert not (dirs.outside / "marker").exists(), result
    assert result.startswith("REFUSED PermissionError"), result


@pytest_twisted.ensureDeferred
async def test_an_unconfined_local_client_still_uses_the_socket(dirs: Dirs, sock_dir: Path) -> None:
    # The same script, started without a sandbox while a confined command
    # of the server runs, connects and starts its process.
    sock = sock_dir / "exec.sock"
    async with _controlled(sock, "landlock") as (_, client):
        sandbox = profile_for(dirs, "landlock", network="enabled")
        sandbox["useLegacyLandlock"] = True
        await client.start_process(
            "confined-cat", ["cat"], cwd=uri(dirs.work), env={"PATH": CHILD_PATH},
            sandbox=sandbox, pipeStdin=True,
        )  # fmt: skip
        result = await _attack(client, dirs, "landlock", sock, sandbox=None)
        # And a client outside the server (this test's process).
        outsider = await with_timeout(
            connect_websocket(reactor, f"unix://{sock}"), DEFAULT_TIMEOUT, "unix connect"
        )
        assert outsider.session_id
        await outsider.close()
        await client.call("process/terminate", {"processId": "confined-cat"})
        await client.wait_notification("process/exited", "confined-cat", timeout=30)
    assert result == "STARTED", result
    assert (dirs.outside / "marker").read_text() == "pwned\n"
