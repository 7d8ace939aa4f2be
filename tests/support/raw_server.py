"""A blocking client for the real server over raw pipes (no reactor).

For tests that must control exactly when the server's stdout is read (flow
control) or that drive many hypothesis examples against one server. Every
read has a deadline; :meth:`RawServer.stop` always leaves no process behind,
and at teardown the server's stderr and exit status are checked like every
harness server's (``tests/support/server_checks.py``).
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.support.harness import REPO_ROOT, console_script, server_env
from tests.support.server_checks import ServerChecks

_decode = msgspec.json.Decoder().decode


class RawServer(ServerChecks):
    def __init__(
        self, *args: str, command: list[str] | None = None, cwd: str | None = None
    ) -> None:
        """Run the installed ``exec-server ARGS`` (or ``command``)."""
        # Closed with the RawServer; a context manager cannot span its life.
        self.stderr_file = tempfile.TemporaryFile()  # noqa: SIM115
        argv = command or [console_script("exec-server"), *args]
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr_file,
            env=server_env(),
            cwd=cwd or str(REPO_ROOT),
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin = self.proc.stdin
        self.stdout_fd = self.proc.stdout.fileno()
        self.pid = self.proc.pid
        self._buffer = b""
        self._lines: list[bytes] = []
        self._backlog: list[dict[str, Any]] = []
        self._next_id = 1
        self.eof = False
        self._init_checks(f"{' '.join(argv)} (raw pipes, pid {self.pid})")

    # --- sending ------------------------------------------------------------------------

    def send_raw(self, data: bytes) -> None:
        self.stdin.write(data)
        self.stdin.flush()

    def send(self, message: dict[str, Any]) -> None:
        self.send_raw(msgspec.json.encode(message) + b"\n")

    def request(self, method: str, params: Any = None) -> Any:
        request_id = self._next_id
        self._next_id += 1
        message: dict[str, Any] = {"id": request_id, "method": method}
        if params is not None:
            message["params"] = params
        self.send(message)
        return request_id

    def call(self, method: str, params: Any = None, timeout: float = 10.0) -> Any:
        """Request and wait for its result; messages read meanwhile stay queued."""
        request_id = self.request(method, params)
        skipped: list[dict[str, Any]] = []
        try:
            while True:
                message = self._read_new(timeout)
                if message.get("id") == request_id and ("result" in message or "error" in message):
                    assert "error" not in message, message
                    return message["result"]
                skipped.append(message)
        finally:
            # Notifications may precede the answer (e.g. a fast child's output
            # before its process/start result); later reads still see them.
            self._backlog.extend(skipped)

    def handshake(self) -> Any:
        result = self.call("initialize", {"clientName": "raw"})
        self.send({"method": "initialized", "params": {}})
        return result

    # --- receiving ----------------------------------------------------------------------

    def read_line(self, timeout: float = 10.0) -> bytes:
        deadline = time.monotonic() + timeout
        while not self._lines:
            if self.eof:
                raise EOFError("server closed its stdout")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no line from the server within {timeout}s")
            ready, _, _ = select.select([self.stdout_fd], [], [], remaining)
            if not ready:
                continue
            data = os.read(self.stdout_fd, 1 << 20)
            if not data:
                self.eof = True
                continue
            *lines, self._buffer = (self._buffer + data).split(b"\n")
            self._lines.extend(line for line in lines if line)
        return self._lines.pop(0)

    def read_message(self, timeout: float = 10.0) -> dict[str, Any]:
        if self._backlog:
            return self._backlog.pop(0)
        return self._read_new(timeout)

    def _read_new(self, timeout: float) -> dict[str, Any]:
        message: dict[str, Any] = _decode(self.read_line(timeout))
        return message

    # --- ending -------------------------------------------------------------------------

    def stop(self, timeout: float = 10.0) -> int:
        """Close stdin, drain stdout, wait for exit; SIGKILL if it does not exit in time."""
        if not self.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self.stdin.close()
        deadline = time.monotonic() + timeout
        try:
            while not self.eof and time.monotonic() < deadline:
                ready, _, _ = select.select([self.stdout_fd], [], [], 0.5)
                if ready and not os.read(self.stdout_fd, 1 << 20):
                    self.eof = True
            return self.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.harness_killed = True
            self.proc.kill()
            self.proc.wait(timeout)
            raise
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()

    def stderr_text(self) -> str:
        return self.stderr_bytes().decode(errors="replace")

    # --- teardown checks ----------------------------------------------------------------

    def stderr_bytes(self) -> bytes:
        self.stderr_file.seek(0)
        return self.stderr_file.read()

    def exit_status(self) -> tuple[int | None, int | None] | None:
        code = self.proc.poll()
        if code is None:
            return None
        return (None, -code) if code < 0 else (code, None)

    def stop_for_teardown(self) -> None:
        self.stop()


@pytest.fixture(name="server")
def handshaken_raw_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RawServer]:
    """A :class:`RawServer` past the handshake, its state directory in ``tmp_path``,
    stopped (and required to exit 0) after the test. Import it to use it as
    the fixture ``server``."""
    monkeypatch.setenv("EXECSERVER_STATE_DIR", str(tmp_path / "state"))
    started = RawServer()
    started.handshake()
    try:
        yield started
    finally:
        assert started.stop() == 0
