"""The twisted.web edge of a WebSocket listener (``transports/http.py``), in memory.

Every connection starts as an ``EdgeChannel`` of the listener's ``EdgeSite``;
these tests cover what the edge adds around twisted.web and Autobahn's
``WebSocketResource``: bytes sent right behind the upgrade request, head
limits above Twisted's own, the connection count moving with an upgrade,
and every HTTP connection of a stopping listener answered 503 (a request
in progress when the shutdown begins, the handshake timeout, the drain
once the listener has closed), none dropped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import txaio
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from execserver.transports.http import DRAIN_SECONDS, EdgeChannel
from execserver.transports.websocket import ExecServerFactory, ExecServerProtocol
from tests.support.ws_wire import (
    UPGRADE,
    client_frame,
    http,
    make_factory,
    server_frames,
    server_on_string_transport,
)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    clock = Clock()
    monkeypatch.setattr(txaio.config, "loop", clock)  # type: ignore[attr-defined]
    yield clock


def test_frames_in_the_same_read_as_the_upgrade_are_answered(clock: Clock) -> None:
    channel, transport = server_on_string_transport(make_factory(clock))
    request = client_frame(1, b'{"id":1,"method":"initialize","params":{"clientName":"t"}}')
    channel.dataReceived(UPGRADE + b"\r\n" + request + client_frame(1, b'{"id":2,"method":"x"}'))
    head, _, frames = transport.value().partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101 ")
    assert [json.loads(p)["id"] for _, p in server_frames(frames)] == [1, 2]


def test_a_head_limit_above_twisteds_own_is_honoured(clock: Clock) -> None:
    # twisted.web alone answers 400 past 16 KiB of headers (totalHeadersSize).
    factory = make_factory(clock, max_request_head_bytes=64 * 1024)
    filler = b"X-Filler: " + b"f" * 30_000 + b"\r\n"
    response, _ = http(factory, b"GET /readyz HTTP/1.1\r\nHost: x\r\n" + filler + b"\r\n")
    assert response.startswith(b"HTTP/1.1 200 OK\r\n")
    response, _ = http(factory, b"GET /readyz HTTP/1.1\r\n" + filler * 3 + b"\r\n")
    assert response.startswith(b"HTTP/1.1 431 ")
    assert response.endswith(b"request head exceeds 65536 bytes (--max-request-head-bytes)\n")


def test_a_plain_reply_says_connection_close_and_closes(clock: Clock) -> None:
    factory = make_factory(clock)
    response, transport = http(factory, b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b"\r\nConnection: close\r\n" in response
    assert b"\r\nCache-Control: no-store\r\n" in response
    assert transport.disconnecting


def test_the_connection_count_moves_with_the_upgrade(clock: Clock) -> None:
    factory = make_factory(clock)
    stats = factory.dispatcher.stats
    channel, transport = server_on_string_transport(factory)
    assert stats.sockets_open == 1
    channel.dataReceived(UPGRADE + b"\r\n")
    proto = transport.protocol  # type: ignore[attr-defined]
    assert isinstance(proto, ExecServerProtocol)
    assert stats.sockets_open == 1
    assert factory.site.channels == set()
    # The handshake timer was the channel's: an open connection outlives it.
    clock.advance(60)
    assert not transport.disconnecting
    proto.connectionLost(Failure(ConnectionLost()))
    assert stats.sockets_open == 0
    assert stats.refused["handshake_timeout"] == 0


class HalfClosing(StringTransport):
    """A string transport that records a write-side close (a real TCP one has it)."""

    write_closed = False

    def loseWriteConnection(self) -> None:
        self.write_closed = True


def half_closing_channel(factory: ExecServerFactory) -> tuple[EdgeChannel, HalfClosing]:
    channel = factory.site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 40000))
    transport = HalfClosing(peerAddress=IPv4Address("TCP", "127.0.0.1", 40000))
    channel.makeConnection(transport)
    return channel, transport


SHUTTING_DOWN_BODY = b"exec-server is shutting down; connect again later\n"


def test_a_request_in_progress_when_the_shutdown_begins_gets_503(clock: Clock) -> None:
    # The /readyz race of the SIGTERM test: accepted before the signal, its
    # request completed after. The shutdown used to abort it (no answer).
    factory = make_factory(clock)
    channel, transport = server_on_string_transport(factory)
    channel.dataReceived(b"GET /readyz HTTP/1.1\r\n")
    factory.dispatcher.begin_stopping()
    factory.shut_down()
    assert not transport.disconnecting
    assert transport.value() == b""
    channel.dataReceived(b"Host: x\r\n\r\n")
    response = transport.value()
    assert response.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert b"\r\nRetry-After: 1\r\n" in response
    assert response.endswith(SHUTTING_DOWN_BODY)
    assert transport.disconnecting


def test_while_stopping_the_request_is_read_before_the_503(clock: Clock) -> None:
    # An answer written before the request was read is lost to the reset
    # that closing a socket with unread bytes sends: read first, then answer.
    factory = make_factory(clock)
    factory.dispatcher.begin_stopping()
    for request in (UPGRADE + b"\r\n", b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n"):
        channel, transport = server_on_string_transport(factory)
        assert transport.value() == b""
        channel.dataReceived(request)
        assert transport.value().startswith(b"HTTP/1.1 503 ")
        assert transport.value().endswith(SHUTTING_DOWN_BODY)


def test_a_handshake_timeout_while_stopping_is_answered_503(clock: Clock) -> None:
    factory = make_factory(clock, open_handshake_timeout=5.0)
    channel, transport = half_closing_channel(factory)
    channel.dataReceived(b"GET /readyz HTTP/1.1\r\n")
    factory.dispatcher.begin_stopping()
    clock.advance(5.0)
    assert transport.value().endswith(SHUTTING_DOWN_BODY)
    # A FIN after the answer, reading on: no reset can overtake it.
    assert transport.write_closed and not transport.disconnecting
    assert factory.dispatcher.stats.refused["handshake_timeout"] == 1


def test_the_drain_answers_waits_for_the_close_then_aborts_the_rest(clock: Clock) -> None:
    factory = make_factory(clock)
    site = factory.site
    slow, slow_transport = half_closing_channel(factory)
    slow.dataReceived(b"GET /readyz HTTP/1.1\r\n")
    polite, polite_transport = half_closing_channel(factory)
    polite.dataReceived(b"GET /re")
    factory.dispatcher.begin_stopping()
    drained = Deferred.fromCoroutine(site.drain())
    # Both are answered at once (the listener is closed: no more time).
    for transport in (slow_transport, polite_transport):
        assert transport.value().startswith(b"HTTP/1.1 503 ")
        assert transport.write_closed and not transport.disconnecting
    polite.connectionLost(Failure(ConnectionDone()))
    assert not drained.called
    clock.advance(DRAIN_SECONDS - 0.01)
    assert not drained.called and not slow_transport.disconnecting
    clock.advance(0.01)
    assert drained.called
    # (StringTransport's abortConnection is loseConnection.)
    assert slow_transport.disconnecting


def test_the_drain_adds_nothing_to_twisted_webs_own_answer(clock: Clock) -> None:
    factory = make_factory(clock)
    channel, transport = half_closing_channel(factory)
    channel.dataReceived(b"GET /readyz HTTP/1.1\r\nBad Header Line\r\n\r\n")
    response = transport.value()
    assert response.startswith(b"HTTP/1.1 400 ") and transport.disconnecting
    factory.dispatcher.begin_stopping()
    drained = Deferred.fromCoroutine(factory.site.drain())
    assert transport.value() == response
    channel.connectionLost(Failure(ConnectionDone()))
    assert drained.called


def test_the_drain_ends_at_the_last_close(clock: Clock) -> None:
    factory = make_factory(clock)
    channel, transport = half_closing_channel(factory)
    factory.dispatcher.begin_stopping()
    channel.dataReceived(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert transport.value().endswith(SHUTTING_DOWN_BODY)
    drained = Deferred.fromCoroutine(factory.site.drain())
    assert not drained.called
    channel.connectionLost(Failure(ConnectionDone()))
    assert drained.called
    assert Deferred.fromCoroutine(factory.site.drain()).called
    assert clock.getDelayedCalls() == []


def test_an_absolute_form_target_names_the_same_path(clock: Clock) -> None:
    response, _ = http(make_factory(clock), b"GET http://x/readyz?a=1 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert response.startswith(b"HTTP/1.1 200 OK\r\n")
    response, _ = http(make_factory(clock), b"GET http://x/else HTTP/1.1\r\nHost: x\r\n\r\n")
    assert response.startswith(b"HTTP/1.1 404 ")
    assert response.endswith(
        b"no resource at /else; plain HTTP is served at /readyz and /metrics only\n"
    )


@pytest.mark.parametrize(
    "body",
    [b"Content-Length: 64\r\n\r\n" + b"x" * 64, b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"],
    ids=["content-length", "chunked"],
)
def test_an_upgrade_request_with_a_body_is_refused(clock: Clock, body: bytes) -> None:
    # twisted.web reads a body as the request's and keeps the bytes behind
    # it: upgraded, the client's first frames were silently lost (and the
    # client waited for their replies forever).
    frames = client_frame(1, b'{"id":1,"method":"initialize","params":{"clientName":"t"}}')
    response, transport = http(make_factory(clock), UPGRADE + body + frames)
    assert response.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert response.endswith(
        b"a WebSocket upgrade request has no body (no Transfer-Encoding, "
        b"no Content-Length above 0)\n"
    )
    assert transport.disconnecting


def test_an_upgrade_request_with_content_length_0_is_upgraded(clock: Clock) -> None:
    request = client_frame(1, b'{"id":1,"method":"initialize","params":{"clientName":"t"}}')
    response, _ = http(make_factory(clock), UPGRADE + b"Content-Length: 0\r\n\r\n" + request)
    head, _, frames = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101 ")
    assert [json.loads(p)["id"] for _, p in server_frames(frames)] == [1]
