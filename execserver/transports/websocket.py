"""JSON-RPC over WebSocket (Autobahn, Twisted flavour), plus two plain HTTP endpoints.

One JSON-RPC message per WebSocket message: text frames, or binary frames
holding the same JSON; replies are always text frames. Every connection gets
its own dispatcher :class:`~execserver.dispatcher.Connection` and so its own
session; when the connection ends (close frame, TCP reset, ping timeout) the
session's processes are terminated, whole groups, as the reference does.

The same port answers, without an upgrade, ``GET /readyz`` (200, ``ready``) and
``GET /metrics`` (Prometheus text). Every connection starts in a
``twisted.web`` site (``transports/http.py``: limits, Host, token and Origin
checks, the plain resources); an admitted upgrade is handed to this module's
factory through Autobahn's public ``WebSocketResource``, so Autobahn parses
and answers the handshake itself. The connection's backpressure (both ways)
lives in ``transports/backpressure.py``; the private Autobahn corners still
used (close codes, exact timers, the fast frame path) in
``transports/autobahn_private.py``.

Size limits are ours, not Autobahn's: Autobahn's ``maxMessagePayloadSize``
also caps *outgoing* messages and closes the connection, whereas a too-large
message here is discarded as it streams in, answered with an ``id: null``
error, and the connection stays usable (docs/protocol.md, "Bad framing is answered, not fatal").

Messages still being received (fragments, or one large frame arriving in
pieces) are held in memory until complete. Their bytes, over all
connections of the server, are capped by ``max_partial_message_bytes``
(``--max-partial-message-bytes``): a connection whose data would exceed it is
closed with code 1013 (Try Again Later), which frees what it held. A lost
connection frees its partial message at once, and drops its references to
the session so that reference counting, not a garbage collection, frees it.
"""

from __future__ import annotations

import struct
import sys
from collections import deque
from collections.abc import Callable, Sequence
from typing import IO, TYPE_CHECKING, Any, Final, cast

import attrs
from autobahn.twisted.resource import WebSocketResource
from autobahn.twisted.websocket import WebSocketServerFactory, WebSocketServerProtocol
from autobahn.websocket.protocol import WebSocketProtocol
from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.error import ConnectionLost
from twisted.internet.interfaces import (
    IAddress,
    IListeningPort,
    IReactorTCP,
    IReactorTime,
    IReadDescriptor,
)
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure

from execserver import __version__, tls, writebuffer
from execserver.auth import TokenStore
from execserver.codec import LONG_MESSAGE_BYTES, MappedBuffer
from execserver.dispatcher import Connection, Dispatcher
from execserver.registry import ANONYMOUS
from execserver.transports import autobahn_private, http
from execserver.transports.backpressure import RequestBackpressure, read_pause_bytes
from execserver.transports.listen import (
    DEFAULT_SOCKET_MODE,
    UnixAddress,
    WebSocketAddress,
    server_endpoint,
)
from execserver.waiters import Latch
from execserver.writebuffer import LARGE_MESSAGE_BYTES, Outbox, set_high_water, unsent_bytes

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = Logger()

#: Close codes sent by the server (RFC 6455 section 7.4.1; 1013 is in the
#: IANA WebSocket close code registry).
CLOSE_GOING_AWAY: Final = 1001
CLOSE_POLICY_VIOLATION: Final = 1008
CLOSE_TRY_AGAIN_LATER: Final = 1013

#: Default of ``--max-partial-message-bytes``: room for two incomplete
#: messages of the default ``--max-message-bytes`` at once.
DEFAULT_MAX_PARTIAL_MESSAGE_BYTES: Final = 256 * 1024 * 1024


def _text_frame_header(length: int) -> bytes:
    """RFC 6455 header of a final, unmasked text frame (server to client)."""
    if length < 126:
        return struct.pack("!BB", 0x81, length)
    if length < 1 << 16:
        return struct.pack("!BBH", 0x81, 126, length)
    return struct.pack("!BBQ", 0x81, 127, length)


def partial_limit_reason(limit: int) -> str:
    """Close reason sent with 1013 (at most 123 bytes, as close reasons must be)."""
    return f"incomplete messages exceed the server limit of {limit} bytes; retry later"


@attrs.frozen
class WebSocketSettings:
    """Transport settings of a WebSocket listener (from the command line)."""

    #: Largest accepted message (all frames of it), in bytes.
    max_message_bytes: int
    #: Seconds between server pings; 0 disables pinging.
    ping_interval: float = 20.0
    #: Seconds a ping may stay unanswered before the peer is declared dead.
    ping_timeout: float = 20.0
    #: Browser origins allowed to connect (normalized); others get 403.
    allowed_origins: frozenset[str] = frozenset()
    #: Seconds a client may take to send its upgrade request.
    open_handshake_timeout: float = 5.0
    #: Seconds the server waits for the client's close reply before dropping TCP.
    close_handshake_timeout: float = 1.0
    #: Bytes of incomplete incoming messages held over all connections.
    max_partial_message_bytes: int = DEFAULT_MAX_PARTIAL_MESSAGE_BYTES
    #: Decode small complete frames in :meth:`ExecServerProtocol.processData`
    #: (False: every frame goes through Autobahn's parser; ``--no-fast-frames``).
    fast_frames: bool = True
    #: Accepted bearer tokens (``--auth-token-file``); None: no authentication.
    auth: TokenStore | None = None
    #: Permissions of a ``unix://`` listener's socket file (``--socket-mode``).
    socket_mode: int = DEFAULT_SOCKET_MODE
    #: Twisted ``CertificateOptions`` of ``wss://`` listeners (``transports/tls.py``).
    tls_options: Any = None
    #: Connections open at once over all WebSocket listeners (``--max-connections``).
    max_connections: int = 4096
    #: Largest HTTP request head accepted (``--max-request-head-bytes``).
    max_request_head_bytes: int = http.MAX_REQUEST_HEAD_BYTES
    #: ``unix://`` listeners: refuses a connecting confined command of this
    #: server (True: close it; :class:`execserver.sandbox.peers.ConfinedPeers`).
    peer_check: Callable[[Any], bool] | None = None


class ExecServerProtocol(WebSocketServerProtocol):
    """Frames in, messages to the dispatcher connection; messages out as text frames."""

    factory: ExecServerFactory

    def __init__(self) -> None:
        super().__init__()
        self.connection: Connection | None = None
        self._parts: list[bytes] = []
        #: A large message being received (instead of ``_parts``).
        self._long: MappedBuffer | None = None
        #: Bytes in ``_parts`` or ``_long`` (counted in the server-wide partial total).
        self._parts_bytes = 0
        self._size = 0
        self._oversized = False
        self._lost: Latch[None] = Latch()
        self._flow: RequestBackpressure | None = None
        self._held: deque[bytes | memoryview | None] = deque()
        self._read_pause_bytes = 0
        self._outbox: Outbox | None = None
        #: Counted in the server's open sockets (``--max-connections``).
        self._counted = False
        #: Who this connection authenticated as (read by the dispatcher
        #: connection when the upgrade completes; sessions are owned by it).
        self.identity: object = ANONYMOUS

    @property
    def _transport(self) -> Any:
        return self.transport

    def connectionMade(self) -> None:
        super().connectionMade()
        # Autobahn's own attempt runs before it copies ``tcpNoDelay`` onto
        # the protocol, fails with AttributeError and is silently skipped,
        # leaving Nagle on: small replies would wait for the peer's ACK.
        set_no_delay = getattr(self.transport, "setTcpNoDelay", None)
        if set_no_delay is not None:
            set_no_delay(True)

    # --- WebSocket lifecycle -------------------------------------------------------

    def onOpen(self) -> None:
        factory = self.factory
        conn = factory.dispatcher.connect(self, f"websocket {self.peer}")
        self.connection = conn
        high_water = factory.dispatcher.config.output_high_water_bytes
        set_high_water(self._transport, high_water)
        # The session pauses its children's output pipes while this
        # connection's unsent output is above the high-water mark...
        self._flow = RequestBackpressure(conn.session, self._transport, self.release_held)
        if autobahn_private.USABLE_CORNERS.send_path:
            # Large messages are fed to the socket as it drains (see Outbox).
            self._outbox = Outbox(self._transport, self._transport, self._flow)
            self._transport.registerProducer(self._outbox, True)
        else:
            # Autobahn's frames could not wait behind a queued message:
            # every message goes to Twisted's buffer whole.
            self._transport.registerProducer(self._flow, True)
        # ...and requests stop being read while far more than that is unsent
        # (responses such as process/read can be large: a client that sends
        # requests without reading replies must not grow server memory).
        self._read_pause_bytes = read_pause_bytes(high_water)

    def onClose(self, wasClean: bool, code: int | None, reason: str | None) -> None:
        self._held.clear()
        conn = self.connection
        if conn is None:
            return
        log.debug(
            "{label} closed (clean={clean}, code={code}, reason={reason})",
            label=conn.label,
            clean=wasClean,
            code=code,
            reason=reason,
        )
        conn.transport_closed()
        conn.shutdown().addErrback(
            lambda f: log.failure("ending {label} failed", f, label=conn.label)
        )

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        why = tls.tls_error_text(reason.value)
        if why is not None:
            # A peer that fails the TLS handshake (wrong CA, no client
            # certificate) is the peer's problem: Autobahn would log an error.
            log.info("TLS handshake with {peer} failed: {why}", peer=self.peer, why=why)
            reason = Failure(ConnectionLost(f"TLS handshake failed: {why}"))
        super().connectionLost(reason)
        self.factory.protocols.discard(self)
        if self._counted:
            self._counted = False
            self.factory.dispatcher.stats.sockets_open -= 1
        # Free at once what a half-sent message and unparsed input hold,
        # and break the reference cycles through this protocol (its
        # connection and flow controller point back at it; Autobahn's
        # ``is_closed`` Deferred holds it as its result), so it is freed
        # by reference counting, not at the next full garbage collection.
        self._release_parts()
        autobahn_private.release_input(self)
        self._held.clear()
        if self._outbox is not None:
            self._outbox.discard()
        self._outbox = None
        self._flow = None
        self.connection = None
        self.is_closed = None
        self._lost.fire(None)

    def unregisterProducer(self) -> None:
        # Autobahn calls this on every drop, registered or not (e.g. after
        # a plain HTTP reply); strict transports refuse that.
        if getattr(self.transport, "producer", None) is not None:
            self._transport.unregisterProducer()

    def when_lost(self) -> Deferred[None]:
        return self._lost.wait()

    def processData(self) -> bool:
        """Parse buffered frames: small complete messages on our own path, the rest by Autobahn.

        See ``autobahn_private.fast_frames`` (and ``--no-fast-frames``).
        """
        if self.factory.settings.fast_frames:
            more = autobahn_private.fast_frames(
                self, self.factory.settings.max_message_bytes, self._deliver
            )
            if more is not None:
                return more
        return bool(super().processData())

    def dataReceived(self, data: bytes) -> None:
        autobahn_private.receive(self, data)

    # --- incoming messages, size-limited as they stream in -------------------------

    def onMessageBegin(self, isBinary: bool) -> None:
        self._release_parts()
        self._size = 0
        self._oversized = False

    def onMessageFrameBegin(self, length: int) -> None:
        # The frame header announces its length: refuse before buffering any of it.
        self._size += length
        if autobahn_private.failed_by_me(self):
            return
        if not self._oversized and self._size > self.factory.settings.max_message_bytes:
            self._oversized = True
            self._release_parts()
            self._deliver(None)

    def onMessageFrameData(self, payload: bytes) -> None:
        if self._oversized or self.state != WebSocketProtocol.STATE_OPEN:
            return
        size = len(payload)
        stats = self.factory.dispatcher.stats
        limit = self.factory.settings.max_partial_message_bytes
        if stats.partial_message_bytes + size > limit:
            held = stats.partial_message_bytes
            self._oversized = True
            self._release_parts()
            log.warn(
                "closing {peer}: incomplete messages would exceed {limit} bytes "
                "(all connections hold {held}, --max-partial-message-bytes)",
                peer=self.peer,
                limit=limit,
                held=held,
            )
            autobahn_private.send_close(self, CLOSE_TRY_AGAIN_LATER, partial_limit_reason(limit))
            return
        if self._long is None and self._parts_bytes + size > LONG_MESSAGE_BYTES:
            # Gathered in one mapping, announced size up front: joining the
            # frame data at the end would hold the message twice.
            self._long = MappedBuffer(self._size)
            for part in self._parts:
                self._long.append(part)
            self._parts = []
        if self._long is not None:
            self._long.append(payload)
        else:
            self._parts.append(payload)
        self._parts_bytes += size
        stats.partial_message_bytes += size

    def _release_parts(self) -> None:
        """Forget the message being received, and its share of the server-wide total."""
        self._parts = []
        self._long = None
        if self._parts_bytes:
            self.factory.dispatcher.stats.partial_message_bytes -= self._parts_bytes
            self._parts_bytes = 0

    def onMessageFrameEnd(self) -> None:
        pass

    def onMessageEnd(self) -> None:
        parts = self._parts
        long = self._long
        self._release_parts()
        # failedByMe: Autobahn keeps parsing after failing a connection (to
        # read the close reply) and still delivers the offending message.
        if (
            self._oversized
            or autobahn_private.failed_by_me(self)
            or self.state != WebSocketProtocol.STATE_OPEN
        ):
            return
        if long is not None:
            self._deliver(long.take())
        else:
            self._deliver(parts[0] if len(parts) == 1 else b"".join(parts))

    def _deliver(self, message: bytes | memoryview | None) -> None:
        """Hand one message (None: an oversized one) to the dispatcher, in order.

        While requests are paused, messages already read (at most one TCP
        read's worth) wait here; one read can hold hundreds of requests.
        """
        if self._held or (self._flow is not None and self._flow.reads_paused):
            self._held.append(message)
            return
        self._dispatch(message)

    def _dispatch(self, message: bytes | memoryview | None) -> None:
        conn = self.connection
        if conn is None:
            return
        if message is None:
            conn.oversized_message()
        else:
            # Invalid UTF-8 in a binary frame is answered by the codec (-32700).
            conn.message_received(message)

    def release_held(self) -> None:
        """Requests are read again: dispatch what was held, until paused again."""
        flow = self._flow
        while self._held and not (flow is not None and flow.reads_paused):
            self._dispatch(self._held.popleft())

    # --- Outbound ------------------------------------------------------------------

    def write_message(self, data: bytes) -> None:
        self._write_frame((data,), len(data))

    def write_message_parts(self, parts: Sequence[Buffer]) -> None:
        """Send one message given as consecutive pieces, without joining them."""
        self._write_frame(parts, sum(memoryview(part).nbytes for part in parts))

    def _write_frame(self, parts: Sequence[Buffer], size: int) -> None:
        """One message of ``size`` bytes as one unfragmented, unmasked text frame.

        Written as header + payload without copying the payload: equivalent
        to sendMessage() here (no compression is ever negotiated, and the
        streaming send API is never used) at a fraction of its per-message cost.
        """
        if self.state != WebSocketProtocol.STATE_OPEN:
            return
        header = _text_frame_header(size)
        outbox = self._outbox
        if outbox is not None and (outbox.busy or size >= LARGE_MESSAGE_BYTES):
            # Header (with the total length) first, then the pieces as the
            # socket drains; later frames wait behind them.
            outbox.write_parts((header, *parts), len(header) + size)
        else:
            # (Twisted's queue takes bytes only; a non-bytes piece is copied here.)
            self._transport.writeSequence(
                [header, *(part if type(part) is bytes else bytes(part) for part in parts)]
            )
        flow = self._flow
        if flow is not None and not flow.reads_paused:
            unsent = outbox.unsent() if outbox is not None else unsent_bytes(self._transport)
            if unsent > self._read_pause_bytes:
                flow.pause_reads()

    def sendData(self, data: bytes, sync: bool = False, chopsize: int | None = None) -> None:
        # Autobahn writes its own frames (pong, close) straight to the
        # transport: while a large message is still queued, they wait behind
        # it so they cannot land inside its payload (autobahn_private checks
        # that Autobahn still writes them through here; else no Outbox).
        outbox = self._outbox
        if outbox is not None and outbox.busy:
            outbox.write(data)
            return
        super().sendData(data, sync, chopsize)

    def unsent_bytes(self) -> int:
        return writebuffer.unsent_bytes(writebuffer.write_buffer_of(self.transport))

    def discard_unsent(self) -> None:
        writebuffer.discard_unsent(writebuffer.write_buffer_of(self.transport))

    def close_connection(self) -> None:
        """Close after a JSON-RPC protocol violation (the dispatcher logged why)."""
        if self.state == WebSocketProtocol.STATE_OPEN:
            autobahn_private.send_close(self, CLOSE_POLICY_VIOLATION, "JSON-RPC protocol violation")

    # --- server shutdown -----------------------------------------------------------

    def shut_down(self) -> Deferred[None]:
        """Terminate the session's processes, say goodbye, and wait for the TCP close."""
        conn = self.connection
        if conn is None or self.state != WebSocketProtocol.STATE_OPEN:
            if not self._lost.done:
                self._transport.abortConnection()
            return self.when_lost()
        d = conn.shutdown()

        def close(_: object) -> Deferred[None]:
            if self.state == WebSocketProtocol.STATE_OPEN:
                autobahn_private.send_close(self, CLOSE_GOING_AWAY, "exec-server is shutting down")
            # Autobahn drops TCP after closeHandshakeTimeout if the peer never replies.
            return self.when_lost()

        return d.addBoth(close)


class _HandOver:
    """What ``WebSocketResource`` builds the protocol from: the factory plus the edge's findings."""

    def __init__(self, factory: ExecServerFactory, channel: http.EdgeChannel, identity: object):
        self._factory = factory
        self._channel = channel
        self._identity = identity

    def buildProtocol(self, addr: IAddress) -> ExecServerProtocol:
        proto = self._factory.buildProtocol(addr)
        proto.identity = self._identity
        # The socket's place in --max-connections moves with it.
        self._channel.hand_over(proto)
        proto._counted = True
        return proto


class ExecServerFactory(WebSocketServerFactory):
    protocol = ExecServerProtocol  # type: ignore[assignment]
    noisy = False

    def __init__(
        self,
        dispatcher: Dispatcher,
        settings: WebSocketSettings,
        reactor: IReactorTime,
        loopback_only: bool = False,
        *,
        metrics: http.MetricsText,
        peer_check: Callable[[Any], bool] | None = None,
    ) -> None:
        super().__init__(server=f"exec-server/{__version__}", reactor=reactor)
        autobahn_private.install_exact_timers(self, reactor)
        self.dispatcher = dispatcher
        self.settings = settings
        self.protocols: set[ExecServerProtocol] = set()
        #: The twisted.web site every connection starts in (a listener
        #: listens with it); admitted upgrades come back to :meth:`upgrade`.
        self.site = http.EdgeSite(
            http.EdgePolicy(
                dispatcher,
                metrics,
                allowed_origins=frozenset(
                    http.normalize_origin(o) for o in settings.allowed_origins
                ),
                auth=settings.auth,
                # A loopback listener answers only requests whose Host is
                # loopback (a DNS-rebinding page sends its own name as Host).
                loopback_only=loopback_only,
                max_connections=settings.max_connections,
                max_request_head_bytes=settings.max_request_head_bytes,
                handshake_timeout=settings.open_handshake_timeout,
                peer_check=peer_check,
            ),
            self.upgrade,
            reactor,
        )
        self.setProtocolOptions(
            # Plain GETs are answered by the twisted.web site in front.
            webStatus=False,
            # Limits are enforced per message by the protocol (see module doc).
            maxFramePayloadSize=0,
            maxMessagePayloadSize=0,
            # Protocol errors get a close frame with a code and reason.
            failByDrop=False,
            # EdgeChannel's timer bounds the request until the upgrade, and
            # Autobahn answers the replayed request within WebSocketResource's
            # render (101 or an error and a drop): its own timer would never fire.
            openHandshakeTimeout=0,
            closeHandshakeTimeout=settings.close_handshake_timeout,
            autoPingInterval=settings.ping_interval,
            autoPingTimeout=settings.ping_timeout if settings.ping_interval else 0,
            # Origins are checked by the site before Autobahn sees the request.
            allowedOrigins=["*"],
            allowNullOrigin=True,
            perMessageCompressionAccept=lambda _offers: None,
        )

    def buildProtocol(self, addr: IAddress) -> ExecServerProtocol:  # type: ignore[override]
        proto = cast(ExecServerProtocol, super().buildProtocol(addr))
        self.protocols.add(proto)
        return proto

    def upgrade(self, request: Any, identity: object) -> Any:
        """Hand an admitted upgrade request to Autobahn (``http.EdgeResource`` checked it)."""
        if identity is None:
            # Mutual TLS without tokens: the client certificate is who connects.
            identity = tls.certificate_identity(request.channel.transport) or ANONYMOUS
        return WebSocketResource(_HandOver(self, request.channel, identity)).render(request)

    def shut_down(self) -> Deferred[None]:
        # (The HTTP connections are left to finish: each request gets its
        # answer, 503 from now on; the listener drains them once closed.)
        waits = [proto.shut_down() for proto in list(self.protocols)]
        return DeferredList(waits).addCallback(lambda _: None)


class WebSocketService(Service):
    """Listens on one ``ws://IP:PORT`` or ``unix:///PATH`` address (an endpoint, see ``listen``)."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        reactor: IReactorTCP,
        address: WebSocketAddress | UnixAddress,
        settings: WebSocketSettings | None = None,
        banner: Callable[[str], None] | None = None,
        *,
        metrics: http.MetricsText,
    ) -> None:
        self.dispatcher = dispatcher
        self.reactor = reactor
        self.address = address
        self.settings = settings or WebSocketSettings(dispatcher.config.max_message_bytes)
        self.factory = ExecServerFactory(
            dispatcher,
            self.settings,
            IReactorTime(reactor),
            # (A browser cannot reach a Unix socket: no Host check there.)
            loopback_only=isinstance(address, WebSocketAddress) and address.is_loopback,
            metrics=metrics,
            peer_check=self.settings.peer_check if isinstance(address, UnixAddress) else None,
        )
        self._banner = banner or _print_to(sys.stderr)
        self.port: IListeningPort | None = None
        #: The bound address, ``ws://IP:PORT`` (real port), once started.
        self.url: str | None = None

    def startService(self) -> None:
        super().startService()
        if isinstance(self.address, UnixAddress):
            self.address.remove_stale_socket()
        settings = self.settings
        listening = server_endpoint(
            self.reactor, self.address, settings.socket_mode, settings.tls_options
        ).listen(self.factory.site)
        failed: list[Failure] = []
        listening.addCallbacks(self._listening, failed.append)
        if failed:
            # A TCP endpoint answers at once: a port in use stops the start.
            failed[0].raiseException()

    def _listening(self, port: IListeningPort) -> None:
        self.port = port
        address = self.address
        if isinstance(address, WebSocketAddress):
            bound = port.getHost()
            address = address.with_port(bound.port)  # type: ignore[attr-defined]
        self.url = str(address)
        mutual_tls = getattr(self.settings.tls_options, "verify", False)
        if (
            self.settings.auth is None
            and isinstance(address, WebSocketAddress)
            and not address.is_loopback
            and not (address.secure and mutual_tls)
        ):
            log.warn(
                "{url} is not a loopback address and has no authentication "
                "(--allow-unauthenticated): anyone who can reach it can run any command "
                "as this user",
                url=self.url,
            )
        # twistd starts services before the reactor runs, i.e. before its
        # SIGTERM/SIGINT handlers exist: announce the listener only once they
        # do, so a supervisor that signals on "listening on" gets a clean stop.
        # Under a running reactor, the announcement still waits for the
        # current reactor turn to end: the services started after this one
        # (the SIGHUP token reload among them) are then in place too.
        banner = f"exec-server listening on {self.url}"
        when_running = getattr(self.reactor, "callWhenRunning", None)
        call_later = getattr(self.reactor, "callLater", None)
        if when_running is None or call_later is None:
            self._banner(banner)
        else:
            when_running(call_later, 0, self._banner, banner)

    def stopService(self) -> Deferred[None]:
        super().stopService()
        d: Deferred[None] = Deferred.fromCoroutine(self._stop())
        return d

    async def _stop(self) -> None:
        # The sessions end first (all of them), the listener last: meanwhile new
        # connections are answered 503 (the dispatcher is stopping), not
        # refused, so /readyz says so (docs/operations.md, "Signals and
        # shutdown"). Once the listener is closed, the connections it
        # accepted get their answers out before the reactor may stop.
        await self.factory.shut_down()
        # The listener outlives every session of the server, not only its
        # own (another listener's, stdio's, the detached ones): /readyz
        # answers 503 on it until the whole grace is over.
        await self.dispatcher.shutdown()
        if self.port is not None:
            port, self.port = self.port, None
            if IReadDescriptor.providedBy(port):
                # Accept what the kernel holds in the backlog now: closing
                # the socket would reset those connections unanswered; accepted,
                # they get the drain's 503.
                cast(IReadDescriptor, port).doRead()
            stopped = port.stopListening()
            if stopped is not None:
                await stopped
        await self.factory.site.drain()


def _print_to(stream: IO[str]) -> Callable[[str], None]:
    def emit(line: str) -> None:
        print(line, file=stream, flush=True)

    return emit
