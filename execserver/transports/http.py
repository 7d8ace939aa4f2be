"""The HTTP side of the WebSocket port on ``twisted.web``: edge checks, ``/readyz``, ``/metrics``.

Every connection of a WebSocket listener starts as an :class:`EdgeChannel`
(a ``twisted.web`` ``HTTPChannel``) of an :class:`EdgeSite`. The channel
enforces what must be decided before any HTTP parsing: the connection limit
(``503``), the size of the request head (``431``; Twisted's own limits would
answer ``400``) and the time the request may take (dropped, no answer). The
site's only resource, :class:`EdgeResource`, checks ``Host`` (loopback
listeners), the bearer token and ``Origin``, then hands an upgrade to the
WebSocket layer (``transports/websocket.py``, through Autobahn's public
``WebSocketResource``) and answers anything else itself: ``/readyz`` and
``/metrics`` are ordinary resources, ``426`` on ``/``, ``404`` elsewhere.
One request per connection: every plain reply closes it.

While the server shuts down (``Dispatcher.stopping``) every request is
read to its end and answered ``503`` with ``Retry-After`` (the handshake
timeout answers it too), and once the listener has closed
:meth:`EdgeSite.drain` answers what is left and waits, bounded, for the
clients to close: no accepted connection ends without an answer.

The replies themselves are pure functions to an :class:`HttpReply`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, cast
from urllib.parse import urlsplit

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import (
    IAddress,
    IDelayedCall,
    IProtocol,
    IReactorTime,
    ISSLTransport,
)
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http import HTTPChannel
from twisted.web.resource import Resource
from twisted.web.server import Request, Site

from execserver import __version__, tls
from execserver.dispatcher import SHUTTING_DOWN
from execserver.logsink import OncePerInterval

if TYPE_CHECKING:
    from execserver.auth import TokenStore
    from execserver.dispatcher import Dispatcher

log = Logger()

#: Default of ``--max-request-head-bytes``: largest accepted HTTP request
#: head (request line and headers).
MAX_REQUEST_HEAD_BYTES: Final = 16 * 1024

_STATUS_TEXT: Final = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    426: "Upgrade Required",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


@attrs.frozen
class HttpReply:
    status: int
    body: str | bytes
    headers: tuple[tuple[str, str], ...] = ()
    content_type: str = "text/plain; charset=utf-8"

    @property
    def payload(self) -> bytes:
        return self.body.encode() if isinstance(self.body, str) else self.body

    def fields(self) -> list[tuple[str, str]]:
        """Every header field of the reply, in order."""
        return [
            ("Server", f"exec-server/{__version__}"),
            ("Content-Type", self.content_type),
            # (Also for HEAD, where twisted.web would leave it out: no body.)
            ("Content-Length", str(len(self.payload))),
            ("Cache-Control", "no-store"),
            ("Connection", "close"),
            *self.headers,
        ]

    def render(self) -> bytes:
        """The whole response, for a connection answered before twisted.web parses it."""
        lines = [f"HTTP/1.1 {self.status} {_STATUS_TEXT[self.status]}"]
        lines += [f"{name}: {value}" for name, value in self.fields()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + self.payload


def normalize_origin(origin: str) -> str:
    """Origins compare case-insensitively, without a trailing slash."""
    return origin.strip().rstrip("/").lower()


def origin_refused(origin: str) -> HttpReply:
    return HttpReply(
        403,
        f"origin {origin!r} is not allowed to connect; "
        "the server admits it only when started with --allow-origin for it\n",
    )


def unauthorized(what: str) -> HttpReply:
    """401 for a missing or wrong bearer token (the reply never says which, nor echoes it)."""
    return HttpReply(
        401,
        f"{what} needs a valid `Authorization: Bearer TOKEN` header\n",
        (("WWW-Authenticate", "Bearer"),),
    )


def host_refused(host: str) -> HttpReply:
    return HttpReply(
        403,
        f"Host {host[:200]!r} is not a loopback name or address; this loopback listener "
        "answers only requests addressed to localhost, 127.0.0.0/8 or [::1] "
        "(DNS rebinding protection)\n",
    )


#: Headers a request carries at most once (RFC 9110 section 5.3: neither is a list).
_SINGLE_HEADERS = (b"host", b"authorization")


def duplicate_header_refused(name: bytes) -> HttpReply:
    title = name.decode().title()
    return HttpReply(400, f"the request carries more than one {title} header; send one\n")


def body_refused() -> HttpReply:
    return HttpReply(
        400,
        "a WebSocket upgrade request has no body (no Transfer-Encoding, no Content-Length "
        "above 0)\n",
    )


def host_is_loopback(host: str) -> bool:
    """Whether a ``Host`` header names this machine's loopback (``localhost``, 127/8, ::1)."""
    host = host.strip().lower()
    if host.startswith("["):
        name, sep, rest = host[1:].partition("]")
        if not sep or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return False
    else:
        name, sep, port = host.partition(":")
        if sep and not port.isdigit():
            return False
    name = name.rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


# --- the twisted.web edge -------------------------------------------------------------

#: What the edge hands an admitted upgrade to: the request and the
#: authenticated identity (None: no token checked); returns the render result.
Upgrade = Callable[[Request, object], Any]
#: The ``/metrics`` text, rendered when asked for. The composition root
#: (``service.build_service``) binds ``metrics.render`` to its dispatcher:
#: the edge imports nothing of the application it measures.
MetricsText = Callable[[], bytes]
#: The Prometheus text exposition format, version 0.0.4.
PROMETHEUS_TEXT: Final = "text/plain; version=0.0.4; charset=utf-8"
#: Seconds a stopping listener's last connections get to take their answer
#: after the listener closed (:meth:`EdgeSite.drain`); then they are aborted.
DRAIN_SECONDS: Final = 1.0


def shutting_down() -> HttpReply:
    """What every HTTP request gets while the server shuts down (``/readyz`` included)."""
    return HttpReply(503, f"{SHUTTING_DOWN}; connect again later\n", (("Retry-After", "1"),))


@attrs.frozen
class EdgePolicy:
    """What the edge of one WebSocket listener checks (from ``WebSocketSettings``)."""

    dispatcher: Dispatcher
    #: What ``GET /metrics`` answers.
    metrics: MetricsText
    #: Normalized browser origins admitted to upgrade (others get 403).
    allowed_origins: frozenset[str] = frozenset()
    #: Accepted bearer tokens; None: no authentication.
    auth: TokenStore | None = None
    #: Answer only requests whose Host is a loopback name (DNS rebinding).
    loopback_only: bool = False
    #: Connections open at once over all WebSocket listeners.
    max_connections: int = 4096
    #: Largest request head (request line and headers), in bytes.
    max_request_head_bytes: int = MAX_REQUEST_HEAD_BYTES
    #: Seconds a client may take to send its request.
    handshake_timeout: float = 5.0
    #: Called with each accepted connection's transport first: True closes
    #: it at once (a ``unix://`` listener's check of confined peers).
    peer_check: Callable[[Any], bool] | None = None


def _send(request: Request, reply: HttpReply) -> bytes:
    """Put ``reply`` on a twisted.web request; the body is returned for ``render``."""
    request.setResponseCode(reply.status, _STATUS_TEXT[reply.status].encode())
    for name, value in reply.fields():
        request.setHeader(name.encode("latin-1"), value.encode("latin-1"))
    return b"" if request.method == b"HEAD" else reply.payload


def peer_text(address: IAddress) -> str:
    """``tcp4:HOST:PORT`` / ``tcp6:...`` / ``unix:PATH``, as Autobahn names a peer in its logs."""
    host = getattr(address, "host", None)
    if host is not None:
        kind = "tcp6" if ":" in host else "tcp4"
        return f"{kind}:{host}:{getattr(address, 'port', '')}"
    name = getattr(address, "name", None)
    return f"unix:{name}" if name else "unix"


def _header(request: Request, name: bytes) -> str | None:
    value = request.getHeader(name)
    return None if value is None else value.decode("latin-1")


def _has_body(request: Request) -> bool:
    if request.getHeader(b"transfer-encoding") is not None:
        return True
    length = request.getHeader(b"content-length")
    # (twisted.web has already refused a Content-Length that is not a number.)
    return length is not None and int(length) > 0


def _only_get(request: Request, path: str) -> bytes | None:
    if request.method in (b"GET", b"HEAD"):
        return None
    return _send(
        request, HttpReply(405, f"{path} answers GET and HEAD only\n", (("Allow", "GET, HEAD"),))
    )


class ReadyResource(Resource):
    """``GET /readyz``: 200 ``ready``, or 503 with the reason while not ready."""

    isLeaf = True

    def __init__(self, dispatcher: Dispatcher) -> None:
        super().__init__()
        self._dispatcher = dispatcher

    def render(self, request: Request) -> bytes:
        refused = _only_get(request, "/readyz")
        if refused is not None:
            return refused
        reason = self._dispatcher.not_ready_reason()
        return _send(
            request,
            HttpReply(200, "ready\n") if reason is None else HttpReply(503, reason + "\n"),
        )


class MetricsResource(Resource):
    """``GET /metrics``: the Prometheus text (with authentication on, only for a valid token)."""

    isLeaf = True

    def __init__(self, dispatcher: Dispatcher, metrics: MetricsText, auth: TokenStore | None):
        super().__init__()
        self._dispatcher = dispatcher
        self._metrics = metrics
        self._auth = auth

    def render(self, request: Request) -> bytes:
        refused = _only_get(request, "/metrics")
        if refused is not None:
            return refused
        auth = self._auth
        if auth is not None and auth.authenticate(_header(request, b"authorization")) is None:
            self._dispatcher.stats.auth_refused += 1
            return _send(request, unauthorized("GET /metrics"))
        return _send(request, HttpReply(200, self._metrics(), content_type=PROMETHEUS_TEXT))


class EdgeResource(Resource):
    """The site's root: Host, token and Origin checks, then the upgrade or a plain resource.

    The path of an upgrade is not checked (``ws://host:port/anything`` is
    the endpoint), so this is a leaf that looks at ``request.path`` itself.
    """

    isLeaf = True

    def __init__(self, policy: EdgePolicy, upgrade: Upgrade) -> None:
        super().__init__()
        self._policy = policy
        self._upgrade = upgrade
        self._plain: dict[bytes, Resource] = {
            b"/readyz": ReadyResource(policy.dispatcher),
            b"/metrics": MetricsResource(policy.dispatcher, policy.metrics, policy.auth),
        }

    def render(self, request: Request) -> Any:
        policy = self._policy
        if policy.dispatcher.stopping:
            # Until the server exits the listener stays open and every
            # request, read to its end first, gets this: probes and
            # clients learn why (and retry elsewhere), none is dropped.
            return _send(request, shutting_down())
        for name in _SINGLE_HEADERS:
            values = request.requestHeaders.getRawHeaders(name)
            if values is not None and len(values) > 1:
                # Which one a check reads and which one a proxy or the next
                # hop reads may differ: a request carries one or is refused.
                return _send(request, duplicate_header_refused(name))
        host = _header(request, b"host")
        if policy.loopback_only and host is not None and not host_is_loopback(host):
            return _send(request, host_refused(host))
        if request.getHeader(b"upgrade") is None:
            # (An absolute-form target, ``GET http://host/readyz``, names the same path.)
            target = (
                urlsplit(request.path).path if not request.path.startswith(b"/") else request.path
            )
            resource = self._plain.get(target)
            if resource is not None:
                return resource.render(request)
            if target == b"/":
                return _send(
                    request,
                    HttpReply(
                        426,
                        "this is an exec-server WebSocket endpoint: connect with a WebSocket "
                        "client (ws://HOST:PORT); plain HTTP is served only at GET /readyz and "
                        "GET /metrics\n",
                        (("Upgrade", "websocket"),),
                    ),
                )
            path = target.decode("latin-1")
            return _send(
                request,
                HttpReply(
                    404,
                    f"no resource at {path}; plain HTTP is served at /readyz and /metrics only\n",
                ),
            )
        if _has_body(request):
            # twisted.web has read the body as the request's and keeps what
            # came right behind it (the client's first frames) to itself.
            return _send(request, body_refused())
        origin = _header(request, b"origin")
        if origin is not None and normalize_origin(origin) not in policy.allowed_origins:
            return _send(request, origin_refused(origin))
        identity: object = None
        if policy.auth is not None:
            authorization = _header(request, b"authorization")
            identity = policy.auth.authenticate(authorization)
            if identity is None:
                policy.dispatcher.stats.auth_refused += 1
                log.info(
                    "refused a WebSocket upgrade from {peer}: {why} bearer token",
                    peer=peer_text(request.getClientAddress()),
                    why="no" if authorization is None else "an invalid",
                )
                return _send(request, unauthorized("a WebSocket upgrade"))
        return self._upgrade(request, identity)


class EdgeRequest(Request):
    """A twisted.web request that answers in HTTP/1.1 whatever version the client spoke.

    (RFC 9110, section 6.2: a server sends the highest version it conforms
    to; the replies of the earlier hand-written edge did the same.)
    """

    def process(self) -> None:
        self.clientproto = b"HTTP/1.1"
        # (The render is synchronous: from here on the channel has its answer.)
        cast(EdgeChannel, self.channel).answered = True
        super().process()


class EdgeChannel(HTTPChannel):
    """One connection of a WebSocket listener until it is upgraded or answered.

    Before twisted.web parses anything, the channel counts the connection
    (``--max-connections``: 503), bounds the request head
    (``--max-request-head-bytes``: 431, where Twisted's ``totalHeadersSize``
    would answer a bare 400) and starts the handshake timer
    (``--handshake-timeout-ms``). After an upgrade (:meth:`hand_over`) the
    WebSocket protocol owns the socket and the count.
    """

    site: EdgeSite

    def __init__(self) -> None:
        super().__init__()
        self._head = bytearray()
        self._head_done = False
        self._refused = False
        self._counted = False
        self._timer: IDelayedCall | None = None
        #: A request of this connection reached its resource (it is answered).
        self.answered = False
        #: The WebSocket protocol this connection was upgraded to.
        self.upgraded: IProtocol | None = None

    def connectionMade(self) -> None:
        super().connectionMade()
        # (HTTPChannel does this only for a transport declaring ITCPTransport.)
        set_no_delay = getattr(self.transport, "setTcpNoDelay", None)
        if set_no_delay is not None:
            set_no_delay(True)
        site = self.site
        policy = site.policy
        if policy.peer_check is not None and policy.peer_check(self.transport):
            # A confined command of this server (unix:// listeners; see
            # execserver/sandbox/peers.py): closed before anything is read.
            self._refused = True
            self.transport.abortConnection()  # type: ignore[union-attr]
            return
        stats = policy.dispatcher.stats
        stats.sockets_open += 1
        self._counted = True
        site.channels.add(self)
        if stats.sockets_open > policy.max_connections:
            stats.refused["connections"] += 1
            refused = site.refusal_log.hit()
            if refused is not None:
                # One line per interval, however fast a peer reconnects.
                log.warn(
                    "refusing a connection from {peer}: {limit} connections are open "
                    "(--max-connections); {refused} refused since the last such line "
                    "(logged at most once per {interval:g} s)",
                    peer=peer_text(self.transport.getPeer()),  # type: ignore[union-attr]
                    limit=policy.max_connections,
                    refused=refused,
                    interval=site.refusal_log.interval,
                )
            self._refuse(
                HttpReply(
                    503,
                    f"the server has {policy.max_connections} connections open, its limit "
                    "(--max-connections); retry later\n",
                    (("Retry-After", "1"),),
                )
            )
            return
        # (While the server shuts down the request is read as usual and
        # answered 503 by EdgeResource: an answer written before the
        # request was read could be lost to the reset that closing a socket
        # with unread bytes sends.)
        self._timer = site.clock.callLater(policy.handshake_timeout, self._timed_out)

    def _timed_out(self) -> None:
        # A peer that does not finish its request in time (slow headers)
        # holds a connection for nothing: counted, then dropped unanswered
        # (while the server shuts down: answered 503, like every request).
        self._timer = None
        self.site.policy.dispatcher.stats.refused["handshake_timeout"] += 1
        if self.site.policy.dispatcher.stopping:
            self.answer_shutting_down()
            return
        self._refused = True
        self.transport.abortConnection()  # type: ignore[union-attr]

    def answer_shutting_down(self) -> None:
        """The shutdown's 503 for a connection whose request has not reached a resource."""
        if self._refused or self.answered or self.upgraded is not None:
            return
        if getattr(self.transport, "disconnecting", False):
            # twisted.web has answered it itself (e.g. 400 for a malformed
            # request line) and is closing it.
            return
        self._refuse(shutting_down())

    def _refuse(self, reply: HttpReply) -> None:
        """Answer before (or instead of) parsing, and close."""
        self._refused = True
        self._head = bytearray()
        self._cancel_timer()
        transport: Any = self.transport
        transport.write(reply.render())
        # (Not under TLS: its wrapper would half-close the TCP beneath it,
        # under bytes it may still hold; it closes with close_notify.)
        half_close = (
            None
            if ISSLTransport.providedBy(transport)
            else getattr(transport, "loseWriteConnection", None)
        )
        if half_close is None or not self.site.policy.dispatcher.stopping:
            transport.loseConnection()
            return
        # Shutting down: the answer and a FIN, then the rest of the request
        # is read (and discarded) until the client closes, so that closing
        # with unread bytes cannot reset the answer away; EdgeSite.drain
        # bounds the wait.
        half_close()

    def dataReceived(self, data: bytes) -> None:
        upgraded = self.upgraded
        if upgraded is not None:
            # (Only a transport that still calls the channel gets here, e.g. a test's.)
            upgraded.dataReceived(data)
            return
        if self._refused:
            return
        if self._head_done:
            super().dataReceived(data)
            return
        head = self._head
        head += data
        end = head.find(b"\r\n\r\n")
        limit = self.site.policy.max_request_head_bytes
        if (end < 0 and len(head) > limit) or end > limit:
            self.site.policy.dispatcher.stats.refused["request_head_bytes"] += 1
            self._refuse(
                HttpReply(431, f"request head exceeds {limit} bytes (--max-request-head-bytes)\n")
            )
            return
        if end < 0:
            return
        self._head_done = True
        self._head = bytearray()
        data = bytes(head)
        super().dataReceived(data[: end + 4])
        if self.upgraded is not None:
            # The upgraded request never finishes: drop it, so the request
            # (and through it this channel) is freed by reference counting
            # with the connection, not at a garbage collection.
            self.requests = []
        rest = data[end + 4 :]
        if rest:
            # Bytes sent right behind an upgrade request (frames from a client
            # that did not wait for the 101) belong to the WebSocket.
            if self.upgraded is not None:
                self.upgraded.dataReceived(rest)
            elif not self._refused and self.transport is not None:
                super().dataReceived(rest)

    def checkPersistence(self, request: Any, version: bytes) -> bool:
        # One request per connection: the port is not a general web server.
        request.responseHeaders.setRawHeaders(b"Connection", [b"close"])
        return False

    def hand_over(self, protocol: IProtocol) -> None:
        """The upgrade took the socket: stop the timer, leave the producer slot and the count."""
        self.upgraded = protocol
        self._cancel_timer()
        self.site.discard(self)
        self._counted = False
        # HTTPChannel registered itself as the transport's producer; the
        # WebSocket connection registers its own.
        self.transport.unregisterProducer()  # type: ignore[union-attr]

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            if self._timer.active():
                self._timer.cancel()
            self._timer = None

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        why = tls.tls_error_text(reason.value)
        if why is not None:
            # A peer that fails the TLS handshake (wrong CA, no client
            # certificate) is the peer's problem, not an error of ours.
            log.info(
                "TLS handshake with {peer} failed: {why}",
                peer=peer_text(self.transport.getPeer()),  # type: ignore[union-attr]
                why=why,
            )
        self._cancel_timer()
        self.site.discard(self)
        if self._counted:
            self._counted = False
            self.site.policy.dispatcher.stats.sockets_open -= 1
        self._head = bytearray()
        super().connectionLost(reason)


class EdgeSite(Site):
    """The ``twisted.web`` site of one WebSocket listener."""

    protocol = EdgeChannel  # type: ignore[assignment]
    requestFactory = EdgeRequest
    noisy = False
    displayTracebacks = False

    def __init__(self, policy: EdgePolicy, upgrade: Upgrade, clock: IReactorTime) -> None:
        # No idle timeout: EdgeChannel's handshake timer bounds the request,
        # and every connection ends after one reply or an upgrade.
        super().__init__(EdgeResource(policy, upgrade), timeout=None, reactor=clock)
        self.policy = policy
        self.clock = clock
        #: Connections not (yet) upgraded, drained when the listener stops.
        self.channels: set[EdgeChannel] = set()
        self._drained: list[Deferred[None]] = []
        #: The --max-connections refusal warning, at most once per interval.
        self.refusal_log = OncePerInterval(clock)

    def buildProtocol(self, addr: Any) -> EdgeChannel:  # type: ignore[override]
        channel = cast(EdgeChannel, super().buildProtocol(addr))
        # The channel has bounded the head before twisted.web parses it:
        # Twisted's own limits (400 at 16 KiB or 500 headers) must not come first.
        head = self.policy.max_request_head_bytes
        channel.MAX_LENGTH = channel.totalHeadersSize = channel.maxHeaders = head + 4
        return channel

    def startFactory(self) -> None:
        # No access log (and so none of its once-a-second date timer).
        pass

    def stopFactory(self) -> None:
        pass

    def log(self, request: Any) -> None:
        pass

    def discard(self, channel: EdgeChannel) -> None:
        """``channel`` is gone or upgraded: a drain waiting for the last one may end."""
        self.channels.discard(channel)
        if not self.channels:
            drained, self._drained = self._drained, []
            for d in drained:
                d.callback(None)

    async def drain(self, seconds: float = DRAIN_SECONDS) -> None:
        """End every connection that has not been upgraded, answered (the listener has closed).

        The server is stopping: a connection still sending its request is
        answered 503 now; one whose answer is on its way keeps it. Fires
        when the last has closed, or after ``seconds``, when the rest (a
        peer that neither reads nor closes) are aborted.
        """
        for channel in list(self.channels):
            channel.answer_shutting_down()
        if not self.channels:
            return
        done: Deferred[None] = Deferred()
        self._drained.append(done)
        # (At the bound the wait ends as if the last had closed.)
        done.addTimeout(seconds, self.clock, onTimeoutCancel=lambda _result, _timeout: None)
        await done
        if done in self._drained:
            self._drained.remove(done)
        for channel in list(self.channels):
            if channel.transport is not None:
                cast(Any, channel.transport).abortConnection()
