"""Authentication and the Host check, through the real server over real sockets.

docs/operations.md, "Security": every status code and header promised
there is produced here by a real client of a real ``exec-server``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import pytest_twisted

from execserver import auth
from execserver.service import Options
from execserver.transports import http
from tests.support.auth import NEAR_MISS, OTHER, TOKEN, token_file, wait_stderr
from tests.support.harness import console_script, server_env
from tests.support.ws_harness import WsServerProcess, connect, get_request, http_get


def upgrade_request(extra: str = "", host: str = "127.0.0.1") -> bytes:
    return (
        f"GET / HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
        f"{extra}\r\n"
    ).encode()


def run_server_expecting_refusal(*args: str, env: dict[str, str] | None = None) -> str:
    """Run ``exec-server`` that must refuse to start; its stderr."""
    done = subprocess.run(
        [console_script("exec-server"), *args],
        check=False,
        env=server_env(env),
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode != 0, done.stderr
    assert "Traceback" not in done.stderr
    return done.stderr


@pytest_twisted.ensureDeferred
async def test_bearer_token_statuses_headers_and_secrecy(tmp_path: Path) -> None:
    path = token_file(tmp_path, TOKEN, OTHER)
    server = await WsServerProcess.start("--auth-token-file", str(path), "--verbose")
    host, port = server.host_port
    try:
        for extra in (
            "",
            "Authorization: Bearer wrong\r\n",
            f"Authorization: Bearer {NEAR_MISS}\r\n",
            f"Authorization: Basic {TOKEN}\r\n",
            f"Authorization: Bearer {TOKEN}x\r\n",
        ):
            status, headers, body = await http_get(host, port, upgrade_request(extra))
            assert (status, headers["www-authenticate"]) == (401, "Bearer"), extra
            assert TOKEN.encode() not in body
        # Right tokens (either of the file's) upgrade and get a session.
        for token in (TOKEN, OTHER):
            client = await connect(server.url, headers={"Authorization": f"Bearer {token}"})
            init = await client.handshake()
            assert init["sessionId"]
            await client.close()
        # readyz needs no token; metrics does.
        status, _, _ = await http_get(host, port, get_request("/readyz"))
        assert status == 200
        for extra in ("", f"Authorization: Bearer {NEAR_MISS}\r\n"):
            status, headers, _ = await http_get(host, port, get_request("/metrics", extra))
            assert (status, headers["www-authenticate"]) == (401, "Bearer")
        status, _, metrics = await http_get(
            host, port, get_request("/metrics", f"Authorization: Bearer {TOKEN}\r\n")
        )
        assert status == 200
        # Refusals created no session and started nothing.
        assert b"exec_server_connections_opened_total 2" in metrics
        assert b"exec_server_processes_started_total 0" in metrics
        assert b"exec_server_auth_refused_total 7" in metrics
        assert TOKEN.encode() not in metrics and OTHER.encode() not in metrics
    finally:
        assert await server.stop() == 0
    for secret in (TOKEN, OTHER, NEAR_MISS):
        assert secret.encode() not in server.stderr


@pytest_twisted.ensureDeferred
async def test_sighup_rereads_tokens_and_open_connections_keep_theirs(tmp_path: Path) -> None:
    path = token_file(tmp_path, TOKEN)
    server = await WsServerProcess.start("--auth-token-file", str(path), "--verbose")
    host, port = server.host_port
    try:
        kept = await connect(server.url, headers={"Authorization": f"Bearer {TOKEN}"})
        await kept.handshake()
        path.write_text(OTHER + "\n")
        server._signal("HUP")
        await wait_stderr(server, b"SIGHUP: 1 token(s) loaded")
        status, _, _ = await http_get(
            host, port, upgrade_request(f"Authorization: Bearer {TOKEN}\r\n")
        )
        assert status == 401
        fresh = await connect(server.url, headers={"Authorization": f"Bearer {OTHER}"})
        await fresh.handshake()
        # The connection opened with the retired token still works.
        started = await kept.start_process("p", ["true"])
        assert started == {"processId": "p"}
        await kept.wait_closed("p")
        await kept.close()
        await fresh.close()
    finally:
        assert await server.stop() == 0
    assert TOKEN.encode() not in server.stderr and OTHER.encode() not in server.stderr


@pytest_twisted.ensureDeferred
async def test_token_from_environment() -> None:
    server = await WsServerProcess.start(env={auth.TOKEN_ENV: TOKEN})
    host, port = server.host_port
    try:
        status, _, _ = await http_get(host, port, upgrade_request())
        assert status == 401
        client = await connect(server.url, headers={"Authorization": f"Bearer {TOKEN}"})
        await client.handshake()
        await client.close()
    finally:
        assert await server.stop() == 0
    assert TOKEN.encode() not in server.stderr


def test_environment_token_is_removed_from_the_server_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    options = Options()
    options.parseOptions(["--listen", "ws://127.0.0.1:0"])
    assert auth.TOKEN_ENV not in os.environ
    store = options.websocket_settings().auth
    assert store is not None
    assert store.authenticate(f"Bearer {TOKEN}") == auth.identity_of(TOKEN.encode())


def test_token_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    path = token_file(tmp_path, TOKEN, mode=0o640)
    stderr = run_server_expecting_refusal(
        "--listen", "ws://127.0.0.1:0", "--auth-token-file", str(path)
    )
    assert "accessible by group or other users (mode 0640)" in stderr
    assert "chmod 600" in stderr
    assert TOKEN not in stderr


def test_non_loopback_listener_without_auth_is_refused() -> None:
    stderr = run_server_expecting_refusal("--listen", "ws://0.0.0.0:0")
    assert "refusing to listen on ws://0.0.0.0:0 without authentication" in stderr
    assert "--allow-unauthenticated" in stderr


@pytest_twisted.ensureDeferred
async def test_allow_unauthenticated_warns_on_start() -> None:
    server = await WsServerProcess.start("--listen", "ws://0.0.0.0:0", "--allow-unauthenticated")
    try:
        assert b"is not a loopback address and has no authentication" in server.stderr
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_loopback_listener_refuses_foreign_host() -> None:
    server = await WsServerProcess.start()
    host, port = server.host_port
    try:
        for name in ("evil.example", "evil.example:80", "10.0.0.1", "127.0.0.1.evil.example"):
            status, _, body = await http_get(
                host, port, f"GET /readyz HTTP/1.1\r\nHost: {name}\r\n\r\n".encode()
            )
            assert status == 403, name
            assert b"DNS rebinding" in body
            status, _, _ = await http_get(host, port, upgrade_request(host=name))
            assert status == 403, name
        for name in (
            "localhost",
            f"localhost:{port}",
            f"127.0.0.1:{port}",
            "[::1]:1",
            "a.localhost",
        ):
            status, _, _ = await http_get(
                host, port, f"GET /readyz HTTP/1.1\r\nHost: {name}\r\n\r\n".encode()
            )
            assert status == 200, name
        client = await connect(server.url)
        await client.handshake()
        await client.close()
    finally:
        assert await server.stop() == 0


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("localhost", True),
        ("LOCALHOST:8765", True),
        ("localhost.", True),
        ("x.localhost", True),
        ("127.0.0.1", True),
        ("127.1.2.3:9", True),
        ("[::1]", True),
        ("[::1]:8765", True),
        ("::1", False),
        ("[::1]x", False),
        ("localhost:http", False),
        ("localhost.evil.example", False),
        ("evil.example", False),
        ("0.0.0.0", False),
        ("", False),
    ],
)
def test_host_is_loopback(host: str, loopback: bool) -> None:
    assert http.host_is_loopback(host) is loopback


def test_token_store_parsing_and_identity() -> None:
    store = auth.TokenStore(auth.parse_tokens(b"# c\n\n a \nb\n", "f"))
    assert store.count == 2
    assert store.authenticate("Bearer a") == auth.identity_of(b"a")
    assert store.authenticate("bearer  b ") == auth.identity_of(b"b")
    assert store.authenticate("Bearer c") is None
    assert store.authenticate(None) is None
    assert store.authenticate("Bearer") is None
    assert TOKEN not in str(auth.identity_of(TOKEN.encode()))
    assert auth.identity_of(b"a") != auth.identity_of(b"b")
    with pytest.raises(auth.AuthConfigError, match="holds no token"):
        auth.parse_tokens(b"# only a comment\n", "f")
    with pytest.raises(auth.AuthConfigError, match="printable ASCII"):
        auth.parse_tokens(b"a b\n", "f")


@pytest_twisted.ensureDeferred
async def test_a_session_is_resumed_only_with_the_token_that_created_it(tmp_path: Path) -> None:
    path = token_file(tmp_path, TOKEN, OTHER)
    server = await WsServerProcess.start("--auth-token-file", str(path), "--verbose")
    try:
        owner = await connect(server.url, headers={"Authorization": f"Bearer {TOKEN}"})
        init = await owner.call("initialize", {"clientName": "t", "sessionTtlMs": 60_000})
        await owner.close()
        session_id = init["sessionId"]
        thief = await connect(server.url, headers={"Authorization": f"Bearer {OTHER}"})
        reply = await thief.request(
            "initialize", {"clientName": "t", "resumeSessionId": session_id}
        )
        assert "error" in reply and "result" not in reply
        await thief.close()
        back = await connect(server.url, headers={"Authorization": f"Bearer {TOKEN}"})
        resumed = await back.call("initialize", {"clientName": "t", "resumeSessionId": session_id})
        assert resumed["sessionId"] == session_id
        await back.close()
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_no_child_inherits_the_environment_token() -> None:
    server = await WsServerProcess.start(env={auth.TOKEN_ENV: TOKEN})
    try:
        client = await connect(server.url, headers={"Authorization": f"Bearer {TOKEN}"})
        await client.call("initialize", {"clientName": "t", "resumeSessionId": None})
        client.notify("initialized", {})
        # Everything the server has, default excludes (*TOKEN*) switched off.
        policy = {"inherit": "all", "ignoreDefaultExcludes": True}
        await client.start_process("env", ["env"], env={}, envPolicy=policy)
        await client.wait_closed("env")
        output = client.output_of("env")
        assert b"PATH=" in output  # the server's environment was inherited...
        assert TOKEN.encode() not in output  # ...without the token
        assert auth.TOKEN_ENV.encode() not in output
        await client.close()
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_a_failed_reload_keeps_the_previous_tokens(tmp_path: Path) -> None:
    path = token_file(tmp_path, TOKEN)
    server = await WsServerProcess.start("--auth-token-file", str(path))
    server.allow_stderr(r"SIGHUP: keeping the previous tokens")
    host, port = server.host_port
    try:
        path.write_text(OTHER + "\n")
        path.chmod(0o644)
        server._signal("HUP")
        await wait_stderr(server, b"SIGHUP: keeping the previous tokens")
        assert b"accessible by group or other users (mode 0644)" in server.stderr
        client = await connect(server.url, headers={"Authorization": f"Bearer {TOKEN}"})
        await client.handshake()
        await client.close()
        status, _, _ = await http_get(
            host, port, upgrade_request(f"Authorization: Bearer {OTHER}\r\n")
        )
        assert status == 401
    finally:
        assert await server.stop() == 0
    assert TOKEN.encode() not in server.stderr and OTHER.encode() not in server.stderr
