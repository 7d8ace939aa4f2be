"""The WebSocket transport driven in-process: a server factory on a fake clock
and string transports, raw client and server frames, raw HTTP upgrade
requests.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
import txaio
from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

from execserver import metrics
from execserver.app import build_dispatcher
from execserver.config import ServerConfig
from execserver.transports.http import EdgeChannel
from execserver.transports.websocket import (
    ExecServerFactory,
    ExecServerProtocol,
    WebSocketSettings,
)

LIMIT = 2048


UPGRADE = (
    b"GET / HTTP/1.1\r\nHost: 127.0.0.1:9000\r\nUpgrade: websocket\r\n"
    b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    b"Sec-WebSocket-Version: 13\r\n"
)


class NoSpawner:
    def spawn(self, proto: Any, spec: Any) -> Any:
        raise AssertionError("no process is started in these tests")


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    clock = Clock()
    # Autobahn schedules a few calls through txaio's global loop; keep them
    # on the fake clock too so nothing leaks onto the real reactor.
    monkeypatch.setattr(txaio.config, "loop", clock)  # type: ignore[attr-defined]
    yield clock


def make_factory(clock: Clock, **settings: Any) -> ExecServerFactory:
    dispatcher = build_dispatcher(ServerConfig(max_message_bytes=LIMIT), clock, NoSpawner())
    options: dict[str, Any] = {"max_message_bytes": LIMIT, "ping_interval": 0.0}
    options.update(settings)
    return ExecServerFactory(
        dispatcher,
        WebSocketSettings(**options),
        clock,
        metrics=partial(metrics.render, dispatcher),
    )


def server_on_string_transport(
    factory: ExecServerFactory,
) -> tuple[EdgeChannel, StringTransport]:
    """A connection of the listener's twisted.web site (where every connection starts)."""
    proto = factory.site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 40000))
    transport = StringTransport(
        hostAddress=IPv4Address("TCP", "127.0.0.1", 9000),
        peerAddress=IPv4Address("TCP", "127.0.0.1", 40000),
    )
    # (What a real transport has: the upgrade re-points it at the WebSocket protocol.)
    transport.protocol = proto  # type: ignore[attr-defined]
    proto.makeConnection(transport)
    return proto, transport


def client_frame(opcode: int, payload: bytes, fin: bool = True) -> bytes:
    """One masked client-to-server frame (masked as one big-int XOR: fast at MiBs)."""
    n = len(payload)
    first = (0x80 if fin else 0) | opcode
    if n < 126:
        head = bytes([first, 0x80 | n])
    elif n < 1 << 16:
        head = bytes([first, 0x80 | 126]) + struct.pack(">H", n)
    else:
        head = bytes([first, 0x80 | 127]) + struct.pack(">Q", n)
    mask = os.urandom(4)
    key = int.from_bytes((mask * (n // 4 + 1))[:n], "little")
    masked = (int.from_bytes(payload, "little") ^ key).to_bytes(n, "little")
    return head + mask + masked


def server_frames(data: bytes) -> list[tuple[int, bytes]]:
    """Split unmasked server-to-client bytes into (opcode, payload) frames."""
    frames = []
    while data:
        opcode = data[0] & 0x0F
        n = data[1] & 0x7F
        offset = 2
        if n == 126:
            n = struct.unpack(">H", data[2:4])[0]
            offset = 4
        elif n == 127:
            n = struct.unpack(">Q", data[2:10])[0]
            offset = 10
        frames.append((opcode, data[offset : offset + n]))
        data = data[offset + n :]
    return frames


def open_raw(factory: ExecServerFactory) -> tuple[ExecServerProtocol, StringTransport]:
    channel, transport = server_on_string_transport(factory)
    channel.dataReceived(UPGRADE + b"\r\n")
    assert transport.value().startswith(b"HTTP/1.1 101 ")
    transport.clear()
    proto = transport.protocol  # type: ignore[attr-defined]
    assert isinstance(proto, ExecServerProtocol) and proto is channel.upgraded
    return proto, transport


def http(factory: ExecServerFactory, request: bytes) -> tuple[bytes, StringTransport]:
    proto, transport = server_on_string_transport(factory)
    proto.dataReceived(request)
    return transport.value(), transport
