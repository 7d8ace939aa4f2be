"""The blocking client: :mod:`execserver.aio` run on a background event loop.

``connect()`` returns a :class:`Client` whose methods block until the
asyncio client's coroutine (run on the shared loop thread, see
:mod:`execserver.sync._loop`) finishes. Names, arguments, results and errors
are the asyncio client's. Every blocking call has a bound:

- protocol calls (fs, signal, list, ...) wait at most ``call_timeout``
  seconds (60 by default), then the request is cancelled and
  :class:`TimeoutError` raised;
- ``connect`` waits at most ``2 * connect_timeout`` + 1 seconds (the
  connection, then the handshake);
- ``run``, ``Process.wait``, ``Process.output`` and ``upload``/``download``
  wait as long as the caller's ``timeout`` says (None: until the process
  ends, the transfer completes or the connection is lost).

A KeyboardInterrupt while a call blocks cancels its coroutine before it
propagates (an interrupted ``run``'s process is terminated and has ended). Any number of threads
may use one client (and its process handles) at once.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import os
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, BinaryIO, TypeVar

from execserver import aio
from execserver import protocol as p
from execserver.aio import RunResult
from execserver.clientcore.errors import ConnectionClosed
from execserver.clientcore.types import GapEvent, OutputEvent
from execserver.sync._loop import CANCEL_GRACE, LOOP, Call, check_not_loop_thread

T = TypeVar("T")
P = TypeVar("P")
R = TypeVar("R")

#: Bound of every protocol call that has no timeout of its own (seconds).
DEFAULT_CALL_TIMEOUT = 60.0
#: Bound of ``close()``: terminating the processes and closing the connection.
CLOSE_TIMEOUT = 30.0

LocalFile = str | os.PathLike[str] | BinaryIO
Progress = Callable[[int, int | None], object]


class Client:
    """A connected, initialized exec-server client with blocking methods."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        client: aio.Client,
        call_timeout: float | None,
    ) -> None:
        self._loop = loop
        self._aio = client
        self.call_timeout = call_timeout
        self._close_lock = threading.Lock()
        self._run_ids = itertools.count(1)
        self._closed = False
        _OPEN.add(self)
        # Dropped unclosed: close on the loop, and let the loop stop.
        self._finalizer = weakref.finalize(self, _close_dropped, loop, client)
        # At interpreter exit _close_all closes it properly (and waits).
        self._finalizer.atexit = False

    def __repr__(self) -> str:
        return f"<execserver.sync.Client session {self.session_id!r}>"

    # --- running coroutines ------------------------------------------------------------

    def _check_usable(self) -> None:
        check_not_loop_thread()
        if self._closed:
            raise ConnectionClosed("the client was closed")

    def _call(self, factory: Callable[[], Awaitable[T]], what: str) -> Call[T]:
        """A started :class:`Call` of ``factory()`` on the loop."""
        self._check_usable()
        call = Call(self._loop, factory, what)
        call.start()
        return call

    def _blocking(
        self,
        factory: Callable[[], Awaitable[T]],
        timeout: float | None,
        what: str,
        on_progress: Callable[..., object] | None = None,
    ) -> T:
        return self._call(factory, what).wait(timeout, on_progress)

    def _rpc(self, what: str, factory: Callable[[], Awaitable[T]]) -> T:
        return self._blocking(factory, self.call_timeout, what)

    def request(self, method: p.Method[P, R], params: P) -> R:
        """Any declared protocol method (``p.ProcessSignal``, ``p.FsCopy``, ...),
        bounded by ``call_timeout``: the path the typed methods below take."""
        return self._rpc(method.name, lambda: self._aio.request(method, params))

    # --- state ---------------------------------------------------------------------------

    @property
    def aio(self) -> aio.Client:
        """The underlying asyncio client (use it only on :attr:`loop`)."""
        return self._aio

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def session_id(self) -> str | None:
        return self._aio.session_id

    @property
    def capabilities(self) -> list[str]:
        return list(self._aio.capabilities)

    def supports(self, method: str) -> bool:
        return self._aio.supports(method)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pending_request_count(self) -> int:
        """Requests sent and not yet answered (on the current connection)."""
        return self._aio.pending_request_count

    # --- processes -----------------------------------------------------------------------

    def start(
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
        """``process/start``; the handle follows the process (see :class:`Process`).

        Timed out or interrupted (KeyboardInterrupt), a process the server
        started anyway is terminated, and has ended, before the exception
        propagates (unless ``detach``), as with :meth:`run`.
        """

        def start_reaped() -> Awaitable[aio.Process]:
            return self._reaped(
                lambda: self._aio.start(
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
                    detach=detach,
                )
            )

        return Process(self, self._rpc("process/start", start_reaped))

    #: The one name every client gives it (the Twisted client's): ``start``
    #: stays, as an alias.
    start_process = start

    async def _reaped(self, work: Callable[[], Awaitable[T]]) -> T:
        """``work()``; if it fails or is cancelled, first wait for the processes the
        asyncio client terminates in tasks of their own (a started process, a
        timed-out run), so a script that goes on or exits right after the
        exception finds them ended."""
        try:
            return await work()
        except BaseException:
            # The caller's own bound often expires with the work's (both are
            # call_timeout): its cancellation must not cut this wait short,
            # or the exception would reach the script before the process ended.
            settling = asyncio.ensure_future(self._aio.settle(CANCEL_GRACE))
            while not settling.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(settling)
            raise

    def run(
        self,
        argv: Sequence[str],
        *,
        input: bytes | None = None,
        timeout: float | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        tty: bool = False,
        arg0: str | None = None,
        size: tuple[int, int] | None = None,
        timeout_ms: int | None = None,
        idle_timeout_ms: int | None = None,
        sandbox: p.SandboxConfig | None = None,
    ) -> RunResult:
        """Run ``argv`` to its end: stdout, stderr, exit code (a :class:`RunResult`).

        After ``timeout`` seconds the process tree is terminated and
        :class:`TimeoutError` raised; None waits as long as it runs. Interrupted
        (KeyboardInterrupt), the process is terminated, and has ended, before
        the exception propagates.
        """
        process_id = f"run-{next(self._run_ids)}"

        def run_reaped() -> Awaitable[RunResult]:
            return self._reaped(
                lambda: self._aio.run(
                    argv,
                    input=input,
                    timeout=timeout,
                    process_id=process_id,
                    cwd=cwd,
                    env=env,
                    tty=tty,
                    arg0=arg0,
                    size=size,
                    timeout_ms=timeout_ms,
                    idle_timeout_ms=idle_timeout_ms,
                    sandbox=sandbox,
                )
            )

        bound = None if timeout is None else timeout + (self.call_timeout or CLOSE_TIMEOUT)
        return self._blocking(run_reaped, bound, f"run {list(argv)[:1]}")

    def read(
        self,
        process_id: str,
        after_seq: int | None = None,
        max_bytes: int | None = None,
        wait_ms: int | None = None,
    ) -> p.ReadResponse:
        """``process/read``; bounded by ``wait_ms`` plus ``call_timeout``."""
        return self._blocking(
            lambda: self._aio.read(process_id, after_seq, max_bytes, wait_ms),
            self._long_poll_bound(wait_ms or 0),
            "process/read",
        )

    def write(self, process_id: str, data: bytes) -> p.WriteResponse:
        return self._rpc("process/write", lambda: self._aio.write(process_id, data))

    def terminate(self, process_id: str, grace_ms: int | None = None) -> p.TerminateResponse:
        return self._rpc(
            "process/terminate", lambda: self._aio.terminate(process_id, grace_ms=grace_ms)
        )

    def signal(self, process_id: str, signal: int | str) -> p.SignalResponse:
        return self.request(p.ProcessSignal, p.SignalParams(process_id, signal))

    def close_stdin(self, process_id: str) -> p.CloseStdinResponse:
        return self.request(p.ProcessCloseStdin, p.CloseStdinParams(process_id))

    def resize(self, process_id: str, rows: int, cols: int) -> p.Empty:
        return self.request(p.ProcessResize, p.ResizeParams(process_id, rows, cols))

    def wait(self, process_id: str, timeout_ms: int | None = None) -> p.WaitResponse:
        """``process/wait``; bounded by ``timeout_ms`` plus ``call_timeout``
        (without ``timeout_ms``: until the process exits)."""
        return self._blocking(
            lambda: self._aio.wait(process_id, timeout_ms),
            self._long_poll_bound(timeout_ms),
            "process/wait",
        )

    def _long_poll_bound(self, server_ms: int | None) -> float | None:
        """A request the server holds up to ``server_ms`` (None: indefinitely);
        the asyncio client bounds its request the same way with the same
        ``call_timeout`` (its ``request_timeout``)."""
        if self.call_timeout is None or server_ms is None:
            return None
        return self.call_timeout + server_ms / 1000

    def list_processes(self) -> p.ListResponse:
        return self.request(p.ProcessList, p.ListParams())

    # --- fs --------------------------------------------------------------------------------

    def fs_read_file(self, path: str) -> p.FsReadFileResponse:
        return self.request(p.FsReadFile, p.FsReadFileParams(path))

    def fs_write_file(self, path: str, data: bytes) -> p.Empty:
        return self.request(p.FsWriteFile, p.FsWriteFileParams(path, bytes(data)))

    def fs_create_directory(self, path: str, recursive: bool | None = None) -> p.Empty:
        return self.request(p.FsCreateDirectory, p.FsCreateDirectoryParams(path, recursive))

    def fs_get_metadata(self, path: str) -> p.FsGetMetadataResponse:
        return self.request(p.FsGetMetadata, p.FsGetMetadataParams(path))

    def fs_read_directory(self, path: str) -> p.FsReadDirectoryResponse:
        return self.request(p.FsReadDirectory, p.FsReadDirectoryParams(path))

    def fs_remove(
        self, path: str, recursive: bool | None = None, force: bool | None = None
    ) -> p.Empty:
        return self.request(p.FsRemove, p.FsRemoveParams(path, recursive, force))

    def fs_copy(self, source_path: str, destination_path: str, recursive: bool = False) -> p.Empty:
        return self.request(p.FsCopy, p.FsCopyParams(source_path, destination_path, recursive))

    def upload(
        self,
        path: str,
        local_file: LocalFile,
        *,
        progress: Progress | None = None,
        timeout: float | None = None,
    ) -> int:
        """Copy a local file (path or binary file object) to ``path``; the bytes sent.

        ``progress(done, total)`` is called in this thread after each range.
        """
        return self._transfer("upload", path, local_file, progress, timeout)

    def download(
        self,
        path: str,
        local_file: LocalFile,
        *,
        progress: Progress | None = None,
        timeout: float | None = None,
    ) -> int:
        """Copy ``path`` to a local file (path or binary file object); the bytes received."""
        return self._transfer("download", path, local_file, progress, timeout)

    def _transfer(
        self,
        direction: str,
        path: str,
        local_file: LocalFile,
        progress: Progress | None,
        timeout: float | None,
    ) -> int:
        method = self._aio.upload if direction == "upload" else self._aio.download

        async def transfer() -> int:
            on_range = call.progress if progress is not None else None
            return await method(path, local_file, progress=on_range)

        self._check_usable()
        # Made before it starts: the coroutine refers to it.
        call: Call[int] = Call(self._loop, transfer, f"{direction} {path}")
        call.start()
        return call.wait(timeout, progress)

    # --- closing ---------------------------------------------------------------------------

    def close(self) -> None:
        """Terminate the processes this client started (unless detached) and disconnect.

        Idempotent and thread-safe; the last open client stops the loop thread.
        """
        check_not_loop_thread()
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._finalizer.detach()
        _OPEN.discard(self)
        try:
            call = Call(self._loop, self._aio.close, "close")
            call.start()
            call.wait(CLOSE_TIMEOUT)
        finally:
            LOOP.release()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Process:
    """A process started by :meth:`Client.start`, with blocking methods."""

    def __init__(self, client: Client, process: aio.Process) -> None:
        self._client = client
        self._aio = process
        #: [the aio OutputStream every output() iterator reads] once created
        #: (a list: shared with the finalizer, which stops it with the handle).
        self._stream: list[Any] = []
        self._pushback: list[OutputEvent] = []
        weakref.finalize(self, _close_stream, client.loop, self._stream)

    def __repr__(self) -> str:
        return f"<execserver.sync.Process {self.process_id!r}>"

    @property
    def aio(self) -> aio.Process:
        return self._aio

    @property
    def process_id(self) -> str:
        return self._aio.process_id

    @property
    def exit_code(self) -> int | None:
        return self._aio.exit_code

    @property
    def signal(self) -> str | None:
        """The signal that ended the process (``"SIGTERM"``), once exited."""
        return self._aio.signal

    @property
    def has_exited(self) -> bool:
        return self._aio.has_exited

    @property
    def timed_out(self) -> str | None:
        return self._aio.timed_out

    @property
    def limit_exceeded(self) -> tuple[str, int | None] | None:
        """``(limitExceeded, limitValue)`` when a resource limit ended or crippled it."""
        return self._aio.limit_exceeded

    def output(self, timeout: float | None = None, *, gaps: bool = False) -> Iterator[OutputEvent]:
        """The output events (:class:`OutputEvent`) up to the close.

        ``timeout`` bounds this iteration (TimeoutError when it expires). Every
        ``output()`` of a handle reads one stream: a new iteration continues
        where the last one stopped (after a timeout, a ``break``, a gap), so no
        event is lost or seen twice. One thread at a time may iterate it.
        Where the server dropped output the iteration raises
        :class:`~execserver.clientcore.errors.OutputGap` naming the lost
        seqs; with ``gaps=True`` a :class:`GapEvent` comes in its place.
        """
        return _OutputIterator(self, timeout, gaps)

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code once the process exited (TimeoutError after ``timeout``)."""
        return self._client._blocking(self._aio.wait, timeout, f"wait {self.process_id}")

    #: The one name every handle gives it (the Twisted handle's): ``wait``
    #: stays, as an alias.
    exited = wait

    def write(self, data: bytes) -> p.WriteResponse:
        return self._client._rpc("process/write", lambda: self._aio.write(data))

    def close_stdin(self) -> p.CloseStdinResponse:
        return self._client._rpc("process/closeStdin", self._aio.close_stdin)

    def send_signal(self, sig: int | str) -> p.SignalResponse:
        """``process/signal``: a name (``"SIGINT"``, ``"INT"``) or a number."""
        return self._client._rpc("process/signal", lambda: self._aio.send_signal(sig))

    def resize(self, rows: int, cols: int) -> p.Empty:
        return self._client._rpc("process/resize", lambda: self._aio.resize(rows, cols))

    def terminate(self, grace_ms: int | None = None) -> p.TerminateResponse:
        return self._client._rpc(
            "process/terminate", lambda: self._aio.terminate(grace_ms=grace_ms)
        )

    def read(
        self,
        after_seq: int | None = None,
        max_bytes: int | None = None,
        wait_ms: int | None = None,
    ) -> p.ReadResponse:
        return self._client.read(self.process_id, after_seq, max_bytes, wait_ms)


class _OutputIterator(Iterator[OutputEvent]):
    """Pulls the handle's output stream one event per blocking call.

    The stream is created, and read, on the loop thread.
    """

    def __init__(self, process: Process, timeout: float | None, gaps: bool) -> None:
        self._process = process
        self._gaps = gaps
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._ended = False

    def __iter__(self) -> Iterator[OutputEvent]:
        return self

    def __next__(self) -> OutputEvent:
        if self._ended:
            raise StopIteration
        process = self._process

        async def step() -> OutputEvent | None:
            if not process._stream:
                # Gaps are events here; each iterator raises them or not.
                process._stream.append(process.aio.output(gaps=True))
            try:
                event: OutputEvent = await process._stream[0].__anext__()
            except StopAsyncIteration:
                return None
            return event

        if process._pushback:
            return self._checked(process._pushback.pop(0))
        remaining = None
        if self._deadline is not None:
            remaining = max(0.0, self._deadline - time.monotonic())
        call = process._client._call(step, f"output of {process.process_id}")
        try:
            event = call.wait(remaining)
        except BaseException:
            if call.leftover is not None and call.leftover[0] is not None:
                # Interrupted as it arrived: the next iteration starts with it.
                process._pushback.append(call.leftover[0])
            raise
        if event is None:
            self._ended = True
            raise StopIteration
        return self._checked(event)

    def _checked(self, event: OutputEvent) -> OutputEvent:
        if isinstance(event, GapEvent) and not self._gaps:
            raise event.error()
        return event


def _close_stream(loop: asyncio.AbstractEventLoop, holder: list[Any]) -> None:
    if holder:
        stream = holder.pop()
        with contextlib.suppress(RuntimeError):  # the loop is gone: so is the stream
            loop.call_soon_threadsafe(stream.close)


# --- open clients, for interpreter exit ------------------------------------------------

_OPEN: weakref.WeakSet[Client] = weakref.WeakSet()


def _close_dropped(loop: asyncio.AbstractEventLoop, client: aio.Client) -> None:
    def close() -> None:
        task = loop.create_task(client.close())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    try:
        loop.call_soon_threadsafe(close)
    except RuntimeError:
        return  # the loop is gone already
    LOOP.release()


def _close_all() -> None:
    for client in list(_OPEN):
        try:
            client.close()
        except Exception:
            continue


# Registered after the loop's own atexit hook, so it runs before it (LIFO).
atexit.register(_close_all)


# --- connecting ------------------------------------------------------------------------


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
    call_timeout: float | None = DEFAULT_CALL_TIMEOUT,
    resume: bool = True,
    session_ttl_ms: int | None = None,
    on_detached_full: str | None = None,
    client_name: str = "exec-server-sync",
    env: dict[str, str] | None = None,
    stderr: Callable[[bytes], None] | None = None,
    shutdown_grace: float = 5.0,
) -> Client:
    """Connect and initialize; use as ``with connect(...) as client:``.

    The arguments are :func:`execserver.aio.connect`'s (``url`` None: a local
    server over stdio; ``ws://``, ``wss://``, ``unix:///PATH``), plus
    ``call_timeout``: the bound of every protocol call (seconds, default 60;
    None: unbounded), also passed on as the asyncio client's
    ``request_timeout``. ``stderr`` (the local server's stderr) is called on
    the loop thread. Waits at most ``2 * connect_timeout`` (connection, then
    handshake) plus a second.
    """
    check_not_loop_thread()
    loop = LOOP.acquire()
    try:
        client = Call(
            loop,
            lambda: aio.connect(
                url,
                server_command=server_command,
                token=token,
                token_file=token_file,
                ca_file=ca_file,
                client_cert=client_cert,
                client_key=client_key,
                connect_timeout=connect_timeout,
                request_timeout=call_timeout,
                resume=resume,
                session_ttl_ms=session_ttl_ms,
                on_detached_full=on_detached_full,
                client_name=client_name,
                env=env,
                stderr=stderr,
                shutdown_grace=shutdown_grace,
            ),
            f"connect {url or 'stdio'}",
        )
        client.start()
        connected = client.wait(2 * connect_timeout + 1.0)
    except BaseException:
        LOOP.release()
        raise
    return Client(loop, connected, call_timeout)
