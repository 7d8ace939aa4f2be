"""What a new user and an attacker hit at the edge (issue 22, item 15 and the frictions).

Through the real installed server: duplicate ``Host``/``Authorization``
headers are refused with 400 (the last one used to win), ``/readyz``
answers a body, anything but a stale socket at a ``unix://`` path is named
precisely (and left alone), and a bad ``--listen`` lists every accepted form.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import pytest_twisted
from twisted.internet import reactor

from tests.support.harness import run_script
from tests.support.ws_harness import WsServerProcess, get_request, http_get

TOKEN = "token-of-the-edge-tests-0123456789"


@pytest_twisted.ensureDeferred
async def test_duplicate_host_or_authorization_headers_are_refused_with_400(
    tmp_path: Path,
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    tokens.chmod(0o600)
    server = await WsServerProcess.start("--auth-token-file", str(tokens))
    host, port = server.host_port
    bearer = f"Authorization: Bearer {TOKEN}\r\n"
    try:
        status, _, body = await http_get(host, port, get_request("/metrics", bearer))
        assert status == 200
        # A second Host (the first a loopback name, the last not, or the reverse).
        for extra in ("Host: evil.example\r\n", "Host: 127.0.0.1\r\n"):
            status, _, body = await http_get(host, port, get_request("/metrics", bearer + extra))
            assert (status, body) == (
                400,
                b"the request carries more than one Host header; send one\n",
            )
        # Two tokens, the good one last (or first): refused either way.
        for extra in (f"Authorization: Bearer wrong\r\n{bearer}", f"{bearer}Authorization: x\r\n"):
            status, _, body = await http_get(host, port, get_request("/metrics", extra))
            assert (status, body) == (
                400,
                b"the request carries more than one Authorization header; send one\n",
            )
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_readyz_answers_a_short_body() -> None:
    server = await WsServerProcess.start()
    host, port = server.host_port
    try:
        status, headers, body = await http_get(host, port, get_request("/readyz"))
        assert (status, body, headers["content-length"]) == (200, b"ready\n", "6")
    finally:
        assert await server.stop() == 0


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    # (AF_UNIX paths are short: not under pytest's deep tmp_path.)
    path = Path(tempfile.mkdtemp(prefix="exec-server-edge-"))
    try:
        yield path
    finally:
        shutil.rmtree(path)


@pytest.mark.parametrize("kind", ["regular file", "symbolic link", "directory"])
def test_a_unix_path_that_is_not_a_socket_is_named_and_left_alone(
    socket_dir: Path, kind: str
) -> None:
    path = socket_dir / "exec.sock"
    target = socket_dir / "target"
    target.write_text("keep me\n")
    if kind == "regular file":
        path.write_text("keep me\n")
    elif kind == "symbolic link":
        path.symlink_to(target)
    else:
        path.mkdir()
    done = run_script("exec-server", "--listen", f"unix://{path}", text=True)
    assert done.returncode == 1
    assert (
        f"exec-server: cannot start: cannot listen on unix://{path}: {path} is a {kind}, "
        "not a socket; it is left alone: remove it or choose another path"
    ) in done.stderr
    assert "Errno" not in done.stderr
    assert os.path.lexists(path)
    assert target.read_text() == "keep me\n"


def test_an_unsupported_listen_url_lists_every_accepted_form() -> None:
    done = run_script("exec-server", "--listen", "stdio://x", text=True)
    assert done.returncode != 0
    assert (
        "unsupported --listen URL `stdio://x`; expected `stdio://` or `ws://IP:PORT` "
        "(or `wss://IP:PORT`, `unix:///ABSOLUTE/PATH`)"
    ) in done.stderr


@pytest_twisted.ensureDeferred
async def test_ws_to_a_wss_port_says_use_wss(tmp_path: Path) -> None:
    from execserver.client import connect_websocket
    from execserver.client.errors import ConnectFailed
    from tests.support.harness import DEFAULT_TIMEOUT, with_timeout
    from tests.support.tls import Pki, start_wss

    server = await start_wss(Pki(tmp_path))
    plain = server.url.replace("wss://", "ws://")
    try:
        with pytest.raises(ConnectFailed) as failed:
            await with_timeout(
                connect_websocket(reactor, plain), DEFAULT_TIMEOUT, f"connect to {plain}"
            )
        assert str(failed.value) == (
            f"cannot connect to {plain}: the server speaks TLS here: "
            f"use wss://{plain.removeprefix('ws://')}"
        )
        # The client command says the same.
        done = run_script("exec-server-client", "run", "--url", plain, "--", "true", text=True)
        assert done.returncode == 255
        assert "the server speaks TLS here: use wss://" in done.stderr
    finally:
        assert await server.stop() == 0
