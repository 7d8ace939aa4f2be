"""Handles on processes started through the asyncio client.

A :class:`Process` is registered *before* ``process/start`` is sent, so
output racing the start response is kept. It follows the server's
notifications: ``terminate()`` asks the server to stop the process, the
handle is marked exited when ``process/exited`` arrives (as in the
reference and the Twisted client). If the connection is lost and the session
cannot be resumed, the handle is marked exited with no exit code
(``wait()`` returns None; ``lost_reason`` holds why).

Output, in seq order and never twice (also across a resumed session):

- ``async for event in proc.output()``: an :class:`OutputStream` buffering up
  to ``limit`` bytes (64 MiB); a consumer that falls further behind gets
  :class:`~execserver.clientcore.errors.OutputLagged` after the buffered
  events, naming the ``after_seq`` to ``read()`` from -- never a silent gap
  and never unbounded memory; where the server dropped output it raises
  :class:`~execserver.clientcore.errors.OutputGap` naming the lost seqs
  (``output(gaps=True)``: a ``GapEvent`` in its place);
- ``add_output_listener(fn)``: a function called for every event (a gap
  only with ``gaps=True``; otherwise logged as an error, kept in ``gaps``).

Output that arrives before the first ``output()`` or listener is kept (up to
16 MiB) and replayed to it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from execserver import protocol as p
from execserver.clientcore.errors import OutputGap
from execserver.clientcore.process import DEFAULT_BACKLOG_BYTES, Empty, OutputQueue, ProcessCore
from execserver.clientcore.types import OutputEvent

if TYPE_CHECKING:
    from execserver.aio.client import Client

log = logging.getLogger("execserver.aio")

DEFAULT_OUTPUT_LIMIT = 64 * 1024 * 1024


class OutputStream(OutputQueue):
    """A bounded queue of one process's output events; an async iterator.

    Ends (``StopAsyncIteration``) once the process's output is closed and
    the queue drained; raises the handle's error (``OutputLagged``,
    ``SessionLost``) once the events before it are consumed. The queue and
    its limit are :class:`~execserver.clientcore.process.OutputQueue`.
    """

    def __init__(
        self,
        process_id: str,
        limit: int,
        on_cancel: Callable[[OutputStream], None],
        *,
        gaps: bool = False,
    ) -> None:
        super().__init__(process_id, limit, gaps=gaps)
        self._on_cancel = on_cancel
        self._waiter: asyncio.Future[None] | None = None

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        """Stop receiving events (the buffered ones are dropped)."""
        self._on_cancel(self)
        self._stop()

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> OutputEvent:
        while True:
            event = self.take()
            if event is None:
                raise StopAsyncIteration
            if not isinstance(event, Empty):
                return event
            if self._waiter is not None:
                raise RuntimeError("OutputStream is already being iterated")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


class Process(ProcessCore[OutputStream]):
    """A process started by :class:`~execserver.aio.Client`, followed through its notifications.

    Output fan-out, the backlog and the exit/close state are
    :class:`~execserver.clientcore.process.ProcessCore`, shared with the
    Twisted client's handle.
    """

    def __init__(
        self,
        client: Client,
        process_id: str,
        *,
        detach: bool = False,
        backlog_bytes: int = DEFAULT_BACKLOG_BYTES,
    ) -> None:
        self._client = client
        self._exited = asyncio.Event()
        self._closed = asyncio.Event()
        self._init_process(process_id, backlog_bytes)
        self.detach = detach

    def __repr__(self) -> str:
        state = f"exited {self.exit_code}" if self.has_exited else "running"
        return f"<aio.Process {self.process_id!r} {state}>"

    # --- hooks of ProcessCore -------------------------------------------------------

    def _fire_exited(self, exit_code: int | None) -> None:
        self._exited.set()

    def _fire_closed(self) -> None:
        self._closed.set()

    def _backlog_overflow(self) -> None:
        log.warning(
            "output of %s exceeds the %d-byte backlog with no reader",
            self.process_id,
            self._backlog_limit,
        )

    def _listener_failed(self) -> None:
        log.exception("output listener of %s failed", self.process_id)

    def _gap_unheard(self, error: OutputGap) -> None:
        log.error("%s (an output listener without gaps=True was not told)", error)

    # --- output -------------------------------------------------------------------

    def output(self, limit: int = DEFAULT_OUTPUT_LIMIT, *, gaps: bool = False) -> OutputStream:
        """A new stream of output events (the backlog first); ``async for`` it.

        Where the server dropped output, the iteration raises
        :class:`~execserver.clientcore.errors.OutputGap` (iterating again
        continues after the gap); with ``gaps=True`` a ``GapEvent`` comes in
        its place instead.
        """
        stream = OutputStream(self.process_id, limit, self._forget_queue, gaps=gaps)
        return self._add_queue(stream, fail_if_lost=True)

    # --- lifecycle ------------------------------------------------------------------

    def connection_lost(self) -> None:
        """The connection is gone for good: exited without an exit code, and closed."""
        self.abandon_catch_up()
        super().connection_lost()

    async def wait(self, timeout: float | None = None) -> int | None:
        """The exit code once ``process/exited`` arrived (128+N: died of signal N,
        ``signal`` names it); None if the connection was lost first.
        Raises ``TimeoutError`` after ``timeout`` seconds (the process keeps running)."""
        if not self.has_exited:
            async with asyncio.timeout(timeout):
                await self._exited.wait()
        return self.exit_code

    #: The one name every handle gives it (the Twisted handle's): ``wait``
    #: stays, as an alias.
    exited = wait

    async def closed(self, timeout: float | None = None) -> None:
        """Until no more output will arrive (``process/closed``, or the end of the handle)."""
        if not self.is_closed:
            async with asyncio.timeout(timeout):
                await self._closed.wait()

    # --- requests -------------------------------------------------------------------

    async def write(self, data: bytes) -> p.WriteResponse:
        """Bytes to the process's stdin (PTY, or started with ``pipe_stdin=True``)."""
        return await self._client.write(self.process_id, data)

    async def close_stdin(self) -> p.CloseStdinResponse:
        return await self._client.close_stdin(self.process_id)

    async def send_signal(self, sig: int | str) -> p.SignalResponse:
        """``process/signal``: a name (``"SIGINT"``, ``"INT"``) or a number."""
        return await self._client.signal(self.process_id, sig)

    async def resize(self, rows: int, cols: int) -> p.Empty:
        return await self._client.resize(self.process_id, rows, cols)

    async def terminate(self, grace_ms: int | None = None) -> p.TerminateResponse:
        """Ask the server to terminate the process tree (SIGTERM, SIGKILL after
        ``grace_ms``); ``wait()`` returns once ``process/exited`` arrives."""
        return await self._client.terminate(self.process_id, grace_ms)

    async def read(
        self,
        after_seq: int | None = None,
        max_bytes: int | None = None,
        wait_ms: int | None = None,
    ) -> p.ReadResponse:
        return await self._client.read(self.process_id, after_seq, max_bytes, wait_ms)
