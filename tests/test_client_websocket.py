"""The WebSocket client and the reconnecting client, against a test-local Autobahn server.

``LocalWsServer`` runs on 127.0.0.1 in front of a real dispatcher, so these
tests exercise the real Autobahn client handshake, the bearer token, the
connect and initialize timeouts, and reconnection across a server restart.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any

import pytest
import pytest_twisted
from twisted.internet.defer import Deferred
from twisted.internet.protocol import Factory, Protocol

from execserver.client import (
    AuthRefused,
    ConnectFailed,
    ConnectionClosed,
    ConnectOptions,
    ConnectTimeout,
    ExecServerClient,
    InitializeTimeout,
    NotConnected,
)
from execserver.client.channels.websocket import READ_BYTES, ChannelFactory, WebSocketChannel
from execserver.client.reconnect import ReconnectingClient
from execserver.session import session_of
from tests.support.client_fakes import LocalWsServer, wait
from tests.support.harness import DEFAULT_TIMEOUT, REPO_ROOT, reactor, refused_port
from tests.support.polling import until

OPTIONS = ConnectOptions("test-client", initialize_timeout=5.0)
CWD = str(REPO_ROOT)


async def _connect(url: str, **kwargs: Any) -> ExecServerClient:
    options = kwargs.pop("options", OPTIONS)
    client: ExecServerClient = await wait(
        ExecServerClient.connect_websocket(reactor, url, options, **kwargs), "ws connect"
    )
    return client


@pytest_twisted.ensureDeferred
async def test_websocket_handshake_process_and_close() -> None:
    server = LocalWsServer(token="s3cret").start()
    try:
        client = await _connect(server.url, token="s3cret")
        assert client.session_id
        process = await client.start_process(["printf", "over ws"], cwd=CWD)
        event = await wait(process.subscribe().next(), "output")
        assert event is not None and event.chunk == b"over ws"
        assert await wait(process.exited(), "exit") == 0
        await wait(client.close(), "close")
        assert not client.is_connected
        await until(
            lambda: not server.protocols, "server to see the close", timeout=DEFAULT_TIMEOUT
        )
    finally:
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_websocket_wrong_or_missing_token_is_auth_refused() -> None:
    server = LocalWsServer(token="s3cret").start()
    try:
        for token in ("wrong", None):
            with pytest.raises(AuthRefused) as info:
                await _connect(server.url, token=token)
            assert info.value.status == 401
            assert "authentication refused" in str(info.value)
    finally:
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_websocket_unreachable_server_is_connect_failed() -> None:
    with refused_port() as port:
        with pytest.raises(ConnectFailed) as info:
            await _connect(f"ws://127.0.0.1:{port}")
        assert "connection refused" in str(info.value)


@pytest_twisted.ensureDeferred
async def test_websocket_invalid_url_is_connect_failed() -> None:
    with pytest.raises(ConnectFailed):
        await _connect("http://127.0.0.1:1")


@pytest_twisted.ensureDeferred
async def test_websocket_connect_timeout_when_the_upgrade_is_never_answered() -> None:
    # A TCP listener that accepts and never says anything.
    listening = reactor.listenTCP(0, Factory.forProtocol(Protocol), interface="127.0.0.1")
    try:
        url = f"ws://127.0.0.1:{listening.getHost().port}"
        with pytest.raises(ConnectTimeout) as info:
            await _connect(url, connect_timeout=0.3)
        assert info.value.timeout == 0.3
    finally:
        await listening.stopListening()


class _CannedAnswer(Protocol):
    """Answers an upgrade request with one fixed HTTP response, then hangs up."""

    answer = b""

    def connectionMade(self) -> None:
        self._request = b""

    def dataReceived(self, data: bytes) -> None:
        self._request += data
        if b"\r\n\r\n" in self._request:
            assert self.transport is not None
            self.transport.write(self.answer)
            self.transport.loseConnection()


async def _answered_with(status_line: bytes, **kwargs: Any) -> BaseException:
    canned = type("Canned", (_CannedAnswer,), {"answer": status_line + b"\r\n\r\n"})
    listening = reactor.listenTCP(0, Factory.forProtocol(canned), interface="127.0.0.1")
    try:
        with pytest.raises(ConnectFailed) as info:
            await _connect(f"ws://127.0.0.1:{listening.getHost().port}", **kwargs)
        return info.value
    finally:
        await listening.stopListening()


@pytest.mark.parametrize(
    ("status_line", "status", "text"),
    [
        (b"HTTP/1.1 401 Unauthorized", 401, "authentication refused (HTTP 401 Unauthorized)"),
        (b"HTTP/1.1 403 Forbidden", 403, "authentication refused (HTTP 403 Forbidden)"),
        # The status decides, whatever else Autobahn finds wrong with the answer.
        (b"HTTP/1.0 403  Not  Allowed", 403, "authentication refused (HTTP 403 Not Allowed)"),
    ],
)
@pytest_twisted.ensureDeferred
async def test_a_401_or_403_upgrade_answer_is_auth_refused_with_its_status(
    status_line: bytes, status: int, text: str
) -> None:
    error = await _answered_with(status_line)
    assert isinstance(error, AuthRefused)
    assert error.status == status
    assert text in str(error)


@pytest.mark.parametrize(
    "status_line",
    [b"HTTP/1.1 503 Service Unavailable", b"HTTP/1.1 404 Not Found", b"HTTP/1.1 101 Switching"],
)
@pytest_twisted.ensureDeferred
async def test_other_upgrade_answers_are_connect_failed_quoting_autobahn(
    status_line: bytes,
) -> None:
    error = await _answered_with(status_line)
    assert not isinstance(error, AuthRefused | ConnectTimeout)
    status = status_line.split()[1].decode()
    if status == "101":
        assert "Upgrade header missing" in str(error)
    else:
        assert f"upgrade failed [{status}]" in str(error)


@pytest_twisted.ensureDeferred
async def test_autobahns_own_opening_handshake_timeout_is_connect_timeout() -> None:
    # The reconnecting client has no timer of its own around the upgrade:
    # Autobahn's opening handshake timeout is what ends a silent server.
    listening = reactor.listenTCP(0, Factory.forProtocol(Protocol), interface="127.0.0.1")
    client = ReconnectingClient(
        reactor, f"ws://127.0.0.1:{listening.getHost().port}", connect_timeout=0.3
    )
    try:
        client.start()
        await until(
            lambda: client.last_error is not None,
            "the first attempt to fail",
            timeout=DEFAULT_TIMEOUT,
        )
        assert isinstance(client.last_error, ConnectTimeout), client.last_error
        assert client.last_error.timeout == 0.3
    finally:
        await client.stop()
        await listening.stopListening()


@pytest_twisted.ensureDeferred
async def test_websocket_initialize_timeout_when_the_server_is_silent() -> None:
    server = LocalWsServer(silent=True).start()
    try:
        with pytest.raises(InitializeTimeout):
            await _connect(server.url, options=ConnectOptions("t", initialize_timeout=0.3))
        await until(lambda: not server.protocols, "the client to hang up", timeout=DEFAULT_TIMEOUT)
    finally:
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_websocket_drop_fails_pending_calls_and_marks_processes() -> None:
    server = LocalWsServer().start()
    try:
        client = await _connect(server.url)
        process = await client.start_process(["sleep", "30"], cwd=CWD)
        pending = client.read(process.process_id, after_seq=0, wait_ms=30_000)
        assert client.pending_request_count == 1
        for proto in list(server.protocols):
            transport: Any = proto.transport
            transport.abortConnection()
        with pytest.raises(ConnectionClosed):
            await wait(pending, "pending call to fail")
        assert client.pending_request_count == 0
        assert await wait(process.exited(), "handle") is None
    finally:
        await server.stop()


# --- reconnecting ------------------------------------------------------------------------


def _reconnecting(url: str, **kwargs: Any) -> ReconnectingClient:
    return ReconnectingClient(
        reactor,
        url,
        OPTIONS,
        initial_delay=0.05,
        max_delay=0.2,
        factor=1.5,
        jitter=lambda: 0,
        connect_timeout=2.0,
        **kwargs,
    )


@pytest_twisted.ensureDeferred
async def test_reconnecting_client_without_a_session_ttl_survives_a_server_restart() -> None:
    # session_ttl_ms=0: a drop ends the session (resumption: tests/test_resume_client.py).
    server = LocalWsServer().start()
    client = _reconnecting(server.url, call_timeout=10.0, session_ttl_ms=0)
    events: list[str] = []
    connected: list[Deferred[None]] = [Deferred()]
    disconnected: Deferred[str] = Deferred()

    def on_connect(c: ExecServerClient) -> None:
        events.append("connected")
        connected[-1].callback(None)

    def on_disconnect(reason: str) -> None:
        events.append("disconnected")
        if not disconnected.called:
            disconnected.callback(reason)

    client.add_connect_listener(on_connect)
    client.add_disconnect_listener(on_disconnect)
    client.start()
    try:
        await wait(connected[0], "first connection")
        first_session = client.client.session_id if client.client else None
        assert (await client.terminate("none")).running is False

        process = await client.start_process(["sleep", "30"], cwd=CWD)
        pending = client.read(process.process_id, after_seq=0, wait_ms=30_000)
        connected.append(Deferred())
        await server.stop()
        # Calls pending at the drop fail promptly with a clear error.
        with pytest.raises(ConnectionClosed):
            await wait(pending, "pending call to fail", timeout=2.0)
        await wait(disconnected, "disconnect event")
        assert await wait(process.exited(), "handle marked exited") is None

        # A call made while disconnected waits for the next connection.
        waiting = client.list_processes()
        assert not waiting.called
        restarted = LocalWsServer(port=server.port).start()
        try:
            await wait(connected[1], "reconnection within the backoff", timeout=5.0)
            listed = await wait(waiting, "the waiting call")
            assert listed.processes == []
            assert client.client is not None
            assert client.client.session_id != first_session
            assert events == ["connected", "disconnected", "connected"]
            assert client.connect_count == 2
            # New calls succeed on the new connection.
            again = await client.start_process(["printf", "back"], cwd=CWD)
            assert await wait(again.exited(), "exit") == 0
        finally:
            await wait(client.stop(), "stop")
            await restarted.stop()
    finally:
        await wait(client.stop(), "stop")
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_reconnecting_client_calls_fail_after_the_wait_bound() -> None:
    with refused_port() as port:
        client = _reconnecting(f"ws://127.0.0.1:{port}", call_timeout=0.3)
        client.start()
        try:
            with pytest.raises(NotConnected) as info:
                await wait(client.terminate("p"), "NotConnected")
            assert "connection refused" in str(info.value)
        finally:
            await wait(client.stop(), "stop")


@pytest_twisted.ensureDeferred
async def test_stopping_the_reconnecting_client_fails_waiting_calls() -> None:
    with refused_port() as port:
        client = _reconnecting(f"ws://127.0.0.1:{port}", call_timeout=30.0)
        client.start()
        waiting = client.terminate("p")
        await wait(client.stop(), "stop")
        with pytest.raises(ConnectionClosed):
            await wait(waiting, "waiting call to fail")


@pytest_twisted.ensureDeferred
async def test_reconnecting_client_across_a_real_server_process_restart() -> None:
    from tests.support.ws_harness import WsServerProcess

    server = await WsServerProcess.start()
    _host, port = server.host_port
    # Without a session TTL (a restarted server has no session to resume).
    client = _reconnecting(server.url, call_timeout=10.0, session_ttl_ms=0)
    connected: list[Deferred[None]] = [Deferred(), Deferred()]
    disconnects: list[str] = []
    client.add_connect_listener(lambda c: connected[client.connect_count - 1].callback(None))
    client.add_disconnect_listener(disconnects.append)
    client.start()
    restarted: WsServerProcess | None = None
    try:
        await wait(connected[0], "first connection")
        process = await client.start_process(["sleep", "30"], cwd=CWD)
        (listed,) = (await client.list_processes()).processes
        orphan = listed.pid
        pending = client.read(process.process_id, after_seq=0, wait_ms=30_000)
        # A crash: the server cannot answer what is pending.
        server.signal("KILL")
        with pytest.raises(ConnectionClosed):
            await wait(pending, "pending call to fail", timeout=5.0)
        assert await wait(process.exited(), "handle") is None
        await server.stop()
        if orphan is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(orphan, signal.SIGKILL)
        waiting = client.list_processes()
        restarted = await WsServerProcess.start("--listen", f"ws://127.0.0.1:{port}")
        await wait(connected[1], "reconnection", timeout=5.0)
        assert (await wait(waiting, "the call made while disconnected")).processes == []
        again = await client.start_process(["printf", "back"], cwd=CWD)
        assert await wait(again.exited(), "exit") == 0
        assert len(disconnects) == 1
    finally:
        await wait(client.stop(), "stop")
        await server.stop()
        if restarted is not None:
            await restarted.stop()


@pytest_twisted.ensureDeferred
async def test_dropping_a_websocket_client_ends_its_session() -> None:
    import gc

    server = LocalWsServer().start()
    try:
        client = await _connect(server.url)
        await client.start_process(["sleep", "30"], cwd=CWD)
        await client.list_processes()
        (connection,) = server.dispatcher.connections
        managed = next(iter(session_of(connection).processes.values()))
        del client
        gc.collect()
        await wait(managed.when_closed(), "the dropped client's process to be terminated")
        await until(
            lambda: not server.protocols,
            "the server to see the disconnect",
            timeout=DEFAULT_TIMEOUT,
        )
    finally:
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_the_client_reads_its_socket_up_to_one_mib_per_wakeup() -> None:
    """Twisted's 64 KiB reads cut each output notification into five-plus
    wakeups; the client's one connection reads up to READ_BYTES at once."""
    server = LocalWsServer().start()
    try:
        channel_of: list[WebSocketChannel] = []
        real = ChannelFactory.buildProtocol

        def keep(self: ChannelFactory, addr: Any) -> WebSocketChannel:
            channel = real(self, addr)
            channel_of.append(channel)
            return channel

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ChannelFactory, "buildProtocol", keep)
            client = await _connect(server.url)
        (channel,) = channel_of
        transport: Any = channel.transport
        assert transport.bufferSize == READ_BYTES == 1024 * 1024
        await wait(client.close(), "close")
    finally:
        await server.stop()
