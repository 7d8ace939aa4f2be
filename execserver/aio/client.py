"""The asyncio client: connect, processes, fs, resume after a dropped connection.

:func:`connect` returns a :class:`Client` once ``initialize``/``initialized``
is done, over a local server's stdio (``url=None``), ``ws://``, ``wss://`` or
``unix:///PATH``. It imports no Twisted: wire types come from
:mod:`execserver.protocol`, events and errors from :mod:`execserver.clientcore`
(the same classes the Twisted client raises).

Over WebSocket and Unix sockets (``resume=True``, the default) the session
is created with a TTL (``session_ttl_ms``, default 60 s, capped by the
server) and ``onDetachedFull: "pause"`` (the server pauses a child rather
than drop output the client has not read; ``on_detached_full="drop"`` to
choose otherwise), and survives a dropped connection exactly as the Twisted
client's ``ResumingClient`` does:

1. the client re-dials with backoff (50 ms doubling to 2 s) and sends
   ``initialize`` with ``resumeSessionId``;
2. every live process handle is caught up with ``process/read`` from the last
   seq it delivered: output is delivered in seq order, never twice, then the
   exit and the close; where the server dropped some ("drop" only), the
   output iteration raises :class:`~execserver.clientcore.errors.OutputGap`
   (a :class:`~execserver.clientcore.types.GapEvent` for readers that asked
   for ``gaps=True``); live notifications wait their turn;
3. calls in flight at the drop that are safe to repeat (``read``, ``wait``,
   ``list_processes``, fs reads, and ``write``, which carries a ``writeId``)
   are sent again on the resumed session; the others fail with
   :class:`~execserver.clientcore.errors.OutcomeUnknown`;
4. it gives up -- every handle and every waiting call fails with
   :class:`~execserver.clientcore.errors.SessionLost` naming the cause --
   when the server answers that the session is unknown, when connections are
   refused for 2 s, when the upgrade is refused (401/403: the token was
   withdrawn), or after the session's TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import uuid
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from typing import Any, BinaryIO, TypeVar

import attrs

from execserver import protocol as p
from execserver.aio.channels import (
    UNIX_SCHEME,
    StdioChannel,
    WebSocketChannel,
    open_websocket,
    spawn_stdio,
)
from execserver.aio.process import Process
from execserver.aio.rpc import AsyncRpc
from execserver.clientcore import defaults, transfer
from execserver.clientcore.errors import (
    ConnectFailed,
    ConnectionClosed,
    ExecServerError,
    InitializeTimeout,
    ServerError,
    SessionLost,
    SpawnFailed,
)
from execserver.clientcore.follow import ProcessTable, decode_output, end_processes
from execserver.clientcore.initialize import initialize_params
from execserver.clientcore.process import DEFAULT_BACKLOG_BYTES
from execserver.clientcore.resume import ResumeAttempts
from execserver.clientcore.session import Dialing, first_dial, resume_session, through_drops
from execserver.clientcore.start import exec_params
from execserver.clientcore.transfer import TRANSFER_CHUNK_BYTES, Progress
from execserver.clientcore.types import (
    ClosedParams,
    ExitedParams,
    GapEvent,
    InitializeResult,
    OutputEvent,
    OutputParams,
)

T = TypeVar("T")
P = TypeVar("P")
R = TypeVar("R")
log = logging.getLogger("execserver.aio")

#: The session lifetime asked for over WebSocket with ``resume=True``.
DEFAULT_SESSION_TTL_MS = 60_000
#: Shared by every client (see :mod:`execserver.clientcore.defaults`).
CLOSE_WAIT_SECONDS = defaults.CLOSE_WAIT_SECONDS
EXITED_LINGER_SECONDS = defaults.EXITED_LINGER_SECONDS


class _Default(enum.Enum):
    TOKEN = 0


#: "the client's request_timeout" (None already means "no timeout").
_DEFAULT = _Default.TOKEN


@attrs.frozen
class RunResult:
    """What :meth:`Client.run` returns: all output and how the process ended."""

    stdout: bytes
    stderr: bytes
    #: 128+N when the process died of signal N (``signal`` names it).
    exit_code: int | None
    signal: str | None = None
    #: ``"wall"`` or ``"idle"`` when a server-side ``timeout_ms`` /
    #: ``idle_timeout_ms`` ended the process.
    timed_out: str | None = None
    #: ``(limitExceeded, limitValue)`` when a resource limit ended or
    #: crippled it, e.g. ``("fileSize", 1000)`` (as the handle's).
    limit_exceeded: tuple[str, int | None] | None = None


async def _feed(handle: Process, data: bytes) -> None:
    """Write ``data`` to a run's process, then close its stdin (a PTY: EOF).

    A process may exit before it has read all of it or before the close
    arrives (a quick one does, racing the requests): as a pipe's reader
    that went away, that is no failure of the run. The server reports the
    exit before it answers the refused request, so the handle knows by then.
    """
    try:
        if data:
            await handle.write(data)
        await handle.close_stdin()
    except ServerError:
        if not handle.has_exited:
            raise


@attrs.frozen
class _Dialer:
    """How to open (and re-open) this client's connection."""

    url: str | None
    server_command: Sequence[str] | None
    token: str | None
    ca_file: str | None
    client_cert: str | None
    client_key: str | None
    connect_timeout: float
    client_name: str
    session_ttl_ms: int | None
    on_detached_full: str | None
    env: dict[str, str] | None
    stderr: Callable[[bytes], None] | None
    shutdown_grace: float

    async def open(
        self, resume_session_id: str | None
    ) -> tuple[AsyncRpc, StdioChannel | WebSocketChannel, InitializeResult]:
        """A connection and its completed handshake, or an ExecServerError."""
        label = f"exec-server {self.url}" if self.url else "exec-server stdio"
        rpc = AsyncRpc(label)
        channel: StdioChannel | WebSocketChannel
        if self.url is None:
            channel = await spawn_stdio(
                rpc,
                self.server_command,
                env=self.env,
                stderr=self.stderr,
                shutdown_grace=self.shutdown_grace,
            )
        else:
            channel = await open_websocket(
                rpc,
                self.url,
                token=self.token,
                connect_timeout=self.connect_timeout,
                ca_file=self.ca_file,
                client_cert=self.client_cert,
                client_key=self.client_key,
            )
        try:
            result = await self._handshake(rpc, resume_session_id)
        except ConnectionClosed as exc:
            if isinstance(channel, StdioChannel):
                await channel.wait_exited(self.shutdown_grace)
                tail = channel.stderr_tail.decode("utf-8", "replace").strip()
                message = (
                    f"exec-server `{' '.join(channel.argv)}` ended before the handshake "
                    f"({channel.describe_exit()})"
                )
                await channel.aclose()
                raise SpawnFailed(f"{message}: {tail}" if tail else message) from exc
            await channel.aclose()
            raise
        except BaseException:
            await asyncio.shield(channel.aclose())
            raise
        return rpc, channel, result

    async def _handshake(self, rpc: AsyncRpc, resume_session_id: str | None) -> InitializeResult:
        params = initialize_params(
            self.client_name,
            session_ttl_ms=self.session_ttl_ms,
            resume_session_id=resume_session_id,
            on_detached_full=self.on_detached_full,
        )
        try:
            result = await rpc.call(
                p.INITIALIZE, params, InitializeResult, timeout=self.connect_timeout
            )
        except TimeoutError:
            raise InitializeTimeout(self.connect_timeout) from None
        await rpc.notify(p.INITIALIZED, p.Empty())
        return result


async def _within(jobs: Sequence[Awaitable[object]], seconds: float) -> bool:
    """Run ``jobs`` together: True if all ended within ``seconds``."""
    try:
        async with asyncio.timeout(seconds):
            await asyncio.gather(*jobs, return_exceptions=True)
    except TimeoutError:
        return False
    return True


def _schedule(seconds: float, fn: Callable[[], None]) -> Callable[[], None]:
    """``loop.call_later`` as :class:`~execserver.clientcore.follow.ProcessTable` wants it."""
    return asyncio.get_running_loop().call_later(seconds, fn).cancel


class Client:
    """A connected, initialized exec-server client on asyncio.

    Every protocol method is a coroutine returning the shared wire type of
    :mod:`execserver.protocol` (the Twisted client's names: ``read``,
    ``write``, ``terminate``, ``signal``, ``close_stdin``, ``resize``,
    ``wait``, ``list_processes``, ``fs_*``); :meth:`start` and :meth:`run`
    manage process handles. Each call takes the client's ``request_timeout``
    (``TimeoutError`` when it expires; the request is forgotten).
    """

    def __init__(
        self,
        dialer: _Dialer,
        rpc: AsyncRpc,
        channel: StdioChannel | WebSocketChannel,
        result: InitializeResult,
        *,
        request_timeout: float | None,
        resume: bool,
        backlog_bytes: int = DEFAULT_BACKLOG_BYTES,
    ) -> None:
        self._dialer = dialer
        self._request_timeout = request_timeout
        self._resume_enabled = resume and dialer.url is not None
        self._backlog_bytes = backlog_bytes
        self.initialize_result = result
        self._table: ProcessTable[Process] = ProcessTable(_schedule)
        self._closing = False
        self._closed = asyncio.Event()
        #: The session could not be resumed: every later call fails with it.
        self.lost: SessionLost | None = None
        #: Successful resumes of the session so far.
        self.resumes = 0
        self._waiters: list[asyncio.Future[AsyncRpc]] = []
        self._resume_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        #: Terminations of cancelled or timed-out starts and runs: awaited
        #: (not cancelled) by close(), so no process outlives the client.
        self._terminations: set[asyncio.Task[None]] = set()
        self._rpc = rpc
        self._channel = channel
        self._install(rpc)

    # --- state --------------------------------------------------------------------

    @property
    def session_id(self) -> str | None:
        return self.initialize_result.session_id

    @property
    def capabilities(self) -> list[str]:
        """Extension methods the server announced (empty for a baseline server)."""
        return list(self.initialize_result.capabilities)

    def supports(self, method: str) -> bool:
        return method in self.initialize_result.capabilities

    @property
    def resumable(self) -> bool:
        """The server keeps this client's session after a disconnect."""
        return self.initialize_result.session_ttl_ms > 0

    @property
    def is_connected(self) -> bool:
        return not self._rpc.is_closed

    @property
    def _following(self) -> bool:
        """This client rides through a dropped connection (resume gating)."""
        return not self._closing and self._resume_enabled and self.resumable

    @property
    def pending_request_count(self) -> int:
        """Requests sent on the current connection and not yet answered."""
        return self._rpc.pending_count

    @property
    def server_pid(self) -> int | None:
        """The local server's pid (stdio), else None."""
        return self._channel.pid if isinstance(self._channel, StdioChannel) else None

    def process(self, process_id: str) -> Process | None:
        """The handle of a process this client started, while it is tracked."""
        return self._table.get(process_id)

    @property
    def tracked_process_count(self) -> int:
        return len(self._table)

    @property
    def terminating_count(self) -> int:
        """Processes of cancelled or timed-out starts and runs being terminated
        (see :meth:`settle`)."""
        return len(self._terminations)

    # --- connection and resume ----------------------------------------------------

    def _install(self, rpc: AsyncRpc) -> None:
        rpc.on_notification(p.PROCESS_OUTPUT, OutputParams, self._on_output)
        rpc.on_notification(p.PROCESS_EXITED, ExitedParams, self._on_exited)
        rpc.on_notification(p.PROCESS_CLOSED, ClosedParams, self._on_closed)
        rpc.add_lost_listener(lambda reason: self._on_lost(rpc, reason))

    def _on_lost(self, rpc: AsyncRpc, reason: str) -> None:
        if rpc is not self._rpc:
            return
        if not self._table.dropped(self._following):
            self._fail_waiters(ConnectionClosed(reason))
            return
        # Hold live events back from now on: the catch-up reads on the next
        # connection fill in what was missed before them.
        for handle in self._table:
            handle.begin_catch_up()
        if self._resume_task is None or self._resume_task.done():
            self._resume_task = self._spawn(self._resume(reason))

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _resume(self, reason: str) -> None:
        session_id = self.session_id
        ttl = self.initialize_result.session_ttl_ms / 1000.0
        loop = asyncio.get_running_loop()
        Dialled = tuple[AsyncRpc, StdioChannel | WebSocketChannel, InitializeResult]

        async def discard(dialled: Dialled) -> None:
            await dialled[1].aclose()

        async def adopt(dialled: Dialled) -> None:
            rpc, channel, result = dialled
            self._rpc, self._channel = rpc, channel
            self.initialize_result = result
            self.resumes += 1
            self._install(rpc)
            await self._catch_up_all(rpc)

        def resumed(dialled: Dialled) -> None:
            waiters, self._waiters = self._waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(dialled[0])

        dialing = Dialing(
            lambda: self._dialer.open(session_id),
            session_of=lambda dialled: dialled[2].session_id,
            discard=discard,
            now=loop.time,
            sleep=asyncio.sleep,
            refused=lambda exc: isinstance(exc.__cause__, ConnectionRefusedError),
            stopped=lambda: self._closing,
            retry_on=ExecServerError,
            on_retry=lambda cause: log.info("resuming session %s failed: %s", session_id, cause),
        )
        await resume_session(
            dialing,
            session_id,
            ResumeAttempts(ttl, loop.time(), reason),
            adopt=adopt,
            # Dropped again meanwhile (this task still running, no other was
            # started): resume again; the handles wait.
            is_up=lambda dialled: not dialled[0].is_closed,
            dropped_because=lambda dialled: dialled[0].closed_reason,
            resumed=resumed,
            give_up=self._give_up,
        )

    async def _catch_up_all(self, rpc: AsyncRpc) -> None:
        handles = [h for h in self._table.settled() if h.catching_up]
        # Every handle's reads are in flight at once: one round trip for all.
        await asyncio.gather(*(self._catch_up(rpc, h) for h in handles))

    async def _catch_up(self, rpc: AsyncRpc, handle: Process) -> None:
        error = await self._table.catch_up(
            rpc.call, handle, self.initialize_result, lambda: True, self._spawn
        )
        if error is not None:
            # Its id expired (closed longer than the exit retention), or a
            # malformed reply: the handle ended rather than hold events back.
            log.warning("catching up process %s failed: %s", handle.process_id, error)

    def _give_up(self, cause: str) -> None:
        self.lost = SessionLost(self.session_id, cause)
        log.warning("%s", self.lost)
        for handle in self._table.take_all():
            handle.fail(self.lost)
        self._fail_waiters(self.lost)

    def _fail_waiters(self, error: Exception) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(error)

    async def _current(self) -> AsyncRpc:
        if self.lost is not None:
            raise self.lost
        rpc = self._rpc
        if not rpc.is_closed or not self._following:
            return rpc
        waiter: asyncio.Future[AsyncRpc] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    async def call(
        self,
        method: str,
        params: object,
        result_type: type[T],
        *,
        timeout: float | _Default | None = _DEFAULT,
    ) -> T:
        """Any protocol method by name; the typed methods below are built on it.

        ``timeout`` (seconds, default the client's ``request_timeout``) bounds
        the whole call, waiting for a resume included: ``TimeoutError``.
        """
        seconds = self._request_timeout if isinstance(timeout, _Default) else timeout
        async with asyncio.timeout(seconds):
            return await self._call(method, params, result_type)

    async def request(
        self,
        method: p.Method[P, R],
        params: P,
        *,
        timeout: float | _Default | None = _DEFAULT,
    ) -> R:
        """Any declared protocol method (``p.ProcessRead``, ``p.FsCopy``, ...)
        through :meth:`call`: the one path every typed method below takes."""
        return await self.call(method.name, params, method.result, timeout=timeout)

    async def _call(self, method: str, params: object, result_type: type[T]) -> T:
        def send(rpc: AsyncRpc, again: bool) -> Awaitable[T]:
            return rpc.call(method, params, result_type)

        return await self._through_drops(send, method, params)

    def _through_drops(
        self, send: Callable[[AsyncRpc, bool], Awaitable[T]], method: str, params: object
    ) -> Awaitable[T]:
        """:func:`execserver.clientcore.session.through_drops` over this client's
        connections (one session: a lost one raises from :meth:`_current`)."""
        return through_drops(
            self._current,
            send,
            method,
            params,
            following=lambda rpc: self._following,
            session_of=lambda rpc: self.session_id,
            lost_error=lambda session_id: self.lost or SessionLost(session_id, "not resumed"),
        )

    # --- process/* ------------------------------------------------------------------

    async def exec(self, params: p.ExecParams) -> p.ExecResponse:
        """``process/start`` without a handle (see :meth:`start` for one)."""
        return await self.request(p.ProcessStart, params)

    async def read(
        self,
        process_id: str,
        after_seq: int | None = None,
        max_bytes: int | None = None,
        wait_ms: int | None = None,
    ) -> p.ReadResponse:
        """``process/read``: retained output after ``after_seq``, waiting up to ``wait_ms``."""
        params = p.ReadParams(process_id, after_seq, max_bytes, wait_ms)
        bound = self._long_poll_bound(wait_ms or 0)
        return await self.request(p.ProcessRead, params, timeout=bound)

    async def write(self, process_id: str, data: bytes) -> p.WriteResponse:
        """``process/write``: raw bytes to stdin. On a resumable session it
        carries a ``writeId``, so a retry after a drop writes once."""
        write_id = uuid.uuid4().hex if self._resume_enabled and self.resumable else None
        params = p.WriteParams(process_id, bytes(data), write_id=write_id)
        return await self.request(p.ProcessWrite, params)

    async def terminate(self, process_id: str, grace_ms: int | None = None) -> p.TerminateResponse:
        """``process/terminate``; ``running`` says whether it was still running."""
        params = p.TerminateParams(process_id, grace_ms)
        return await self.request(p.ProcessTerminate, params)

    async def signal(self, process_id: str, signal: int | str) -> p.SignalResponse:
        """``process/signal``: a signal name (``"SIGINT"``, ``"INT"``) or number."""
        params = p.SignalParams(process_id, signal)
        return await self.request(p.ProcessSignal, params)

    async def close_stdin(self, process_id: str) -> p.CloseStdinResponse:
        params = p.CloseStdinParams(process_id)
        return await self.request(p.ProcessCloseStdin, params)

    async def resize(self, process_id: str, rows: int, cols: int) -> p.Empty:
        params = p.ResizeParams(process_id, rows, cols)
        return await self.request(p.ProcessResize, params)

    async def wait(self, process_id: str, timeout_ms: int | None = None) -> p.WaitResponse:
        """``process/wait``: until exit, or ``timeout_ms`` (then ``exited: false``).

        Bounded by ``timeout_ms`` plus ``request_timeout`` (without
        ``timeout_ms``: until the process exits)."""
        params = p.WaitParams(process_id, timeout_ms)
        bound = self._long_poll_bound(timeout_ms)
        return await self.request(p.ProcessWait, params, timeout=bound)

    def _long_poll_bound(self, server_ms: int | None) -> float | None:
        """The bound of a request the server holds up to ``server_ms`` (None:
        until an event): that wait plus ``request_timeout``."""
        if self._request_timeout is None or server_ms is None:
            return None
        return self._request_timeout + server_ms / 1000

    async def list_processes(self) -> p.ListResponse:
        return await self.request(p.ProcessList, p.ListParams())

    # --- fs/* -----------------------------------------------------------------------

    async def fs_read_file(self, path: str) -> p.FsReadFileResponse:
        """``fs/readFile``: the whole file (``data_base64`` holds the raw bytes)."""
        return await self.request(p.FsReadFile, p.FsReadFileParams(path))

    async def fs_write_file(self, path: str, data: bytes) -> p.Empty:
        """``fs/writeFile``: create or replace ``path`` with ``data``."""
        return await self.request(p.FsWriteFile, p.FsWriteFileParams(path, bytes(data)))

    async def fs_create_directory(self, path: str, recursive: bool | None = None) -> p.Empty:
        params = p.FsCreateDirectoryParams(path, recursive)
        return await self.request(p.FsCreateDirectory, params)

    async def fs_get_metadata(self, path: str) -> p.FsGetMetadataResponse:
        params = p.FsGetMetadataParams(path)
        return await self.request(p.FsGetMetadata, params)

    async def fs_read_directory(self, path: str) -> p.FsReadDirectoryResponse:
        params = p.FsReadDirectoryParams(path)
        return await self.request(p.FsReadDirectory, params)

    async def fs_remove(
        self, path: str, recursive: bool | None = None, force: bool | None = None
    ) -> p.Empty:
        return await self.request(p.FsRemove, p.FsRemoveParams(path, recursive, force))

    async def fs_copy(
        self, source_path: str, destination_path: str, recursive: bool = False
    ) -> p.Empty:
        params = p.FsCopyParams(source_path, destination_path, recursive)
        return await self.request(p.FsCopy, params)

    async def download(
        self,
        path: str,
        local_file: str | os.PathLike[str] | BinaryIO,
        *,
        chunk_bytes: int = TRANSFER_CHUNK_BYTES,
        progress: Progress | None = None,
    ) -> int:
        """Copy the remote file ``path`` into ``local_file`` (a path or a binary file)
        in ranged ``fs/readFile`` calls of ``chunk_bytes``; returns the bytes copied.

        Each range is read when asked for (a file that changes meanwhile is
        copied as the ranges found it; the download ends at the first short
        range). The local file is opened once the first range arrived, so a
        missing remote file leaves it as it was. ``RangesNotSupported``
        before anything is sent if the server lacks ``fs/readFile:range``.
        """
        return await transfer.download(
            self.call,
            self.capabilities,
            path,
            local_file,
            chunk_bytes=chunk_bytes,
            progress=progress,
        )

    async def upload(
        self,
        path: str,
        local_file: str | os.PathLike[str] | BinaryIO,
        *,
        chunk_bytes: int = TRANSFER_CHUNK_BYTES,
        progress: Progress | None = None,
    ) -> int:
        """Copy ``local_file`` (a path or a binary file) to the remote ``path``;
        returns the bytes copied.

        A file that fits in one chunk is written with one plain
        ``fs/writeFile`` (an atomic replacement). A larger one is written in
        place, range by range: the first range truncates the remote file,
        each next one extends it (readers see a partial file until the last
        arrives). ``RangesNotSupported`` before anything is sent if more than
        one range is needed and the server lacks ``fs/writeFile:range``.
        """
        return await transfer.upload(
            self.call,
            self.capabilities,
            path,
            local_file,
            chunk_bytes=chunk_bytes,
            progress=progress,
        )

    # --- process handles --------------------------------------------------------------

    async def start(
        self,
        argv: Sequence[str] | p.ExecParams,
        *,
        process_id: str | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        tty: bool = False,
        arg0: str | None = None,
        pipe_stdin: bool = False,
        size: tuple[int, int] | None = None,
        timeout_ms: int | None = None,
        idle_timeout_ms: int | None = None,
        sandbox: p.SandboxConfig | None = None,
        detach: bool = False,
    ) -> Process:
        """``process/start`` and a :class:`Process` handle following it.

        Defaults as the Twisted client's ``start_process``: a generated
        ``process_id`` (``proc-N``), this process's working directory,
        ``env={"PATH": DEFAULT_PATH}``; ``size`` is ``(rows, cols)``.
        ``detach=True``: :meth:`close` leaves the process running.
        A start cancelled (or failed) before the answer leaves no handle; if
        the server started the process anyway it is terminated.
        """
        params = exec_params(
            argv,
            self._table.new_process_id,
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
        requested = params.process_id
        handle = Process(self, requested, detach=detach, backlog_bytes=self._backlog_bytes)

        resent: list[AsyncRpc] = []

        async def catch_up_later(rpc: AsyncRpc) -> None:
            resent[:] = [rpc]

        def send(rpc: AsyncRpc, again: bool) -> Awaitable[None]:
            # ProcessTable.start: sent again (same processId) once the
            # session is resumed when it was in flight at a drop. The
            # catch-up that then follows is the handle's, not the request's:
            # made below, outside the request's timeout.
            return self._table.start(rpc.call, handle, params, again, lambda h: catch_up_later(rpc))

        try:
            async with asyncio.timeout(self._request_timeout):
                await self._through_drops(send, p.PROCESS_START, params)
        except BaseException as exc:
            self._table.unregister(handle.process_id, handle)
            # Untracked, it would never close: a close() waiting for it is released.
            handle.connection_lost()
            if isinstance(exc, asyncio.CancelledError | TimeoutError) and not detach:
                # The request may have been carried out: do not leave an orphan.
                self._terminate_later(requested, None)
            raise
        followed = self._table.after_start(
            handle,
            up=not self._rpc.is_closed,
            following=self._resume_enabled and self.resumable,
            lost=self.lost,
        )
        if followed and resent:
            await self._catch_up(resent[0], handle)
        return handle

    #: The one name every client gives it (the Twisted client's): ``start``
    #: stays, as an alias.
    start_process = start

    def _terminate_later(self, process_id: str, handle: Process | None) -> asyncio.Task[None]:
        """Terminate ``process_id`` in a task of its own (the caller is being
        cancelled), tracked until the process has ended: see :meth:`settle`."""
        task = asyncio.get_running_loop().create_task(self._terminate_quietly(process_id, handle))
        self._terminations.add(task)
        task.add_done_callback(self._terminations.discard)
        return task

    async def _terminate_quietly(self, process_id: str, handle: Process | None) -> None:
        with contextlib.suppress(ExecServerError, TimeoutError):
            async with asyncio.timeout(CLOSE_WAIT_SECONDS):
                await self._call(
                    p.PROCESS_TERMINATE, p.TerminateParams(process_id), p.TerminateResponse
                )
                if handle is not None:
                    await handle.closed()
                else:
                    # No handle (a start cancelled before its answer): the
                    # server says when the process has exited.
                    wait_ms = int(CLOSE_WAIT_SECONDS * 1000)
                    await self._call(
                        p.PROCESS_WAIT, p.WaitParams(process_id, wait_ms), p.WaitResponse
                    )

    async def settle(self, timeout: float | None = CLOSE_WAIT_SECONDS) -> None:
        """Until the processes of cancelled or timed-out :meth:`start` and
        :meth:`run` calls have been terminated and have ended (each such
        termination is bounded by 10 s; a process the server cannot reach
        is given up). :meth:`close` does this first."""
        pending = set(self._terminations)
        if pending:
            await asyncio.wait(pending, timeout=timeout)

    async def run(
        self,
        argv: Sequence[str],
        *,
        input: bytes | None = None,
        timeout: float | None = None,
        **start_kwargs: Any,
    ) -> RunResult:
        """Start ``argv``, feed it ``input`` (then close its stdin), collect all
        output until it exits and its output is closed. A process that exits
        before it took all its input (or its EOF) is no failure, as with a pipe.

        On ``timeout`` (seconds, client side) the process tree is terminated
        and ``TimeoutError`` is raised once it has ended (at most 10 s
        later); on cancellation ``CancelledError`` is raised at once and the
        termination goes on in the background (:meth:`settle`, :meth:`close`).
        PTY output (``tty=True``) is in ``stdout``.
        """
        if input is not None and not start_kwargs.get("tty"):
            start_kwargs["pipe_stdin"] = True  # a PTY's stdin is the terminal
        stdout: list[bytes] = []
        stderr: list[bytes] = []
        handle: Process | None = None

        gaps: list[GapEvent] = []

        def collect(event: OutputEvent) -> None:
            if isinstance(event, GapEvent):
                gaps.append(event)
                return
            (stderr if event.stream == "stderr" else stdout).append(event.chunk)

        try:
            async with asyncio.timeout(timeout):
                handle = await self.start(argv, **start_kwargs)
                handle.add_output_listener(collect, gaps=True)
                if input is not None:
                    await _feed(handle, input)
                await handle.closed()
        except TimeoutError:
            # Our own deadline, not a cancellation: the caller gets the
            # TimeoutError once the process has ended (bounded by the
            # termination's own 10 s), with no request of it left pending.
            if handle is not None and not handle.is_closed:
                await asyncio.wait({self._terminate_later(handle.process_id, handle)})
            else:
                await self.settle()  # a start that timed out terminates its own
            raise
        except BaseException:
            if handle is not None and not handle.is_closed:
                # The terminate runs in its own task (this one is being
                # cancelled), tracked so that close() waits for it.
                self._terminate_later(handle.process_id, handle)
            raise
        if handle.lost_reason is not None:
            raise handle.lost_reason
        if not handle.has_exited or handle.exit_code is None:
            raise ConnectionClosed(self._rpc.closed_reason or "connection closed")
        result = RunResult(
            b"".join(stdout),
            b"".join(stderr),
            handle.exit_code,
            handle.signal,
            handle.timed_out,
            handle.limit_exceeded,
        )
        if gaps:
            # Never a silently incomplete result: what arrived rides on the error.
            error = gaps[0].error()
            error.result = result
            raise error
        return result

    # --- notifications --------------------------------------------------------------

    def _on_output(self, out: OutputParams) -> None:
        if self._table.get(out.process_id) is None:
            return  # not followed: not even decoded
        event = decode_output(out)
        if event is None:
            log.warning("dropping process/output of %s with invalid base64", out.process_id)
            return
        rpc = self._rpc
        self._table.output(event, rpc.call, self.initialize_result, not rpc.is_closed, self._spawn)

    def _on_exited(self, ex: ExitedParams) -> None:
        # A baseline server sends no process/closed: the handle lingers.
        self._table.exited(ex)

    def _on_closed(self, closed: ClosedParams) -> None:
        self._table.closed(closed)

    # --- closing --------------------------------------------------------------------

    async def close(self) -> None:
        """Terminate every process this client started that has not exited
        (except ``detach=True`` ones) and wait up to 10 s for their exits --
        and for the terminations of cancelled or timed-out starts and runs
        (:meth:`settle`) -- then close the connection (a local server is
        asked to exit, and killed after its grace). Idempotent. The sequence
        is :func:`execserver.clientcore.follow.end_processes`, the Twisted
        client's too."""
        if self._closing:
            await self._closed.wait()
            return
        try:
            await self._end_processes()
        finally:
            self._closing = True
            self._table.cancel_lingers()
            self._fail_waiters(ConnectionClosed("the client was closed"))
            for task in [*self._tasks, *self._terminations]:
                task.cancel()
            await self._channel.aclose()
            self._rpc.connection_lost("closed by the client")
            for handle in self._table.take_all():
                handle.connection_lost()
            self._closed.set()

    async def _end_processes(self) -> None:
        if self._rpc.is_closed or self.lost is not None:
            return
        if not await end_processes(
            self._table.to_end(),
            self.terminate,
            Process.exited,
            _within,
            # A cancelled start's process has no handle: its own
            # termination (already bounded) ends it.
            also=[asyncio.shield(t) for t in list(self._terminations)],
        ):
            log.warning("closing: processes still running after %s s", CLOSE_WAIT_SECONDS)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _Connecting:
    """What :func:`connect` returns: awaitable, and an async context manager."""

    def __init__(self, opening: Callable[[], Awaitable[Client]]) -> None:
        self._opening = opening
        self._client: Client | None = None

    def __await__(self) -> Generator[Any, None, Client]:
        return self._opening().__await__()

    async def __aenter__(self) -> Client:
        self._client = await self._opening()
        return self._client

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.close()


def connect(
    url: str | None = None,
    *,
    server_command: Sequence[str] | None = None,
    token: str | None = None,
    token_file: str | None = None,
    ca_file: str | None = None,
    client_cert: str | None = None,
    client_key: str | None = None,
    connect_timeout: float = 10.0,
    request_timeout: float | None = None,
    resume: bool = True,
    session_ttl_ms: int | None = None,
    on_detached_full: str | None = None,
    client_name: str = "exec-server-aio",
    env: dict[str, str] | None = None,
    stderr: Callable[[bytes], None] | None = None,
    shutdown_grace: float = 5.0,
) -> _Connecting:
    """Connect and initialize: ``await connect(...)`` or ``async with connect(...) as c``.

    - ``url=None``: launch a local server over stdio (``server_command``,
      default ``python -m execserver``; ``env`` its environment, ``stderr``
      a callback for its stderr, ``shutdown_grace`` seconds before ``close``
      kills it); ``ws://HOST:PORT``, ``wss://HOST:PORT`` (``ca_file`` instead
      of the system's trust store; ``client_cert``/``client_key`` for mutual
      TLS) or ``unix:///PATH``.
    - ``token`` / ``token_file``: the bearer token, sent as
      ``Authorization: Bearer ...`` on the upgrade (the file's content,
      stripped; ``ConnectFailed`` if it cannot be read or is empty).
    - ``connect_timeout``: seconds for the connection (TCP, TLS, upgrade:
      ``ConnectTimeout``) and again for the ``initialize`` answer
      (``InitializeTimeout``).
    - ``request_timeout``: the default per-call timeout (``TimeoutError``).
    - ``resume`` (WebSocket / Unix socket): ride through dropped connections
      (see the module doc); the session is asked to live ``session_ttl_ms``
      after a drop (default 60000; the server may grant less), with
      ``on_detached_full`` (default ``"pause"`` for such a session;
      ``"drop"``: the server may drop unread output, and the output
      iteration raises ``OutputGap`` where it did).
    """
    display = url or "stdio"
    if token_file is not None:
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as exc:
            raise ConnectFailed(
                display, f"cannot read token file {token_file}: {exc.strerror}"
            ) from None
        if not token:
            raise ConnectFailed(display, f"token file {token_file} is empty")
    if url is not None and not url.startswith(("ws://", "wss://", UNIX_SCHEME)):
        raise ConnectFailed(url, "unsupported URL: expected ws://, wss:// or unix:///PATH")
    ttl = session_ttl_ms
    if ttl is None and resume and url is not None:
        ttl = DEFAULT_SESSION_TTL_MS
    if on_detached_full is None and ttl:
        # A resumed session never lacks output the client has not read.
        on_detached_full = "pause"
    dialer = _Dialer(
        url=url,
        server_command=server_command,
        token=token,
        ca_file=ca_file,
        client_cert=client_cert,
        client_key=client_key,
        connect_timeout=connect_timeout,
        client_name=client_name,
        session_ttl_ms=ttl,
        on_detached_full=on_detached_full,
        env=env,
        stderr=stderr,
        shutdown_grace=shutdown_grace,
    )

    async def opening() -> Client:
        if url is None or not resume or not ttl:
            rpc, channel, result = await dialer.open(None)
        else:
            # A cut during this first handshake leaves no session, but
            # nothing started either: dialled again within the session's TTL.
            rpc, channel, result = await first_dial(
                lambda: dialer.open(None),
                ttl / 1000,
                now=asyncio.get_running_loop().time,
                sleep=asyncio.sleep,
                refused=lambda exc: isinstance(exc.__cause__, ConnectionRefusedError),
                give_up=lambda reason: ConnectFailed(url, reason),
            )
        return Client(dialer, rpc, channel, result, request_timeout=request_timeout, resume=resume)

    return _Connecting(opening)
