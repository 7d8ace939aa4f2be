"""Seq bookkeeping of one process handle: ordered, at-most-once delivery.

Every ``process/output``, ``process/exited`` and ``process/closed`` of this
server carries a ``seq``; ``process/read`` returns retained output by seq
with ``exitedSeq``/``closedSeq`` saying where the exit and the close fall.
After a resumed session a handle receives both at once: live notifications
on the new connection and the catch-up reads from its last seq. This mixin
puts them back into one stream: in seq order, never twice, a
:class:`~execserver.clientcore.types.GapEvent` where the server dropped
output, exit and close in their place.

It is pure bookkeeping, shared by the Twisted handle
(:class:`execserver.client.process.RemoteProcess`) and the asyncio one
(:class:`execserver.aio.Process`); a subclass provides the delivery methods.
"""

from __future__ import annotations

from collections.abc import Callable

from execserver import protocol as p
from execserver.clientcore.types import ExitedParams, GapEvent, OutputEvent


class SeqOrdering:
    """Ordered, de-duplicated delivery of one process's events by seq.

    Subclasses implement :meth:`deliver_output`, :meth:`mark_exited` and
    :meth:`mark_closed`, and set ``has_exited`` / ``is_closed``.
    """

    process_id: str
    has_exited: bool
    is_closed: bool

    def _init_ordering(self) -> None:
        #: The highest seq delivered (output, exit or close): a resumed
        #: session is caught up from here, and nothing at or below it is
        #: delivered twice.
        self.last_seq = 0
        #: While catching up after a resume, live events wait here by seq.
        self._pending: dict[int, Callable[[], None]] | None = None
        #: ``(limitExceeded, limitValue)`` of its exit, when a resource limit
        #: ended or crippled it (docs/process-control.md, "Resource limits"):
        #: from ``process/exited`` or from a catch-up read, in every client.
        self.limit_exceeded: tuple[str, int | None] | None = None

    def note_limit(self, kind: object, value: object) -> None:
        """Keep the exit's ``limitExceeded`` (and ``limitValue``), if it has one."""
        if isinstance(kind, str):
            self.limit_exceeded = (kind, value if isinstance(value, int) else None)

    # --- what a subclass delivers ---------------------------------------------------

    def deliver_output(self, event: OutputEvent) -> None:
        raise NotImplementedError

    def mark_exited(
        self, exit_code: int | None, signal: str | None = None, timed_out: str | None = None
    ) -> None:
        raise NotImplementedError

    def mark_closed(self) -> None:
        raise NotImplementedError

    # --- live notifications -----------------------------------------------------------

    @property
    def catching_up(self) -> bool:
        return self._pending is not None

    def accept_output(self, event: OutputEvent) -> bool:
        """Deliver output in seq order, at most once; False if it was not (yet)."""
        seq = event.seq
        if seq is None:
            self.deliver_output(event)
            return True
        if seq <= self.last_seq:
            return False
        if self._pending is not None:
            self._pending.setdefault(seq, lambda: self.deliver_output(event))
            return False
        self.last_seq = seq
        self.deliver_output(event)
        return True

    # Exit and close happen once: they are de-duplicated by state, not by
    # seq (a server of the seed era numbered close like the last output).

    def accept_exit(
        self, seq: int | None, exit_code: int, signal: str | None, timed_out: str | None
    ) -> bool:
        if self.has_exited:
            return False
        if self._pending is not None and seq is not None:
            self._pending.setdefault(seq, lambda: self.mark_exited(exit_code, signal, timed_out))
            return False
        self.last_seq = max(self.last_seq, seq or 0)
        self.mark_exited(exit_code, signal, timed_out)
        return True

    def accept_exit_report(self, ex: ExitedParams) -> bool:
        """A ``process/exited`` notification: :meth:`accept_exit`, keeping the
        resource limit that ended or crippled the process."""
        self.note_limit(ex.limit_exceeded, ex.limit_value)
        return self.accept_exit(ex.seq, ex.exit_code, ex.signal, ex.timed_out)

    def accept_close(self, seq: int | None) -> bool:
        if self.is_closed:
            return False
        if self._pending is not None and seq is not None:
            self._pending.setdefault(seq, self.mark_closed)
            return False
        self.last_seq = max(self.last_seq, seq or 0)
        self.mark_closed()
        return True

    # --- catching up after a resume -----------------------------------------------------

    def begin_catch_up(self) -> None:
        """Live events wait until :meth:`end_catch_up`; reads fill in before them."""
        if self._pending is None:
            self._pending = {}

    def catch_up(self, read: p.ReadResponse) -> bool:
        """Deliver what a ``process/read`` after :attr:`last_seq` returned, in order.

        Returns True while more reads are needed.
        """
        events: list[tuple[int, Callable[[], None]]] = []
        gap = read.gap
        if isinstance(gap, p.SeqGap) and gap.to_seq > self.last_seq:
            low = max(gap.from_seq, self.last_seq + 1)
            event = GapEvent(self.process_id, "stdout", b"", low, low, gap.to_seq)
            events.append((gap.to_seq, lambda: self.deliver_output(event)))
        for chunk in read.chunks:
            out = OutputEvent(self.process_id, chunk.stream, chunk.chunk, chunk.seq)
            events.append((chunk.seq, lambda out=out: self.deliver_output(out)))  # type: ignore[misc]
        exited_seq = read.exited_seq
        if read.exited and isinstance(exited_seq, int):
            code = read.exit_code if read.exit_code is not None else -1
            signal = read.signal if isinstance(read.signal, str) else None
            timed_out = read.timed_out if isinstance(read.timed_out, str) else None
            self.note_limit(read.limit_exceeded, read.limit_value)
            events.append((exited_seq, lambda: self.mark_exited(code, signal, timed_out)))
        closed_seq = read.closed_seq
        if read.closed is True and isinstance(closed_seq, int):
            events.append((closed_seq, self.mark_closed))
        for seq, deliver in sorted(events, key=lambda e: e[0]):
            # Beyond nextSeq the read says nothing: exit and close wait for
            # the output before them (the next read brings it).
            if seq >= read.next_seq:
                break
            if seq > self.last_seq:
                self.last_seq = seq
                deliver()
        # Done once a read brings nothing new, or once the live events
        # waiting meanwhile continue right where the reads got to (a process
        # writing all the time would otherwise keep the catch-up reading).
        pending = self._pending
        return bool(read.chunks) and (pending is None or self.last_seq + 1 not in pending)

    def end_catch_up(self) -> None:
        """Deliver the live events that arrived meanwhile, in seq order."""
        pending, self._pending = self._pending, None
        for seq in sorted(pending or {}):
            if seq > self.last_seq:
                self.last_seq = seq
                pending[seq]()  # type: ignore[index]

    def abandon_catch_up(self) -> None:
        """Forget the live events held back (the handle is ending)."""
        self._pending = None
