"""``--listen unix:///PATH``: the socket's permissions, the client library and the CLI."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import pytest_twisted
from twisted.internet import reactor

from execserver.client import connect_websocket
from execserver.client.errors import ConnectFailed
from execserver.service import Options
from execserver.transports.listen import ListenUrlError, UnixAddress, parse_listen_url
from tests.support.harness import DEFAULT_TIMEOUT, run_script, with_timeout
from tests.support.ws_harness import WsServerProcess

NOBODY = 65534


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    # Outside pytest's 0700 tmp tree, so that only the socket's own mode
    # decides whether another user may connect.
    path = Path(tempfile.mkdtemp(prefix="exec-server-unix-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_unix_urls_parse() -> None:
    assert parse_listen_url("unix:///run/x.sock") == UnixAddress("/run/x.sock")
    for bad in ("unix://relative.sock", "unix:///dir/", "unix://"):
        with pytest.raises(ListenUrlError, match="expected `unix:///ABSOLUTE/PATH`"):
            parse_listen_url(bad)
    assert "mode=660" in UnixAddress("/a").endpoint_description(0o660)


def test_socket_mode_option() -> None:
    options = Options()
    options.parseOptions(["--listen", "unix:///tmp/x.sock", "--socket-mode", "0660"])
    assert options.websocket_settings().socket_mode == 0o660
    from twisted.python import usage

    with pytest.raises(usage.UsageError, match="--socket-mode takes octal"):
        Options().parseOptions(["--socket-mode", "999"])


@pytest_twisted.ensureDeferred
async def test_unix_listener_mode_client_and_cli(socket_dir: Path) -> None:
    path = socket_dir / "exec.sock"
    server = await WsServerProcess.start("--listen", f"unix://{path}")
    try:
        assert server.url == f"unix://{path}"
        info = os.stat(path)
        assert stat.S_ISSOCK(info.st_mode)
        assert stat.S_IMODE(info.st_mode) == 0o600
        client = await with_timeout(
            connect_websocket(reactor, f"unix://{path}"), DEFAULT_TIMEOUT, "unix connect"
        )
        assert client.session_id
        await client.close()
        done = run_script(
            "exec-server-client",
            *("run", "--url", f"unix://{path}", "--", "echo", "over-a-unix-socket"),
        )
        assert (done.returncode, done.stdout) == (0, b"over-a-unix-socket\n"), done.stderr
    finally:
        assert await server.stop() == 0
    # A clean stop removes the socket file.
    assert not path.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
@pytest_twisted.ensureDeferred
async def test_another_uid_is_refused_by_the_kernel(socket_dir: Path) -> None:
    path = socket_dir / "exec.sock"
    server = await WsServerProcess.start("--listen", f"unix://{path}")
    probe = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n"
        "    s.connect(sys.argv[1])\n"
        "except PermissionError:\n"
        "    print('refused')\n"
        "else:\n"
        "    print('connected')\n"
    )
    try:
        done = subprocess.run(
            ["python3", "-c", probe, str(path)],
            user=NOBODY,
            capture_output=True,
            timeout=60,
            check=False,
        )
        assert done.stdout == b"refused\n", done.stderr
        # The same probe as the server's own uid connects.
        done = subprocess.run(
            ["python3", "-c", probe, str(path)], capture_output=True, timeout=60, check=False
        )
        assert done.stdout == b"connected\n", done.stderr
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_socket_mode_and_stale_socket_file(socket_dir: Path) -> None:
    path = socket_dir / "exec.sock"
    # A socket file left behind by a server that died is replaced.
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()
    server = await WsServerProcess.start("--listen", f"unix://{path}", "--socket-mode", "0660")
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
        # A second server on the socket of a live one is refused, and the
        # live one's socket is left alone.
        done = run_script("exec-server", "--listen", f"unix://{path}", text=True)
        assert done.returncode != 0
        assert "Address already in use" in done.stderr
        assert stat.S_ISSOCK(os.stat(path).st_mode)
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_client_names_a_missing_socket() -> None:
    with pytest.raises(ConnectFailed, match=r"unix:///nonexistent/exec\.sock"):
        await with_timeout(
            connect_websocket(reactor, "unix:///nonexistent/exec.sock"),
            DEFAULT_TIMEOUT,
            "unix connect",
        )
