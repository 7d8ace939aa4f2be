"""ReconnectingClient on a fake clock, over in-memory WebSocket connections.

A fake endpoint connects each attempt through ``twisted.test.iosim`` to a
test-local Autobahn server protocol in front of a real dispatcher; the
``ClientService`` runs on a ``task.Clock`` with ``jitter=lambda: 0``, so the
backoff schedule, the wait bound of calls made while disconnected and the
handshake-before-use rule are checked exactly, without sockets or sleeps.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import pytest
import pytest_twisted
from autobahn.twisted.websocket import WebSocketServerFactory
from twisted.internet import task
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.interfaces import IProtocolFactory, IStreamClientEndpoint
from twisted.logger import ILogObserver, globalLogPublisher
from twisted.test import iosim
from zope.interface import implementer

from execserver.client import (
    ConnectionClosed,
    ConnectOptions,
    ExecServerClient,
    NotConnected,
    RemoteProcess,
    SessionLost,
)
from execserver.client.reconnect import ReconnectingClient
from tests.support.client_fakes import LocalServerProtocol, LocalWsServer
from tests.support.harness import DEFAULT_TIMEOUT
from tests.support.polling import until


@implementer(IStreamClientEndpoint)
class MemoryEndpoint:
    """Each connect: an in-memory link to a fresh server protocol (or refused)."""

    def __init__(self, server: LocalWsServer) -> None:
        self.server = server
        self.up = True
        self.attempts = 0
        self.pumps: list[iosim.IOPump] = []
        self.server_protocols: list[LocalServerProtocol] = []

    def connect(self, factory: IProtocolFactory) -> Deferred[Any]:
        self.attempts += 1
        if not self.up:
            return fail(ConnectionRefusedError("memory endpoint is down"))
        address = IPv4Address("TCP", "127.0.0.1", 8765)
        client = factory.buildProtocol(address)
        assert client is not None

        class Proto(LocalServerProtocol):
            pass

        Proto.server = self.server
        server = Proto()
        server.factory = WebSocketServerFactory()
        self.server_protocols.append(server)
        pump = iosim.connect(
            server,
            iosim.FakeTransport(server, isServer=True),
            client,
            iosim.FakeTransport(client, isServer=False),
            greet=False,
        )
        self.pumps.append(pump)
        return succeed(client)

    def flush(self) -> None:
        for _ in range(10):
            for pump in list(self.pumps):
                pump.flush()

    def drop_all(self) -> None:
        for proto in self.server_protocols:
            if proto.transport is not None:
                proto.transport.loseConnection()
        self.flush()
        self.server_protocols.clear()
        self.pumps.clear()


@pytest.fixture(autouse=True)
def no_logged_failures() -> Iterator[None]:
    """Fail on any error logged meanwhile (e.g. a NoTransition in ClientService)."""
    failures: list[str] = []

    def observe(event: dict[str, Any]) -> None:
        if "log_failure" in event:
            failures.append(event["log_failure"].getTraceback())

    observer = cast(ILogObserver, observe)
    globalLogPublisher.addObserver(observer)
    yield
    globalLogPublisher.removeObserver(observer)
    assert not failures, failures[0]


def _client(endpoint: MemoryEndpoint, clock: task.Clock, **kwargs: Any) -> ReconnectingClient:
    client = ReconnectingClient(
        clock,
        "ws://127.0.0.1:8765",
        ConnectOptions("unit", initialize_timeout=5.0),
        initial_delay=1.0,
        factor=2.0,
        max_delay=8.0,
        jitter=lambda: 0,
        endpoint=endpoint,
        **{"session_ttl_ms": 0, **kwargs},
    )
    return client


@pytest_twisted.ensureDeferred
async def test_backoff_handshake_waiting_calls_and_reconnect_on_a_fake_clock() -> None:
    clock = task.Clock()
    server = LocalWsServer()
    endpoint = MemoryEndpoint(server)
    client = _client(endpoint, clock, call_timeout=5.0)
    events: list[str] = []
    client.add_connect_listener(lambda c: events.append("connected"))
    client.add_disconnect_listener(lambda reason: events.append("disconnected"))

    # A call made before anything is connected waits for the handshake.
    early = client.terminate("p")
    client.start()
    assert endpoint.attempts == 1
    # TCP is "connected" but the WebSocket and initialize are not done yet:
    # the call must not have been sent (ClientService.whenConnected pitfall).
    assert not early.called and client.client is None
    endpoint.flush()
    assert events == ["connected"]
    assert client.client is not None and client.client.session_id
    endpoint.flush()
    assert (await early).running is False

    # The connection drops: a pending call fails at once.
    pending = client.read("p", wait_ms=60_000)
    endpoint.up = False
    endpoint.drop_all()
    with pytest.raises(ConnectionClosed):
        await pending
    assert events == ["connected", "disconnected"]
    assert client.client is None

    # Backoff: first retry after initial_delay * factor, then doubling.
    waiting = client.list_processes()
    attempts = endpoint.attempts
    clock.advance(1.99)
    assert endpoint.attempts == attempts
    clock.advance(0.02)
    assert endpoint.attempts == attempts + 1  # refused
    clock.advance(3.99)
    assert endpoint.attempts == attempts + 1
    # The call made while disconnected gives up after call_timeout (5 s).
    with pytest.raises(NotConnected) as info:
        clock.advance(0.02)
        await waiting
    assert "connection refused" in str(info.value)
    assert endpoint.attempts == attempts + 2

    # The server is back: the next attempt connects and handshakes again,
    # and a call waiting for it then runs.
    endpoint.up = True
    clock.advance(7.9)
    assert endpoint.attempts == attempts + 2  # the next retry is 8 s after the last
    waiting = client.list_processes()
    clock.advance(0.2)
    assert endpoint.attempts == attempts + 3
    assert not waiting.called  # not before the handshake
    endpoint.flush()
    assert events == ["connected", "disconnected", "connected"]
    endpoint.flush()
    assert (await waiting).processes == []
    assert client.connect_count == 2

    stopping = client.stop()
    endpoint.flush()
    clock.advance(10)
    endpoint.flush()
    await stopping
    await server.dispatcher.shutdown()


@pytest_twisted.ensureDeferred
async def test_a_failed_handshake_is_retried_not_used() -> None:
    clock = task.Clock()
    server = LocalWsServer(silent=True)  # accepts the WebSocket, never answers
    endpoint = MemoryEndpoint(server)
    client = _client(endpoint, clock, call_timeout=30.0)
    connected: list[ExecServerClient] = []
    client.add_connect_listener(connected.append)
    client.start()
    endpoint.flush()
    clock.advance(5.0)  # initialize_timeout
    endpoint.flush()
    assert connected == []
    assert "initialize" in str(client.last_error)
    # The server starts answering: the retry succeeds.
    server.silent = False
    clock.advance(8.0)
    endpoint.flush()
    assert len(connected) == 1
    stopping = client.stop()
    endpoint.flush()
    clock.advance(10)
    endpoint.flush()
    await stopping
    await server.dispatcher.shutdown()


async def _suspended_handle(
    endpoint: MemoryEndpoint, clock: task.Clock, **kwargs: Any
) -> tuple[ReconnectingClient, RemoteProcess]:
    """A client with a resumable session, one live handle, and the connection dropped."""
    client = _client(endpoint, clock, session_ttl_ms=60_000, **kwargs)
    client.start()
    endpoint.flush()
    starting = client.start_process(["sleep", "30"])

    def started() -> bool:
        endpoint.flush()
        return starting.called

    await until(started, "the process to start", timeout=DEFAULT_TIMEOUT)
    proc = await starting
    endpoint.up = False
    endpoint.drop_all()
    assert client.client is None and not proc.exited().called
    return client, proc


async def _stop(client: ReconnectingClient, endpoint: MemoryEndpoint, server: Any) -> None:
    stopping = client.stop()
    endpoint.flush()
    await stopping
    await server.dispatcher.shutdown()


@pytest_twisted.ensureDeferred
async def test_a_suspended_session_is_lost_once_connections_are_refused_for_two_seconds() -> None:
    clock = task.Clock()
    server = LocalWsServer()
    endpoint = MemoryEndpoint(server)
    client, proc = await _suspended_handle(endpoint, clock)
    try:
        clock.advance(2.0)  # the first retry: refused
        assert not proc.exited().called
        clock.advance(4.0)  # refused again, 4 s after the first refusal
        assert proc.exited().called and await proc.exited() is None
        assert isinstance(proc.lost_reason, SessionLost)
        assert proc.lost_reason.cause == (
            "the server is gone (connection refused (is the server running?))"
        )
        assert client.lost_sessions == [proc.lost_reason]
        # The client carries on: the server is back, a new session.
        endpoint.up = True
        clock.advance(8.0)
        endpoint.flush()
        assert client.client is not None
        assert client.client.session_id != proc.lost_reason.session_id
    finally:
        await _stop(client, endpoint, server)


@pytest_twisted.ensureDeferred
async def test_a_suspended_session_is_lost_after_its_ttl_when_no_handshake_succeeds() -> None:
    clock = task.Clock()
    server = LocalWsServer()
    endpoint = MemoryEndpoint(server)
    client, proc = await _suspended_handle(endpoint, clock)
    ttl = 60.0  # asked for and granted (the server's cap is higher)
    try:
        # Connections succeed, but the server never answers initialize.
        server.silent = True
        endpoint.up = True
        # The first failed attempt after the TTL gives up (attempts are at
        # most max_delay apart, each ends within initialize_timeout).
        while not proc.exited().called and clock.seconds() < ttl + 8.0 + 5.0:
            clock.advance(1.0)
            endpoint.flush()
        assert proc.exited().called and clock.seconds() >= ttl
        assert isinstance(proc.lost_reason, SessionLost)
        assert proc.lost_reason.cause.startswith("no connection within its 60 s TTL (")
    finally:
        await _stop(client, endpoint, server)


@pytest_twisted.ensureDeferred
async def test_a_start_in_flight_at_a_drop_is_sent_again_with_the_same_process_id() -> None:
    """The start-retry loop (written once, in ``clientcore.session``) also
    serves ReconnectingClient: a ``process/start`` whose request is lost with
    the connection is sent again, same ``processId``, on the resumed session,
    and its handle follows the process there."""
    clock = task.Clock()
    server = LocalWsServer()
    endpoint = MemoryEndpoint(server)
    client = _client(endpoint, clock, session_ttl_ms=60_000)
    client.start()
    endpoint.flush()
    first = client.client
    assert first is not None and first.resumable
    starting = client.start_process(["sh", "-c", "echo again"], process_id="p-again")
    # The request is still in the client's transport: lost with the connection.
    (pump,) = endpoint.pumps
    assert pump.clientIO.stream and first.pending_request_count == 1  # (a masked frame)
    pump.clientIO.stream.clear()
    endpoint.drop_all()
    assert not starting.called  # waiting for the resume, not failed
    clock.advance(2.0)  # the first retry
    endpoint.flush()
    second = client.client
    assert second is not None and second is not first
    assert second.session_id == first.session_id  # resumed

    def started() -> bool:
        endpoint.flush()
        return starting.called

    try:
        await until(started, "the start sent again to be answered", timeout=DEFAULT_TIMEOUT)
        proc = await starting
        assert proc.process_id == "p-again"
        assert proc._api is client  # its requests follow the session
        seen: list[bytes] = []
        proc.add_output_listener(lambda event: seen.append(event.chunk))

        def closed() -> bool:
            endpoint.flush()
            return proc.closed().called

        await until(closed, "the process to end", timeout=DEFAULT_TIMEOUT)
        assert await proc.exited() == 0
        assert b"".join(seen) == b"again\n"
    finally:
        await _stop(client, endpoint, server)
