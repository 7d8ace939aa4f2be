"""One JSON-RPC message per WebSocket text frame, on Autobahn's client protocol.

Until the upgrade completes, the channel's ``opened`` Deferred says how it
ended: a refused upgrade is told apart by the HTTP status of the server's
answer, which Autobahn keeps as the parsed response's status line
(``http_status_line``), not by the wording of its failure text; an opening
handshake that ran out of time by Autobahn's ``wasOpenHandshakeTimeout``.
"""

from __future__ import annotations

from typing import Any, Final, cast

from autobahn.twisted.websocket import WebSocketClientFactory, WebSocketClientProtocol
from twisted.internet import error
from twisted.internet.abstract import FileDescriptor
from twisted.internet.defer import Deferred
from twisted.internet.protocol import connectionDone
from twisted.python.failure import Failure

from execserver.client.channels.ndjson import DEFAULT_MAX_MESSAGE_BYTES
from execserver.client.errors import AuthRefused, ConnectFailed, ConnectTimeout
from execserver.client.rpc import RpcClient
from execserver.tls import tls_error_text

#: ``unix:///PATH``: the WebSocket protocol over a Unix-domain socket.
UNIX_SCHEME = "unix://"
UNIX_WS_URL = "ws://localhost/"
#: Statuses of a refused upgrade reported as :class:`AuthRefused`.
AUTH_REFUSED_STATUSES = (401, 403)
#: The most a connection reads from its socket per wakeup (the socket's
#: ``bufferSize``, which Twisted's ``doRead`` passes to ``recv``). Twisted's
#: 64 KiB is a fifth of one output notification (~350 KiB); 1 MiB took the
#: client end to end over ws:// from ~460 to ~660 MB/s with less CPU per
#: byte (256 MiB, 5 of 6 paired runs). One string of up to 1 MiB per read
#: is nothing to one client; the server keeps Twisted's size for its many
#: connections.
READ_BYTES: Final = 1024 * 1024


def refused_status(status_line: object) -> tuple[int, str] | None:
    """``(status, reason)`` of an HTTP response status line other than ``101``.

    None when there is no such line (the connection ended before an answer,
    or the upgrade was accepted).
    """
    if not isinstance(status_line, str):
        return None
    parts = status_line.split()
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        return None
    status = int(parts[1])
    if status == 101:
        return None
    return status, " ".join(parts[2:])


class WebSocketChannel(WebSocketClientProtocol):
    """One JSON-RPC message per WebSocket text frame."""

    rpc: RpcClient
    opened: Deferred[None]
    url: str
    open_timeout: float

    def connectionMade(self) -> None:
        # The socket under TLS's wrapper too (wss://).
        socket: object = self.transport
        while socket is not None and not isinstance(socket, FileDescriptor):
            socket = getattr(socket, "transport", None)
        if socket is not None:
            socket.bufferSize = READ_BYTES
        super().connectionMade()

    def onConnect(self, response: Any) -> None:
        pass

    def onOpen(self) -> None:
        self.rpc.attach(self)
        if not self.opened.called:
            self.opened.callback(None)

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        self.rpc.message_received(payload)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        why = tls_error_text(reason.value)
        if why is not None:
            # Reported as this connection's failure (ConnectFailed), not
            # logged as an error by Autobahn.
            hint = (
                ": the server's certificate is not signed by a trusted CA "
                "(give the CA that signed it: --ca-file)"
                if "certificate verify failed" in why
                else ""
            )
            self.tls_failure = f"TLS handshake failed: {why}{hint}"
            reason = Failure(error.ConnectionLost(self.tls_failure))
        super().connectionLost(reason)

    def onClose(self, wasClean: bool, code: int | None, reason: str | None) -> None:
        text = (
            getattr(self, "tls_failure", None)
            or self.wasNotCleanReason
            or reason
            or "connection closed"
        )
        if not self.opened.called:
            self.opened.errback(self._open_failure(text))
        self.rpc.connection_lost(text)

    def _open_failure(self, text: str) -> ConnectFailed:
        if getattr(self, "wasOpenHandshakeTimeout", False):
            return ConnectTimeout(self.url, self.open_timeout)
        refused = refused_status(getattr(self, "http_status_line", None))
        if refused is not None and refused[0] in AUTH_REFUSED_STATUSES:
            status, phrase = refused
            return AuthRefused(self.url, status, f"authentication refused (HTTP {status} {phrase})")
        return ConnectFailed(self.url, text)

    # MessageSink
    def send_message(self, data: bytes) -> None:
        self.sendMessage(data, isBinary=False)

    def close(self) -> None:
        self.sendClose()


class ChannelFactory(WebSocketClientFactory):
    """Builds a :class:`WebSocketChannel` with a fresh RpcClient per connection."""

    protocol = WebSocketChannel

    def __init__(
        self,
        url: str,
        reactor: Any,
        token: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        open_timeout: float = 10.0,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else None
        # Over a Unix socket the WebSocket handshake still needs an http URL
        # (its Host is localhost); errors name the socket's URL.
        super().__init__(
            UNIX_WS_URL if url.startswith(UNIX_SCHEME) else url, headers=headers, reactor=reactor
        )
        self.display_url = url
        self.open_timeout = open_timeout
        self.setProtocolOptions(
            maxMessagePayloadSize=max_message_bytes,
            maxFramePayloadSize=max_message_bytes,
            # msgspec rejects invalid UTF-8 itself; Autobahn's check is slow.
            utf8validateIncoming=False,
            # A backstop: connect_websocket's own timer (same length, started
            # before the TCP connect) normally fires first.
            openHandshakeTimeout=open_timeout + 0.5,
            closeHandshakeTimeout=2,
        )

    def buildProtocol(self, addr: Any) -> WebSocketChannel:
        proto = cast(WebSocketChannel, super().buildProtocol(addr))
        proto.rpc = RpcClient(label=f"exec-server {self.display_url}")
        proto.opened = Deferred()
        proto.url = self.display_url
        proto.open_timeout = self.open_timeout
        self.last_built = proto
        return proto
