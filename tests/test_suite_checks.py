"""The suite's own checks see what they must (issue 20, point 5).

Containment-failure warnings count as errors in a server's stderr, and the
servers that clients launch themselves (``--stdio``, ``connect()`` without
a URL) get the same check through their stderr copies in
``EXEC_SERVER_LOCAL_LOG_DIR``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from execserver import sync
from execserver.clientcore.framing import LOCAL_SERVER_LOG_DIR_ENV
from tests.support import server_checks
from tests.support.harness import NEUTRAL_CWD, console_script, server_env


def noisy_server(root: Path) -> str:
    """A server command that first writes a traceback header to its stderr."""
    script = root / "noisy-server"
    script.write_text(
        '#!/bin/sh\necho "Traceback (most recent call last):" >&2\n'
        f"exec {sys.executable} -m execserver\n"
    )
    script.chmod(0o755)
    return str(script)


@pytest.mark.parametrize(
    "line",
    [
        # The two warnings of execserver/processes.py, as the log prints them.
        b"2026-12-01T00:00:00+0000 [execserver.processes#warn] process p (pid 12): members "
        b"still alive 5 s after SIGKILL; no longer waiting for them",
        b"2026-12-01T00:00:00+0000 [execserver.processes#warn] process p (pid 12) output "
        b"still open after SIGKILL; closing it",
        b"Traceback (most recent call last):",
        b"2026-12-01T00:00:00+0000 [execserver.dispatcher#error] oops",
    ],
)
def test_containment_failures_count_as_errors(line: bytes) -> None:
    assert server_checks.forbidden_lines(b"fine\n" + line + b"\n") == [line]


def test_the_library_launched_servers_stderr_is_checked(tmp_path: Path) -> None:
    directory = os.environ[LOCAL_SERVER_LOG_DIR_ENV]
    with sync.connect(server_command=[noisy_server(tmp_path)]) as client:
        pid = client.aio.server_pid
        assert client.run(["true"], cwd="/").exit_code == 0
    # Read (and removed) here, so this test's own teardown check passes.
    [problem] = server_checks.check_local_server_logs(directory)
    assert problem.startswith(f"local server exec-server-{pid}.log (launched by a client)")
    assert "Traceback (most recent call last)" in problem


def test_the_cli_launched_servers_stderr_is_checked(tmp_path: Path) -> None:
    directory = os.environ[LOCAL_SERVER_LOG_DIR_ENV]
    argv = [console_script("exec-server-client"), "run", "--stdio"]
    argv += ["--server-command", noisy_server(tmp_path), "--", "true"]
    done = subprocess.run(
        argv, env=server_env(), cwd=NEUTRAL_CWD, capture_output=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    [problem] = server_checks.check_local_server_logs(directory)
    assert "Traceback (most recent call last)" in problem


def test_a_servers_host_port_is_its_first_tcp_listeners() -> None:
    # Before the fix host_port cut len("ws://") off the first URL: a wss://
    # server's host came out as "/127.0.0.1", a unix:// one's as garbage.
    from tests.support.ws_harness import WsServerProcess

    server = WsServerProcess(expected_urls=2)
    server.urls = ["wss://127.0.0.1:4443"]
    assert server.host_port == ("127.0.0.1", 4443)
    server.urls = ["unix:///run/x.sock", "ws://[::1]:8765"]
    assert server.host_port == ("::1", 8765)
    server.urls = ["unix:///run/x.sock"]
    with pytest.raises(AssertionError, match="no ws:// or wss:// listener"):
        _ = server.host_port


def test_tcp_address_reads_ws_and_wss_urls_only() -> None:
    from tests.support.ws_harness import tcp_address

    assert tcp_address("wss://localhost:9/some/path") == ("localhost", 9)
    assert tcp_address("ws://[::1]:80") == ("::1", 80)
    with pytest.raises(ValueError, match="not a ws:// or wss:// URL"):
        tcp_address("unix:///run/x.sock")
