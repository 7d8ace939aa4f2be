"""In-memory tests of the WebSocket transport: framing, handshake, HTTP, timers.

No sockets and no real time: the server protocol runs on ``iosim`` (with an
Autobahn client on the other end) or on a ``StringTransport`` fed raw bytes,
and every timer (Autobahn's pings included) runs on a ``task.Clock``.
"""

from __future__ import annotations

import json
import struct
from typing import Any, cast

import pytest
from autobahn.twisted.websocket import WebSocketClientFactory, WebSocketClientProtocol
from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionLost
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.test import iosim

from execserver import metrics
from execserver.session import session_of
from execserver.transports.autobahn_private import ClockTimers
from tests.support.ws_wire import (
    LIMIT,
    UPGRADE,
    client_frame,
    clock,
    http,
    make_factory,
    open_raw,
    server_frames,
    server_on_string_transport,
)

__all__ = ["clock"]  # fixtures, used by name


# --- plain HTTP on the WebSocket port ------------------------------------------------------


def test_readyz_answers_200_with_a_short_body(clock: Clock) -> None:
    response, transport = http(make_factory(clock), b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert response.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"\r\nContent-Length: 6\r\n" in response
    assert response.endswith(b"\r\n\r\nready\n")
    assert transport.disconnecting


def test_readyz_accepts_head_and_http_1_0(clock: Clock) -> None:
    response, _ = http(make_factory(clock), b"HEAD /readyz HTTP/1.0\r\n\r\n")
    assert response.startswith(b"HTTP/1.1 200 OK\r\n")


def test_metrics_are_prometheus_text(clock: Clock) -> None:
    factory = make_factory(clock)
    open_raw(factory)
    response, _ = http(factory, b"GET /metrics?x=1 HTTP/1.1\r\nHost: x\r\n\r\n")
    head, _, body = response.partition(b"\r\n\r\n")
    assert b"Content-Type: text/plain; version=0.0.4; charset=utf-8" in head
    assert f"Content-Length: {len(body)}".encode() in head
    text = body.decode()
    assert "exec_server_connections 1\n" in text
    assert "exec_server_sessions 1\n" in text
    assert 'exec_server_output_bytes_total{stream="pty"} 0\n' in text


def test_plain_get_of_the_websocket_path_is_426(clock: Clock) -> None:
    response, transport = http(make_factory(clock), b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert response.startswith(b"HTTP/1.1 426 Upgrade Required\r\n")
    assert b"\r\nUpgrade: websocket\r\n" in response
    assert b"connect with a WebSocket client" in response
    assert transport.disconnecting


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /favicon.ico HTTP/1.1\r\nHost: x\r\n\r\n", b"404 Not Found"),
        (b"DELETE /metrics HTTP/1.1\r\nHost: x\r\n\r\n", b"405 Method Not Allowed"),
        (b"garbage\r\n\r\n", b"400 Bad Request"),
        (b"GET / HTTP/1.1\r\nX: " + b"y" * 20000 + b"\r\n\r\n", b"431 Request Header"),
    ],
)
def test_bad_http_requests_get_precise_errors(
    clock: Clock, request_bytes: bytes, status: bytes
) -> None:
    response, transport = http(make_factory(clock), request_bytes)
    assert response.startswith(b"HTTP/1.1 " + status)
    assert transport.disconnecting


def test_endless_request_head_is_cut_off_at_the_limit(clock: Clock) -> None:
    proto, transport = server_on_string_transport(make_factory(clock))
    for _ in range(20):
        proto.dataReceived(b"X-Filler: " + b"z" * 1000 + b"\r\n")
    assert transport.value().startswith(b"HTTP/1.1 431 ")


def test_browser_origin_refused_with_403_unless_allowed(clock: Clock) -> None:
    factory = make_factory(clock, allowed_origins=frozenset({"http://localhost:3000"}))
    refused, _ = http(factory, UPGRADE + b"Origin: http://evil.example\r\n\r\n")
    assert refused.startswith(b"HTTP/1.1 403 Forbidden\r\n")
    assert b"'http://evil.example' is not allowed" in refused
    null, _ = http(factory, UPGRADE + b"Origin: null\r\n\r\n")
    assert null.startswith(b"HTTP/1.1 403 ")
    allowed, _ = http(factory, UPGRADE + b"Origin: HTTP://LocalHost:3000/\r\n\r\n")
    assert allowed.startswith(b"HTTP/1.1 101 ")
    no_origin, _ = http(factory, UPGRADE + b"\r\n")
    assert no_origin.startswith(b"HTTP/1.1 101 ")


def test_open_handshake_times_out(clock: Clock) -> None:
    proto, transport = server_on_string_transport(make_factory(clock))
    proto.dataReceived(b"GET / HTTP/1.1\r\n")
    clock.advance(5.1)
    assert transport.disconnecting or transport.disconnected


# --- framing --------------------------------------------------------------------------------


def test_text_and_binary_messages_get_text_replies(clock: Clock) -> None:
    proto, transport = open_raw(make_factory(clock))
    proto.dataReceived(
        client_frame(1, b'{"id":1,"method":"initialize","params":{"clientName":"t"}}')
    )
    proto.dataReceived(client_frame(2, b'{"id":2,"method":"nope"}'))
    frames = server_frames(transport.value())
    assert [op for op, _ in frames] == [1, 1]
    first, second = (json.loads(p) for _, p in frames)
    assert first["result"]["protocolVersion"] == "exec-server.v0"
    assert second == {"id": 2, "error": {"code": -32600, "message": "unknown method: nope"}}


def test_many_frames_in_one_read_are_answered_in_order(clock: Clock) -> None:
    proto, transport = open_raw(make_factory(clock))
    medium = b'{"id":0,"method":"initialize","params":{"clientName":"' + b"m" * 300 + b'"}}'
    batch = client_frame(1, medium) + b"".join(
        client_frame(1 + n % 2, b'{"id":%d,"method":"nope"}' % n) for n in range(1, 200)
    )
    batch += client_frame(9, b"hello") + client_frame(1, b'{"id":200,"method":"nope"}')
    # Also with a zero masking key, and split at an awkward place.
    zero_masked = bytes([0x81, 0x80 | 24]) + b"\0\0\0\0" + b'{"id":201,"method":"no"}'
    batch += zero_masked
    proto.dataReceived(batch[:1001])
    proto.dataReceived(batch[1001:])
    frames = server_frames(transport.value())
    assert (10, b"hello") in frames
    ids = [json.loads(p)["id"] for op, p in frames if op == 1]
    assert ids == list(range(202))


def test_unmasked_client_frame_is_a_protocol_error(clock: Clock) -> None:
    proto, transport = open_raw(make_factory(clock))
    proto.dataReceived(bytes([0x81, 5]) + b"hello")
    opcode, payload = server_frames(transport.value())[-1]
    assert opcode == 8
    assert struct.unpack(">H", payload[:2])[0] == 1002


def test_frame_with_reserved_bits_is_a_protocol_error(clock: Clock) -> None:
    proto, transport = open_raw(make_factory(clock))
    frame = bytearray(client_frame(1, b'{"id":1,"method":"nope"}'))
    frame[0] |= 0x40
    proto.dataReceived(bytes(frame))
    opcode, payload = server_frames(transport.value())[-1]
    assert opcode == 8
    assert struct.unpack(">H", payload[:2])[0] == 1002


def test_fragmented_message_is_reassembled(clock: Clock) -> None:
    proto, transport = open_raw(make_factory(clock))
    message = b'{"id":7,"method":"initialize","params":{"clientName":"fragments"}}'
    proto.dataReceived(
        client_frame(1, message[:10], fin=False)
        + client_frame(0, message[10:30], fin=False)
        + client_frame(9, b"ping-in-between")
        + client_frame(0, message[30:])
    )
    frames = server_frames(transport.value())
    assert frames[0] == (10, b"ping-in-between")
    assert json.loads(frames[1][1])["id"] == 7


def test_oversized_message_is_refused_and_the_connection_stays_usable(clock: Clock) -> None:
    proto, transport = open_raw(make_factory(clock))
    chunk = b"x" * 1000
    # Three fragments: the limit is crossed by the third frame's header.
    proto.dataReceived(client_frame(1, chunk, fin=False) + client_frame(0, chunk, fin=False))
    assert transport.value() == b""
    proto.dataReceived(client_frame(0, chunk))
    proto.dataReceived(
        client_frame(1, b'{"id":1,"method":"initialize","params":{"clientName":"t"}}')
    )
    replies = [json.loads(p) for _, p in server_frames(transport.value())]
    assert replies[0] == {
        "id": None,
        "error": {
            "code": -32600,
            "message": f"message exceeds the maximum size of {LIMIT} bytes (--max-message-bytes)",
        },
    }
    assert replies[1]["id"] == 1
    assert len(replies) == 2
    assert not transport.disconnecting


def test_single_huge_frame_is_refused_from_its_header(clock: Clock) -> None:
    proto, transport = open_raw(make_factory(clock))
    frame = client_frame(2, b"y" * 100_000)
    proto.dataReceived(frame[:16])  # header says 100000 bytes: refused before the data
    replies = [json.loads(p) for _, p in server_frames(transport.value())]
    assert replies[0]["id"] is None and replies[0]["error"]["code"] == -32600
    proto.dataReceived(frame[16:])
    assert len(server_frames(transport.value())) == 1


def test_invalid_utf8_text_frame_closes_with_1007(clock: Clock) -> None:
    proto, transport = open_raw(make_factory(clock))
    proto.dataReceived(client_frame(1, b'{"id":1,"method":"\xff"}'))
    frames = server_frames(transport.value())
    assert frames[-1][0] == 8
    assert struct.unpack(">H", frames[-1][1][:2])[0] == 1007


def test_invalid_utf8_in_a_binary_frame_is_a_parse_error(clock: Clock) -> None:
    proto, transport = open_raw(make_factory(clock))
    proto.dataReceived(client_frame(2, b'{"id":1,"method":"\xff"}'))
    proto.dataReceived(client_frame(2, b'{"id":2,"method":"nope"}'))
    first, second = (json.loads(p) for _, p in server_frames(transport.value()))
    assert first["id"] is None
    assert first["error"]["code"] == -32700
    assert second["id"] == 2
    assert not transport.disconnecting


def test_protocol_violation_closes_with_1008(clock: Clock) -> None:
    proto, transport = open_raw(make_factory(clock))
    proto.dataReceived(client_frame(1, b'{"id":1,"result":{}}'))
    opcode, payload = server_frames(transport.value())[-1]
    assert opcode == 8
    assert struct.unpack(">H", payload[:2])[0] == 1008


# --- lifecycle, flow control, timers --------------------------------------------------------


def test_session_is_paused_and_resumed_by_the_tcp_transport(clock: Clock) -> None:
    proto, transport = open_raw(make_factory(clock))
    assert proto.connection is not None
    session = proto.connection.session
    assert transport.streaming is True
    producer: Any = transport.producer
    assert producer.inner.session is session
    producer.pauseProducing()  # what TCP does above the high-water mark
    assert session.paused
    producer.resumeProducing()  # ...and once its buffer is empty
    assert not session.paused
    assert transport.producerState == "producing"


def test_requests_stop_being_read_while_replies_pile_up(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    from execserver.transports import backpressure
    from execserver.writebuffer import Outbox

    proto, transport = open_raw(make_factory(clock))
    unsent = 0
    # (The connection asks its Outbox, which counts Twisted's buffer and its own queue.)
    monkeypatch.setattr(Outbox, "unsent", lambda _self: unsent)
    request = client_frame(1, b'{"id":1,"method":"initialize","params":{"clientName":"t"}}')
    proto.dataReceived(request)
    assert transport.producerState == "producing"
    unsent = backpressure.READ_PAUSE_MIN_BYTES + 1
    # One TCP read holding three requests: the first reply crosses the mark.
    proto.dataReceived(
        client_frame(1, b'{"id":2,"method":"nope"}')
        + client_frame(1, b'{"id":3,"method":"nope"}')
        + client_frame(1, b'{"id":4,"method":"nope"}')
    )
    assert transport.producerState == "paused"  # the socket is not read any more
    assert proto.connection is not None and not session_of(proto.connection).paused
    answered = [json.loads(p)["id"] for _, p in server_frames(transport.value())]
    assert answered == [1, 2]  # 3 and 4 are held, not answered
    producer: Any = transport.producer
    producer.pauseProducing()
    unsent = 0
    producer.resumeProducing()  # the buffer drained
    assert transport.producerState == "producing"
    answered = [json.loads(p)["id"] for _, p in server_frames(transport.value())]
    assert answered == [1, 2, 3, 4]


def test_connection_loss_ends_the_session(clock: Clock) -> None:
    factory = make_factory(clock)
    proto, _ = open_raw(factory)
    assert len(factory.dispatcher.connections) == 1
    proto.connectionLost(Failure(ConnectionLost()))
    assert factory.dispatcher.connections == set()
    assert factory.protocols == set()


def test_dead_peer_is_dropped_after_ping_interval_plus_timeout(clock: Clock) -> None:
    factory = make_factory(clock, ping_interval=10.0, ping_timeout=5.0)
    proto, transport = open_raw(factory)
    clock.advance(10.0)
    ping = server_frames(transport.value())
    assert [op for op, _ in ping] == [9]
    clock.advance(4.9)
    assert not transport.disconnecting
    clock.advance(0.2)
    assert transport.disconnecting
    proto.connectionLost(Failure(ConnectionLost()))
    assert factory.dispatcher.connections == set()


def test_live_peer_answering_pings_is_kept(clock: Clock) -> None:
    factory = make_factory(clock, ping_interval=10.0, ping_timeout=5.0)
    proto, transport = open_raw(factory)
    for _ in range(5):
        clock.advance(10.0)
        opcode, payload = server_frames(transport.value())[-1]
        assert opcode == 9
        transport.clear()
        proto.dataReceived(client_frame(10, payload))
        clock.advance(5.0)
        assert not transport.disconnecting


def test_server_shutdown_sends_going_away_and_waits_for_the_close(clock: Clock) -> None:
    factory = make_factory(clock)
    proto, transport = open_raw(factory)
    done = factory.shut_down()
    opcode, payload = server_frames(transport.value())[-1]
    assert opcode == 8
    assert struct.unpack(">H", payload[:2])[0] == 1001
    assert b"shutting down" in payload
    assert not done.called
    # The peer never answers: Autobahn drops TCP after closeHandshakeTimeout.
    clock.advance(1.1)
    assert transport.disconnecting
    proto.connectionLost(Failure(ConnectionLost()))
    assert done.called


# --- against Autobahn's client, in memory ---------------------------------------------------


class RecordingClient(WebSocketClientProtocol):
    def __init__(self) -> None:
        super().__init__()
        self.received: list[tuple[bytes, bool]] = []
        # (Not `is_open`: Autobahn keeps a Deferred under that name.)
        self.opened = False

    def onOpen(self) -> None:
        self.opened = True

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        self.received.append((payload, isBinary))


def test_autobahn_client_round_trip_in_memory(clock: Clock) -> None:
    factory = make_factory(clock)
    server = factory.site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 40000))
    client_factory = WebSocketClientFactory("ws://127.0.0.1:9000", reactor=clock)
    client_factory.protocol = RecordingClient
    client_factory._batched_timer = ClockTimers(clock)
    client = cast(RecordingClient, client_factory.buildProtocol(None))
    pump = iosim.connect(
        server,
        iosim.FakeTransport(server, isServer=True),
        client,
        iosim.FakeTransport(client, isServer=False),
        clock=clock,
    )
    assert client.opened
    client.sendMessage(
        b'{"id":"a","method":"initialize","params":{"clientName":"mem"}}', isBinary=True
    )
    client.sendMessage(b'{"method":"initialized"}', fragmentSize=5)
    client.sendMessage(b'{"id":"b","method":"process/terminate","params":{"processId":"x"}}')
    pump.flush()
    replies = [(json.loads(p), binary) for p, binary in client.received]
    assert [(r["id"], binary) for r, binary in replies] == [("a", False), ("b", False)]
    assert replies[1][0]["result"] == {"running": False}
    client.sendClose(1000)
    pump.flush()
    assert factory.dispatcher.connections == set()


def test_metrics_render_counts_requests_by_method_and_outcome(clock: Clock) -> None:
    factory = make_factory(clock)
    proto, _ = open_raw(factory)
    proto.dataReceived(
        client_frame(1, b'{"id":1,"method":"initialize","params":{"clientName":"t"}}')
    )
    proto.dataReceived(client_frame(1, b'{"id":2,"method":"bogus\\"name"}'))
    proto.dataReceived(client_frame(1, b"not json"))
    text = metrics.render(factory.dispatcher).decode()
    assert 'exec_server_requests_total{method="initialize",outcome="ok"} 1\n' in text
    assert 'exec_server_requests_total{method="<unknown>",outcome="error"} 1\n' in text
    assert 'exec_server_requests_total{method="<invalid>",outcome="error"} 1\n' in text
    for line in text.splitlines():
        assert line.startswith("#") or " " in line


# --- command line -----------------------------------------------------------------------------


def test_websocket_options_become_settings() -> None:
    from execserver.service import Options

    options = Options()
    options.parseOptions(
        [
            "--listen",
            "ws://127.0.0.1:0",
            "--allow-origin",
            "http://localhost:3000",
            "--allow-origin",
            "null",
            "--ping-interval-ms",
            "1500",
            "--ping-timeout-ms",
            "2500",
            "--max-message-bytes",
            "4096",
        ]
    )
    settings = options.websocket_settings()
    assert settings.allowed_origins == {"http://localhost:3000", "null"}
    assert (settings.ping_interval, settings.ping_timeout) == (1.5, 2.5)
    assert settings.max_message_bytes == 4096


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--allow-origin", "localhost:3000"], "--allow-origin takes an origin like"),
        (["--allow-origin", "http://x/path"], "--allow-origin takes an origin like"),
        (["--ping-timeout-ms", "0"], "--ping-timeout-ms must be positive"),
        (["--ping-interval-ms", "-1"], "--ping-interval-ms must not be negative"),
    ],
)
def test_bad_websocket_options_are_refused(argv: list[str], message: str) -> None:
    from twisted.python import usage

    from execserver.service import Options

    with pytest.raises(usage.UsageError, match=message):
        Options().parseOptions(argv)


def test_nagle_is_disabled_on_accepted_sockets(clock: Clock) -> None:
    factory = make_factory(clock)
    proto = factory.site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 40000))
    transport = StringTransport()
    calls: list[bool] = []
    transport.setTcpNoDelay = calls.append  # type: ignore[attr-defined]
    proto.makeConnection(transport)
    assert calls[-1:] == [True]
