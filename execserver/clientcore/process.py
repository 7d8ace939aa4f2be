"""The sans-IO half of a process handle: output fan-out, backlog, exit and close state.

:class:`ProcessCore` is what the Twisted ``RemoteProcess`` and the asyncio
``Process`` share beyond seq ordering
(:class:`~execserver.clientcore.ordering.SeqOrdering`): the handle's state
(exit code, signal, timeout, closed, lost), output listeners, the pull
queues (:class:`OutputQueue`: a Twisted ``OutputSubscription``, an asyncio
``OutputStream``; all they need here is ``push``/``end``/``fail``), the backlog kept until the
first reader (bounded, its overflow reported to that reader as
:class:`~execserver.clientcore.errors.OutputLagged`), and marking the handle
exited and closed exactly once. How a waiter is woken (a ``Latch``, an
``asyncio.Event``) and how the handle logs are hooks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from typing import Final, Generic, Protocol, TypeVar

import attrs

from execserver.clientcore.errors import OutputGap, OutputLagged
from execserver.clientcore.ordering import SeqOrdering
from execserver.clientcore.types import GapEvent, OutputEvent
from execserver.retained import CHUNK_OVERHEAD_BYTES

DEFAULT_BACKLOG_BYTES = 16 * 1024 * 1024


class EventQueue(Protocol):
    """A reader's pull queue of output events."""

    def push(self, event: OutputEvent) -> None: ...

    def end(self) -> None: ...

    def fail(self, error: Exception) -> None: ...


class Empty:
    """Nothing queued yet (the reader has to wait)."""


#: :meth:`OutputQueue.take` when the reader has to wait.
EMPTY: Final = Empty()


class OutputQueue(ABC):
    """A reader's bounded queue of one process's output events (an :class:`EventQueue`).

    The Twisted ``OutputSubscription`` and the asyncio ``OutputStream`` are
    this queue with their own way to wait (:meth:`_wake`). It holds up to
    ``limit`` bytes of chunks; an event that would take it past the limit
    fails it with :class:`OutputLagged` (after the events already queued,
    naming the last of them as the seq to ``read()`` from), unless nothing
    is queued: then one event larger than the limit is not a lag, it is
    queued alone.

    A :class:`GapEvent` (output the server dropped) is taken as
    :class:`OutputGap` raised in its place, unless the reader asked for
    ``gaps``: a reader writing every event's chunk cannot lose output
    silently. Taking again continues after the gap.
    """

    def __init__(self, process_id: str, limit: int, *, gaps: bool = False) -> None:
        self.process_id = process_id
        self._limit = limit
        self._gaps = gaps
        self._queue: deque[OutputEvent] = deque()
        self._bytes = 0
        self._ended = False
        self._error: Exception | None = None

    @abstractmethod
    def _wake(self) -> None:
        """Something changed (an event, the end, an error): wake a waiting reader."""

    @property
    def buffered_bytes(self) -> int:
        return self._bytes

    def push(self, event: OutputEvent) -> None:
        if self._ended or self._error is not None:
            return
        if self._queue and self._bytes + len(event.chunk) > self._limit:
            self.fail(OutputLagged(self.process_id, self._queue[-1].seq, self._limit))
            return
        self._queue.append(event)
        self._bytes += len(event.chunk)
        self._wake()

    def end(self) -> None:
        """No more output: the reader gets the end once the queue is drained."""
        self._ended = True
        self._wake()

    def fail(self, error: Exception) -> None:
        """Stop taking events; the reader gets ``error`` once the queue is drained."""
        if self._error is None:
            self._error = error
            self._wake()

    def take(self) -> OutputEvent | Empty | None:
        """The next event; None at the end; :data:`EMPTY` if the reader has to
        wait; raises the queue's error once the events before it are taken."""
        if self._queue:
            event = self._queue.popleft()
            self._bytes -= len(event.chunk)
            if isinstance(event, GapEvent) and not self._gaps:
                raise event.error()
            return event
        if self._error is not None:
            raise self._error
        if self._ended:
            return None
        return EMPTY

    def _stop(self) -> None:
        """The reader leaves: buffered events dropped, a waiting read ends."""
        self._ended = True
        self._queue.clear()
        self._bytes = 0
        self._wake()


Q = TypeVar("Q", bound=EventQueue)


class ProcessCore(SeqOrdering, ABC, Generic[Q]):
    """One process's output and lifecycle bookkeeping; ``Q`` is the pull queue type."""

    def _init_process(self, process_id: str, backlog_bytes: int) -> None:
        self.process_id = process_id
        #: Left running by the client's close (``detach=True``).
        self.detach = False
        self.exit_code: int | None = None
        self.signal: str | None = None
        self.timed_out: str | None = None
        self.has_exited = False
        self.is_closed = False
        #: Why the handle ended without its exit (None: it did not).
        self.lost_reason: Exception | None = None
        #: Output bytes (with per-chunk overhead) not yet acknowledged ("pause").
        self.unacked_bytes = 0
        #: Output bytes delivered so far, by stream (what a gap follows).
        self.delivered_bytes: dict[str, int] = {"stdout": 0, "stderr": 0}
        #: Every gap in this handle's output so far (whoever read it).
        self.gaps: list[OutputGap] = []
        #: (listener, whether it takes GapEvents)
        self._listeners: list[tuple[Callable[[OutputEvent], None], bool]] = []
        self._queues: list[Q] = []
        self._backlog: list[OutputEvent] | None = []
        self._backlog_bytes = 0
        self._backlog_limit = backlog_bytes
        self._backlog_overflow_seq: int | None = None
        self._backlog_overflowed = False
        # last_seq and the events held back while catching up.
        self._init_ordering()

    # --- hooks ------------------------------------------------------------------------

    @abstractmethod
    def _fire_exited(self, exit_code: int | None) -> None:
        """Wake whoever waits for the exit."""

    @abstractmethod
    def _fire_closed(self) -> None:
        """Wake whoever waits for the end of the output."""

    @abstractmethod
    def _backlog_overflow(self) -> None:
        """Log that output with no reader went past the backlog limit."""

    @abstractmethod
    def _listener_failed(self) -> None:
        """Called inside ``except``: an output listener raised; log it with its traceback."""

    @abstractmethod
    def _gap_unheard(self, error: OutputGap) -> None:
        """Log (at error level) a gap that an output listener without ``gaps`` did not get."""

    # --- output -----------------------------------------------------------------------

    def add_output_listener(
        self, listener: Callable[[OutputEvent], None], *, gaps: bool = False
    ) -> None:
        """Call ``listener`` with every output event (the backlog first).

        A gap (output the server dropped) reaches it as a :class:`GapEvent`
        only with ``gaps=True``; otherwise it is logged as an error and kept
        in :attr:`gaps`.
        """
        self._listeners.append((listener, gaps))
        for event in self._take_backlog():
            self._call(listener, gaps, event)

    def remove_output_listener(self, listener: Callable[[OutputEvent], None]) -> None:
        self._listeners = [entry for entry in self._listeners if entry[0] is not listener]

    def _call(
        self, listener: Callable[[OutputEvent], None], gaps: bool, event: OutputEvent
    ) -> None:
        if isinstance(event, GapEvent) and not gaps:
            self._gap_unheard(event.error())
            return
        listener(event)

    def _add_queue(self, queue: Q, *, fail_if_lost: bool) -> Q:
        """Give ``queue`` the backlog (and its overflow), then every later event.

        ``fail_if_lost``: a handle that already ended without its exit fails
        the new queue with why, rather than just ending it.
        """
        overflowed = self._backlog_overflowed
        for event in self._take_backlog():
            queue.push(event)
        if overflowed:
            queue.fail(
                OutputLagged(self.process_id, self._backlog_overflow_seq, self._backlog_limit)
            )
        if fail_if_lost and self.lost_reason is not None:
            queue.fail(self.lost_reason)
        elif self.is_closed:
            queue.end()
        else:
            self._queues.append(queue)
        return queue

    def _forget_queue(self, queue: Q) -> None:
        if queue in self._queues:
            self._queues.remove(queue)

    def _take_backlog(self) -> list[OutputEvent]:
        backlog, self._backlog = self._backlog, None
        self._backlog_bytes = 0
        self._backlog_overflowed = False
        return backlog or []

    def deliver_output(self, event: OutputEvent) -> None:
        """Called by the client for each ``process/output`` of this process."""
        if isinstance(event, GapEvent):
            delivered = self.delivered_bytes
            if "pty" in delivered:  # a terminal has one stream
                delivered = {"pty": delivered["pty"]}
            event = attrs.evolve(
                event,
                stream="pty" if "pty" in delivered else event.stream,
                delivered=tuple(delivered.items()),
            )
            self.gaps.append(event.error())
        else:
            counts = self.delivered_bytes
            counts[event.stream] = counts.get(event.stream, 0) + len(event.chunk)
        if self._backlog is not None:
            if self._backlog_overflowed:
                return
            if self._backlog_bytes + len(event.chunk) > self._backlog_limit:
                # Reported to the first reader, who can read() from here.
                self._backlog_overflowed = True
                self._backlog_overflow_seq = self._backlog[-1].seq if self._backlog else None
                self._backlog_overflow()
                return
            self._backlog.append(event)
            self._backlog_bytes += len(event.chunk)
            return
        for listener, gaps in list(self._listeners):
            try:
                self._call(listener, gaps, event)
            except Exception:
                self._listener_failed()
        for queue in list(self._queues):
            queue.push(event)

    # --- acknowledging ("pause") -------------------------------------------------------

    def ack_due(self, size: int, retention: int, *, now: bool = False) -> bool:
        """Count ``size`` more output bytes delivered unacknowledged, as the
        server counts them against its ``retention`` (each chunk with its
        overhead); True, and the count starts again, once an acknowledgement
        is due: at a quarter of the retention (a "pause" server stops reading
        a child whose unacknowledged output fills it), or ``now``."""
        self.unacked_bytes += size + CHUNK_OVERHEAD_BYTES
        if self.unacked_bytes * 4 < retention and not now:
            return False
        self.unacked_bytes = 0
        return True

    # --- lifecycle --------------------------------------------------------------------

    def mark_exited(
        self, exit_code: int | None, signal: str | None = None, timed_out: str | None = None
    ) -> None:
        if self.has_exited:
            return
        self.has_exited = True
        self.exit_code = exit_code
        self.signal = signal
        self.timed_out = timed_out
        self._fire_exited(exit_code)

    def mark_closed(self) -> None:
        if self.is_closed:
            return
        self.is_closed = True
        queues, self._queues = self._queues, []
        for queue in queues:
            queue.end()
        self._fire_closed()

    def connection_lost(self) -> None:
        """The connection is gone for good: exited without an exit code, and closed."""
        self.mark_exited(None)
        self.mark_closed()

    def fail(self, error: Exception) -> None:
        """The process is out of reach (its session is lost): end the handle with ``error``."""
        self.abandon_catch_up()
        self.lost_reason = error
        for queue in list(self._queues):
            queue.fail(error)
        self.connection_lost()
