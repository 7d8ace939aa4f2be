"""The transport-agnostic JSON-RPC dispatcher.

A :class:`Dispatcher` is shared by every listener; each transport connection
gets a :class:`Connection` from :meth:`Dispatcher.connect` and hands it one
message's bytes at a time. The connection decodes the envelope, routes by
method (unknown method -> ``-32600``, bad params -> ``-32602`` before any
state check, as the reference does), gates on the handshake, runs the
handler and writes the response by id. Handlers may return a value or a
Deferred, so requests on one connection run concurrently and responses go
out in completion order.

The dispatcher knows nothing of sockets or pipes: a transport implements
:class:`Outbound` (write one encoded message, close) and calls
:meth:`Connection.message_received`, :meth:`Connection.oversized_message`
and :meth:`Connection.shutdown`.

Nor does it know the application: the composition root
(:mod:`execserver.app`) adds the routes, gives the factory of each
connection's session (known here only as a
:class:`~execserver.registry.ResumableSession`) and plugs in the parts that
must hear of closed connections or can make the server not ready.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from typing import Any, Protocol

import attrs
import msgspec
from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from execserver import codec
from execserver import protocol as p
from execserver.config import ServerConfig
from execserver.errors import RpcError
from execserver.registry import ANONYMOUS, ResumableSession, SessionRegistry
from execserver.replies import Charged, Releasable
from execserver.waiters import Latch, Waiters, cancel_call

log = Logger()

#: Raw results at least this large are written as pieces, not re-rendered.
LARGE_RESULT_BYTES = 64 * 1024

#: The current dialect answers unknown methods with JSON-RPC's "method not found".
METHOD_NOT_FOUND = -32601
#: ... with the text of codex exec-server 0.171.0 (the seed's is ``unknown method: NAME``).
CURRENT_UNKNOWN_METHOD = "exec-server stub does not implement `{}` yet"

#: /readyz's reason (and the 503 to new WebSocket connections) while the
#: server stops: the listeners stay open until every session has ended.
SHUTTING_DOWN = "exec-server is shutting down"
#: A JSON string value that is a file:// URI.
_URI_VALUE = codec.URI_VALUE
#: Bytes of params copied at a time by the search for it.
_URI_WINDOW = 256 * 1024


def _has_uri_value(params: msgspec.Raw) -> bool:
    """Whether ``params`` hold a string starting ``file://``.

    Looks for its ``:`` (``bytes.find`` of one byte is a ``memchr``; base64
    text has none), not for the whole needle: in the 11 MiB of an 8 MiB
    ``fs/writeFile`` range a regex or a substring search took 13-17 ms,
    this about 1.5 ms. The params are searched in windows of
    :data:`_URI_WINDOW` bytes (overlapping by the needle's length), so
    the search never holds a second copy of a long request.
    """
    view = memoryview(params)
    size = len(view)
    overlap = len(_URI_VALUE) - 1
    start = 0
    while start < size:
        window = bytes(view[max(0, start - overlap) : start + _URI_WINDOW])
        at = window.find(b":")
        while at >= 0:
            if at >= 5 and window.startswith(_URI_VALUE, at - 5):
                return True
            at = window.find(b":", at + 1)
        start += _URI_WINDOW
    return False


#: Seconds between checks of whether a charged reply (fs/readFile) has been
#: sent, while one is queued: its reply budget is released within this.
SENT_POLL_SECONDS = 0.02


class Outbound(Protocol):
    """What a transport offers the dispatcher."""

    def write_message(self, data: bytes) -> None:
        """Send one encoded JSON-RPC message (the transport adds framing)."""

    def close_connection(self) -> None:
        """Close the connection (after flushing what was written)."""

    def unsent_bytes(self) -> int:
        """Bytes of the messages written that the transport has not sent yet.

        Its framing may count too (never less than the messages' own bytes
        still held): a reply charged to a budget is released once sent.
        """

    def discard_unsent(self) -> None:
        """The connection is lost: drop what the transport still holds (never to be sent)."""

    # Optional: ``write_message_parts(parts)`` sends one message given as
    # consecutive byte pieces without joining them (used for large results).


class _GoneOutbound:
    """Stands in for a closed transport: nothing can be sent any more."""

    def write_message(self, data: bytes) -> None:
        pass

    def close_connection(self) -> None:
        pass

    def unsent_bytes(self) -> int:
        return 0

    def discard_unsent(self) -> None:
        pass


_GONE = _GoneOutbound()

Handler = Callable[["Connection", Any], Any]


def _log_send_failure(failure: Failure) -> None:
    log.failure("sending a response failed", failure)


def _never(method: str) -> bool:
    return False


def _unchanged(error: RpcError) -> RpcError:
    return error


@attrs.frozen
class CurrentDialect:
    """How the reference's current dialect differs, as the composition root says.

    A connection speaks it once its ``initialize`` carries ``resumeSessionId``,
    or once a request of a method ``announced_by`` accepts carries a
    ``file://`` URI (docs/protocol.md, "Dialects"); from then on its unknown
    methods get ``-32601`` and its errors go through ``error``.
    """

    announced_by: Callable[[str], bool] = _never
    error: Callable[[RpcError], RpcError] = _unchanged


#: Builds the session of a new connection (the composition root's).
SessionFactory = Callable[["Connection"], ResumableSession]


@attrs.frozen
class Route:
    params_type: type[Any]
    handler: Handler
    #: Handshake family named in "client must ... before using X methods";
    #: None for methods usable before the handshake completes.
    family: str | None
    #: A file:// URI in this method's params announces the current dialect
    #: (``CurrentDialect.announced_by``, asked once, when the route is added).
    announces: bool = False


@attrs.define
class Stats:
    """Counters for /metrics."""

    connections_opened: int = 0
    connections_active: int = 0
    requests: Counter[tuple[str, str]] = attrs.Factory(Counter)
    output_bytes: Counter[str] = attrs.Factory(Counter)
    processes_started: int = 0
    processes_exited: int = 0
    #: Bytes of incomplete WebSocket messages held, over all connections.
    partial_message_bytes: int = 0
    #: Processes started and not yet closed (holding descriptors), all sessions.
    processes_open: int = 0
    #: WebSocket upgrades and /metrics requests refused for a missing or wrong token.
    auth_refused: int = 0
    #: Connections, handshakes, sessions and processes refused by a limit, by
    #: limit (docs/operations.md, "Security": "Limits").
    refused: Counter[str] = attrs.Factory(Counter)
    #: Connections open on WebSocket listeners (upgraded or not), all listeners.
    sockets_open: int = 0
    #: Detached anonymous sessions ended to make room for a new one
    #: (--max-sessions-per-identity reached; operations.md, "Limits a peer cannot exceed").
    sessions_evicted: int = 0
    #: PTYs held (tty processes started and not yet closed), all sessions.
    ptys_open: int = 0
    #: Processes a resource limit ended or crippled, by ``limitExceeded``.
    limits_exceeded: Counter[str] = attrs.Factory(Counter)


class Dispatcher:
    """Method table and shared state for all connections of one server."""

    def __init__(
        self,
        config: ServerConfig,
        clock: IReactorTime,
        session_factory: SessionFactory,
        capabilities: tuple[str, ...] = (),
        dialect: CurrentDialect = CurrentDialect(),
    ) -> None:
        self.config = config
        self.clock = clock
        self.session_factory = session_factory
        self.dialect = dialect
        #: Listed in ``initialize``'s result; routes add theirs.
        self.capabilities = list(capabilities)
        self.stats = Stats()
        self.connections: set[Connection] = set()
        #: Sessions that may outlive their connection (server-wide).
        self.sessions = SessionRegistry(clock)
        self._stopping = False
        #: The method table, filled by the composition root.
        self.routes: dict[str, Route] = {}
        #: Told when a connection's transport is gone (drop its queued work).
        self.closed_hooks: list[Callable[[Connection], None]] = []
        #: Told when a connection begins to shut down (end its work in flight).
        self.shutdown_hooks: list[Callable[[Connection], None]] = []
        #: Each says why the server should not get new work now, or None.
        self.readiness_checks: list[Callable[[], str | None]] = []
        #: What the composition root built around this dispatcher
        #: (``app.Application``: the fs methods' state, the sandbox), for the
        #: modules that report on it (``/metrics``); opaque here.
        self.application: object = None
        #: Offered every long incoming line (codec.LineFramer's sink_factory):
        #: the streamed fs/writeFile decode, set by the fs routes.
        self.long_line_sink: codec.SinkFactory | None = None

    def add_route(
        self, method: str, params_type: type[Any], handler: Handler, family: str | None = "exec"
    ) -> None:
        announces = self.dialect.announced_by(method)
        self.routes[method] = Route(params_type, handler, family, announces)

    def add_method(
        self, method: p.Method[Any, Any], handler: Handler, *, decode: type[Any] | None = None
    ) -> None:
        """A route for a declared method: its name, params type and family.

        ``decode``: the server's own type to decode the params with where it
        decodes more than the declared type says (fs/readFile's and
        fs/writeFile's wire types); the declaration stays the one for clients.
        """
        params = method.params if decode is None else decode
        self.add_route(method.name, params, handler, method.family)

    def connect(self, outbound: Outbound, label: str = "connection") -> Connection:
        conn = Connection(self, outbound, label)
        self.connections.add(conn)
        self.stats.connections_opened += 1
        self.stats.connections_active += 1
        return conn

    def _forget(self, conn: Connection) -> None:
        if conn in self.connections:
            self.connections.discard(conn)
            self.stats.connections_active -= 1

    def all_sessions(self) -> list[ResumableSession]:
        """Every live session: attached to a connection, or detached and resumable."""
        found = {id(conn.session): conn.session for conn in self.connections}
        for session in self.sessions.detached_sessions():
            found[id(session)] = session
        return list(found.values())

    def sessions_of(self, identity: object) -> int:
        """Initialized sessions (attached or detached) owned by ``identity``."""
        attached = sum(
            1
            for conn in self.connections
            if conn.initialize_requested and conn.identity == identity
        )
        return attached + self.sessions.detached_owned_by(identity)

    def not_ready_reason(self) -> str | None:
        """Why the server should not get new work now (for /readyz), or None."""
        if self._stopping:
            return SHUTTING_DOWN
        for check in self.readiness_checks:
            reason = check()
            if reason is not None:
                return reason
        return None

    @property
    def stopping(self) -> bool:
        return self._stopping

    def begin_stopping(self) -> None:
        """From now on /readyz and new WebSocket connections are answered 503."""
        self._stopping = True

    def shutdown(self) -> Deferred[None]:
        """Shut every connection down and end detached sessions (terminating all processes)."""
        self._stopping = True
        waits = [conn.shutdown() for conn in list(self.connections)]
        waits.append(self.sessions.shutdown())
        return DeferredList(waits).addCallback(lambda _: None)


class Connection:
    """The JSON-RPC endpoint of one transport connection and its session."""

    def __init__(self, dispatcher: Dispatcher, outbound: Outbound, label: str) -> None:
        self.dispatcher = dispatcher
        self.outbound = outbound
        self.label = label
        self.initialize_requested = False
        self.initialized = False
        self.client_name: str | None = None
        #: The client speaks the reference's current dialect (docs/protocol.md,
        #: "Dialects"): set by its initialize or by its first file:// path.
        self.speaks_current_dialect = False
        #: Who is connected: a session is resumed only by the identity that
        #: created it. An authenticating transport sets ``identity`` on itself.
        self.identity: object = getattr(outbound, "identity", ANONYMOUS)
        #: False where one connection lives as long as the server (stdio).
        self.resumable: bool = getattr(outbound, "resumable", True)
        self.session = dispatcher.session_factory(self)
        self._open = True
        #: The session was detached (kept for its TTL), not ended, at close.
        self._detached = False
        self._in_flight = 0
        self._idle: Waiters[None] = Waiters()
        self._shutdown: Deferred[None] | None = None
        self._shut: Latch[None] = Latch()
        #: Bytes handed to the transport so far, and the charged replies
        #: (fs/readFile) among them: (end offset, charge), oldest first.
        self._written = 0
        self._charges: deque[tuple[int, Releasable]] = deque()
        self._sent_poll: IDelayedCall | None = None

    # --- incoming ---------------------------------------------------------------

    def message_received(
        self, data: bytes | bytearray | memoryview | str | codec.StreamedLine
    ) -> None:
        """Handle one complete message (one line, one frame)."""
        if isinstance(data, codec.StreamedLine):
            if self._streamed_received(data):
                return
            data = data.line  # decoded as any line: the exact answer
        if not self._open:
            return
        try:
            incoming = codec.decode_message(data)
        except codec.FramingError as exc:
            self._count("<invalid>", "error")
            self._send_error(exc.request_id, exc.error)
            return
        except Exception:
            # An exception escaping here would end the whole connection (and,
            # on stdio, the server): one bad line must cost one error reply.
            self._count("<invalid>", "error")
            log.failure("unexpected error decoding a message on {label}", label=self.label)
            self._send_error(None, RpcError.internal("internal error: cannot decode message"))
            return
        if isinstance(incoming, codec.IncomingRequest):
            self._handle_request(incoming, data)
        elif isinstance(incoming, codec.IncomingNotification):
            self._handle_notification(incoming)
        else:
            kind = "error" if incoming.is_error else "response"
            self._violation(f"unexpected client {kind} for request id {incoming.id!r}")

    def _streamed_received(self, line: codec.StreamedLine) -> bool:
        """Handle a long fs/writeFile whose data was decoded as it arrived, if it is one."""
        req = codec.decode_streamed(line) if self._open else None
        route = self.dispatcher.routes.get(req.method) if req is not None else None
        if req is None or route is None or not hasattr(route.params_type, "long_string"):
            line.sink.abort()
            return False
        self._handle_request(req, line)
        return True

    def oversized_message(self) -> None:
        """The transport dropped a message larger than ``max_message_bytes``."""
        if not self._open:
            return
        self._count("<invalid>", "error")
        limit = self.dispatcher.config.max_message_bytes
        self._send_error(
            None,
            RpcError.invalid_request(
                f"message exceeds the maximum size of {limit} bytes (--max-message-bytes)"
            ),
        )

    def _handle_notification(self, note: codec.IncomingNotification) -> None:
        if note.method != p.INITIALIZED:
            self._violation(f"unexpected notification method: {note.method}")
            return
        if not self.initialize_requested:
            self._violation("received `initialized` notification before `initialize`")
            return
        self.initialized = True

    def _handle_request(
        self,
        req: codec.IncomingRequest,
        line: bytes | bytearray | memoryview | str | codec.StreamedLine = b"",
    ) -> None:
        route = self.dispatcher.routes.get(req.method)
        long_string = getattr(route.params_type, "long_string", None) if route is not None else None
        cut = None
        if long_string is not None and not isinstance(line, str | codec.StreamedLine):
            # (fs/writeFile over WebSocket: its long string found and cut out
            # once, for the URI check below and the params' decode.)
            try:
                cut = codec.cut_long_params(line, req.params, long_string[0])
            except Exception:  # (never: the whole params are then searched and decoded)
                cut = None
        if (
            not self.speaks_current_dialect
            and req.params is not None
            and (
                route.announces
                if route is not None
                else self.dispatcher.dialect.announced_by(req.method)
            )
            and (
                codec.has_uri_value(line, cut)
                if cut is not None and not isinstance(line, str | codec.StreamedLine)
                else _has_uri_value(req.params)
            )
        ):
            # Only the current dialect sends paths as URIs: from now on this
            # client gets its error codes and fields.
            self.speaks_current_dialect = True
            self.session.speaks_current_dialect = True
        if route is None:
            self._count("<unknown>", "error")
            if self.speaks_current_dialect:
                message = CURRENT_UNKNOWN_METHOD.format(req.method)
                self._send_error(req.id, RpcError(METHOD_NOT_FOUND, message))
            else:
                message = f"unknown method: {req.method}"
                self._send_error(req.id, RpcError.invalid_request(message))
            return
        try:
            if long_string is not None and not isinstance(line, str):
                # (fs/writeFile: its data is not parsed a second time; a
                # streamed line has no cut, its sink consumed the string.)
                key, attribute = long_string
                params = codec.decode_long_params(
                    line, req.params, route.params_type, key, attribute, cut=cut
                )
            else:
                params = codec.decode_params(req.params, route.params_type)
            # (initialized implies initialize_requested: one test per request.)
            if route.family is not None and not self.initialized:
                self._require_handshake(route.family)
            result = route.handler(self, params)
        except RpcError as exc:
            self._count(req.method, "error")
            self._send_error(req.id, exc)
            return
        except Exception:
            self._internal_error(req, Failure())
            return
        if isinstance(result, Deferred):
            self._in_flight += 1
            result.addCallbacks(
                self._deferred_result,
                self._deferred_failure,
                callbackArgs=(req,),
                errbackArgs=(req,),
            ).addErrback(_log_send_failure)
        else:
            self._respond(req, result)

    def _respond(self, req: codec.IncomingRequest, result: object) -> None:
        if not isinstance(result, Charged):
            self._respond_with(req, result)
            return
        charge = result.charge
        try:
            self._respond_with(req, result.result)
        finally:
            # Held until the transport has sent the reply; at once if it
            # was not written (closed connection: the reply is dropped).
            if self._open:
                self._charges.append((self._written, charge))
                self._check_sent()
            else:
                charge.release()

    def _respond_with(self, req: codec.IncomingRequest, result: object) -> None:
        # Encode before counting and writing: a result msgspec cannot encode
        # must become an error reply, not an exception that ends the connection.
        rendered = isinstance(result, codec.RenderedParts)
        if rendered or (isinstance(result, msgspec.Raw) and len(result) >= LARGE_RESULT_BYTES):
            # A large pre-rendered result (fs/readFile) is sent around the
            # envelope as pieces: rendering the envelope would copy it.
            self._count(req.method, "ok")
            if self._open:
                pieces = result.parts if isinstance(result, codec.RenderedParts) else (result,)
                parts = (b'{"id":', codec.encode(req.id), b',"result":', *pieces, b"}")
                size = sum(len(part) for part in parts)
                self._written += size
                write_parts = getattr(self.outbound, "write_message_parts", None)
                if write_parts is not None and size >= LARGE_RESULT_BYTES:
                    write_parts(parts)
                else:
                    self.outbound.write_message(b"".join(parts))
            self.session.release_held()
            return
        try:
            data = codec.encode(p.Response(req.id, result))
        except Exception:
            self._internal_error(req, Failure())
            return
        self._count(req.method, "ok")
        if self._open:
            self._written += len(data)
            self.outbound.write_message(data)
        # Events of a process that finished while it was being started were
        # held back so that they follow this (its start) response.
        self.session.release_held()

    def _check_sent(self) -> None:
        """Release the charges of replies the transport has sent.

        ``written - unsent`` undercounts what was sent (the transport's own
        framing is unsent too but not in ``written``), so a charge is never
        released early; once the buffer drains, every charge is released.
        While any remains, one timer checks again.
        """
        if self._charges:
            sent = self._written - self.outbound.unsent_bytes()
            while self._charges and self._charges[0][0] <= sent:
                self._charges.popleft()[1].release()
        if self._charges and self._sent_poll is None:
            self._sent_poll = self.dispatcher.clock.callLater(SENT_POLL_SECONDS, self._poll_sent)

    def _poll_sent(self) -> None:
        self._sent_poll = None
        self._check_sent()

    def _release_charges(self) -> None:
        cancel_call(self._sent_poll)
        self._sent_poll = None
        while self._charges:
            self._charges.popleft()[1].release()

    def _deferred_result(self, result: object, req: codec.IncomingRequest) -> None:
        try:
            self._respond(req, result)
        finally:
            # Always: shutdown waits until no request is in flight.
            self._request_done()

    def _deferred_failure(self, failure: Failure, req: codec.IncomingRequest) -> None:
        try:
            if isinstance(failure.value, RpcError):
                self._count(req.method, "error")
                self._send_error(req.id, failure.value)
            else:
                self._internal_error(req, failure)
        finally:
            self._request_done()

    def _internal_error(self, req: codec.IncomingRequest, failure: Failure) -> None:
        self._count(req.method, "error")
        if isinstance(failure.value, OSError):
            # An OS error is the host's answer, not a bug of ours: one line.
            log.warn("{method} failed: {error}", method=req.method, error=failure.getErrorMessage())
        else:
            log.failure("unexpected error handling {method}", failure, method=req.method)
        self._send_error(req.id, RpcError.internal(f"internal error: {failure.getErrorMessage()}"))

    def _request_done(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.fire(None)

    def _require_handshake(self, family: str) -> None:
        if not self.initialize_requested:
            raise RpcError.invalid_request(
                f"client must call initialize before using {family} methods"
            )
        if not self.initialized:
            raise RpcError.invalid_request(
                f"client must send initialized before using {family} methods"
            )

    def _violation(self, reason: str) -> None:
        log.warn("closing {label} after protocol error: {reason}", label=self.label, reason=reason)
        self._count("<violation>", "error")
        self.outbound.close_connection()
        # Like the reference, stop processing this connection's messages.
        self._open = False

    def _count(self, method: str, outcome: str) -> None:
        self.dispatcher.stats.requests[(method, outcome)] += 1

    # --- outgoing ---------------------------------------------------------------

    def send(self, message: object) -> None:
        """Send a wire value, or ``bytes`` that already encode one message."""
        if self._open:
            data = message if type(message) is bytes else codec.encode(message)
            self._written += len(data)
            self.outbound.write_message(data)

    def _send_error(self, request_id: p.RequestId | None, error: RpcError) -> None:
        if self.speaks_current_dialect:
            error = self.dispatcher.dialect.error(error)
        self.send(p.ErrorResponse(request_id, error.to_wire()))

    # --- lifecycle --------------------------------------------------------------

    def when_idle(self) -> Deferred[None]:
        """Fires once every request received so far has been answered."""
        if self._in_flight == 0:
            return succeed(None)
        return self._idle.wait()

    def adopt(self, session: ResumableSession) -> None:
        """Carry the resumed ``session`` from now on (instead of this connection's own)."""
        placeholder = self.session
        # The transport registered the placeholder as its flow-control
        # producer; it steers the resumed session's pipes from now on.
        placeholder.steer_flow_of(session)
        placeholder.release()
        session.attach(self.send)
        self.session = session

    def shutdown(self) -> Deferred[None]:
        """Terminate the session's processes, then answer what is in flight.

        Idempotent; the returned Deferred fires when every process is closed
        and every request has been answered. A session with a TTL whose
        connection was lost is detached instead (kept for its TTL); on server
        shutdown it is terminated like any other.
        """
        if self._shutdown is None:
            for hook in self.dispatcher.shutdown_hooks:
                hook(self)
            session = self.session
            registry = self.dispatcher.sessions
            if (
                not self._open
                and session.ttl_ms > 0
                and not self.dispatcher.stopping
                and session.session_id in registry
            ):
                registry.detach(session)
                self._detached = True
                d = self.when_idle()
                d.addBoth(self._finished)
                self._shutdown = d
                return self.shutdown()
            registry.forget(session)
            d = session.shutdown()
            d.addCallback(lambda _: self.when_idle())
            d.addBoth(self._finished)
            self._shutdown = d
        return self._shut.wait()

    def _finished(self, result: object) -> None:
        if isinstance(result, Failure):
            log.failure("session shutdown failed", result)
        self.dispatcher._forget(self)
        if not self._open and not self._detached:
            self.session.release()
        self._shut.fire(None)

    def transport_closed(self) -> None:
        """The transport is gone: nothing more can be sent."""
        self._open = False
        # What the transport still holds will never be sent: free it now
        # (a closed Twisted transport keeps its buffer), with the reply
        # budget it was charged to, and drop fs requests not yet started.
        self.outbound.discard_unsent()
        self._release_charges()
        for hook in self.dispatcher.closed_hooks:
            hook(self)
        # Let go of the transport (which points back at this connection):
        # it is freed as soon as it closes, not at a garbage collection.
        self.outbound = _GONE
        # Output is discarded from now on; read the children's pipes again so
        # they are not left blocked on a full pipe while being terminated.
        self.session.resumeProducing()
