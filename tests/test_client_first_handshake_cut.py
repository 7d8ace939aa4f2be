"""A connection cut during the FIRST ``initialize`` is re-dialled, not fatal.

Before any session exists a cut leaves nothing to resume, but nothing was
started either: ``exec-server-client run`` over ``--url``, the asyncio
client (``resume=True``) with the blocking one on it, and the Twisted
``ReconnectingClient`` dial again within their retry budget (docs/client.md,
"Dropped connections"), and say so clearly when every attempt is cut.
The cut is made by the test-only proxy the resume tests use
(:mod:`tests.support.cutting_proxy`), a few bytes into the server's answer
to ``initialize`` (right after its WebSocket upgrade answer, whose length
the test measures on the server itself).
"""

from __future__ import annotations

import socket
import sys
from typing import Any

import pytest_twisted
from twisted.internet import threads

from execserver import aio, sync
from tests.support.aio_harness import in_asyncio
from tests.support.children import Collected
from tests.support.cutting_proxy import CuttingProxy
from tests.support.harness import (
    DEFAULT_TIMEOUT,
    child_env,
    console_script,
    observe,
    reactor,
    with_timeout,
)
from tests.support.streams import reconnecting
from tests.support.ws_harness import WsServerProcess

#: Bytes of the ``initialize`` answer that get through before the cut.
INTO_THE_ANSWER = 8


def _upgrade_answer_bytes(host: str, port: int) -> int:
    """The length of the server's ``101`` answer to a WebSocket upgrade."""
    with socket.create_connection((host, port), timeout=DEFAULT_TIMEOUT) as sock:
        sock.sendall(
            b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            b"Sec-WebSocket-Version: 13\r\n\r\n"
        )
        answer = b""
        while b"\r\n\r\n" not in answer:
            data = sock.recv(4096)
            assert data, answer
            answer += data
    assert answer.startswith(b"HTTP/1.1 101"), answer
    return answer.index(b"\r\n\r\n") + 4


class CutsHandshakes(CuttingProxy):
    """Cuts the next ``times`` connections a few bytes into their ``initialize`` answer."""

    def __init__(self, target: tuple[str, int], upgrade_bytes: int, times: int) -> None:
        super().__init__(target)
        self.upgrade_bytes = upgrade_bytes
        self.times = times

    def arm(self) -> None:
        if self.times > 0:
            self.times -= 1
            self.cut_after(self.upgrade_bytes + INTO_THE_ANSWER)

    def cut(self) -> None:
        super().cut()
        self.arm()  # the next connection's bytes are counted from here


async def cutting(server: WsServerProcess, times: int) -> CutsHandshakes:
    host, port = server.host_port[0], server.host_port[1]
    upgrade = await threads.deferToThread(_upgrade_answer_bytes, host, port)
    proxy = CutsHandshakes((host, port), upgrade, times)
    await proxy.start()
    proxy.arm()
    return proxy


async def run_cli(*argv: str) -> tuple[int | None, Collected]:
    proto = Collected()
    argv = (console_script("exec-server-client"), *argv)
    reactor.spawnProcess(proto, argv[0], argv, env=child_env(), path="/")
    try:
        code = await with_timeout(observe(proto.ended), 60.0, "the CLI to finish")
    finally:
        proto.kill()
    return code, proto


@pytest_twisted.ensureDeferred
async def test_cli_run_redials_after_a_cut_in_the_first_handshake() -> None:
    server = await WsServerProcess.start()
    proxy = await cutting(server, times=1)
    try:
        code, proto = await run_cli(
            "run", "--url", proxy.url, "--", sys.executable, "-c", "print('ran'); exit(7)"
        )
        assert proxy.cuts == 1  # the cut was made, in the first handshake
        assert proxy.accepted == 2, "dialled again"
        assert (code, proto.out) == (7, b"ran\n"), proto.err
        assert proto.err == b""
    finally:
        await proxy.stop()
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_cli_run_reports_clearly_when_every_handshake_is_cut() -> None:
    server = await WsServerProcess.start()
    proxy = await cutting(server, times=1_000)
    try:
        code, proto = await run_cli(
            "run", "--url", proxy.url, "--session-ttl-ms", "1000", "--", "true"
        )
        assert code == 255, proto.err
        assert proxy.accepted >= 3, "retried with backoff within the budget"
        lines = proto.err.decode().splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith(
            f"exec-server-client: cannot connect to {proxy.url}: the connection was lost "
            "during the handshake (re-dialled within 1 s, --session-ttl-ms): "
        ), lines
    finally:
        await proxy.stop()
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_cli_session_ttl_0_still_fails_at_the_first_cut() -> None:
    """``--session-ttl-ms 0`` asks for no riding through drops: exit 255 as before."""
    server = await WsServerProcess.start()
    proxy = await cutting(server, times=1)
    try:
        code, proto = await run_cli(
            "run", "--url", proxy.url, "--session-ttl-ms", "0", "--", "true"
        )
        assert code == 255, proto.err
        assert proxy.accepted == 1
        assert proto.err.startswith(b"exec-server-client: "), proto.err
    finally:
        await proxy.stop()
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_aio_connect_redials_after_a_cut_in_the_first_handshake() -> None:
    server = await WsServerProcess.start()
    proxy = await cutting(server, times=2)

    async def scenario() -> Any:
        async with aio.connect(proxy.url, connect_timeout=5.0) as client:
            result = await client.run([sys.executable, "-c", "print('ran')"], env=child_env())
            return result.stdout, result.exit_code, client.resumes

    try:
        outcome = await in_asyncio(scenario)
        assert outcome == (b"ran\n", 0, 0)
        assert proxy.cuts == 2
        assert proxy.accepted == 3
    finally:
        await proxy.stop()
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_aio_connect_gives_up_clearly_when_every_handshake_is_cut() -> None:
    server = await WsServerProcess.start()
    proxy = await cutting(server, times=1_000)

    async def scenario() -> str:
        try:
            await aio.connect(proxy.url, connect_timeout=5.0, session_ttl_ms=1000)
        except aio.ConnectFailed as exc:
            return str(exc)
        raise AssertionError("connected through a proxy that cuts every handshake")

    try:
        message = await in_asyncio(scenario)
        assert message.startswith(
            f"cannot connect to {proxy.url}: the connection was lost during the "
            "handshake (re-dialled within 1 s): "
        ), message
        assert proxy.accepted >= 3
    finally:
        await proxy.stop()
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_sync_connect_redials_after_a_cut_in_the_first_handshake() -> None:
    """The blocking client wraps the asyncio one: the same re-dial, within its bound."""
    server = await WsServerProcess.start()
    proxy = await cutting(server, times=1)

    def scenario() -> tuple[bytes, int | None]:
        with sync.connect(proxy.url, connect_timeout=5.0) as client:
            result = client.run([sys.executable, "-c", "print('ran')"], env=child_env())
            return result.stdout, result.exit_code

    try:
        assert await threads.deferToThread(scenario) == (b"ran\n", 0)
        assert (proxy.cuts, proxy.accepted) == (1, 2)
    finally:
        await proxy.stop()
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_reconnecting_client_redials_after_a_cut_in_the_first_handshake() -> None:
    server = await WsServerProcess.start()
    proxy = await cutting(server, times=1)
    client = reconnecting(proxy.url, session_ttl_ms=30_000)
    client.start()
    try:
        connected = await with_timeout(client.when_connected(), DEFAULT_TIMEOUT, "a connection")
        assert proxy.cuts == 1
        assert client.connect_count == 1
        listed = await client.list_processes()
        assert listed.processes == []
        assert connected.session_id is not None
    finally:
        await client.stop()
        await proxy.stop()
        await server.stop()
