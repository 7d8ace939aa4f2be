"""Processes under a sandbox profile, through the real installed server (issue 21).

Both mechanisms (``--sandbox-mechanism bwrap`` and ``landlock``), both
spawn paths where it matters, stdio and WebSocket: the escape matrix (each
attempt denied, each allowed action working), ``sandboxDenied`` exactly
where the sandbox stopped the command, PTY/stdin/signals/terminate inside,
no process surviving, and a refusal (never an unconfined run) where no
mechanism works. CI runs as root with bubblewrap, user namespaces,
Landlock and libseccomp: nothing here skips.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted

from execserver.sandbox.denied import likely_denied
from tests.support.harness import (
    BIN,
    RpcFailure,
    b64,
    console_script,
    run_script,
    server_env,
)
from tests.support.polling import until
from tests.support.sandbox import (
    CHILD_PATH,
    MECHANISMS,
    SECRET,
    Dirs,
    codex_profile,
    dirs,
    env_for,
    profile_for,
    run,
    stdio_server,
    temp_dir,
    uri,
)
from tests.support.stdio_server import ServerProcess
from tests.support.ws_harness import WsServerProcess, connect

__all__ = ["dirs"]  # fixtures, used by name


# --- the escape matrix ------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    script: str
    allowed: bool
    #: sandboxDenied the reference reports for this command (None: its guess from the output).
    denied: bool | None = True


def matrix(d: Dirs, server_pid: int, mechanism: str) -> list[Case]:
    w, o = d.work, d.outside
    tmp_name = f"{temp_dir(d, mechanism)}/exec-server-sbx-{os.getpid()}-{mechanism}"
    py = "python3 -c"
    cases = [
        Case("write inside the workspace", f"echo in > {w}/inside.txt && cat {w}/inside.txt", True),
        Case(
            "write in the temporary directory",
            f"echo t > {tmp_name} && cat {tmp_name} && rm {tmp_name}",
            True,
        ),
        Case("read outside", f"cat {o}/target", True),
        Case("write outside", f"echo pwn > {o}/new.txt", False),
        Case("overwrite outside", f"echo pwn > {o}/target", False),
        Case("write through a symlink", f"echo pwn > {w}/link/new.txt", False),
        # EXDEV ("Invalid cross-device link"): no denial word, as for the reference.
        Case(
            "write through a hardlink", f"ln {o}/target {w}/hl && echo pwn >> {w}/hl", False, None
        ),
        Case(
            "move a directory in from outside",
            f"mv {o}/dir {w}/dir && echo pwn > {w}/dir/f",
            False,
            None,
        ),
        Case("write through /proc/self/root", f"echo pwn > /proc/self/root{o}/new.txt", False),
        Case(
            "read the server's environment",
            f"cat /proc/{server_pid}/environ > {w}/env.txt",
            False,
            None,
        ),
        Case(
            "write the server's /proc", f"echo 1000 > /proc/{server_pid}/oom_score_adj", False, None
        ),
        Case("create a setuid file", f"touch {w}/suid && chmod u+s {w}/suid", False),
        Case("mount", f"mkdir -p {w}/m && mount -t tmpfs none {w}/m", False),
        Case(
            "ptrace the server",
            f"{py} 'import ctypes,os,sys; c=ctypes.CDLL(None,use_errno=True); "
            f"r=c.ptrace(16,{server_pid},0,0); print(os.strerror(ctypes.get_errno())); "
            "sys.exit(r!=0)'",
            False,
        ),
        Case("unshare -U", "unshare -U true", False),
        Case("an ordinary failure is no denial", "exit 3", False, False),
    ]
    if mechanism == "bwrap":
        cases += [
            Case("write into .git", f"echo pwn > {w}/.git/config", False),
            Case("rename .git away", f"mv {w}/.git {w}/g && echo pwn > {w}/g/config", False, None),
            Case("read .git", f"cat {w}/.git/HEAD", True),
        ]
    return cases


def prepare(d: Dirs, mechanism: str) -> None:
    (d.outside / "target").write_text("original\n")
    (d.outside / "dir").mkdir()
    (d.work / "link").symlink_to(d.outside)
    if mechanism == "bwrap":
        # Landlock cannot re-protect a path inside a writable root (see below).
        (d.work / ".git").mkdir()
        (d.work / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
        (d.work / ".git" / "config").write_text("[core]\n")


def check_nothing_escaped(d: Dirs, server_pid: int, mechanism: str) -> None:
    assert sorted(p.name for p in d.outside.iterdir()) == ["dir", "target"]
    assert (d.outside / "target").read_text() == "original\n"
    assert list((d.outside / "dir").iterdir()) == []
    env_copy = d.work / "env.txt"
    assert not env_copy.exists() or SECRET not in env_copy.read_text(errors="replace")
    assert Path(f"/proc/{server_pid}/oom_score_adj").read_text().strip() != "1000"
    suid = d.work / "suid"
    assert not suid.exists() or not suid.stat().st_mode & stat.S_ISUID
    if mechanism == "bwrap":
        assert (d.work / ".git" / "config").read_text() == "[core]\n"
        assert not (d.work / "g").exists()


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest_twisted.ensureDeferred
async def test_escape_matrix_workspace_write(dirs: Dirs, mechanism: str) -> None:
    prepare(dirs, mechanism)
    async with stdio_server("--sandbox-mechanism", mechanism) as server:
        assert server.pid is not None
        profile = profile_for(dirs, mechanism)
        problems = []
        for case in matrix(dirs, server.pid, mechanism):
            ran = await run(server, case.script, dirs.work, profile, env_for(dirs, mechanism))
            expected_denied = (
                case.denied
                if case.denied is not None
                else likely_denied(ran.exit_code, False, [ran.output])
            )
            if case.allowed and ran.exit_code != 0:
                problems.append(f"{case.name}: refused ({ran.exit_code}) {ran.output!r}")
            if not case.allowed and ran.exit_code == 0:
                problems.append(f"{case.name}: NOT DENIED {ran.output!r}")
            if ran.denied != (expected_denied and not case.allowed):
                problems.append(f"{case.name}: sandboxDenied {ran.denied} {ran.output!r}")
        assert not problems, "\n".join(problems)
        check_nothing_escaped(dirs, server.pid, mechanism)
    assert (dirs.work / "inside.txt").read_text() == "in\n"


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest_twisted.ensureDeferred
async def test_read_only_refuses_every_write(dirs: Dirs, mechanism: str) -> None:
    async with stdio_server("--sandbox-mechanism", mechanism) as server:
        profile = codex_profile(dirs.work, write=False)
        tmp_name = f"/tmp/exec-server-sbx-ro-{os.getpid()}"
        for script in (
            f"echo x > {dirs.work}/f",
            f"mkdir {dirs.work}/d",
            f"echo x > {tmp_name}",
            f"echo x > {dirs.outside}/f",
            f"touch {dirs.base}/f",
        ):
            ran = await run(server, script, dirs.work, profile)
            assert ran.exit_code != 0, script
            assert ran.denied, (script, ran.output)
        ok = await run(server, "cat /etc/hostname >/dev/null && echo fine", dirs.work, profile)
        assert (ok.exit_code, ok.output, ok.denied) == (0, b"fine\n", False)
    assert list(dirs.work.iterdir()) == []
    assert not os.path.exists(tmp_name)


# --- the network -------------------------------------------------------------------------------

CONNECT = (
    "python3 -c 'import socket,sys; "
    'fam=socket.AF_UNIX if sys.argv[1]=="unix" else socket.AF_INET; '
    "s=socket.socket(fam); "
    "s.connect(sys.argv[2] if fam==socket.AF_UNIX else (sys.argv[2], int(sys.argv[3]))); "
    'print("CONNECTED")\' '
)
DNS = (
    "python3 -c 'import socket,sys; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
    's.sendto(b"\\x12\\x34\\x01\\x00\\x00\\x01\\x00\\x00\\x00\\x00\\x00\\x00", '
    '("127.0.0.1", int(sys.argv[1]))); print("SENT")\' '
)


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest_twisted.ensureDeferred
async def test_network_restricted_reaches_nothing(dirs: Dirs, mechanism: str) -> None:
    sock_path = dirs.work / "exec.sock"
    server = await WsServerProcess.start(
        "--listen", "ws://127.0.0.1:0", "--listen", f"unix://{sock_path}",
        "--sandbox-mechanism", mechanism, listeners=2,
    )  # fmt: skip
    listener = socket.socket()
    dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        dns.bind(("127.0.0.1", 0))
        dns.setblocking(False)
        host, port = server.host_port
        client = await connect(server.url)
        try:
            await client.call("initialize", {"clientName": "sandbox-net"})
            client.notify("initialized", {})
            profile = profile_for(dirs, mechanism)
            attempts = {
                "the test's listener": CONNECT + f"inet 127.0.0.1 {listener.getsockname()[1]}",
                "the server's port": CONNECT + f"inet {host} {port}",
                "the server's Unix socket": CONNECT + f"unix {sock_path}",
                "DNS": DNS + str(dns.getsockname()[1]),
            }
            for name, script in attempts.items():
                ran = await run(client, script, dirs.work, profile)
                assert ran.exit_code != 0 and b"CONNECTED" not in ran.output, (name, ran.output)
                assert b"SENT" not in ran.output, (name, ran.output)
                assert ran.denied, (name, ran.output)
            # With the network enabled the same connection works.
            enabled = profile_for(dirs, mechanism, network="enabled")
            ran = await run(client, attempts["the test's listener"], dirs.work, enabled)
            assert (ran.exit_code, ran.output, ran.denied) == (0, b"CONNECTED\n", False)
            conn, _ = listener.accept()
            conn.close()
        finally:
            await client.close()
        with pytest.raises(BlockingIOError):
            listener.accept()
        with pytest.raises(BlockingIOError):
            dns.recvfrom(512)
    finally:
        listener.close()
        dns.close()
        assert await server.stop() == 0


# --- process control inside the sandbox -----------------------------------------------------


def _marked_processes(marker: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                if marker.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                    found.append(int(name))
    return found


@pytest.mark.parametrize("spawn_path", ["fast", "stock"])
@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest_twisted.ensureDeferred
async def test_pty_stdin_signal_terminate(dirs: Dirs, mechanism: str, spawn_path: str) -> None:
    async with stdio_server("--sandbox-mechanism", mechanism, "--spawn-path", spawn_path) as s:
        profile = profile_for(dirs, mechanism)
        env = env_for(dirs, mechanism, TERM="dumb")
        # A PTY of the requested size, its input, its exit code.
        await s.start_process(
            "tty", ["sh", "-c", "stty size; read x; echo got-$x; exit 4"], tty=True,
            cwd=uri(dirs.work), env=env, sandbox=profile, size={"rows": 33, "cols": 101},
        )  # fmt: skip
        await s.wait_for(lambda m: b"33 101" in s.output_of("tty"), 20, "stty size")
        await s.call("process/resize", {"processId": "tty", "rows": 40, "cols": 120})
        await s.call("process/write", {"processId": "tty", "chunk": b64(b"hello\n")})
        exited = await s.wait_notification("process/exited", "tty", 20)
        assert exited["exitCode"] == 4
        assert b"got-hello" in s.output_of("tty")
        # Piped stdin.
        await s.start_process(
            "cat", ["cat"], cwd=uri(dirs.work), env=env, sandbox=profile, pipeStdin=True
        )
        await s.call("process/write", {"processId": "cat", "chunk": b64(b"through stdin\n")})
        await s.call("process/closeStdin", {"processId": "cat"})
        await s.wait_closed("cat", 20)
        assert s.output_of("cat") == b"through stdin\n"
        # A signal reaches the command's own handler; bwrap does not die of it.
        await s.start_process(
            "trap",
            ["sh", "-c", 'trap "echo trapped; exit 7" INT; echo ready; '
             "while :; do sleep 0.05; done"],
            cwd=uri(dirs.work), env=env, sandbox=profile,
        )  # fmt: skip
        await s.wait_for(lambda m: b"ready" in s.output_of("trap"), 20, "ready")
        await s.call("process/signal", {"processId": "trap", "signal": "SIGINT"})
        exited = await s.wait_notification("process/exited", "trap", 20)
        assert exited["exitCode"] == 7, s.output_of("trap")
        assert b"trapped" in s.output_of("trap")
        # terminate reaches every process of the sandbox, background ones too.
        marker = f"98765{os.getpid() % 1000}"
        await s.start_process(
            "tree", ["sh", "-c", f"sleep {marker}1 & sleep {marker}2 & echo up; wait"],
            cwd=uri(dirs.work), env=env, sandbox=profile,
        )  # fmt: skip
        await s.wait_for(lambda m: b"up" in s.output_of("tree"), 20, "up")
        assert len(_marked_processes(marker)) >= 2
        assert (await s.call("process/terminate", {"processId": "tree"}))["running"] is True
        await s.wait_closed("tree", 20)
        assert await s.call("process/wait", {"processId": "tree", "waitMs": 10_000}) is not None
        assert _marked_processes(marker) == []


@pytest.mark.parametrize("containment", ["cgroup", "subreaper"])
@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest_twisted.ensureDeferred
async def test_disconnect_kills_the_sandbox(dirs: Dirs, mechanism: str, containment: str) -> None:
    marker = f"87654{os.getpid() % 1000}"
    server = await WsServerProcess.start(
        "--sandbox-mechanism", mechanism, "--process-containment", containment
    )
    try:
        client = await connect(server.url)
        await client.call("initialize", {"clientName": "sandbox-disconnect"})
        client.notify("initialized", {})
        await client.start_process(
            "bg", ["sh", "-c", f"sleep {marker}1 & echo up; sleep {marker}2"],
            cwd=uri(dirs.work), env=env_for(dirs, mechanism),
            sandbox=profile_for(dirs, mechanism),
        )  # fmt: skip
        await client.wait_for(lambda m: b"up" in client.output_of("bg"), 20, "up")
        assert len(_marked_processes(marker)) >= 2
        client.abort()
        # The server terminates a disconnected session's processes (SIGTERM,
        # SIGKILL after the 2 s grace): all gone well within 10 s.
        await until(
            lambda: not _marked_processes(marker),
            "the session's processes to be gone",
            timeout=10,
            interval=0.05,
        )
        assert _marked_processes(marker) == []
    finally:
        assert await server.stop() == 0


# --- what the server answers -------------------------------------------------------------------


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest_twisted.ensureDeferred
async def test_max_processes_counts_the_commands_processes_not_the_sandboxs(
    dirs: Dirs, mechanism: str
) -> None:
    # bwrap and its init stay beside the command for its whole life; they
    # are not the command's processes (issue 24: maxProcesses 1 or 2 could
    # not start anything under bwrap). Landlock's helper execs the command.
    async with stdio_server("--sandbox-mechanism", mechanism) as server:
        env = env_for(dirs, mechanism)
        sandbox = {"mode": "readOnly"}
        one = {"maxProcesses": 1}
        ran = await run(server, "exec echo alone", dirs.work, sandbox, env, limits=one)
        assert (ran.exit_code, ran.output) == (0, b"alone\n"), ran.exited
        assert "limitExceeded" not in ran.exited
        # A second process of the command's own is one too many...
        ran = await run(server, "/bin/true; exec echo two", dirs.work, sandbox, env, limits=one)
        assert ran.exit_code != 0 and ran.exited["limitExceeded"] == "processes", ran.exited
        assert ran.exited["limitValue"] == 1
        # ...and fits under maxProcesses 2, which counts the command's two.
        two = {"maxProcesses": 2}
        script = "/bin/true; exec echo two"
        ran = await run(server, script, dirs.work, sandbox, env, limits=two)
        assert (ran.exit_code, ran.output) == (0, b"two\n"), ran.exited
        assert "limitExceeded" not in ran.exited
        # The process count in process/list leaves the sandbox's own out.
        await server.start_process(
            "counted", ["sh", "-c", "sleep 30 & exec sleep 30"], cwd=uri(dirs.work), env=env,
            sandbox=sandbox, limits=two,
        )  # fmt: skip
        try:
            seen: dict[str, Any] = {}

            async def counted_two() -> bool:
                listed = await server.call("process/list", {})
                (entry,) = [p for p in listed["processes"] if p["processId"] == "counted"]
                seen.update(entry)
                return bool(entry["usage"].get("processes") == 2)

            # The background sleep is forked right after the start.
            await until(counted_two, "process/list to count 2", timeout=10.0, detail=lambda: seen)
        finally:
            await server.call("process/terminate", {"processId": "counted"})
            await server.wait_closed("counted", timeout=30)


@pytest_twisted.ensureDeferred
async def test_unconfined_and_seed_forms(dirs: Dirs) -> None:
    async with stdio_server() as server:
        info = await server.call("environment/info", None)
        assert info["sandbox"] == "bwrap"
        ran = await run(server, "echo free > /var/tmp/../tmp/x-$$ && echo ok", dirs.work, None)
        assert (ran.exit_code, ran.output, ran.denied) == (0, b"ok\n", False)
        # Our additive form: workspaceWrite with writable roots, and readOnly.
        form = {"mode": "workspaceWrite", "writableRoots": [str(dirs.work)], "network": False}
        ran = await run(
            server, f"echo a > {dirs.work}/a && echo b > {dirs.outside}/b", dirs.work, form
        )
        assert ran.exit_code != 0 and ran.denied
        assert (dirs.work / "a").exists() and not (dirs.outside / "b").exists()
        ran = await run(server, f"echo a > {dirs.work}/c", dirs.work, {"mode": "readOnly"})
        assert ran.exit_code != 0 and ran.denied and not (dirs.work / "c").exists()
        # arg0 (through bash's exec -a inside the sandbox), confined.
        await server.start_process(
            "arg0", ["sh", "-c", "tr '\\0' ' ' < /proc/$$/cmdline"], cwd=uri(dirs.work),
            env={"PATH": CHILD_PATH}, sandbox={"mode": "readOnly"}, arg0="renamed-sh",
        )  # fmt: skip
        await server.wait_closed("arg0")
        assert server.output_of("arg0").startswith(b"renamed-sh -c ")


@pytest.mark.parametrize(
    ("args", "missing"),
    [
        (
            ("--sandbox-mechanism", "bwrap", "--bwrap", "/nonexistent/bwrap"),
            "--bwrap /nonexistent/bwrap",
        ),
        (
            ("--sandbox-mechanism", "bwrap"),
            "bwrap not found on PATH (install the `bubblewrap` package",
        ),
    ],
)
@pytest_twisted.ensureDeferred
async def test_no_mechanism_is_a_refusal(dirs: Dirs, args: tuple[str, ...], missing: str) -> None:
    empty = dirs.base / "empty-path"
    empty.mkdir()
    server = ServerProcess.start(*args, env={"PATH": str(empty)})
    try:
        await server.call("initialize", {"clientName": "sandbox-refusal"})
        server.notify("initialized", {})
        info = await server.call("environment/info", None)
        assert info["sandbox"] == "none"
        with pytest.raises(RpcFailure) as refused:
            await server.start_process(
                "p", ["sh", "-c", f"echo pwn > {dirs.outside}/x"], cwd=uri(dirs.work),
                env={"PATH": CHILD_PATH}, sandbox=codex_profile(dirs.work),
            )  # fmt: skip
        error = refused.value
        assert error.code == -32602
        assert error.message.startswith("sandbox intent cannot be enforced on this executor: ")
        assert missing in error.message
        assert "Landlock: not used (--sandbox-mechanism bwrap)" in error.message
        assert not (dirs.outside / "x").exists()
        # An unconfined start still runs.
        ran = await run(server, "echo fine", dirs.work, None, env={"PATH": CHILD_PATH})
        assert (ran.exit_code, ran.output) == (0, b"fine\n")
    finally:
        await server.stop()
    assert b"confined process starts will be refused" in server.stderr


@pytest_twisted.ensureDeferred
async def test_landlock_refuses_what_it_cannot_re_protect(dirs: Dirs) -> None:
    (dirs.work / ".git").mkdir()
    async with stdio_server("--sandbox-mechanism", "landlock") as server:
        with pytest.raises(RpcFailure) as refused:
            await server.start_process(
                "p", ["true"], cwd=uri(dirs.work), env=env_for(dirs, "landlock"),
                sandbox=profile_for(dirs, "landlock"),
            )  # fmt: skip
        assert refused.value.message == (
            "sandbox intent cannot be enforced on this executor: Landlock cannot re-protect "
            f"{dirs.work}/.git inside a writable root; install the `bubblewrap` package "
            "(or pass --bwrap PATH) and enable user namespaces"
        )


@pytest_twisted.ensureDeferred
async def test_use_legacy_landlock_runs_under_landlock(dirs: Dirs) -> None:
    async with stdio_server() as server:
        profile = profile_for(dirs, "landlock")
        profile["useLegacyLandlock"] = True
        # No pid namespace under Landlock: the command sees the host's pids.
        ran = await run(server, "ls /proc | grep -c '^[0-9]'", dirs.work, profile)
        assert ran.exit_code == 0 and int(ran.output) > 5
        profile["useLegacyLandlock"] = False
        ran = await run(server, "ls /proc | grep -c '^[0-9]'", dirs.work, profile)
        assert ran.exit_code == 0 and int(ran.output) < 5


@pytest_twisted.ensureDeferred
async def test_floor_confines_and_refuses_full_access(dirs: Dirs) -> None:
    async with stdio_server(
        "--sandbox-floor", "workspace-write", "--floor-writable-root", str(dirs.work),
        "--floor-no-network",
    ) as server:  # fmt: skip
        # A seed client asking for nothing is confined to the floor.
        ran = await run(
            server,
            f"echo a > {dirs.work}/a && echo b > {dirs.outside}/b",
            dirs.work,
            None,
            confined=True,
        )
        assert ran.exit_code != 0 and (dirs.work / "a").exists()
        assert not (dirs.outside / "b").exists()
        with pytest.raises(RpcFailure) as refused:
            await server.start_process(
                "full", ["true"], cwd=uri(dirs.work), env={"PATH": CHILD_PATH},
                sandbox={"permissions": {"type": "disabled"}},
            )  # fmt: skip
        assert refused.value.code == -32602
        assert "full access (`danger-full-access`) is refused" in refused.value.message
        # The same floor reaches fs/* (--sandbox-floor is handed to the fs guard).
        with pytest.raises(RpcFailure) as refused:
            await server.call(
                "fs/writeFile", {"path": str(dirs.outside / "c"), "dataBase64": b64(b"x")}
            )
        assert (refused.value.code, refused.value.message) == (
            -32603,
            "Read-only file system (os error 30)",
        )
        await server.call("fs/writeFile", {"path": str(dirs.work / "c"), "dataBase64": b64(b"x")})
        assert (dirs.work / "c").read_bytes() == b"x" and not (dirs.outside / "c").exists()


def test_check_sandbox_command() -> None:
    done = run_script("exec-server", "--check-sandbox", text=True)
    assert done.returncode == 0, done.stderr
    assert "bubblewrap:       ok (" in done.stdout
    assert "landlock:         ok (ABI " in done.stdout
    assert "mechanism:        bwrap + seccomp" in done.stdout
    # Which resource limits this host can enforce (issue 24): all four here.
    for field in ("memoryBytes", "maxProcesses", "cpuPercent", "fileSizeBytes"):
        assert f"limits:           {field}: enforced (" in done.stdout, done.stdout
    subreaper = run_script(
        "exec-server", "--check-sandbox", "--process-containment", "subreaper", text=True
    )
    assert "limits:           memoryBytes: not enforced (process containment is `subreaper`" in (
        subreaper.stdout
    ), subreaper.stdout
    done = run_script(
        "exec-server", "--check-sandbox", "--sandbox-mechanism", "bwrap", "--bwrap", "/nope",
        text=True,
    )  # fmt: skip
    assert done.returncode == 1
    assert "bubblewrap:       NO: --bwrap /nope is not an executable file" in done.stdout
    assert "mechanism:        none (sandbox intent cannot be enforced" in done.stdout


# --- our clients --------------------------------------------------------------------------------


def test_cli_sandbox_options(dirs: Dirs) -> None:
    script = f"echo a > {dirs.work}/x && cat {dirs.work}/x; echo b > {dirs.outside}/y"
    done = run_script(
        "exec-server-client", "run", "--stdio", "--sandbox", "workspace-write",
        "--writable-root", str(dirs.work), "--no-network", "--", "sh", "-c", script,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stdout == b"a\n"
    assert b"Read-only file system" in done.stderr
    assert (dirs.work / "x").exists() and not (dirs.outside / "y").exists()
    done = run_script(
        "exec-server-client", "run", "--stdio", "--sandbox", "read-only", "--",
        "sh", "-c", f"touch {dirs.work}/z",
    )  # fmt: skip
    assert done.returncode == 1 and not (dirs.work / "z").exists(), done.stderr
    done = run_script("exec-server-client", "run", "--stdio", "--no-network", "--", "true")
    assert done.returncode == 2
    assert b"--writable-root and --no-network need --sandbox" in done.stderr


def test_sync_client_sandbox_parameter(dirs: Dirs) -> None:
    from execserver.clientcore.start import sandbox_config
    from execserver.sync import connect as sync_connect

    with sync_connect(server_command=[str(BIN / "exec-server")]) as client:
        confined = sandbox_config("workspace-write", [str(dirs.work)], network=False)
        result = client.run(
            ["sh", "-c", f"echo in > {dirs.work}/a; echo out > {dirs.outside}/b"],
            cwd=str(dirs.work),
            sandbox=confined,
        )
        assert result.exit_code == 2
        assert b"Read-only file system" in result.stderr
        free = client.run(["sh", "-c", f"echo out > {dirs.outside}/c"], cwd=str(dirs.work))
        assert free.exit_code == 0
    assert (dirs.work / "a").exists() and not (dirs.outside / "b").exists()
    assert (dirs.outside / "c").exists()


#: Runs a command with landlock_create_ruleset answering ENOSYS, as on a
#: kernel without Landlock (a seccomp filter of its own, then execv).
WITHOUT_LANDLOCK = """
import ctypes, errno, os, struct, sys
from execserver.sandbox import seccomp
f = seccomp._Filter(seccomp._load())
f.deny("landlock_create_ruleset", code=errno.ENOSYS)
program = f.export()
f.close()
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0
filters = ctypes.create_string_buffer(program, len(program))
fprog = struct.pack("@HP", len(program) // 8, ctypes.addressof(filters))
fprog = ctypes.create_string_buffer(fprog, len(fprog))
assert libc.prctl(22, 2, fprog, 0, 0) == 0
os.execv(sys.argv[1], sys.argv[1:])
"""


@pytest_twisted.ensureDeferred
async def test_neither_bwrap_nor_landlock_is_a_refusal(dirs: Dirs) -> None:
    empty = dirs.base / "empty-path"
    empty.mkdir()
    env = {"PATH": str(empty)}
    script = console_script("exec-server")
    checked = subprocess.run(
        [sys.executable, "-c", WITHOUT_LANDLOCK, script, "--check-sandbox"],
        env=server_env(env), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert checked.returncode == 1, checked.stderr
    assert "landlock:         NO: the kernel has no Landlock (ENOSYS)" in checked.stdout
    assert "bubblewrap:       NO: bwrap not found on PATH" in checked.stdout
    argv = [sys.executable, "-c", WITHOUT_LANDLOCK, script]
    server = ServerProcess().launch(
        argv,
        env=server_env(env),
        path=dirs.base,
        description="exec-server without bwrap or Landlock",
    )
    try:
        await server.call("initialize", {"clientName": "sandbox-none"})
        server.notify("initialized", {})
        with pytest.raises(RpcFailure) as refused:
            await server.start_process(
                "p", ["sh", "-c", f"echo pwn > {dirs.outside}/x"], cwd=uri(dirs.work),
                env={"PATH": CHILD_PATH}, sandbox=codex_profile(dirs.work),
            )  # fmt: skip
        assert refused.value.code == -32602
        assert refused.value.message == (
            "sandbox intent cannot be enforced on this executor: bubblewrap: bwrap not found "
            "on PATH (install the `bubblewrap` package, or pass --bwrap PATH); Landlock: the "
            "kernel has no Landlock (ENOSYS) (exec-server --check-sandbox shows what works here)"
        )
        assert not (dirs.outside / "x").exists()
        ran = await run(server, "echo still-runs", dirs.work, None, env={"PATH": CHILD_PATH})
        assert (ran.exit_code, ran.output) == (0, b"still-runs\n")
    finally:
        await server.stop()
