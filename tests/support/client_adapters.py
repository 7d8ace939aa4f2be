"""One interface over the three clients, for tests/test_clients_parametrised.py.

The tests run on the Twisted reactor (pytest-twisted), as the servers,
harnesses and the connection-cutting proxy do; each adapter offers the same
``async`` methods, awaited there:

- ``twisted``: :mod:`execserver.client` on the reactor itself (Deferreds);
- ``aio``: :mod:`execserver.aio` on an asyncio loop in a thread of its own
  (:class:`AioLoop`); each call is a coroutine submitted to it, its result
  handed back to the reactor; cancelling the Deferred cancels the task;
- ``sync``: :mod:`execserver.sync`, each blocking call made in a reactor
  pool thread (``deferToThread``), so the reactor keeps serving the proxy
  and the servers meanwhile.

Every wait is bounded (``with_timeout``). The adapters add no behaviour of
their own: output is read through each client's own pull interface
(``subscribe()``, ``output()``, the blocking iterator), ``run`` exists only
where the client has it.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.threads import deferToThread

from execserver.client import ConnectOptions, ExecServerClient, OutputEvent, RemoteProcess
from execserver.client.reconnect import ReconnectingClient
from execserver.clientcore.errors import ExecServerError
from tests.support.harness import DEFAULT_TIMEOUT, console_script, reactor, server_env, with_timeout

if TYPE_CHECKING:
    from execserver import aio, sync

T = TypeVar("T")
Progress = Callable[[int, int | None], None]

KINDS = ("twisted", "aio", "sync")


@attrs.frozen
class Target:
    """Where a client connects: ``url`` None is a local server over stdio."""

    url: str | None = None
    token: str | None = None
    connect_timeout: float = 5.0
    #: Ride through dropped connections (WebSocket/unix only).
    resume: bool = False
    session_ttl_ms: int | None = None
    #: The per-call bound of the asyncio (``request_timeout``) and blocking
    #: (``call_timeout``) clients (the blocking client's default); the
    #: Twisted client has none of its own.
    call_timeout: float = 60.0


@attrs.frozen
class RunOutcome:
    stdout: bytes
    stderr: bytes
    exit_code: int | None
    signal: str | None
    timed_out: str | None


def stdio_command() -> list[str]:
    """The installed server, as the harnesses run it."""
    return [console_script("exec-server")]


# --- the aio client's loop ---------------------------------------------------------------


class AioLoop:
    """An asyncio loop in a daemon thread; coroutines on it become Deferreds."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="test-aio-loop", daemon=True
        )
        self.thread.start()

    def run(self, factory: Callable[[], Awaitable[T]]) -> Deferred[T]:
        async def wrapped() -> T:
            return await factory()

        future = asyncio.run_coroutine_threadsafe(wrapped(), self.loop)

        def cancel(_: Deferred[T]) -> None:
            future.cancel()

        d: Deferred[T] = Deferred(cancel)

        def done(_: object) -> None:
            reactor.callFromThread(settle)

        def settle() -> None:
            if d.called:
                return
            if future.cancelled():
                d.errback(asyncio.CancelledError())
                return
            exc = future.exception()
            if exc is not None:
                d.errback(exc)
            else:
                d.callback(future.result())

        future.add_done_callback(done)
        return d


_AIO: AioLoop | None = None


def aio_loop() -> AioLoop:
    global _AIO
    if _AIO is None:
        _AIO = AioLoop()
    return _AIO


# --- the interface -------------------------------------------------------------------------


class ProcAdapter:
    """A process handle of any client."""

    process_id: str
    handle: Any

    async def next_event(self, timeout: float = DEFAULT_TIMEOUT) -> OutputEvent | None:
        raise NotImplementedError

    async def events(self, timeout: float = DEFAULT_TIMEOUT) -> list[OutputEvent]:
        """Every output event up to the close."""
        found: list[OutputEvent] = []
        while (event := await self.next_event(timeout)) is not None:
            found.append(event)
        return found

    async def output_until(self, needle: bytes, timeout: float = DEFAULT_TIMEOUT) -> bytes:
        """Output (all streams) up to and including the first ``needle``."""
        seen = b""
        while needle not in seen:
            event = await self.next_event(timeout)
            if event is None:
                raise AssertionError(f"output ended before {needle!r}: {seen!r}")
            seen += event.chunk
        return seen

    async def wait(self, timeout: float = DEFAULT_TIMEOUT) -> int | None:
        raise NotImplementedError

    def _on(self, call: Callable[[], Any], timeout: float, what: str) -> Deferred[Any]:
        """``call()`` (a method of ``handle``) where its client runs, bounded."""
        raise NotImplementedError

    # The three clients' handles share these names and arguments.

    async def write(self, data: bytes) -> None:
        await self._on(lambda: self.handle.write(data), DEFAULT_TIMEOUT, "write")

    async def close_stdin(self) -> None:
        await self._on(self.handle.close_stdin, DEFAULT_TIMEOUT, "closeStdin")

    async def signal(self, sig: str) -> None:
        await self._on(lambda: self.handle.send_signal(sig), DEFAULT_TIMEOUT, "signal")

    async def resize(self, rows: int, cols: int) -> None:
        await self._on(lambda: self.handle.resize(rows, cols), DEFAULT_TIMEOUT, "resize")

    async def terminate(self) -> None:
        await self._on(self.handle.terminate, DEFAULT_TIMEOUT, "terminate")

    @property
    def exit_signal(self) -> str | None:
        signal: str | None = self.handle.signal
        return signal

    @property
    def timed_out(self) -> str | None:
        timed_out: str | None = self.handle.timed_out
        return timed_out


class ClientAdapter:
    """A connected client of any kind, one interface."""

    kind: str

    @classmethod
    async def connect(cls, target: Target) -> ClientAdapter:
        raise NotImplementedError

    async def start(self, argv: Sequence[str], **kwargs: Any) -> ProcAdapter:
        raise NotImplementedError

    async def run(
        self, argv: Sequence[str], *, bound: float = DEFAULT_TIMEOUT, **kwargs: Any
    ) -> RunOutcome:
        """``run`` (asyncio and blocking clients); ``bound`` limits the test's wait."""
        raise NotImplementedError

    async def call(self, method: str, *args: Any, timeout: float = DEFAULT_TIMEOUT) -> Any:
        """A ClientApi method by name (``fs_read_file``, ``list_processes``, ...)."""
        raise NotImplementedError

    async def upload(self, path: str, local: str, progress: Progress) -> int:
        raise NotImplementedError

    async def download(self, path: str, local: str, progress: Progress) -> int:
        raise NotImplementedError

    @property
    def pending_request_count(self) -> int:
        raise NotImplementedError

    @property
    def session_id(self) -> str | None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError


async def connect(kind: str, target: Target) -> ClientAdapter:
    adapters: dict[str, type[ClientAdapter]] = {
        "twisted": TwistedClient,
        "aio": AioClient,
        "sync": SyncClient,
    }
    return await adapters[kind].connect(target)


# --- Twisted ---------------------------------------------------------------------------------


class TwistedProc(ProcAdapter):
    def __init__(self, handle: RemoteProcess) -> None:
        self.handle = handle
        self.process_id = handle.process_id
        self._sub = handle.subscribe()

    async def next_event(self, timeout: float = DEFAULT_TIMEOUT) -> OutputEvent | None:
        event: OutputEvent | None = await with_timeout(self._sub.next(), timeout, "output")
        return event

    async def wait(self, timeout: float = DEFAULT_TIMEOUT) -> int | None:
        code: int | None = await with_timeout(self.handle.exited(), timeout, "exit")
        return code

    def _on(self, call: Callable[[], Any], timeout: float, what: str) -> Deferred[Any]:
        return with_timeout(call(), timeout, what)


class TwistedClient(ClientAdapter):
    kind = "twisted"

    def __init__(self, client: ExecServerClient | None, reconnecting: Any = None) -> None:
        self.client = client
        self.reconnecting: ReconnectingClient | None = reconnecting

    @classmethod
    async def connect(cls, target: Target) -> ClientAdapter:
        options = ConnectOptions("adapter-test", session_ttl_ms=target.session_ttl_ms)
        if target.url is None:
            client = await with_timeout(
                ExecServerClient.spawn_local(
                    reactor, options, command=stdio_command(), env=server_env()
                ),
                DEFAULT_TIMEOUT,
                "stdio connect",
            )
            return cls(client)
        if target.resume:
            recon = ReconnectingClient(
                reactor,
                target.url,
                ConnectOptions("adapter-test"),
                token=target.token,
                connect_timeout=target.connect_timeout,
                initial_delay=0.02,
                max_delay=0.2,
                jitter=lambda: 0,
                session_ttl_ms=target.session_ttl_ms or 30_000,
            )
            recon.start()
            await with_timeout(recon.when_connected(), DEFAULT_TIMEOUT, "first connection")
            return cls(None, recon)
        client = await with_timeout(
            ExecServerClient.connect_websocket(
                reactor,
                target.url,
                options,
                token=target.token,
                connect_timeout=target.connect_timeout,
            ),
            DEFAULT_TIMEOUT,
            "ws connect",
        )
        return cls(client)

    @property
    def _api(self) -> Any:
        return self.reconnecting if self.reconnecting is not None else self.client

    async def start(self, argv: Sequence[str], **kwargs: Any) -> ProcAdapter:
        handle = await with_timeout(
            self._api.start_process(list(argv), **kwargs), DEFAULT_TIMEOUT, "start"
        )
        return TwistedProc(handle)

    async def call(self, method: str, *args: Any, timeout: float = DEFAULT_TIMEOUT) -> Any:
        return await with_timeout(getattr(self._api, method)(*args), timeout, method)

    async def upload(self, path: str, local: str, progress: Progress) -> int:
        assert self.client is not None
        sent: int = await with_timeout(
            self.client.upload(path, local, progress=progress), 60.0, "upload"
        )
        return sent

    async def download(self, path: str, local: str, progress: Progress) -> int:
        assert self.client is not None
        got: int = await with_timeout(
            self.client.download(path, local, progress=progress), 60.0, "download"
        )
        return got

    @property
    def pending_request_count(self) -> int:
        client = self.client if self.client is not None else self.reconnecting.client  # type: ignore[union-attr]
        return client.pending_request_count if client is not None else 0

    @property
    def session_id(self) -> str | None:
        client = self.client if self.client is not None else self.reconnecting.client  # type: ignore[union-attr]
        return client.session_id if client is not None else None

    async def close(self) -> None:
        if self.reconnecting is not None:
            await with_timeout(self.reconnecting.stop(), 30.0, "stop")
        if self.client is not None:
            await with_timeout(self.client.close(), 30.0, "close")


# --- asyncio -------------------------------------------------------------------------------


class AioProc(ProcAdapter):
    def __init__(self, handle: aio.Process, loop: AioLoop) -> None:
        self.handle = handle
        self.process_id = handle.process_id
        self._loop = loop
        self._iter: Any = None

    def _on(self, call: Callable[[], Any], timeout: float, what: str) -> Deferred[Any]:
        return with_timeout(self._loop.run(call), timeout, what)

    async def next_event(self, timeout: float = DEFAULT_TIMEOUT) -> OutputEvent | None:
        async def step() -> OutputEvent | None:
            if self._iter is None:
                self._iter = self.handle.output().__aiter__()
            try:
                event: OutputEvent = await self._iter.__anext__()
            except StopAsyncIteration:
                return None
            return event

        event: OutputEvent | None = await self._on(step, timeout, "output")
        return event

    async def wait(self, timeout: float = DEFAULT_TIMEOUT) -> int | None:
        code: int | None = await self._on(self.handle.wait, timeout, "exit")
        return code


class AioClient(ClientAdapter):
    kind = "aio"

    def __init__(self, client: aio.Client, loop: AioLoop) -> None:
        self.client = client
        self.loop = loop

    @classmethod
    async def connect(cls, target: Target) -> ClientAdapter:
        from execserver import aio

        loop = aio_loop()
        client = await with_timeout(
            loop.run(
                lambda: aio.connect(
                    target.url,
                    server_command=stdio_command() if target.url is None else None,
                    env=server_env() if target.url is None else None,
                    token=target.token,
                    connect_timeout=target.connect_timeout,
                    resume=target.resume,
                    session_ttl_ms=target.session_ttl_ms,
                    request_timeout=target.call_timeout,
                )
            ),
            DEFAULT_TIMEOUT,
            "aio connect",
        )
        return cls(client, loop)

    def on_loop(
        self, factory: Callable[[], Awaitable[T]], timeout: float, what: str
    ) -> Deferred[T]:
        return with_timeout(self.loop.run(factory), timeout, what)

    async def start(self, argv: Sequence[str], **kwargs: Any) -> ProcAdapter:
        handle = await self.on_loop(
            lambda: self.client.start(list(argv), **kwargs), DEFAULT_TIMEOUT, "start"
        )
        return AioProc(handle, self.loop)

    async def run(
        self, argv: Sequence[str], *, bound: float = DEFAULT_TIMEOUT, **kwargs: Any
    ) -> RunOutcome:
        result = await self.on_loop(lambda: self.client.run(list(argv), **kwargs), bound, "run")
        return _outcome(result)

    async def call(self, method: str, *args: Any, timeout: float = DEFAULT_TIMEOUT) -> Any:
        return await self.on_loop(lambda: getattr(self.client, method)(*args), timeout, method)

    async def upload(self, path: str, local: str, progress: Progress) -> int:
        sent: int = await self.on_loop(
            lambda: self.client.upload(path, local, progress=progress), 60.0, "upload"
        )
        return sent

    async def download(self, path: str, local: str, progress: Progress) -> int:
        got: int = await self.on_loop(
            lambda: self.client.download(path, local, progress=progress), 60.0, "download"
        )
        return got

    @property
    def pending_request_count(self) -> int:
        return int(self.client.pending_request_count)

    @property
    def session_id(self) -> str | None:
        return self.client.session_id

    async def close(self) -> None:
        await self.on_loop(self.client.close, 30.0, "close")


# --- blocking --------------------------------------------------------------------------------


def in_thread(fn: Callable[[], T], timeout: float, what: str) -> Deferred[T]:
    """``fn()`` in a reactor pool thread; the Deferred is bounded by ``timeout``.

    (A timeout here leaves the thread blocked until the sync client's own
    bound, which the tests set below it.)
    """
    return with_timeout(deferToThread(fn), timeout, what)


class SyncProc(ProcAdapter):
    def __init__(self, handle: sync.Process) -> None:
        self.handle = handle
        self.process_id = handle.process_id
        self._iter: Any = None

    async def next_event(self, timeout: float = DEFAULT_TIMEOUT) -> OutputEvent | None:
        def step() -> OutputEvent | None:
            if self._iter is None:
                self._iter = self.handle.output(timeout=None)
            return next(self._iter, None)

        return await in_thread(step, timeout, "output")

    async def events(self, timeout: float = DEFAULT_TIMEOUT) -> list[OutputEvent]:
        # The blocking iterator is what a script uses: drain it in one thread.
        def drain() -> list[OutputEvent]:
            if self._iter is None:
                self._iter = self.handle.output(timeout=timeout)
            return list(self._iter)

        return await in_thread(drain, timeout + 1, "output")

    async def wait(self, timeout: float = DEFAULT_TIMEOUT) -> int | None:
        return await in_thread(lambda: self.handle.wait(timeout), timeout + 1, "exit")

    def _on(self, call: Callable[[], Any], timeout: float, what: str) -> Deferred[Any]:
        return in_thread(call, timeout, what)


class SyncClient(ClientAdapter):
    kind = "sync"

    def __init__(self, client: sync.Client) -> None:
        self.client = client

    @classmethod
    async def connect(cls, target: Target) -> ClientAdapter:
        from execserver import sync

        def dial() -> sync.Client:
            return sync.connect(
                target.url,
                server_command=stdio_command() if target.url is None else None,
                env=server_env() if target.url is None else None,
                token=target.token,
                connect_timeout=target.connect_timeout,
                call_timeout=target.call_timeout,
                resume=target.resume,
                session_ttl_ms=target.session_ttl_ms,
            )

        return cls(await in_thread(dial, 2 * DEFAULT_TIMEOUT + 1, "sync connect"))

    async def start(self, argv: Sequence[str], **kwargs: Any) -> ProcAdapter:
        handle = await in_thread(
            lambda: self.client.start(list(argv), **kwargs), DEFAULT_TIMEOUT + 1, "start"
        )
        return SyncProc(handle)

    async def run(
        self, argv: Sequence[str], *, bound: float = DEFAULT_TIMEOUT, **kwargs: Any
    ) -> RunOutcome:
        result = await in_thread(
            lambda: self.client.run(list(argv), **kwargs), bound + DEFAULT_TIMEOUT, "run"
        )
        return _outcome(result)

    async def call(self, method: str, *args: Any, timeout: float = DEFAULT_TIMEOUT) -> Any:
        return await in_thread(lambda: getattr(self.client, method)(*args), timeout + 1, method)

    async def upload(self, path: str, local: str, progress: Progress) -> int:
        return await in_thread(
            lambda: self.client.upload(path, local, progress=progress, timeout=60.0),
            61.0,
            "upload",
        )

    async def download(self, path: str, local: str, progress: Progress) -> int:
        return await in_thread(
            lambda: self.client.download(path, local, progress=progress, timeout=60.0),
            61.0,
            "download",
        )

    @property
    def pending_request_count(self) -> int:
        return int(self.client.aio.pending_request_count)

    @property
    def session_id(self) -> str | None:
        return self.client.session_id

    async def close(self) -> None:
        await in_thread(self.client.close, 31.0, "close")


def _outcome(result: Any) -> RunOutcome:
    return RunOutcome(
        result.stdout, result.stderr, result.exit_code, result.signal, result.timed_out
    )


def python(script: str) -> list[str]:
    return [sys.executable, "-c", script]


__all__ = [
    "KINDS",
    "ClientAdapter",
    "ExecServerError",
    "ProcAdapter",
    "RunOutcome",
    "Target",
    "connect",
    "python",
]
