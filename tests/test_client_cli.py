"""``exec-server-client`` end to end: real servers, real processes, a real PTY."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import sys
from pathlib import Path

import pytest_twisted
from twisted.internet.defer import Deferred, succeed

from tests.support.cli import Cli, run
from tests.support.client_fakes import LocalWsServer
from tests.support.harness import (
    console_script,
    pid_alive,
    refused_port,
)
from tests.support.ws_harness import WsServerProcess

# --- run ----------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_run_streams_stdout_and_stderr_and_propagates_the_exit_code() -> None:
    cli = await run("run", "--stdio", "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert cli.exit_code == 7
    assert cli.out == b"out\n"
    assert cli.err == b"err\n"


@pytest_twisted.ensureDeferred
async def test_run_reports_death_by_signal_as_128_plus_n() -> None:
    cli = await run("run", "--stdio", "--", "sh", "-c", "kill -9 $$")
    assert cli.exit_code == 128 + 9


@pytest_twisted.ensureDeferred
async def test_run_writes_binary_output_byte_exact() -> None:
    script = (
        "import sys, random; r = random.Random(7);"
        "sys.stdout.buffer.write(bytes(range(256)) * 4096 + r.randbytes(1 << 20))"
    )
    expected = bytes(range(256)) * 4096 + __import__("random").Random(7).randbytes(1 << 20)
    cli = await run("run", "--stdio", "--", sys.executable, "-c", script)
    assert cli.exit_code == 0, cli.err
    assert len(cli.out) == len(expected)
    assert hashlib.sha256(cli.out).digest() == hashlib.sha256(expected).digest()


@pytest_twisted.ensureDeferred
async def test_run_forwards_stdin_with_dash_i() -> None:
    data = bytes(range(256)) * 8192  # 2 MiB, more than one pipe's worth
    cli = Cli.start("run", "-i", "--stdio", "--", "sha256sum", stdin=data)
    assert await cli.finish() == 0, cli.err
    assert cli.out.split()[0].decode() == hashlib.sha256(data).hexdigest()
    # Without -i the remote stdin is closed, as in the baseline.
    cli = Cli.start("run", "--stdio", "--", "wc", "-c", stdin=b"ignored")
    assert await cli.finish() == 0, cli.err
    assert cli.out.strip() == b"0"


# A remote command that reports each signal it gets (its `sleep` dies of a
# group-wide SIGINT; the shell runs the trap and carries on).
_TRAPPING = (
    "trap 'echo got INT' INT; trap 'echo got TERM' TERM; echo started $$; "
    "while :; do sleep 0.2; done"
)


async def _started_pid(cli: Cli) -> int:
    await cli.output(rb"started (\d+)\r?\n", "the remote process to start")
    match = re.search(rb"started (\d+)", cli.out)
    assert match is not None
    return int(match.group(1))


@pytest_twisted.ensureDeferred
async def test_ctrl_c_sends_sigint_then_terminates_then_kills() -> None:
    cli = Cli.start("run", "--stdio", "--", "sh", "-c", _TRAPPING)
    try:
        remote_pid = await _started_pid(cli)
        # First Ctrl-C: SIGINT, which the command may catch (and here survives).
        cli.signal("INT")
        await cli.output(rb"got INT\n", "the remote SIGINT trap")
        assert b"got TERM" not in cli.out
        assert pid_alive(remote_pid)
        # Second: terminate (SIGTERM; SIGKILL after the server's grace).
        cli.signal("INT")
        await cli.output(rb"got TERM\n", "the remote SIGTERM trap")
        await cli.output(
            rb"terminating `sh` \(interrupt again to kill it at once\)",
            "the client's note on stderr",
            stderr=True,
        )
        # Third: killed at once.
        cli.signal("INT")
        assert await cli.finish() == 128 + 9
        assert b"killing `sh`" in cli.err
        assert not pid_alive(remote_pid)
    finally:
        if not cli.ended.called:
            cli.signal("KILL")


@pytest_twisted.ensureDeferred
async def test_ctrl_c_exit_status_is_the_remote_commands() -> None:
    # A command that dies of the forwarded SIGINT: 130, as at a local shell.
    cli = Cli.start("run", "--stdio", "--", "sh", "-c", "echo started $$; exec sleep 30")
    remote_pid = await _started_pid(cli)
    cli.signal("INT")
    assert await cli.finish() == 128 + 2
    assert cli.err == b""
    assert not pid_alive(remote_pid)


@pytest_twisted.ensureDeferred
async def test_ctrl_c_at_a_terminal_does_not_stop_the_local_server() -> None:
    # A terminal's Ctrl-C signals its whole foreground process group: the
    # client and, unless it has a session of its own, the --stdio server,
    # which would then shut down and SIGTERM the command.
    cli = Cli.start("run", "--stdio", "--", "sh", "-c", _TRAPPING, pty=True, show_terminal=False)
    try:
        remote_pid = await _started_pid(cli)
        assert cli.transport is not None and cli.transport.pid is not None
        os.killpg(cli.transport.pid, signal.SIGINT)
        await cli.output(rb"got INT\r?\n", "the remote SIGINT trap")
        assert b"got TERM" not in cli.out
        assert pid_alive(remote_pid)
        os.killpg(cli.transport.pid, signal.SIGINT)
        await cli.output(rb"got TERM\r?\n", "the remote SIGTERM trap")
        os.killpg(cli.transport.pid, signal.SIGINT)
        assert await cli.finish() == 128 + 9
        assert not pid_alive(remote_pid)
    finally:
        if not cli.ended.called:
            cli.signal("KILL")


@pytest_twisted.ensureDeferred
async def test_sigterm_of_the_client_terminates_the_remote_process() -> None:
    cli = Cli.start("run", "--stdio", "--", "sh", "-c", "echo started $$; exec sleep 30")
    remote_pid = await _started_pid(cli)
    cli.signal("TERM")
    assert await cli.finish() == 128 + 15
    assert not pid_alive(remote_pid)


@pytest_twisted.ensureDeferred
async def test_timeout_is_reported_and_exits_124() -> None:
    cli = await run("run", "--stdio", "--timeout-ms", "300", "--", "sleep", "30")
    assert cli.exit_code == 124
    assert cli.err == (
        b"exec-server-client: `sleep` timed out after 300 ms (--timeout-ms) and was terminated\n"
    )
    # A command that ends in time keeps its own status.
    cli = await run("run", "--stdio", "--timeout-ms", "30000", "--", "sh", "-c", "exit 5")
    assert cli.exit_code == 5 and cli.err == b""


@pytest_twisted.ensureDeferred
async def test_timeout_ms_is_validated() -> None:
    cli = await run("run", "--stdio", "--timeout-ms", "-1", "--", "true")
    assert cli.exit_code == 2
    assert b"--timeout-ms: expected milliseconds >= 0, got `-1`" in cli.err


@pytest_twisted.ensureDeferred
async def test_run_over_websocket_against_the_real_server() -> None:
    server = await WsServerProcess.start()
    try:
        cli = await run("run", "--url", server.url, "--", "printf", "over the wire")
        assert cli.exit_code == 0, cli.err
        assert cli.out == b"over the wire"
    finally:
        await server.stop()


# --- errors ---------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_missing_command_is_127_with_a_message() -> None:
    cli = await run("run", "--stdio", "--", "/nonexistent/program")
    assert cli.exit_code == 127
    assert b"cannot start `/nonexistent/program`" in cli.err
    assert b"No such file or directory" in cli.err


@pytest_twisted.ensureDeferred
async def test_no_server_given_is_a_usage_error() -> None:
    cli = await run("run", "--", "true")
    assert cli.exit_code == 2
    assert b"no server given" in cli.err


@pytest_twisted.ensureDeferred
async def test_unreachable_server_is_255_with_a_message() -> None:
    with refused_port() as port:
        cli = await run("run", "--url", f"ws://127.0.0.1:{port}", "--", "true")
        assert cli.exit_code == 255
        assert b"cannot connect" in cli.err and b"connection refused" in cli.err


@pytest_twisted.ensureDeferred
async def test_auth_refused_is_255_with_a_message(tmp_path: Path) -> None:
    server = LocalWsServer(token="right").start()
    token_file = tmp_path / "token"
    token_file.write_text("wrong\n")
    try:
        cli = await run("run", "--url", server.url, "--token-file", str(token_file), "--", "true")
        assert cli.exit_code == 255
        assert b"authentication refused (HTTP 401" in cli.err
        token_file.write_text("right\n")
        cli = await run("run", "--url", server.url, "--token-file", str(token_file), "--", "true")
        assert cli.exit_code == 0, cli.err
    finally:
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_handshake_timeout_is_255_with_a_message() -> None:
    server = LocalWsServer(silent=True).start()
    try:
        cli = await run("run", "--url", server.url, "--initialize-timeout", "0.5", "--", "true")
        assert cli.exit_code == 255
        assert b"did not answer initialize within 0.5s" in cli.err
    finally:
        await server.stop()


# --- PTY --------------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_pty_session_echo_ctrl_c_and_exit() -> None:
    cli = Cli.start(
        "run", "-t", "--stdio", "-e", "PS1=PROMPT> ", "--", "/bin/sh", "-i",
        pty=True,
        size=(33, 101),
    )  # fmt: skip
    try:
        await cli.output(rb"PROMPT> ", "the first prompt")
        # (Each command is typed at a prompt: an interactive shell may flush
        # typed-ahead input when it takes the terminal back from a job.)
        # The window size was sent at start.
        cli.write(b"stty size\r")
        await cli.output(rb"33 101\r\nPROMPT> ", "the remote terminal size")
        # A local resize (SIGWINCH) is forwarded with process/resize.
        cli.resize(40, 120)
        cli.write(b"stty size\r")
        await cli.output(rb"40 120\r\nPROMPT> ", "the resized remote terminal")
        # Input is forwarded and echoed by the remote terminal.
        cli.write(b"echo he''llo\r")
        await cli.output(rb"echo he''llo\r\nhello\r\nPROMPT> ", "echo output")
        # Ctrl-C reaches the remote foreground process (which announces itself
        # once it is the foreground job).
        cli.write(b"sh -c 'echo sta''rted; exec sleep 30'\r")
        await cli.output(rb"\nstarted\r\n", "sleep to start")
        cli.write(b"\x03")
        await cli.output(rb"\nstarted\r\n.*PROMPT> ", "a prompt after Ctrl-C")
        cli.write(b"exit 3\r")
        assert await cli.finish() == 3
        # The local terminal was restored (canonical mode and echo back on).
        settings = cli.out.rsplit(b"exit 3", 1)[1]
        assert re.search(rb"(^|\s)icanon(\s|$)", settings), settings
        assert re.search(rb"(^|\s)echo(\s|$)", settings), settings
    finally:
        if not cli.ended.called:
            cli.signal("KILL")


class _FakeProc:
    """What _Interrupts asks of a RemoteProcess, recorded."""

    def __init__(self) -> None:
        self.has_exited = False
        self.calls: list[str] = []

    def send_signal(self, name: str) -> Deferred[None]:
        self.calls.append(f"signal {name}")
        return succeed(None)

    def terminate(self, grace_ms: int | None = None) -> Deferred[None]:
        self.calls.append(f"terminate grace={grace_ms}")
        return succeed(None)


class _FakeClient:
    def __init__(self, methods: set[str]) -> None:
        self.methods = methods

    def supports(self, method: str) -> bool:
        return method in self.methods


def _interrupts(signals: list[int], server_signals: bool = True) -> tuple[list[str], list[str]]:
    from execserver.client.cli.run import _Interrupts

    proc = _FakeProc()
    notes: list[str] = []
    client = _FakeClient({"process/signal"} if server_signals else set())
    interrupts = _Interrupts(proc, client, "make", notes.append)  # type: ignore[arg-type]
    for signum in signals:
        interrupts.on_signal(signum)
    return proc.calls, notes


def test_interrupt_escalation_steps() -> None:
    sigint, sigterm = signal.SIGINT, signal.SIGTERM
    calls, notes = _interrupts([sigint, sigint, sigint, sigint])
    assert calls == [
        "signal SIGINT",
        "terminate grace=None",
        "terminate grace=0",
        "terminate grace=0",
    ]
    assert notes[0] == "terminating `make` (interrupt again to kill it at once)"
    assert notes[1:] == ["killing `make`", "killing `make`"]
    # SIGTERM (or SIGHUP) of the client skips the SIGINT step.
    assert _interrupts([sigterm, sigint])[0] == ["terminate grace=None", "terminate grace=0"]
    assert _interrupts([sigint, sigterm])[0] == ["signal SIGINT", "terminate grace=None"]
    # A baseline server has no process/signal: terminate comes first.
    assert _interrupts([sigint, sigint], server_signals=False)[0] == [
        "terminate grace=None",
        "terminate grace=0",
    ]


def test_no_interrupt_is_sent_once_the_process_exited() -> None:
    from execserver.client.cli.run import _Interrupts

    proc = _FakeProc()
    proc.has_exited = True
    interrupts = _Interrupts(proc, _FakeClient({"process/signal"}), "x", print)  # type: ignore[arg-type]
    interrupts.on_signal(signal.SIGINT)
    assert proc.calls == []


def test_terminal_size_helper_ignores_non_terminals() -> None:
    from execserver.client.cli.run import terminal_size

    read_fd, write_fd = os.pipe()
    try:
        assert terminal_size(read_fd) is None
    finally:
        os.close(read_fd)
        os.close(write_fd)


# --- fs ---------------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_fs_subcommands(tmp_path: Path) -> None:
    local = tmp_path / "local.bin"
    payload = bytes(range(256)) * 64
    local.write_bytes(payload)
    remote = tmp_path / "remote"
    assert (await run("fs", "--stdio", "mkdir", "-p", f"{remote}/sub")).exit_code == 0
    cli = await run("fs", "--stdio", "put", str(local), f"{remote}/sub/file.bin")
    assert cli.exit_code == 0, cli.err
    cli = await run("fs", "--stdio", "cat", f"{remote}/sub/file.bin")
    assert cli.out == payload
    cli = await run("fs", "--stdio", "cp", "-r", f"{remote}/sub", f"{remote}/copy")
    assert cli.exit_code == 0, cli.err
    cli = await run("fs", "ls", "--stdio", str(remote))
    assert cli.out == b"copy/\nsub/\n"
    cli = await run("fs", "--stdio", "stat", f"{remote}/copy/file.bin")
    assert b"type: file" in cli.out and b"size: 16384" in cli.out
    assert (await run("fs", "--stdio", "rm", "-r", f"{remote}/sub")).exit_code == 0
    assert not (remote / "sub").exists()
    cli = await run("fs", "--stdio", "cat", f"{remote}/sub/file.bin")
    assert cli.exit_code == 1
    assert cli.err.startswith(f"exec-server-client: fs cat {remote}/sub/file.bin: ".encode())


@pytest_twisted.ensureDeferred
async def test_fs_with_stdio_resolves_relative_paths_against_the_local_directory(
    tmp_path: Path,
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "a.txt").write_bytes(b"local file\n")
    cli = await run("fs", "--stdio", "cat", "a.txt", cwd=work)
    assert (cli.exit_code, cli.out, cli.err) == (0, b"local file\n", b"")
    cli = await run("fs", "--stdio", "cat", "./../work/a.txt", cwd=work)
    assert (cli.exit_code, cli.out) == (0, b"local file\n"), cli.err
    cli = await run("fs", "--stdio", "cp", "a.txt", "b.txt", cwd=work)
    assert cli.exit_code == 0, cli.err
    assert (work / "b.txt").read_bytes() == b"local file\n"
    cli = await run("fs", "--stdio", "mkdir", "-p", "d/e", cwd=work)
    assert cli.exit_code == 0, cli.err
    assert (work / "d" / "e").is_dir()
    cli = await run("fs", "--stdio", "ls", ".", cwd=work)
    assert cli.out == b"a.txt\nb.txt\nd/\n"
    cli = await run("fs", "--stdio", "stat", "..", cwd=work)
    assert cli.out.startswith(f"path: {tmp_path}\ntype: directory\n".encode()), cli.out


@pytest_twisted.ensureDeferred
async def test_fs_errors_name_the_path(tmp_path: Path) -> None:
    cli = await run("fs", "--stdio", "cat", "missing.txt", cwd=tmp_path)
    assert cli.exit_code == 1
    assert cli.err.startswith(f"exec-server-client: fs cat {tmp_path}/missing.txt: ".encode())
    assert b"AbsolutePathBuf" not in cli.err
    cli = await run("fs", "--stdio", "cp", "nope", "/nonexistent/dir/x", cwd=tmp_path)
    assert cli.exit_code == 1
    assert cli.err.startswith(
        f"exec-server-client: fs cp {tmp_path}/nope /nonexistent/dir/x: ".encode()
    )


@pytest_twisted.ensureDeferred
async def test_fs_with_url_refuses_relative_paths_before_connecting() -> None:
    # Nothing listens on this port: the path is refused before any connection.
    with refused_port() as port:
        url = f"ws://127.0.0.1:{port}"
        cli = await run("fs", "--url", url, "cat", "notes.txt")
        assert cli.exit_code == 2
        assert cli.err == (
            b"exec-server-client: fs cat: `notes.txt` is a relative path: with --url give an "
            b"absolute remote path (relative paths are resolved against this directory only "
            b"with --stdio)\n"
        )
        cli = await run("fs", "--url", url, "cp", "/tmp/a", "b")
        assert cli.exit_code == 2 and b"`b` is a relative path" in cli.err
        cli = await run("fs", "--stdio", "cat", "")
        assert cli.exit_code == 2 and cli.err == b"exec-server-client: fs cat: empty path\n"


@pytest_twisted.ensureDeferred
async def test_connection_lost_during_run_is_255_with_a_message() -> None:
    server = await WsServerProcess.start()
    remote_pid: int | None = None
    try:
        cli = Cli.start(
            "run", "--url", server.url, "--", "sh", "-c", "echo started $$; exec sleep 30"
        )
        await cli.output(rb"started (\d+)\n", "the remote process to start")
        match = re.search(rb"started (\d+)", cli.out)
        assert match is not None
        remote_pid = int(match.group(1))
        server.signal("KILL")
        assert await cli.finish() == 255
        assert b"connection lost while `sh` was running" in cli.err
    finally:
        await server.stop()
        if remote_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(remote_pid, 9)


@pytest_twisted.ensureDeferred
async def test_closed_output_reader_terminates_the_remote_process_and_exits_141(
    tmp_path: Path,
) -> None:
    # `exec-server-client run -- yes | head -1`: the remote `yes` must not run
    # on, and the client ends as a local `yes` would, of SIGPIPE, quietly.
    script = '"$@" 2>"$ERR" | head -n 1 >/dev/null; echo "status ${PIPESTATUS[0]}"'
    pid_file = tmp_path / "pid"
    cli = Cli.start(
        "/usr/bin/env", f"ERR={tmp_path / 'err'}", "/bin/bash", "-c", script, "bash",
        console_script("exec-server-client"), "run", "--stdio", "--",
        "sh", "-c", f"echo $$ > {pid_file}; exec yes",
        raw=True,
    )  # fmt: skip
    assert await cli.finish() == 0, cli.err
    assert cli.out == b"status 141\n"
    assert (tmp_path / "err").read_bytes() == b""
    assert not pid_alive(int(pid_file.read_text()))
