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

Process handles belong to one connection: a drop marks them exited without
an exit code. (Resumable sessions will re-attach them: the session id and
the handles' last seq are what a resume needs, and both are at hand in
:meth:`_on_connected`.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

from twisted.application.internet import ClientService, backoffPolicy
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IProtocol, IProtocolFactory, IStreamClientEndpoint
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from execserver import protocol as p
from execserver.client.api import ClientApi
from execserver.client.client import ConnectOptions, ExecServerClient
from execserver.client.connect import (
    ChannelFactory,
    WebSocketChannel,
    close_channel,
    connect_error_text,
    websocket_endpoint,
)
from execserver.client.errors import ConnectFailed, ConnectionClosed, NotConnected
from execserver.client.process import RemoteProcess
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
            self._owner.last_error = ConnectFailed(
                self._owner.url, connect_error_text(failure.value or Exception())
            )
            return failure

        return d.addCallbacks(connected, record)

    def gate_of(self, protocol: IProtocol) -> _Gate:
        return self._gates.pop(id(protocol))


class ReconnectingClient(ClientApi):
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
    ) -> None:
        self.url = url
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
        try:
            await channel.opened
            client = await ExecServerClient.connect_rpc(
                channel.rpc,
                self._reactor,
                self._options,
                closer=lambda: close_channel(channel, self._reactor),
            )
        except BaseException as exc:
            if isinstance(exc, Exception):
                self.last_error = exc
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
        self._waiters.fire(client)
        for listener in list(self._on_connected):
            try:
                listener(client)
            except Exception:
                log.failure("connect listener failed")
        return client

    def _lost(self, client: ExecServerClient, reason: str) -> None:
        if self.client is client:
            self.client = None
        for listener in list(self._on_disconnected):
            try:
                listener(reason)
            except Exception:
                log.failure("disconnect listener failed")

    # --- calls --------------------------------------------------------------------

    def _call(self, method: str, params: object, result_type: type[T]) -> Deferred[T]:
        client = self.client
        if client is not None and client.is_connected:
            return client._call(method, params, result_type)

        async def later() -> T:
            ready = await self.when_connected()
            return await ready._call(method, params, result_type)

        return Deferred.fromCoroutine(later())

    def start_process(
        self, argv: Sequence[str] | p.ExecParams, **kwargs: Any
    ) -> Deferred[RemoteProcess]:
        """``ExecServerClient.start_process`` on the current (or next) connection."""

        async def run() -> RemoteProcess:
            client = await self.when_connected()
            return await client.start_process(argv, **kwargs)

        return Deferred.fromCoroutine(run())
