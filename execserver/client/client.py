"""``ExecServerClient``: one connection, its handshake, processes and events.

The client speaks JSON-RPC through an :class:`~execserver.client.rpc.RpcClient`
and does not care what carries the bytes; the three ways to connect live in
:mod:`execserver.client.connect` (which hands back an attached channel for
:meth:`ExecServerClient.connect_rpc` to finish) and are offered here as class
methods, and as the module functions :func:`spawn_local`,
:func:`connect_websocket` and :func:`connect_in_process`:

- :meth:`ExecServerClient.spawn_local` launches ``python -m execserver`` and
  talks NDJSON over its stdin/stdout (the reference's ``spawn_local_exec_server``);
- :meth:`ExecServerClient.connect_websocket` connects to ``ws://`` / ``wss://``;
- :meth:`ExecServerClient.connect_in_process` calls a dispatcher directly.

Each completes ``initialize``/``initialized`` (bounded by
``ConnectOptions.initialize_timeout``) before the Deferred fires. ``close()``
releases what the mode holds (the spawned server is asked to exit and killed
if it does not; in-process processes are terminated); dropping the last
reference to a client does the same from a ``weakref.finalize`` hook.
"""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import attrs
import msgspec
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from execserver import protocol as p
from execserver.client import connect
from execserver.client.api import ClientApi
from execserver.client.errors import (
    InitializeTimeout,
    ServerError,
)
from execserver.client.fs import FileTransfers
from execserver.client.process import RemoteProcess
from execserver.client.rpc import RpcClient
from execserver.client.types import (
    ClientEvent,
    ClosedEvent,
    ClosedParams,
    DisconnectedEvent,
    ExitedEvent,
    ExitedParams,
    InitializeResult,
    OutputParams,
)
from execserver.clientcore import defaults
from execserver.clientcore.follow import ProcessTable, decode_output, end_processes
from execserver.clientcore.initialize import initialize_params
from execserver.clientcore.process import DEFAULT_BACKLOG_BYTES
from execserver.clientcore.start import exec_params
from execserver.waiters import Latch

if TYPE_CHECKING:
    from execserver.dispatcher import Dispatcher
    from execserver.tls import ClientTls

T = TypeVar("T")
log = Logger()

#: ``env`` sent by ``start_process`` when none is given (shared by every client).
DEFAULT_PATH = defaults.DEFAULT_PATH

#: Shared by every client (see :mod:`execserver.clientcore.defaults`).
EXITED_LINGER_SECONDS = defaults.EXITED_LINGER_SECONDS
CLOSE_WAIT_SECONDS = defaults.CLOSE_WAIT_SECONDS


@attrs.frozen
class ConnectOptions:
    """Options of every connection mode (the reference's ExecServerClientConnectOptions)."""

    client_name: str = "exec-server-client"
    initialize_timeout: float = 10.0
    #: Ask the server to keep the session this long after a disconnect (ms).
    session_ttl_ms: int | None = None
    #: Take over this detached session instead of creating one.
    resume_session_id: str | None = None
    #: "drop" or "pause" (docs/protocol.md, "Resumable sessions"); None:
    #: "pause" when ``session_ttl_ms`` asks for a resumable session.
    on_detached_full: str | None = None


Closer = connect.Closer


def _schedule(clock: IReactorTime) -> Callable[[float, Callable[[], None]], Callable[[], None]]:
    """``clock.callLater`` as :class:`~execserver.clientcore.follow.ProcessTable` wants it."""

    def schedule(seconds: float, fn: Callable[[], None]) -> Callable[[], None]:
        delayed: IDelayedCall = clock.callLater(seconds, fn)

        def cancel() -> None:
            if delayed.active():
                delayed.cancel()

        return cancel

    return schedule


def _background(coro: Coroutine[Any, Any, None]) -> None:
    """An acknowledgement nobody waits for: whatever becomes of it is fine."""
    Deferred.fromCoroutine(coro).addErrback(lambda f: None)


async def _awaited(job: Awaitable[object]) -> None:
    await job


def _weak(method: Callable[..., None]) -> Callable[..., None]:
    """A callable that forwards to ``method`` without keeping its object alive."""
    ref = weakref.WeakMethod(method)

    def forward(*args: Any) -> None:
        target = ref()
        if target is not None:
            target(*args)

    return forward


class ExecServerClient(ClientApi, FileTransfers):
    """A connected, initialized exec-server client."""

    def __init__(
        self,
        rpc: RpcClient,
        clock: IReactorTime,
        *,
        closer: Closer | None = None,
        backlog_bytes: int = DEFAULT_BACKLOG_BYTES,
    ) -> None:
        self._rpc = rpc
        self._clock = clock
        self._closer = closer
        self._backlog_bytes = backlog_bytes
        self.initialize_result: InitializeResult | None = None
        self._table: ProcessTable[RemoteProcess] = ProcessTable(_schedule(clock))
        self._listeners: list[Callable[[ClientEvent], None]] = []
        #: Lost the connection of a resumable session; handles kept.
        self._suspended = False
        self._closing: Deferred[None] | None = None
        self._close_latch: Latch[None] = Latch()
        self._finalizer: weakref.finalize[Any, Any] | None = None
        #: With ``spawn_local``: the server's ServerProcessProtocol (pid, stderr_tail).
        self.local_server: Any = None
        rpc.on_notification = _weak(self._on_notification)
        rpc.on_typed_notification(p.PROCESS_OUTPUT, OutputParams, _weak(self._output_params))
        rpc.on_typed_notification(p.PROCESS_EXITED, ExitedParams, _weak(self._exited_params))
        rpc.on_typed_notification(p.PROCESS_CLOSED, ClosedParams, _weak(self._closed_params))
        rpc.add_lost_listener(_weak(self._on_connection_lost))

    # --- connecting ---------------------------------------------------------------

    @classmethod
    def connect_rpc(
        cls,
        rpc: RpcClient,
        clock: IReactorTime,
        options: ConnectOptions | None = None,
        *,
        closer: Closer | None = None,
        on_collect: Callable[[], None] | None = None,
    ) -> Deferred[ExecServerClient]:
        """Handshake over an attached RPC channel; the base of every mode.

        On failure the channel is closed (through ``closer`` if given).
        ``on_collect`` runs if the client is garbage-collected unclosed; it
        must not refer to the client.
        """
        client = cls(rpc, clock, closer=closer)
        if on_collect is not None:
            client._finalizer = weakref.finalize(client, on_collect)
        return Deferred.fromCoroutine(client._handshake(options or ConnectOptions()))

    async def _handshake(self, options: ConnectOptions) -> ExecServerClient:
        try:
            self.initialize_result = await self._initialize(options)
            self._rpc.notify(p.INITIALIZED, p.Empty())
        except BaseException:
            # Report the failure now; the channel closes in the background.
            self.close().addErrback(
                lambda f: log.failure("closing after a failed handshake failed", f)
            )
            raise
        return self

    def _initialize(self, options: ConnectOptions) -> Deferred[InitializeResult]:
        params = initialize_params(
            options.client_name,
            session_ttl_ms=options.session_ttl_ms,
            resume_session_id=options.resume_session_id,
            on_detached_full=options.on_detached_full,
        )
        d = self._rpc.call(p.INITIALIZE, params, InitializeResult)

        def timed_out(result: InitializeResult | Failure, timeout: float) -> NoReturn:
            raise InitializeTimeout(timeout)

        return d.addTimeout(options.initialize_timeout, self._clock, onTimeoutCancel=timed_out)

    @classmethod
    def _handshake_over(
        cls, clock: IReactorTime, options: ConnectOptions | None
    ) -> connect.Handshake[ExecServerClient]:
        def handshake(link: connect.Link) -> Deferred[ExecServerClient]:
            d = cls.connect_rpc(
                link.rpc, clock, options, closer=link.closer, on_collect=link.on_collect
            )
            if link.local_server is not None:
                local_server = link.local_server

                def keep(client: ExecServerClient) -> ExecServerClient:
                    client.local_server = local_server
                    return client

                d.addCallback(keep)
            return d

        return handshake

    @classmethod
    def spawn_local(
        cls,
        reactor: Any,
        options: ConnectOptions | None = None,
        *,
        command: Sequence[str] | None = None,
        env: dict[str, str] | None = None,
        stderr: Callable[[bytes], None] | None = None,
        shutdown_grace: float = 5.0,
        new_session: bool = True,
    ) -> Deferred[ExecServerClient]:
        """Launch a local server over stdio (default ``python -m execserver``).

        The server's stderr goes to ``stderr`` (its last 8 KiB are quoted in
        errors). ``close()`` closes the server's stdin (it then terminates its
        processes and exits) and kills it after ``shutdown_grace`` seconds; the
        same happens when the client is garbage-collected. With ``new_session``
        (the default) the server leads a session of its own, so signals sent to
        this program's terminal (Ctrl-C) do not reach it.
        """
        return connect.spawn_local(
            reactor,
            cls._handshake_over(reactor, options),
            command=command,
            env=env,
            stderr=stderr,
            shutdown_grace=shutdown_grace,
            new_session=new_session,
        )

    @classmethod
    def connect_websocket(
        cls,
        reactor: Any,
        url: str,
        options: ConnectOptions | None = None,
        *,
        token: str | None = None,
        connect_timeout: float = 10.0,
        tls: ClientTls | None = None,
    ) -> Deferred[ExecServerClient]:
        """Connect to ``ws://HOST:PORT``, ``wss://`` (``tls``: CA file, client
        certificate) or ``unix:///PATH``: TCP and the WebSocket upgrade within
        ``connect_timeout``, then the handshake."""
        return connect.connect_websocket(
            reactor,
            url,
            cls._handshake_over(reactor, options),
            token=token,
            connect_timeout=connect_timeout,
            tls=tls,
        )

    @classmethod
    def connect_in_process(
        cls,
        reactor: Any,
        options: ConnectOptions | None = None,
        *,
        dispatcher: Dispatcher | None = None,
    ) -> Deferred[ExecServerClient]:
        """Talk to a dispatcher in this process (a new one unless given)."""
        return connect.connect_in_process(
            reactor, cls._handshake_over(reactor, options), dispatcher=dispatcher
        )

    # --- state --------------------------------------------------------------------

    @property
    def rpc(self) -> RpcClient:
        return self._rpc

    @property
    def capabilities(self) -> list[str]:
        """Extension methods the server announced (empty for a baseline server)."""
        return list(self.initialize_result.capabilities) if self.initialize_result else []

    def supports(self, method: str) -> bool:
        return method in self.capabilities

    @property
    def session_id(self) -> str | None:
        return self.initialize_result.session_id if self.initialize_result else None

    @property
    def pending_request_count(self) -> int:
        return self._rpc.pending_count

    @property
    def is_connected(self) -> bool:
        return not self._rpc.is_closed

    def process(self, process_id: str) -> RemoteProcess | None:
        """The handle of a process this client started, while it is tracked."""
        return self._table.get(process_id)

    @property
    def tracked_process_count(self) -> int:
        return len(self._table)

    def add_event_listener(self, listener: Callable[[ClientEvent], None]) -> None:
        """Every output/exit/close notification, and the disconnect."""
        self._listeners.append(listener)

    def remove_event_listener(self, listener: Callable[[ClientEvent], None]) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def when_disconnected(self) -> Deferred[str]:
        """Fires with the reason when the connection ends."""
        return self._rpc.when_closed()

    # --- calls --------------------------------------------------------------------

    def _call(self, method: str, params: object, result_type: type[T]) -> Deferred[T]:
        return self._rpc.call(method, params, result_type)

    def start_process(
        self,
        argv: Sequence[str] | p.ExecParams,
        *,
        process_id: str | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        tty: bool = False,
        arg0: str | None = None,
        pipe_stdin: bool = False,
        size: tuple[int, int] | None = None,
        timeout_ms: int | None = None,
        idle_timeout_ms: int | None = None,
        sandbox: p.SandboxConfig | None = None,
        detach: bool = False,
    ) -> Deferred[RemoteProcess]:
        """``process/start`` and a :class:`RemoteProcess` handle following it.

        ``argv`` is a command vector or complete ``ExecParams``. Defaults:
        a generated ``process_id``, this process's working directory,
        ``env={"PATH": DEFAULT_PATH}``. ``size`` is ``(rows, cols)``.
        ``detach=True``: :meth:`close` leaves the process running.
        """
        params = self._start_params(
            argv,
            process_id=process_id,
            cwd=cwd,
            env=env,
            tty=tty,
            arg0=arg0,
            pipe_stdin=pipe_stdin,
            size=size,
            timeout_ms=timeout_ms,
            idle_timeout_ms=idle_timeout_ms,
            sandbox=sandbox,
        )
        return Deferred.fromCoroutine(self._start(params, self._new_handle(params, detach)))

    def _start_params(self, argv: Sequence[str] | p.ExecParams, **kwargs: Any) -> p.ExecParams:
        """``start_process``'s params (its keyword arguments but ``detach``)."""
        return exec_params(argv, self._table.new_process_id, **kwargs)

    def _new_handle(self, params: p.ExecParams, detach: bool) -> RemoteProcess:
        """The handle a start of ``params`` follows (not registered yet)."""
        handle = RemoteProcess(self, params.process_id, self._backlog_bytes)
        handle.detach = detach
        return handle

    async def _start(
        self, params: p.ExecParams, handle: RemoteProcess, *, again: bool = False
    ) -> RemoteProcess:
        """The start sequence of :meth:`ProcessTable.start` on this connection
        (``again``: sent again after a drop, same ``processId``; a drop during
        it raises :class:`ConnectionClosed` again, for the caller to send it
        once more on the next connection)."""
        await self._table.start(self._call, handle, params, again, self._catch_up)
        # A resumable session's drop keeps the handle for the resume to adopt.
        self._table.after_start(
            handle, up=not self._rpc.is_closed, following=self._follows_drop(), lost=None
        )
        return handle

    # --- notifications --------------------------------------------------------------

    def _on_notification(self, method: str, raw: msgspec.Raw | None) -> None:
        log.debug("ignoring unknown notification {method}", method=method)

    def _output_params(self, out: OutputParams) -> None:
        event = decode_output(out)
        if event is None:
            log.warn(
                "dropping process/output of {process_id} with invalid base64",
                process_id=out.process_id,
            )
        elif self._table.output(
            event, self._call, self.initialize_result, not self._rpc.is_closed, _background
        ):
            self._emit(event)

    def _exited_params(self, ex: ExitedParams) -> None:
        if self._table.exited(ex):
            self._emit(ExitedEvent(ex.process_id, ex.exit_code, ex.signal, ex.timed_out))

    def _closed_params(self, closed: ClosedParams) -> None:
        if self._table.closed(closed):
            self._emit(ClosedEvent(closed.process_id))

    def _on_connection_lost(self, reason: str) -> None:
        # A resumable session lives on in the server: the handles wait for
        # a new connection to adopt them (or for fail_suspended).
        self._suspended = self._table.dropped(self._follows_drop())
        self._emit(DisconnectedEvent(reason))

    def _follows_drop(self) -> bool:
        """Whether the handles outlive a drop of this connection (and wait
        for a resume). Asked by the drop's lost listener and by a start
        whose catch-up read the drop failed: the rpc fails the pending calls
        (resuming their callers at once) before its lost listeners run, so
        such a start cannot go by ``_suspended``, not set yet."""
        return self.resumable and self._closing is None

    # --- resumed sessions -----------------------------------------------------------

    @property
    def resumable(self) -> bool:
        """The server keeps this client's session after a disconnect."""
        result = self.initialize_result
        return result is not None and result.session_ttl_ms > 0

    def suspended_processes(self) -> list[RemoteProcess]:
        """Handles waiting for a resume (after a drop of a resumable session;
        a start in flight at the drop is the start loop's to send again)."""
        return self._table.settled() if self._suspended else []

    def fail_suspended(self, error: Exception) -> None:
        """The session will not be resumed: every waiting handle fails with ``error``."""
        self._suspended = False
        for handle in self._table.take_all():
            handle.fail(error)

    def adopt(self, old: ExecServerClient, api: ClientApi | None = None) -> Deferred[None]:
        """Take over ``old``'s handles after resuming its session, and catch them up.

        Each handle gets, in seq order and never twice, what it missed: the
        output retained meanwhile (a :class:`GapEvent` where some was
        dropped), then its exit and close; live notifications that arrive
        meanwhile wait their turn.
        """
        handles = old.suspended_processes()
        old._table.take_all()
        old._suspended = False
        for handle in handles:
            if handle._api is old:
                handle._api = api or self
        self._table.adopt(handles)
        return Deferred.fromCoroutine(self._catch_up_all(handles))

    async def _catch_up_all(self, handles: list[RemoteProcess]) -> None:
        # Every handle's reads are in flight at once: one round trip for all.
        await DeferredList(
            [Deferred.fromCoroutine(self._catch_up(handle)) for handle in handles],
            consumeErrors=True,
        )

    async def _catch_up(self, handle: RemoteProcess) -> None:
        error = await self._table.catch_up(
            self._call, handle, self.initialize_result, lambda: not self._rpc.is_closed, _background
        )
        if error is not None and not isinstance(error, ServerError):
            # A ServerError: its id expired in the server (closed longer
            # than the exit retention) or the process is otherwise gone.
            log.failure(
                "catching up process {process_id} failed",
                Failure(error),
                process_id=handle.process_id,
            )

    def _emit(self, event: ClientEvent) -> None:
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:
                log.failure("client event listener failed")

    # --- closing --------------------------------------------------------------------

    def close(self) -> Deferred[None]:
        """Terminate every process this client started (except ``detach=True``
        ones) and wait up to 10 s for them to exit, then close the connection
        and release the server (idempotent).

        Pending calls fail with :class:`ConnectionClosed`; the handles of
        processes still running then (detached, or not ended in time) are
        marked exited without an exit code.
        """
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self._closing is None:
            self._closing = Deferred.fromCoroutine(self._close())
            self._closing.addErrback(self._close_failed)
            self._closing.addBoth(self._close_done)
        return self._close_latch.wait()

    async def _close(self) -> None:
        # A resumable session would keep them running until its TTL: the
        # processes end with the client, as with the asyncio client.
        await self._end_processes()
        if self._closer is not None:
            await self._closer()
        else:
            self._rpc.close()
            await self._rpc.when_closed()

    async def _end_processes(self) -> None:
        if self._rpc.is_closed:
            return
        if not await end_processes(
            self._table.to_end(), self.terminate, RemoteProcess.exited, self._within
        ):
            log.warn(
                "closing: processes still running after {seconds} s", seconds=CLOSE_WAIT_SECONDS
            )

    async def _within(self, jobs: Sequence[Awaitable[object]], seconds: float) -> bool:
        ending = DeferredList(
            [Deferred.fromCoroutine(_awaited(job)) for job in jobs], consumeErrors=True
        )
        return await connect.wait_at_most(ending, seconds, self._clock)

    def _close_done(self, outcome: object) -> object:
        self._close_latch.fire(None)
        return outcome

    def _close_failed(self, failure: Failure) -> None:
        log.failure("closing the exec-server client failed", failure)
        # Whatever happened, nothing more goes over this channel.
        self._rpc.connection_lost(f"close failed: {failure.getErrorMessage()}")

    async def __aenter__(self) -> ExecServerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


#: The ways to connect, as functions (``execserver.client.spawn_local`` ...).
spawn_local = ExecServerClient.spawn_local
connect_websocket = ExecServerClient.connect_websocket
connect_in_process = ExecServerClient.connect_in_process
