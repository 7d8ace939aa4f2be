"""The edge limits of docs/operations.md ("Security", "Limits"), each reached by a test client
of the real server, with the documented answer, while the server still serves others."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest_twisted

from tests.support.harness import DEFAULT_TIMEOUT, RpcFailure, observe, with_timeout
from tests.support.metrics_probe import metric_at_least, open_idle
from tests.support.polling import until
from tests.support.ws_harness import WsServerProcess, connect, get_request, http_get

TOKEN_A = "token-of-identity-a-0123456789"
TOKEN_B = "token-of-identity-b-0123456789"


@pytest_twisted.ensureDeferred
async def test_max_connections_answers_503_and_frees_with_a_close() -> None:
    server = await WsServerProcess.start(
        "--max-connections", "3", "--handshake-timeout-ms", "60000"
    )
    host, port = server.host_port
    try:
        idle = [await open_idle(host, port) for _ in range(3)]
        status, headers, body = await http_get(host, port, get_request("/readyz"))
        assert (status, headers["retry-after"]) == (503, "1")
        assert b"--max-connections" in body
        idle.pop().transport.loseConnection()  # type: ignore[union-attr]

        async def ready() -> bool:
            status, _, _ = await http_get(host, port, get_request("/readyz"))
            return status == 200

        await until(ready, "a free connection slot", timeout=DEFAULT_TIMEOUT)
        for proto in idle:
            proto.transport.loseConnection()  # type: ignore[union-attr]
        # (Polls that found every slot taken were refused and counted too.)
        await until(
            lambda: metric_at_least(
                host, port, 'exec_server_refused_total{limit="connections"}', 1
            ),
            "the refusal counted",
            timeout=DEFAULT_TIMEOUT,
        )
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_slow_headers_are_dropped_after_the_handshake_timeout() -> None:
    server = await WsServerProcess.start("--handshake-timeout-ms", "300")
    host, port = server.host_port
    try:
        slow = await open_idle(host, port)
        slow.transport.write(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # type: ignore[union-attr]
        await with_timeout(observe(slow.lost), DEFAULT_TIMEOUT, "the slow client dropped")
        assert slow.data == b""
        # Others are served meanwhile and afterwards.
        client = await connect(server.url)
        await client.handshake()
        await client.close()
        body = (await http_get(host, port, get_request("/metrics")))[2]
        assert b'exec_server_refused_total{limit="handshake_timeout"} 1' in body
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_request_head_size_limit() -> None:
    server = await WsServerProcess.start("--max-request-head-bytes", "2048")
    host, port = server.host_port
    try:
        big = get_request("/readyz", "X-Filler: " + "a" * 3000 + "\r\n")
        status, _, body = await http_get(host, port, big)
        assert status == 431
        assert body == b"request head exceeds 2048 bytes (--max-request-head-bytes)\n"
        status, _, _ = await http_get(host, port, get_request("/readyz", "X-Small: b\r\n"))
        assert status == 200
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_sessions_per_identity(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN_A}\n{TOKEN_B}\n")
    tokens.chmod(0o600)
    server = await WsServerProcess.start(
        "--auth-token-file", str(tokens), "--max-sessions-per-identity", "2"
    )
    a_headers = {"Authorization": f"Bearer {TOKEN_A}"}
    try:
        first = await connect(server.url, headers=a_headers)
        await first.handshake()
        # A detached (resumable) session counts too.
        second = await connect(server.url, headers=a_headers)
        kept = await second.call("initialize", {"clientName": "t", "sessionTtlMs": 60_000})
        await second.close()
        third = await connect(server.url, headers=a_headers)
        reply = await third.request("initialize", {"clientName": "t"})
        assert reply["error"]["code"] == -32600
        assert re.fullmatch(
            r"too many sessions: token:[0-9a-f]{24} already holds 2, the limit set by "
            r"--max-sessions-per-identity is 2; close or resume one",
            reply["error"]["message"],
        )
        # Resuming one of its own is always allowed; another identity is unaffected.
        resumed = await third.call(
            "initialize", {"clientName": "t", "resumeSessionId": kept["sessionId"]}
        )
        assert resumed["sessionId"] == kept["sessionId"]
        other = await connect(server.url, headers={"Authorization": f"Bearer {TOKEN_B}"})
        await other.handshake()
        for client in (first, third, other):
            await client.close()
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_processes_per_server() -> None:
    server = await WsServerProcess.start("--max-server-processes", "2")
    try:
        one = await connect(server.url)
        await one.handshake()
        two = await connect(server.url)
        await two.handshake()
        await one.start_process("a", ["sleep", "60"])
        await two.start_process("b", ["sleep", "60"])
        try:
            await one.start_process("c", ["true"])
        except RpcFailure as exc:
            error: dict[str, Any] = {"code": exc.code, "message": exc.message}
        else:
            raise AssertionError("a third process was started")
        assert error["code"] == -32600
        assert error["message"] == (
            "too many running processes: the server already runs 2, "
            "the limit set by --max-server-processes is 2"
        )
        # Both sessions are still served.
        assert await two.call("process/read", {"processId": "b"}) is not None
        for client, pid in ((one, "a"), (two, "b")):
            await client.call("process/terminate", {"processId": pid})
            await client.wait_closed(pid)
        await one.start_process("d", ["true"])
        await one.wait_closed("d")
        await one.close()
        await two.close()
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_total_retained_output_refuses_new_processes() -> None:
    server = await WsServerProcess.start("--max-total-retained-bytes", "4096")
    try:
        one = await connect(server.url)
        await one.handshake()
        await one.start_process("big", ["head", "-c", "8192", "/dev/zero"])
        await one.wait_closed("big")
        two = await connect(server.url)
        await two.handshake()
        try:
            await two.start_process("next", ["true"])
        except RpcFailure as exc:
            error: dict[str, Any] = {"code": exc.code, "message": exc.message}
        else:
            raise AssertionError("a process was started over the retained-output limit")
        assert error["code"] == -32600
        assert re.fullmatch(
            r"the server retains \d+ bytes of output, the limit set by "
            r"--max-total-retained-bytes is 4096: read, close or wait for processes "
            r"to be removed before starting more",
            error["message"],
        )
        # Other requests are still answered.
        read = await one.call("process/read", {"processId": "big"})
        assert read is not None
        await one.close()
        await two.close()
    finally:
        assert await server.stop() == 0
