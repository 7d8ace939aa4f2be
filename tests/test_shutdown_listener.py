"""A stopping WebSocket listener on the real reactor, in-process: its last connections.

A connection the kernel completed in the listen backlog, not yet accepted
when the listener closes, would be reset by the close (the client sees an
accepted connection closed with no answer). The listener accepts its
backlog before it closes, and the drain answers those 503. The test holds
the reactor still (no turn between the connect and the stop) so the
connection is in the backlog for certain.
"""

from __future__ import annotations

import socket
from functools import partial

import pytest_twisted
from twisted.internet.protocol import Factory

from execserver import metrics
from execserver.app import build_dispatcher
from execserver.config import ServerConfig
from execserver.transports.listen import WebSocketAddress, parse_listen_url
from execserver.transports.websocket import WebSocketService, WebSocketSettings
from tests.support.harness import observe, reactor, with_timeout
from tests.support.ws_harness import RawHttp
from tests.support.ws_wire import NoSpawner


@pytest_twisted.ensureDeferred
async def test_a_connection_in_the_backlog_at_the_close_is_answered_503() -> None:
    dispatcher = build_dispatcher(ServerConfig(), reactor, NoSpawner())
    address = parse_listen_url("ws://127.0.0.1:0")
    assert isinstance(address, WebSocketAddress)
    service = WebSocketService(
        dispatcher,
        reactor,
        address,
        WebSocketSettings(max_message_bytes=1 << 20, ping_interval=0.0),
        banner=lambda line: None,
        metrics=partial(metrics.render, dispatcher),
    )
    service.startService()
    assert service.port is not None
    port = service.port.getHost().port  # type: ignore[attr-defined]
    # A blocking connect returns once the kernel has completed the
    # handshake: in the backlog, not accepted (the reactor has not turned).
    client = socket.create_connection(("127.0.0.1", port), timeout=5)
    client.sendall(b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    client.setblocking(False)
    dispatcher.begin_stopping()
    stopped = service.stopService()
    collect = RawHttp()
    factory = Factory()
    factory.buildProtocol = lambda addr: collect  # type: ignore[method-assign]
    reactor.adoptStreamConnection(client.fileno(), socket.AF_INET, factory)
    client.close()  # (the reactor holds its own descriptor of the socket)
    answer = await with_timeout(observe(collect.lost), 5, "the answer")
    assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert answer.endswith(b"\r\n\r\nexec-server is shutting down; connect again later\n")
    await with_timeout(stopped, 5, "the listener's stop")
