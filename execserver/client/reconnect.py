"""A WebSocket client that reconnects, built on Twisted's ``ClientService``.

``ClientService`` keeps one connection up, retrying with exponential backoff
(``backoffPolicy``). Its ``whenConnected`` fires on TCP connect, before the
WebSocket is open, so the ``prepareConnection`` hook here waits for the
WebSocket to open *and* for the ``initialize``/``initialized`` handshake;
a connection whose handshake fails is dropped and retried.

While disconnected, calls wait (up to ``call_timeout``) for the next
connection instead of failing at once, then fail with :class:`NotConnected`;
calls already sent when the connection drops fail promptly with
:class:`ConnectionClosed`. Listeners hear about every connect and disconnect.

The session outlives a drop (``session_ttl_ms``, default 60 s, capped by
the server): each new connection resumes it (``initialize``
``resumeSessionId``) and every live process handle is caught up from the
last seq it delivered, so the code using a handle sees one ordered stream of
output, exit and close, never a duplicate. The session is created with
``onDetachedFull: "pause"`` (``on_detached_full="drop"`` to choose
otherwise): the server pauses a child rather than drop output this client
has not read; where a "drop" server dropped some, subscriptions raise
:class:`OutputGap` (listeners and subscriptions with ``gaps=True`` get a
:class:`GapEvent`). Calls in flight at the drop are retried after
the resume when repeating them is harmless (reads, waits, lists, fs reads,
writes, which carry a ``writeId``); the others fail with
:class:`OutcomeUnknown`. A session that cannot be resumed (expired, server
restarted, connections refused for 2 s, its TTL passed without a resume:
:class:`~execserver.clientcore.resume.ResumeAttempts`, as ResumingClient)
fails every handle with :class:`SessionLost`, naming the cause, and the
client continues with a new session. ``session_ttl_ms=0`` gives the
old behaviour: a drop ends the session and its handles.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, NoReturn, TypeVar

import attrs
from twisted.application.internet import ClientService, backoffPolicy
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.error import ConnectionRefusedError as Refused
from twisted.internet.interfaces import IProtocol, IProtocolFactory, IStreamClientEndpoint
from twisted.internet.protocol import connectionDone
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from execserver import protocol as p
from execserver.client.api import ClientApi
from execserver.client.channels.websocket import ChannelFactory, WebSocketChannel
from execserver.client.client import ConnectOptions, ExecServerClient
from execserver.client.connect import close_channel, connect_error_text, websocket_endpoint
from execserver.client.errors import (
    ConnectFailed,
    ConnectionClosed,
    NotConnected,
    SessionLost,
)
from execserver.client.process import RemoteProcess
from execserver.clientcore.resume import ResumeAttempts
from execserver.clientcore.session import Dialing, resume_session, through_drops
from execserver.waiters import Waiters

T = TypeVar("T")
log = Logger()


@implementer(IProtocol)
class _Gate:
    """Stands between ``ClientService`` and one connection's protocol.

    ``ClientService`` (Twisted 26.10) raises ``NoTransition`` if a connection
    it is still preparing, or whose ``prepareConnection`` failed, reports its
    loss: its state machine has no transition for that. So the loss of a
    connection is passed on to it only once the handshake succeeded; before
    that, the failed ``prepareConnection`` alone drives the retry.
    """

    def __init__(self, outer: IProtocol, channel: WebSocketChannel) -> None:
        self.outer = outer
        self.channel = channel
        self.ready = False

    def makeConnection(self, transport: Any) -> None:
        self.outer.makeConnection(transport)

    def connectionMade(self) -> None:
        self.outer.connectionMade()

    def dataReceived(self, data: bytes) -> None:
        self.outer.dataReceived(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self.ready:
            self.outer.connectionLost(reason)
        else:
            self.channel.connectionLost(reason)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.outer, name)


@implementer(IProtocolFactory)
class _GateFactory:
    def __init__(self, outer: IProtocolFactory, factory: ChannelFactory) -> None:
        self._outer = outer
        self._factory = factory

    def buildProtocol(self, addr: Any) -> _Gate | None:
        outer = self._outer.buildProtocol(addr)
        if outer is None:
            return None
        return _Gate(outer, self._factory.last_built)

    def doStart(self) -> None:
        self._outer.doStart()

    def doStop(self) -> None:
        self._outer.doStop()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._outer, name)


@implementer(IStreamClientEndpoint)
class _GatedEndpoint:
    """Gates each connection (see :class:`_Gate`); remembers why an attempt failed."""

    def __init__(self, endpoint: Any, factory: ChannelFactory, owner: ReconnectingClient) -> None:
        self._endpoint = endpoint
        self._factory = factory
        self._owner = owner
        self._gates: dict[int, _Gate] = {}

    def connect(self, factory: IProtocolFactory) -> Deferred[IProtocol]:
        d: Deferred[_Gate] = self._endpoint.connect(_GateFactory(factory, self._factory))

        def connected(gate: _Gate) -> IProtocol:
            # ClientService insists on getting back the protocol its factory made.
            self._gates[id(gate.outer)] = gate
            return gate.outer

        def record(failure: Failure) -> Failure:
            exc = ConnectFailed(self._owner.url, connect_error_text(failure.value or Exception()))
            self._owner.last_error = exc
            self._owner._resume_failed(exc, refused=failure.check(Refused) is not None)
            return failure

        return d.addCallbacks(connected, record)

    def gate_of(self, protocol: IProtocol) -> _Gate:
        return self._gates.pop(id(protocol))


class _FollowsSession(ClientApi):
    """The calls of a client that follows one resumable session across connections.

    Shared by :class:`ReconnectingClient` and :class:`ResumingClient`, which
    differ only in how the next connection comes (:meth:`_next_client`).
    A call in flight when the connection drops is sent again on the resumed
    session when repeating it is harmless
    (:func:`execserver.clientcore.calls.repeatable`, shared with the asyncio
    client), and fails with :class:`OutcomeUnknown` otherwise; a session that could not be
    resumed fails it with :class:`SessionLost`.
    """

    _stopped: bool

    def _connected_client(self) -> ExecServerClient | None:
        """The client of the current connection, if it is up."""
        raise NotImplementedError

    def _next_client(self) -> Deferred[ExecServerClient]:
        """The client to send on: the current one, or the next connected one."""
        raise NotImplementedError

    def _lost_error(self, session_id: str) -> Exception:
        """Why calls of ``session_id`` can no longer be answered."""
        raise NotImplementedError

    def _call(self, method: str, params: object, result_type: type[T]) -> Deferred[T]:
        client = self._connected_client()
        if client is not None and not client.resumable:
            return client._call(method, params, result_type)

        def send(client: ExecServerClient, again: bool) -> Deferred[T]:
            return client._call(method, params, result_type)

        return Deferred.fromCoroutine(self._through_drops(send, method, params))

    def _through_drops(
        self,
        send: Callable[[ExecServerClient, bool], Awaitable[T]],
        method: str,
        params: object,
        first: ExecServerClient | None = None,
    ) -> Coroutine[Any, Any, T]:
        """:func:`execserver.clientcore.session.through_drops` over this client's connections."""
        return through_drops(
            self._next_client,
            send,
            method,
            params,
            following=lambda client: client.resumable and not self._stopped,
            session_of=lambda client: client.session_id,
            lost_error=self._lost_error,
            first=first,
        )

    def write(self, process_id: str, chunk: bytes) -> Deferred[p.WriteResponse]:
        """``process/write`` with a ``writeId``, so a retry after a drop writes once."""
        params = p.WriteParams(process_id, bytes(chunk), write_id=uuid.uuid4().hex)
        return self._call(p.PROCESS_WRITE, params, p.WriteResponse)

    def start_process(
        self, argv: Sequence[str] | p.ExecParams, **kwargs: Any
    ) -> Deferred[RemoteProcess]:
        """``ExecServerClient.start_process`` on the current (or next) connection."""

        detach = bool(kwargs.pop("detach", False))

        async def run() -> RemoteProcess:
            client = await self._next_client()
            params = client._start_params(argv, **kwargs)
            handle = client._new_handle(params, detach)

            async def send(client: ExecServerClient, again: bool) -> RemoteProcess:
                # Sent again (same processId) once the session is resumed
                # when it was in flight at a drop; "already exists" then
                # says the first one was carried out.
                return await client._start(params, handle, again=again)

            await self._through_drops(send, p.PROCESS_START, params, first=client)
            # Requests of the handle follow the session across connections.
            handle._api = self
            return handle

        return Deferred.fromCoroutine(run())


class ReconnectingClient(_FollowsSession):
    """Typed protocol methods over a connection that comes back by itself."""

    def __init__(
        self,
        reactor: Any,
        url: str,
        options: ConnectOptions | None = None,
        *,
        token: str | None = None,
        connect_timeout: float = 10.0,
        call_timeout: float = 30.0,
        initial_delay: float = 1.0,
        max_delay: float = 30.0,
        factor: float = 1.5,
        jitter: Callable[[], float] | None = None,
        endpoint: Any = None,
        session_ttl_ms: int = 60_000,
        on_detached_full: str | None = None,
    ) -> None:
        self.url = url
        self._session_ttl_ms = session_ttl_ms
        if on_detached_full is None and session_ttl_ms:
            # A resumed session never lacks output the client has not read.
            on_detached_full = "pause"
        self._on_detached_full = on_detached_full
        #: The client of the last connection while its session waits to be resumed.
        self._suspended: ExecServerClient | None = None
        #: When to stop trying to resume it (from the drop on).
        self._attempts: ResumeAttempts | None = None
        #: Sessions that could not be resumed, with the cause (newest last).
        self.lost_sessions: list[SessionLost] = []
        self._reactor = reactor
        self._options = options or ConnectOptions()
        self._call_timeout = call_timeout
        factory = ChannelFactory(url, reactor, token, open_timeout=connect_timeout)
        policy = backoffPolicy(
            initialDelay=initial_delay,
            maxDelay=max_delay,
            factor=factor,
            **({"jitter": jitter} if jitter is not None else {}),
        )
        if endpoint is None:
            endpoint = websocket_endpoint(reactor, url, connect_timeout)
        self._endpoint = _GatedEndpoint(endpoint, factory, self)
        self._service = ClientService(
            self._endpoint,
            factory,
            retryPolicy=policy,
            clock=reactor,
            prepareConnection=self._prepare,
        )
        self.client: ExecServerClient | None = None
        self.last_error: Exception | None = None
        self.connect_count = 0
        self._waiters: Waiters[ExecServerClient] = Waiters()
        self._on_connected: list[Callable[[ExecServerClient], None]] = []
        self._on_disconnected: list[Callable[[str], None]] = []
        self._stopped = False

    # --- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Start connecting (and keep reconnecting until :meth:`stop`)."""
        self._stopped = False
        self._service.startService()

    def stop(self) -> Deferred[None]:
        """Stop reconnecting, close the connection; waiting calls fail."""
        self._stopped = True
        self._waiters.fail(ConnectionClosed("the reconnecting client was stopped"))
        client = self.client
        if self._suspended is not None:
            suspended, self._suspended = self._suspended, None
            self._attempts = None
            suspended.fail_suspended(ConnectionClosed("the reconnecting client was stopped"))

        async def run() -> None:
            # A WebSocket close handshake first, so the server sees a clean
            # close; then no more reconnecting.
            if client is not None:
                await client.close()
            await self._service.stopService()

        return Deferred.fromCoroutine(run())

    def add_connect_listener(self, listener: Callable[[ExecServerClient], None]) -> None:
        """Called after each successful (re)connection and handshake."""
        self._on_connected.append(listener)

    def add_disconnect_listener(self, listener: Callable[[str], None]) -> None:
        """Called with the reason each time an initialized connection is lost."""
        self._on_disconnected.append(listener)

    @property
    def is_connected(self) -> bool:
        return self.client is not None and self.client.is_connected

    def when_connected(self, timeout: float | None = None) -> Deferred[ExecServerClient]:
        """The current client, or the next one (fails with NotConnected after ``timeout``)."""
        if self.client is not None and self.client.is_connected:
            d: Deferred[ExecServerClient] = Deferred()
            d.callback(self.client)
            return d
        if self._stopped:
            failed: Deferred[ExecServerClient] = Deferred()
            failed.errback(ConnectionClosed("the reconnecting client was stopped"))
            return failed
        waited = self._call_timeout if timeout is None else timeout

        d = self._waiters.wait()  # a timeout cancels it, which forgets it

        def timed_out(result: ExecServerClient | Failure, seconds: float) -> NoReturn:
            raise NotConnected(self.url, seconds, self.last_error)

        return d.addTimeout(waited, self._reactor, onTimeoutCancel=timed_out)

    # --- ClientService hook -------------------------------------------------------

    def _prepare(self, proto: IProtocol) -> Deferred[ExecServerClient]:
        return Deferred.fromCoroutine(self._handshake(self._endpoint.gate_of(proto)))

    async def _handshake(self, gate: _Gate) -> ExecServerClient:
        channel = gate.channel
        suspended = self._suspended
        options = attrs.evolve(
            self._options,
            session_ttl_ms=self._session_ttl_ms or None,
            on_detached_full=self._on_detached_full,
            resume_session_id=suspended.session_id if suspended is not None else None,
        )
        try:
            await channel.opened
            client = await ExecServerClient.connect_rpc(
                channel.rpc,
                self._reactor,
                options,
                closer=lambda: close_channel(channel, self._reactor),
            )
        except BaseException as exc:
            if isinstance(exc, Exception):
                self.last_error = exc
                if suspended is not None and suspended is self._suspended:
                    # The handles fail once the session cannot come back
                    # (e.g. unknown session id: expired, or the server
                    # restarted); the next attempt starts a new session.
                    self._resume_failed(exc, refused=False)
            log.info("connecting to {url} failed: {exc}", url=self.url, exc=exc)
            transport: Any = channel.transport
            if transport is not None and not channel.rpc.is_closed:
                transport.abortConnection()
            raise
        gate.ready = True
        self.last_error = None
        self.client = client
        self.connect_count += 1
        channel.rpc.add_lost_listener(lambda reason: self._lost(client, reason))
        if suspended is not None:
            self._suspended = None
            self._attempts = None
            if client.session_id == suspended.session_id:
                client.adopt(suspended, self).addErrback(
                    lambda f: log.failure("catching up after a resume failed", f)
                )
            else:
                self._session_lost(suspended, "the server started a new session")
        self._waiters.fire(client)
        for listener in list(self._on_connected):
            try:
                listener(client)
            except Exception:
                log.failure("connect listener failed")
        return client

    def _lost_error(self, session_id: str) -> SessionLost:
        for error in reversed(self.lost_sessions):
            if error.session_id == session_id:
                return error
        return SessionLost(session_id, "the connection was replaced by a new session")

    def _resume_failed(self, exc: Exception, *, refused: bool) -> None:
        """An attempt to resume the suspended session failed: give up when
        :class:`ResumeAttempts` (shared with ResumingClient and the asyncio
        client) says so."""
        suspended, attempts = self._suspended, self._attempts
        if suspended is None or attempts is None:
            return
        now = self._reactor.seconds()
        cause = attempts.failed(exc, now, refused=refused) or attempts.expired(now)
        if cause is not None:
            self._session_lost(suspended, cause)

    def _session_lost(self, suspended: ExecServerClient, cause: str) -> None:
        error = SessionLost(suspended.session_id, cause)
        self.lost_sessions.append(error)
        if self._suspended is suspended:
            self._suspended = None
            self._attempts = None
        log.warn("{error}", error=error)
        suspended.fail_suspended(error)

    def _lost(self, client: ExecServerClient, reason: str) -> None:
        if self.client is client:
            self.client = None
        if client.resumable and not self._stopped:
            self._suspended = client
            result = client.initialize_result
            ttl = (result.session_ttl_ms if result is not None else 0) / 1000.0
            self._attempts = ResumeAttempts(ttl, self._reactor.seconds(), reason)
        for listener in list(self._on_disconnected):
            try:
                listener(reason)
            except Exception:
                log.failure("disconnect listener failed")

    def _connected_client(self) -> ExecServerClient | None:
        client = self.client
        return client if client is not None and client.is_connected else None

    def _next_client(self) -> Deferred[ExecServerClient]:
        return self.when_connected()


class ResumingClient(_FollowsSession):
    """Keeps one resumable session across drops, starting from a connected client.

    For callers that make the first connection themselves (the CLI, which
    reports first-connection errors its own way): after a drop it re-dials
    with backoff through ``dial(session_id)`` (an ``initialize`` with
    ``resumeSessionId``), adopts and catches up the handles as
    :class:`ReconnectingClient` does, and retries in-flight idempotent calls.
    It gives up -- failing every handle with :class:`SessionLost` -- when the
    server answers that the session is unknown or with a new session, when
    the token is refused (:class:`AuthRefused`), when connections are refused
    for 2 s (nothing listens any more), or after the session's TTL: the policy
    of :class:`~execserver.clientcore.resume.ResumeAttempts`, shared with the
    asyncio client.
    """

    def __init__(
        self,
        reactor: Any,
        first: ExecServerClient,
        dial: Callable[[str], Deferred[ExecServerClient]],
        initial_delay: float = 0.05,
        max_delay: float = 2.0,
    ) -> None:
        self._reactor = reactor
        self._dial = dial
        self._initial_delay = initial_delay
        self._max_delay = max_delay
        self.client = first
        self._stopped = False
        self.lost: SessionLost | None = None
        self.resumes = 0
        self._resuming = False
        self._waiters: Waiters[ExecServerClient] = Waiters()
        self._watch(first)

    # --- what the CLI uses of a client ------------------------------------------------

    def supports(self, method: str) -> bool:
        return self.client.supports(method)

    @property
    def session_id(self) -> str | None:
        return self.client.session_id

    @property
    def resuming(self) -> bool:
        """A drop is being ridden through: re-dialling, or catching the handles up."""
        return self._resuming

    @property
    def closed_reason(self) -> str | None:
        if self.lost is not None:
            return str(self.lost)
        return self.client.rpc.closed_reason

    def close(self) -> Deferred[None]:
        self._stopped = True
        self._waiters.fail(ConnectionClosed("the client was closed"))
        return self.client.close()

    # --- resuming ----------------------------------------------------------------------

    def _watch(self, client: ExecServerClient) -> None:
        client.when_disconnected().addCallback(lambda reason: self._dropped(client, reason))

    def _dropped(self, client: ExecServerClient, reason: str) -> None:
        if self._stopped or self._resuming or client is not self.client or not client.resumable:
            return  # a drop during a resume's catch-up: that resume goes on
        self._resuming = True
        d = Deferred.fromCoroutine(self._resume(client, reason))
        d.addErrback(lambda f: log.failure("resuming the session failed", f))

    async def _resume(self, old: ExecServerClient, reason: str) -> None:
        session_id = old.session_id or ""
        ttl = (old.initialize_result.session_ttl_ms if old.initialize_result else 0) / 1000.0
        attempts = ResumeAttempts(
            ttl,
            self._reactor.seconds(),
            reason,
            initial_delay=self._initial_delay,
            max_delay=self._max_delay,
        )

        async def sleep(seconds: float) -> None:
            await deferLater(self._reactor, seconds, lambda: None)

        async def discard(new: ExecServerClient) -> None:
            await new.close()

        async def adopt(new: ExecServerClient) -> None:
            # The handles wait in the client of the last connection.
            waiting, self.client = self.client, new
            self.resumes += 1
            self._watch(new)
            await new.adopt(waiting, self)

        try:
            dialing = Dialing(
                lambda: self._dial(session_id),
                session_of=lambda client: client.session_id,
                discard=discard,
                now=self._reactor.seconds,
                sleep=sleep,
                refused=lambda exc: isinstance(exc.__cause__, Refused),
                stopped=lambda: self._stopped,
                on_retry=lambda cause: log.info(
                    "resuming session {sid} failed: {cause}", sid=session_id, cause=cause
                ),
            )
            await resume_session(
                dialing,
                session_id,
                attempts,
                adopt=adopt,
                is_up=lambda client: client.is_connected,
                dropped_because=lambda client: client.rpc.closed_reason,
                resumed=self._waiters.fire,
                give_up=lambda cause: self._give_up(self.client, cause),
            )
        finally:
            self._resuming = False

    def _give_up(self, old: ExecServerClient, cause: str) -> None:
        self.lost = SessionLost(old.session_id, cause)
        log.warn("{error}", error=self.lost)
        old.fail_suspended(self.lost)
        self._waiters.fail(self.lost)

    def _connected_client(self) -> ExecServerClient | None:
        return self.client if self.client.is_connected else None

    def _next_client(self) -> Deferred[ExecServerClient]:
        if self.lost is not None:
            return fail(self.lost)
        if self.client.is_connected or not self.client.resumable:
            return succeed(self.client)
        return self._waiters.wait()

    def _lost_error(self, session_id: str) -> Exception:
        return self.lost or SessionLost(session_id, "the session was not resumed")
