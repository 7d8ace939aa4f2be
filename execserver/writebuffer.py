"""What a Twisted write buffer holds, and when it pushes back, in one place.

Flow control itself uses the public producer/consumer API: each transport
gets a streaming producer (``registerProducer``) that Twisted pauses above
the buffer's high-water mark and resumes once the buffer is empty. Three
figures have no public API, and this adapter is the only code that reads or
writes them:

- the bytes a ``FileDescriptor`` holds unsent (``dataBuffer``, ``offset``,
  ``_tempDataLen``): the fs reply budget (when a reply has left), the stdin
  bound of ``process/write``, and when a connection stops reading requests;
- the high-water mark itself: Twisted pauses a streaming producer when
  ``_isSendBufferFull()`` says so, which compares the buffer with
  ``bufferSize`` (64 KiB by default, less than one output notification).
  ``bufferSize`` is also the size of every socket read, and a 2 MiB read
  costs a 2 MiB string plus Autobahn's copies of it, so the mark is set by
  giving the descriptor its own ``_isSendBufferFull`` (checked below,
  :data:`HIGH_WATER_PROBLEM`), leaving reads at Twisted's size. Fallback:
  ``bufferSize`` itself (reads grow to the mark);
- the flag that makes Twisted resume a streaming producer once its buffer
  is empty (``producerPaused``), set by an :class:`Outbox` to hand Twisted
  one piece at a time;
- dropping what a closed descriptor still holds;
- ``StandardIO``'s writer (``_writer``), which holds its buffer.

:data:`PROBLEM` is None when ``FileDescriptor`` still keeps these fields as
relied on, checked at import (the service logs it as a warning otherwise);
``tests/test_writebuffer.py`` breaks if the unsent figure stops moving with
a real socket.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

from twisted.internet.abstract import FileDescriptor
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IPushProducer
from twisted.internet.stdio import StandardIO
from zope.interface import implementer

from execserver.private_api_checks import code_names, parameters

if TYPE_CHECKING:
    from typing_extensions import Buffer


def check_fields(cls: Any = FileDescriptor) -> str | None:
    """None if ``cls`` keeps its write buffer in the fields read here, else what changed."""
    names = ("dataBuffer", "offset", "bufferSize", "producerPaused", "streamingProducer")
    missing = [name for name in names if not hasattr(cls, name)]
    # (Set per instance, by the constructor.)
    made = code_names(getattr(cls, "__init__", None))
    missing += [name for name in ("_tempDataBuffer", "_tempDataLen") if name not in made]
    if missing:
        return f"FileDescriptor has no {', '.join(missing)}"
    if not hasattr(StandardIO, "_writer"):
        return "StandardIO keeps its writer elsewhere than _writer"
    return None


#: Why the unsent figure cannot be read with this Twisted, or None.
PROBLEM: Final = check_fields()


def unsent_bytes(writer: Any) -> int:
    """Bytes a Twisted FileDescriptor has accepted but not yet written.

    Includes what its :class:`Outbox` still queues for it (a transport that
    holds its Outbox asks :meth:`Outbox.unsent` instead of looking it up).
    """
    outbox = outbox_of(writer)
    return _buffered(writer) + (outbox.held if outbox is not None else 0)


def _buffered(writer: Any) -> int:
    """What Twisted's own buffer of ``writer`` holds unsent."""
    try:
        return int(len(writer.dataBuffer) - writer.offset + writer._tempDataLen)
    except AttributeError:
        return 0


def write_buffer_of(transport: Any) -> Any:
    """The FileDescriptor holding what ``transport`` has not yet sent.

    A TCP (or Unix, TLS) transport is its own; StandardIO's is its writer's.
    """
    return getattr(transport, "_writer", None) or transport


def check_high_water(cls: Any = FileDescriptor) -> str | None:
    """None if ``cls`` decides when to pause its producer in ``_isSendBufferFull()``."""
    if parameters(getattr(cls, "_isSendBufferFull", None)) != ["self"]:
        return "FileDescriptor has no _isSendBufferFull(self)"
    if "_isSendBufferFull" not in code_names(getattr(cls, "_maybePauseProducer", None)):
        return "FileDescriptor._maybePauseProducer does not ask _isSendBufferFull"
    return None


#: Why the high-water mark cannot be set apart from the read size, or None.
HIGH_WATER_PROBLEM: Final = check_high_water()


def _buffer_full_above(writer: Any, limit: int) -> Callable[[], bool]:
    # Weakly: the descriptor holds this function, which must not keep it alive.
    ref = weakref.ref(writer)

    def full() -> bool:
        fd = ref()
        return fd is not None and len(fd.dataBuffer) + fd._tempDataLen > limit

    return full


def set_high_water(transport: Any, limit: int, separate: bool | None = None) -> None:
    """Make the transport pause its producer once ``limit`` bytes are unsent.

    Twisted's FileDescriptor pauses a streaming producer above its mark and
    resumes it once its buffer is empty. For StandardIO the buffer is its
    writer's. The read size stays Twisted's (see the module docstring);
    ``separate=False`` (or :data:`HIGH_WATER_PROBLEM`) uses the fallback.
    """
    target = write_buffer_of(transport)
    if separate is None:
        separate = HIGH_WATER_PROBLEM is None
    if separate and isinstance(target, FileDescriptor):
        target._isSendBufferFull = _buffer_full_above(target, limit)  # type: ignore[method-assign]
    elif hasattr(target, "bufferSize"):
        target.bufferSize = limit


def discard_unsent(writer: Any) -> None:
    """Drop what a closed FileDescriptor still holds: it will never be sent.

    Twisted keeps a lost connection's buffer until the transport object is
    collected; a client that stopped reading can leave hundreds of MiB there.
    Does nothing while the descriptor is still connected.
    """
    if writer is None or getattr(writer, "connected", False):
        return
    outbox = outbox_of(writer)
    if outbox is not None:
        outbox.discard()
    if hasattr(writer, "dataBuffer"):
        writer.dataBuffer = b""
        writer.offset = 0
        writer._tempDataBuffer = []
        writer._tempDataLen = 0


# --- large messages, written as the transport drains ---------------------------

#: Messages of at least this many bytes go through an :class:`Outbox`: their
#: pieces reach Twisted's buffer a few at a time instead of all at once.
LARGE_MESSAGE_BYTES: Final = 1024 * 1024

#: Longest piece handed to Twisted in one write; a longer one is copied out
#: a slice of this size at a time.
WRITE_SLICE_BYTES: Final = 4 * 1024 * 1024

#: A piece that is not ``bytes`` (the rest of one the pipe took part of) is
#: copied out this much at a time: the copy exists beside the whole text.
VIEW_SLICE_BYTES: Final = 256 * 1024

#: Consecutive pieces up to this size are joined into one write (the
#: envelope around a result, a frame header).
SMALL_PIECE_BYTES: Final = 64 * 1024

_outboxes: weakref.WeakKeyDictionary[Any, Outbox] = weakref.WeakKeyDictionary()


def outbox_of(writer: Any) -> Outbox | None:
    """The :class:`Outbox` writing to ``writer``, if any."""
    try:
        return _outboxes.get(writer)
    except TypeError:  # None, or anything else that cannot be weakly referenced
        return None


@implementer(IPushProducer)
class Outbox:
    """Whole messages, written to a transport as fast as it drains, in order.

    Handing Twisted a large message at once makes it hold the message twice:
    ``FileDescriptor.doWrite`` joins everything queued into one buffer before
    sending it. An Outbox is the streaming producer registered on the
    transport, in front of the real one (``inner``: the session, or a
    WebSocket's backpressure): it writes a queued piece, pauses, and writes
    the next when Twisted resumes it (its buffer has drained), so Twisted
    holds one piece at a time. Only once the queue is empty is ``inner``
    resumed; every pause reaches ``inner`` at once.

    The pause after each write is one that Twisted ends once its buffer is
    empty (its ``producerPaused`` flag, which ``doWrite`` checks on
    draining; Twisted sets it itself above its high-water mark).
    Twisted joins what it holds into one buffer before sending
    (``doWrite``): a lone ``bytes`` is taken as is, two pieces would be
    copied into a third. Through TLS
    the writer is not a ``FileDescriptor`` and pieces go on until Twisted
    pauses this producer above the high-water mark.

    While anything is queued, every later message (small ones too) is queued
    behind it, so no message's bytes ever land inside another's. The queued
    bytes count as unsent (:func:`unsent_bytes` of ``writer``): the reply
    budget and the stalled-reader checks see them.
    """

    def __init__(
        self,
        transport: Any,
        writer: Any,
        inner: IPushProducer,
        slice_bytes: int = WRITE_SLICE_BYTES,
    ) -> None:
        self._transport = transport
        self._slice = slice_bytes
        self._writer = writer
        #: The producer paused and resumed through this one.
        self.inner = inner
        self._queue: deque[Buffer] = deque()
        #: Bytes queued here, not yet handed to the transport.
        self.held = 0
        self._paused = False
        self._drained: list[Deferred[None]] = []
        _outboxes[writer] = self

    @property
    def busy(self) -> bool:
        return bool(self._queue)

    def write(self, data: bytes) -> None:
        """Write one message's bytes (or a small message), after what is queued."""
        if self._queue:
            self._queue.append(data)
            self.held += len(data)
        else:
            self._transport.write(data)

    def unsent(self) -> int:
        """:func:`unsent_bytes` of the writer, without looking this Outbox up."""
        return _buffered(self._writer) + self.held

    def write_parts(self, parts: Sequence[Buffer], size: int | None = None) -> None:
        """Queue one message's pieces and write what the transport takes now.

        ``size``: their total, if the caller has counted it already.
        """
        if size is None:
            size = sum(memoryview(part).nbytes for part in parts)
        self._queue.extend(parts)
        self.held += size
        self._pump()

    def _pump(self) -> None:
        queue = self._queue
        while queue and not self._paused:
            data = self._next_write()
            self.held -= len(data)
            # May pause this producer at once (Twisted's buffer is full).
            self._transport.write(data)
            if queue and not self._paused:
                self._wait_for_drain()
        if not queue:
            self._fire_drained()

    def _next_write(self) -> bytes:
        """Take the next write off the queue: one piece, or small ones joined."""
        queue = self._queue
        piece = queue[0]
        size = memoryview(piece).nbytes
        if size <= SMALL_PIECE_BYTES and len(queue) > 1:
            small: list[Buffer] = []
            total = 0
            while queue and total + memoryview(queue[0]).nbytes <= SMALL_PIECE_BYTES:
                part = queue.popleft()
                small.append(part)
                total += memoryview(part).nbytes
            return b"".join(small)
        if type(piece) is bytes and size <= self._slice:
            queue.popleft()
            return piece
        view = memoryview(piece).cast("B")
        limit = self._slice if type(piece) is bytes else min(self._slice, VIEW_SLICE_BYTES)
        data = bytes(view[:limit])
        if len(view) > limit:
            queue[0] = view[limit:]
        else:
            queue.popleft()
        return data

    def _wait_for_drain(self) -> None:
        """Pause until Twisted's buffer is empty, if Twisted will say so."""
        writer = self._writer
        if (
            getattr(writer, "producer", None) is self
            and getattr(writer, "streamingProducer", False)
            and hasattr(writer, "producerPaused")
            and _buffered(writer) > 0
        ):
            # What Twisted's write does above its high-water mark.
            writer.producerPaused = True
            self.pauseProducing()

    def discard(self) -> None:
        """Drop what is queued: the connection is gone."""
        self._queue.clear()
        self.held = 0
        # The registry's value holds the transport: without this, the
        # transport (and what hangs off it) would never be freed.
        with contextlib.suppress(TypeError):
            _outboxes.pop(self._writer, None)
        self._fire_drained()

    def when_drained(self) -> Deferred[None]:
        """Fires once nothing is queued here (at once if nothing is)."""
        if not self._queue:
            return succeed(None)
        d: Deferred[None] = Deferred()
        self._drained.append(d)
        return d

    def _fire_drained(self) -> None:
        waiting, self._drained = self._drained, []
        for d in waiting:
            d.callback(None)

    # --- IPushProducer, called by the transport ---------------------------------

    def pauseProducing(self) -> None:
        self._paused = True
        self.inner.pauseProducing()

    def resumeProducing(self) -> None:
        self._paused = False
        self._pump()
        if not self._paused:
            self.inner.resumeProducing()

    def stopProducing(self) -> None:
        self.discard()
        self.inner.stopProducing()
