"""The ``exec-server`` script as a person meets it: help, a terminal, its log, the README.

Every test runs the installed script; terminals are real PTYs.
"""

from __future__ import annotations

import contextlib
import os
import pty
import re
import select
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from execserver.cli import SECURITY_NOTE, TTY_HINT
from tests.support.harness import REPO_ROOT, console_script, server_env
from tests.support.polling import until_blocking
from tests.support.raw_server import RawServer

TIMEOUT = 10.0
README = REPO_ROOT / "README.md"
INITIALIZE = b'{"id":1,"method":"initialize","params":{"clientName":"me"}}\n'


# --- helpers --------------------------------------------------------------------------------


class Reader:
    """Lines from a descriptor, every wait bounded."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.data = b""
        self.eof = False

    def _fill(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"nothing more within {TIMEOUT}s; so far {self.data[-500:]!r}")
        ready, _, _ = select.select([self.fd], [], [], remaining)
        if ready:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # a PTY master reads EIO once the other side is closed
                chunk = b""
            if not chunk:
                self.eof = True
            self.data += chunk

    def line(self, timeout: float = TIMEOUT) -> bytes:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.data:
            if self.eof:
                raise EOFError(f"end of output; so far {self.data!r}")
            self._fill(deadline)
        line, _, self.data = self.data.partition(b"\n")
        return line.rstrip(b"\r")

    def pump(self, seconds: float) -> None:
        """Take whatever arrives during ``seconds`` (a pause, not a wait for anything)."""
        end = time.monotonic() + seconds
        while not self.eof and time.monotonic() < end:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, end - time.monotonic()))
            if ready:
                self._fill(end + TIMEOUT)

    def rest(self, timeout: float = TIMEOUT) -> bytes:
        """Everything until end of file."""
        deadline = time.monotonic() + timeout
        while not self.eof:
            self._fill(deadline)
        rest, self.data = self.data, b""
        return rest


@contextlib.contextmanager
def server_on_a_terminal(*args: str) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """``exec-server ARGS`` whose stdin is a terminal (yields it and the PTY master)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [console_script("exec-server"), *args],
        stdin=slave,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=server_env(),
        cwd=str(REPO_ROOT),
        start_new_session=True,
    )
    os.close(slave)
    try:
        yield proc, master
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(TIMEOUT)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        os.close(master)


def wait_for_sigterm_handler(pid: int) -> None:
    """Until ``pid`` catches SIGTERM (its ``SigCgt`` mask in /proc), bounded."""

    def catches_sigterm() -> bool:
        with open(f"/proc/{pid}/status") as status:
            caught = next(line for line in status if line.startswith("SigCgt:"))
        return bool(int(caught.split()[1], 16) & (1 << (signal.SIGTERM - 1)))

    until_blocking(
        catches_sigterm, f"pid {pid} to install a SIGTERM handler", timeout=TIMEOUT, interval=0.01
    )


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [console_script("exec-server"), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
        env=server_env(),
        stdin=subprocess.DEVNULL,
    )


# --- --help ---------------------------------------------------------------------------------


def test_help_names_the_program_its_default_transport_and_the_security_note() -> None:
    result = run_script("--help")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "Usage: exec-server [--listen URL]... [options]"
    text = " ".join(result.stdout.split())
    assert "By default it speaks JSON-RPC on its stdin/stdout" in text
    assert "-v, --verbose" in result.stdout
    assert "execserver" not in result.stdout  # no module path
    assert lines[-1] == SECURITY_NOTE
    assert len(SECURITY_NOTE) <= 80


# --- a terminal -----------------------------------------------------------------------------


def test_on_a_terminal_one_hint_line_then_requests_then_ctrl_d_quits() -> None:
    with server_on_a_terminal() as (proc, master):
        assert proc.stdout is not None and proc.stderr is not None
        err = Reader(proc.stderr.fileno())
        assert err.line() == TTY_HINT.encode()
        # Type the request the hint shows, as a person would.
        os.write(master, INITIALIZE)
        out = Reader(proc.stdout.fileno())
        assert out.line().startswith(b'{"id":1,"result":{"protocolVersion":"exec-server.v0"')
        os.write(master, b"\x04")  # Ctrl-D at the start of a line: end of input
        assert proc.wait(TIMEOUT) == 0
        assert err.rest() == b""  # nothing but the hint
        assert out.rest() == b""


def test_no_hint_when_stdin_is_not_a_terminal() -> None:
    server = RawServer()
    server.send_raw(INITIALIZE)
    assert server.read_line().startswith(b'{"id":1,"result":')
    assert server.stop() == 0
    assert server.stderr_text() == ""


def test_no_hint_when_not_listening_on_stdio() -> None:
    with server_on_a_terminal("--listen", "ws://127.0.0.1:0") as (proc, _master):
        assert proc.stderr is not None
        err = Reader(proc.stderr.fileno())
        assert err.line().startswith(b"exec-server listening on ws://127.0.0.1:")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(TIMEOUT) == 0
        assert err.rest() == b""


# --- logging --------------------------------------------------------------------------------


def _stdio_session(*args: str) -> str:
    """A handshake, a process that runs and exits, end of input: the server's stderr."""
    server = RawServer(*args)
    server.handshake()
    server.call(
        "process/start",
        {
            "processId": "p1",
            "argv": ["sh", "-c", "echo hi"],
            "cwd": "/",
            "env": {"PATH": "/usr/bin:/bin"},
            "tty": False,
        },
    )
    while server.read_message().get("method") != "process/closed":
        pass
    assert server.stop() == 0
    return server.stderr_text()


def test_default_logging_is_quiet_and_verbose_brings_it_back() -> None:
    assert _stdio_session() == ""
    verbose = _stdio_session("-v")
    assert "Main loop terminated" in verbose


def test_websocket_listener_logs_only_its_banner_by_default() -> None:
    # A client connects, runs a command and leaves; a probe asks /readyz.
    for args, noisy in (((), False), (("--verbose",), True)):
        with server_on_a_terminal("--listen", "ws://127.0.0.1:0", *args) as (proc, _):
            assert proc.stderr is not None
            err = Reader(proc.stderr.fileno())
            banner = b""
            while b"listening on" not in banner:
                banner = err.line()
            url = banner.split()[-1].decode()
            client = subprocess.run(
                [console_script("exec-server-client"), "run", "--url", url, "--", "true"],
                check=False,
                capture_output=True,
                timeout=30,
                env=server_env(),
                stdin=subprocess.DEVNULL,
            )
            assert client.returncode == 0, client.stderr
            host_port = url.removeprefix("ws://")
            with urllib.request.urlopen(f"http://{host_port}/readyz", timeout=TIMEOUT) as r:
                assert r.status == 200
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(TIMEOUT) == 0
            rest = err.data + err.rest()
        if noisy:
            assert b"Main loop terminated" in rest
        else:
            assert banner.startswith(b"exec-server listening on ws://127.0.0.1:")
            assert rest == b"", rest


def test_warnings_are_logged_without_verbose() -> None:
    server = RawServer()
    server.handshake()
    # A client that sends a response breaks the protocol: the server closes the
    # connection (and, on stdio, exits) and says why.
    server.send_raw(b'{"id":7,"result":{}}\n')
    assert server.stop() == 0
    assert "protocol error" in server.stderr_text()


def test_twistd_foreground_logs_to_stdout_with_websocket_listeners_only(tmp_path: Path) -> None:
    # What docs/operations.md says of `twistd -n` (for stdio, where the log
    # goes to stderr, see test_twistd_and_cli.py).
    proc = subprocess.Popen(
        [console_script("twistd"), "-n", "exec-server", "--listen", "ws://127.0.0.1:0"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=server_env(),
        cwd=str(tmp_path),
    )
    assert proc.stdout is not None and proc.stderr is not None
    try:
        err = Reader(proc.stderr.fileno())
        assert err.line().startswith(b"exec-server listening on ws://127.0.0.1:")
        # The listener is announced only once the reactor runs, so SIGTERM
        # right after the banner is already a clean stop.
        proc.send_signal(signal.SIGTERM)
        # After a clean stop twistd exits by re-raising the signal that stopped it.
        assert proc.wait(TIMEOUT) == -signal.SIGTERM
        out = Reader(proc.stdout.fileno()).rest()
        assert b"Main loop terminated." in out
        assert err.rest() == b""
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(TIMEOUT)
        proc.stdout.close()
        proc.stderr.close()


# --- README's 30-second session -------------------------------------------------------------


def readme_session() -> tuple[list[bytes], list[str]]:
    """The lines to paste and the answers README prints, from README.md itself."""
    text = README.read_text(encoding="utf-8")
    section = text.split("## A 30-second session", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```json\n(.*?)```", section, re.DOTALL)
    assert len(blocks) >= 2, "README's session needs a block to paste and one of answers"
    pasted = [line.encode() + b"\n" for line in blocks[0].splitlines() if line.strip()]
    answers = [line for line in blocks[1].splitlines() if line.strip()]
    return pasted, answers


def _elide(line: bytes) -> str:
    # The one field that differs between runs.
    return re.sub(r'"sessionId":"[^"]*"', '"sessionId":"…"', line.decode())


def test_readme_session_pasted_through_a_pipe_gives_the_printed_answers() -> None:
    pasted, answers = readme_session()
    proc = subprocess.Popen(
        [console_script("exec-server")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=server_env(),
        cwd=str(REPO_ROOT),
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        proc.stdin.write(b"".join(pasted))
        proc.stdin.flush()
        out = Reader(proc.stdout.fileno())
        got = [_elide(out.line()) for _ in answers]
        assert got == answers
        proc.stdin.close()  # Ctrl-D
        assert proc.wait(TIMEOUT) == 0
        assert out.rest() == b""  # nothing after the printed answers
        assert Reader(proc.stderr.fileno()).rest() == b""
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(TIMEOUT)
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.parametrize("pause", [0.0, 0.3], ids=["pasted", "typed"])
def test_readme_session_in_a_terminal_gives_the_printed_answers(pause: float) -> None:
    # A terminal hands the server one line per read. "typed": a person who
    # takes a moment per line; the answers must not depend on how long.
    pasted, answers = readme_session()
    with server_on_a_terminal() as (proc, master):
        assert proc.stdout is not None and proc.stderr is not None
        err = Reader(proc.stderr.fileno())
        assert err.line() == TTY_HINT.encode()
        out = Reader(proc.stdout.fileno())
        if pause:
            for line in pasted:
                os.write(master, line)
                out.pump(pause)
        else:
            os.write(master, b"".join(pasted))
        got = [_elide(out.line()) for _ in answers]
        assert got == answers
        os.write(master, b"\x04")
        assert proc.wait(TIMEOUT) == 0
        assert out.rest() == b""  # nothing after the printed answers
        assert err.rest() == b""
