"""Handles on processes started through a client.

A :class:`RemoteProcess` is created *before* ``process/start`` is sent, so
output that races the start response is not lost. It follows the server's
notifications only: ``terminate()`` asks the server to stop the process but
the handle is marked exited when ``process/exited`` arrives, never earlier
(as in the reference). If the connection is lost first, the handle is
marked exited with no exit code (``exit_code is None``).

Output is offered two ways:

- push: :meth:`RemoteProcess.add_output_listener` calls a function for every
  chunk, in order;
- pull: :meth:`RemoteProcess.subscribe` returns an :class:`OutputSubscription`
  (``await sub.next()`` or ``async for event in sub``) that buffers up to a
  byte limit and fails with :class:`OutputLagged` beyond it, naming the seq to
  catch up from with :meth:`RemoteProcess.read`.

Where the server dropped output (a resumed ``onDetachedFull: "drop"``
session), a subscription raises :class:`OutputGap` in its place and a
listener is not called (the gap is logged as an error and kept in
``gaps``), unless they asked for ``gaps=True``: then a :class:`GapEvent`.

Output received before the first listener or subscription is kept (up to
``backlog_bytes``) and replayed to it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from twisted.internet.defer import Deferred, fail, succeed
from twisted.logger import Logger

from execserver import protocol as p
from execserver.client.types import OutputEvent
from execserver.clientcore.errors import OutputGap
from execserver.clientcore.process import DEFAULT_BACKLOG_BYTES, Empty, OutputQueue, ProcessCore
from execserver.waiters import Latch

if TYPE_CHECKING:
    from execserver.client.api import ClientApi

log = Logger()

DEFAULT_SUBSCRIPTION_BYTES = 64 * 1024 * 1024


class OutputSubscription(OutputQueue):
    """A pull queue of one process's output events, from subscription on.

    The queue and its limit are :class:`~execserver.clientcore.process.OutputQueue`
    (shared with the asyncio client's ``OutputStream``).
    """

    def __init__(
        self,
        process_id: str,
        limit: int,
        on_cancel: Callable[[OutputSubscription], None],
        *,
        gaps: bool = False,
    ) -> None:
        super().__init__(process_id, limit, gaps=gaps)
        self._on_cancel = on_cancel
        self._waiter: Deferred[OutputEvent | None] | None = None

    def _wake(self) -> None:
        if self._waiter is None:
            return
        try:
            event = self.take()
        except Exception as error:
            waiter, self._waiter = self._waiter, None
            waiter.errback(error)
            return
        if not isinstance(event, Empty):
            waiter, self._waiter = self._waiter, None
            waiter.callback(event)

    def next(self) -> Deferred[OutputEvent | None]:
        """The next event, or None at the end of the output."""
        try:
            event = self.take()
        except Exception as error:
            return fail(error)
        if not isinstance(event, Empty):
            return succeed(event)
        if self._waiter is not None:
            raise RuntimeError("OutputSubscription.next() called while a call is pending")

        def cancel(_: Deferred[OutputEvent | None]) -> None:
            self._waiter = None

        self._waiter = Deferred(cancel)
        return self._waiter

    def cancel(self) -> None:
        """Stop receiving events (a pending ``next()`` returns None)."""
        self._on_cancel(self)
        self._stop()

    def __aiter__(self) -> OutputSubscription:
        return self

    async def __anext__(self) -> OutputEvent:
        event = await self.next()
        if event is None:
            raise StopAsyncIteration
        return event


class RemoteProcess(ProcessCore[OutputSubscription]):
    """A process started by a client, followed through its notifications.

    Seq-ordered, at-most-once delivery across a resumed session
    (``accept_*``, ``begin_catch_up``/``catch_up``/``end_catch_up``) is
    :class:`~execserver.clientcore.ordering.SeqOrdering`; output fan-out,
    the backlog and the exit/close state are
    :class:`~execserver.clientcore.process.ProcessCore`; both are shared
    with the asyncio client's handle.
    """

    def __init__(
        self, api: ClientApi, process_id: str, backlog_bytes: int = DEFAULT_BACKLOG_BYTES
    ) -> None:
        self._api = api
        self._exited: Latch[int | None] = Latch()
        self._closed: Latch[None] = Latch()
        self._init_process(process_id, backlog_bytes)

    def __repr__(self) -> str:
        state = f"exited {self.exit_code}" if self.has_exited else "running"
        return f"<RemoteProcess {self.process_id!r} {state}>"

    # --- hooks of ProcessCore ---------------------------------------------------

    def _fire_exited(self, exit_code: int | None) -> None:
        self._exited.fire(exit_code)

    def _fire_closed(self) -> None:
        self._closed.fire(None)

    def _backlog_overflow(self) -> None:
        log.warn(
            "output of {pid} exceeds the {limit}-byte backlog with no subscriber",
            pid=self.process_id,
            limit=self._backlog_limit,
        )

    def _listener_failed(self) -> None:
        log.failure("output listener of {pid} failed", pid=self.process_id)

    def _gap_unheard(self, error: OutputGap) -> None:
        log.error("{error} (an output listener without gaps=True was not told)", error=str(error))

    # --- output -----------------------------------------------------------------

    def subscribe(
        self, limit: int = DEFAULT_SUBSCRIPTION_BYTES, *, gaps: bool = False
    ) -> OutputSubscription:
        """A new pull queue of output events (the backlog first).

        Where the server dropped output, ``next()`` fails with
        :class:`~execserver.clientcore.errors.OutputGap` (the next call
        continues after the gap); with ``gaps=True`` a ``GapEvent`` comes
        in its place instead.
        """
        sub = OutputSubscription(self.process_id, limit, self._forget_queue, gaps=gaps)
        return self._add_queue(sub, fail_if_lost=False)

    #: The name the asyncio and blocking handles use for the same queue.
    output = subscribe

    # --- lifecycle ----------------------------------------------------------------

    def exited(self) -> Deferred[int | None]:
        """Fires with the exit code (None if the connection was lost first)."""
        return self._exited.wait()

    def closed(self) -> Deferred[None]:
        """Fires when no more output will arrive (``process/closed`` or connection loss)."""
        return self._closed.wait()

    # --- requests -----------------------------------------------------------------

    def write(self, chunk: bytes) -> Deferred[p.WriteResponse]:
        return self._api.write(self.process_id, chunk)

    def terminate(self, grace_ms: int | None = None) -> Deferred[p.TerminateResponse]:
        """Ask the server to terminate the process; ``exited`` fires on its notification."""
        return self._api.terminate(self.process_id, grace_ms=grace_ms)

    def read(
        self,
        after_seq: int | None = None,
        max_bytes: int | None = None,
        wait_ms: int | None = None,
    ) -> Deferred[p.ReadResponse]:
        return self._api.read(self.process_id, after_seq, max_bytes, wait_ms)

    def send_signal(self, signal: int | str) -> Deferred[p.SignalResponse]:
        return self._api.signal(self.process_id, signal)

    def resize(self, rows: int, cols: int) -> Deferred[p.Empty]:
        return self._api.resize(self.process_id, rows, cols)

    def close_stdin(self) -> Deferred[p.CloseStdinResponse]:
        return self._api.close_stdin(self.process_id)

    def wait(self, timeout_ms: int | None = None) -> Deferred[p.WaitResponse]:
        return self._api.wait(self.process_id, timeout_ms)
