"""Newline-delimited JSON-RPC over the server's own stdin and stdout."""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

from twisted.application.service import Service
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import (
    IDelayedCall,
    IHalfCloseableProtocol,
    IReactorCore,
    IReactorTime,
)
from twisted.internet.main import CONNECTION_DONE, CONNECTION_LOST
from twisted.internet.process import ProcessReader, ProcessWriter
from twisted.internet.protocol import Protocol
from twisted.internet.stdio import StandardIO
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from execserver import writebuffer
from execserver.codec import (
    LONG_MESSAGE_BYTES,
    SPARE_KEEP_SECONDS,
    Framed,
    LineFramer,
    Oversized,
)
from execserver.dispatcher import Connection, Dispatcher
from execserver.fdreads import read_into
from execserver.waiters import Latch
from execserver.writebuffer import LARGE_MESSAGE_BYTES, Outbox, set_high_water, unsent_bytes

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = Logger()

#: Seconds beyond the terminate grace that a stop waits for stdout to flush.
FLUSH_SLACK_SECONDS: Final = 2.0

#: Messages at least this large are written straight to an idle pipe (see
#: ``LineProtocol.write_message``); smaller ones are gathered per read (and
#: the gathering written straight to an idle pipe too) or go through the queue.
DIRECT_WRITE_BYTES: Final = 16 * 1024


@implementer(IHalfCloseableProtocol)
class LineProtocol(Protocol):
    """NDJSON framing in front of a dispatcher :class:`Connection`.

    Used for the server's stdio, and usable over any byte stream.
    """

    #: A line stream is the server's one connection: its session cannot
    #: outlive it, so initialize grants no sessionTtlMs here.
    resumable = False

    def __init__(self, dispatcher: Dispatcher, label: str = "stdio") -> None:
        self._dispatcher = dispatcher
        self._label = label
        self._framer = LineFramer(
            dispatcher.config.max_message_bytes,
            LONG_MESSAGE_BYTES,
            sink_factory=getattr(dispatcher, "long_line_sink", None),
        )
        self.connection: Connection | None = None
        self._finishing = False
        self._write_lost = False
        self._lost = False
        self._closed: Latch[None] = Latch()
        self.on_closed: Callable[[], None] | None = None
        self._pipe_writer: Any = None
        self._batch: list[bytes] | None = None
        self._outbox: Outbox | None = None
        #: Releases the framer's spare mapping a while after a long line.
        self._spare_release: IDelayedCall | None = None
        self._spares_seen = 0

    @property
    def _transport(self) -> Any:
        return self.transport

    def connectionMade(self) -> None:
        self.connection = self._dispatcher.connect(self, self._label)
        reader = getattr(self.transport, "_reader", None)
        if isinstance(reader, ProcessReader):
            read_large(reader, self)
        writer = getattr(self.transport, "_writer", None)
        if isinstance(writer, ProcessWriter):
            self._pipe_writer = writer
        set_high_water(self.transport, self._dispatcher.config.output_high_water_bytes)
        # Large messages are fed to the pipe as it drains (see Outbox); the
        # session is paused and resumed through it.
        self._outbox = Outbox(self.transport, writer or self.transport, self.connection.session)
        self._transport.registerProducer(self._outbox, True)

    def dataReceived(self, data: bytes) -> None:
        self._received(self._framer.feed, data)

    def _received(self, frame: Callable[[Any], list[Framed]], read: object) -> None:
        """Deliver what ``frame(read)`` (a framer's feed or filled) hands over."""
        # Small messages sent while this read is handled (typically the
        # answers to the requests in it) are gathered and written at once:
        # one write instead of one per message.
        self._batch = []
        try:
            self._deliver(frame(read))
        finally:
            self._flush_batch()
            self._batch = None
        if self._framer.spare.kept != self._spares_seen:
            self._keep_spare_a_while()

    def _keep_spare_a_while(self) -> None:
        """A long line ended: its mapping is released unless another begins soon."""
        self._spares_seen = self._framer.spare.kept
        release = self._spare_release
        if release is not None and release.active():
            release.reset(SPARE_KEEP_SECONDS)
        else:
            self._spare_release = self._dispatcher.clock.callLater(
                SPARE_KEEP_SECONDS, self._framer.spare.release
            )

    def read_target(self, size: int) -> memoryview | None:
        """Where the next read of stdin may go (see :func:`read_large`)."""
        return self._framer.read_target(size)

    def filled(self, size: int) -> None:
        """``size`` bytes were read into :meth:`read_target`'s view: as dataReceived."""
        self._received(self._framer.filled, size)

    def _flush_batch(self) -> None:
        batch = self._batch
        if batch:
            self._batch = []
            data = b"".join(batch)
            if self._pipe_idle():
                # Straight to the pipe, as large messages go: through the
                # transport it would wait for the reactor's next turn (a
                # writable event, and the pipe registered and unregistered
                # for it). Only what the pipe does not take is queued.
                try:
                    written = os.write(self._pipe_writer.fileno(), data)
                except OSError:
                    written = 0  # BlockingIOError, or an error the transport reports
                if written == len(data):
                    return
                data = data[written:]
            self._write(data)

    def _write(self, data: bytes) -> None:
        if self._outbox is not None:
            self._outbox.write(data)  # behind a large message still being sent
        else:
            self._transport.write(data)

    def _deliver(self, items: list[Framed]) -> None:
        conn = self.connection
        assert conn is not None
        for item in items:
            if isinstance(item, Oversized):
                conn.oversized_message()
            else:
                conn.message_received(item)

    # --- Outbound -----------------------------------------------------------------

    def write_message_parts(self, parts: Sequence[Buffer]) -> None:
        """Send one message given as consecutive pieces, without joining them.

        When nothing is queued, the pieces (and the newline) go to the pipe at
        once with one ``writev``: no copy, no wait for the reactor. Only what
        the pipe does not take is queued, copied into bytes where Twisted's
        queue needs them; the rest of a large message (an ``fs/readFile``
        result sent around its envelope) waits in the :class:`Outbox`, which
        feeds it to the pipe as it drains. Used for every large message
        (output notifications too).
        """
        self._flush_batch()  # keep order: what was gathered goes first
        pieces: list[Buffer] = [*parts, b"\n"]
        outbox = self._outbox
        if outbox is not None and outbox.busy:
            outbox.write_parts(pieces)
            return
        if self._pipe_idle():
            try:
                written = os.writev(self._pipe_writer.fileno(), pieces)
            except OSError:
                written = 0  # BlockingIOError, or an error the transport reports
            rest: list[Buffer] = []
            for piece in pieces:
                size = memoryview(piece).nbytes
                if written >= size:
                    written -= size
                    continue
                rest.append(memoryview(piece)[written:] if written else piece)
                written = 0
            pieces = rest
        if outbox is not None and sum(memoryview(p).nbytes for p in pieces) >= LARGE_MESSAGE_BYTES:
            outbox.write_parts(pieces)
        elif pieces:
            self._transport.writeSequence(
                [piece if type(piece) is bytes else bytes(piece) for piece in pieces]
            )

    def _pipe_idle(self) -> bool:
        """Nothing is queued for the pipe (here or in Twisted): a write now keeps order."""
        writer = self._pipe_writer
        return bool(
            writer is not None
            and writer.connected
            and not writer.disconnecting
            and not (self._outbox is not None and self._outbox.busy)
            and unsent_bytes(writer) == 0
        )

    def write_message(self, data: bytes) -> None:
        if len(data) >= DIRECT_WRITE_BYTES:
            self.write_message_parts((data,))
            return
        if self._batch is not None:
            # Small messages sent while one read is handled leave together.
            self._batch += (data, b"\n")
            return
        # One concatenation is cheaper than writeSequence's bookkeeping.
        self._write(data + b"\n")

    def close_connection(self) -> None:
        self._flush_batch()
        self._finish()

    def unsent_bytes(self) -> int:
        return writebuffer.unsent_bytes(writebuffer.write_buffer_of(self.transport))

    def discard_unsent(self) -> None:
        writebuffer.discard_unsent(writebuffer.write_buffer_of(self.transport))

    # --- end of input / output ----------------------------------------------------

    def readConnectionLost(self) -> None:
        # Input is over: answer what was received, stop every process, flush
        # and close.
        self._deliver(self._framer.finish())
        self._finish()

    def writeConnectionLost(self) -> None:
        # Nobody reads our output any more: behave as a disconnect.
        self._write_lost = True
        if self.connection is not None:
            self.connection.transport_closed()
        self._finish()

    def _finish(self) -> None:
        if self._finishing or self.connection is None:
            return
        self._finishing = True
        d = self.connection.shutdown()

        def drained(_: object) -> Deferred[None]:
            # Close only once a large message still queued has been written
            # (loseConnection flushes Twisted's buffer, not the Outbox).
            if self._outbox is None or self._write_lost:
                return succeed(None)
            return self._outbox.when_drained()

        def close(_: object) -> None:
            self._transport.unregisterProducer()
            self._transport.loseConnection()
            if self._write_lost:
                # StandardIO reports connectionLost only when its writer closes
                # after loseConnection; ours is already gone, and loseConnection
                # merely stops reading stdin, so without this the server would
                # wait forever, deaf even to stdin EOF.
                self.connectionLost(None)

        d.addBoth(drained)
        d.addBoth(close)
        d.addErrback(lambda f: log.failure("closing {label} failed", f, label=self._label))

    def connectionLost(self, reason: Failure | None = None) -> None:
        conn = self.connection
        if conn is None or self._lost:
            return
        self._lost = True
        # A line cut off here ends its streamed decode (thread and file) now.
        self._framer.discard()
        self._framer.spare.release()
        if self._spare_release is not None and self._spare_release.active():
            self._spare_release.cancel()
        if self._outbox is not None:
            self._outbox.discard()
        conn.transport_closed()
        conn.shutdown().addBoth(self._ended)

    def _ended(self, _: object) -> None:
        if self.on_closed is not None:
            self.on_closed()
        self._closed.fire(None)

    def when_closed(self) -> Deferred[None]:
        """Fires once the connection is closed and its session has ended."""
        return self._closed.wait()


#: What one wakeup reads from stdin once a read has filled the smaller
#: size, and the capacity asked for the stdin pipe. Twisted's reader takes
#: 8 KiB per wakeup: an 8 MiB ``fs/writeFile`` range (11 MiB of text) took
#: 1,400 reactor turns, and ``fs put`` ran at about half ``fs get``'s speed
#: (the client reads the server's stdout 1 MiB at a time). 256 KiB (a
#: child's pipe reads too) cost as little CPU as 1 MiB here.
STDIN_READ_BYTES: Final = 256 * 1024
#: What a wakeup reads while requests are small: below malloc's mmap
#: threshold, so a small request does not cost a 1 MiB mapping per read.
STDIN_SMALL_READ_BYTES: Final = 64 * 1024


def read_large(reader: ProcessReader, lines: LineProtocol | None = None) -> None:
    """Make StandardIO's stdin reader read up to :data:`STDIN_READ_BYTES` per wakeup.

    Replaces the reader's ``doRead`` on this instance (the reactor calls
    it): reads of :data:`STDIN_SMALL_READ_BYTES`, and of
    :data:`STDIN_READ_BYTES` after a read that filled that, until one
    comes back smaller again. End of input and errors are reported as Twisted's
    reader reports them. The stdin pipe (if it is one) is grown to match.

    With ``lines``, while a long line is being gathered in its mapping,
    each read goes straight into the mapping's tail (``readv``: no
    256 KiB object a read and no copy of it; 22 MiB for a 16 MiB
    ``fs/writeFile``), and ``lines`` is told how much came.
    """
    fd = reader.fd
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, STDIN_READ_BYTES)
    size = STDIN_SMALL_READ_BYTES

    def deliver(data: bytes) -> None:
        nonlocal size
        size = STDIN_READ_BYTES if len(data) >= STDIN_SMALL_READ_BYTES else STDIN_SMALL_READ_BYTES
        reader.dataReceived(data)

    def do_read() -> object:
        target = lines.read_target(STDIN_READ_BYTES) if lines is not None else None
        if target is None:
            # The read a child's pipes get (fdreads.py), at this size.
            return read_into(fd, deliver, size)
        try:
            count = os.readv(fd, [target])
        except BlockingIOError:
            return None
        except OSError:
            return CONNECTION_LOST
        finally:
            target.release()
        if not count:
            return CONNECTION_DONE
        assert lines is not None
        lines.filled(count)
        return None

    setattr(reader, "doRead", do_read)  # noqa: B010 (an instance attribute over the method)


_protocol_out: int | None = None


def guard_stdout() -> int:
    """Keep fd 1 for protocol messages only; return the descriptor they go to.

    fd 1 is moved to a private descriptor and replaced by stderr, and
    ``sys.stdout`` becomes ``sys.stderr``, so a stray write (a log line, a
    library's print) lands on stderr. Process-wide and done once.
    """
    global _protocol_out
    if _protocol_out is None:
        _protocol_out = os.dup(1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr
    return _protocol_out


class StdioService(Service):
    """Serves one connection on the process's stdin/stdout.

    stdout is reserved for protocol messages: when the service starts, fd 1
    is moved to a private descriptor and replaced by stderr, so any stray
    write to ``sys.stdout`` or fd 1 (a log line, a library's print) lands on
    stderr instead of corrupting the JSON stream (``guard_stdout=False``,
    ``--no-stdout-guard``, leaves them alone). When the connection ends, the
    server stops.
    """

    def __init__(
        self, dispatcher: Dispatcher, reactor: IReactorCore, guard_stdout: bool = True
    ) -> None:
        self._dispatcher = dispatcher
        self._reactor = reactor
        self._guard_stdout = guard_stdout
        self._protocol_out = 1
        self.protocol: LineProtocol | None = None
        self._stopping = False

    def startService(self) -> None:
        super().startService()
        if self._guard_stdout:
            # Process-wide: only once the server starts, never when built
            # (twistd's makeService guards earlier, before twistd logs).
            self._protocol_out = guard_stdout()
        proto = LineProtocol(self._dispatcher, "stdio")
        proto.on_closed = self._connection_ended
        self.protocol = proto
        # (mypy sees the Windows StandardIO signature.)
        StandardIO(  # type: ignore[call-arg]
            proto, stdin=0, stdout=self._protocol_out, reactor=self._reactor
        )

    def stopService(self) -> Deferred[None] | None:
        super().stopService()
        proto = self.protocol
        if proto is None:
            return None
        self._stopping = True
        # Stopped from outside (SIGTERM): end the session as stdin EOF does, so
        # exit notifications and answers to requests in flight are flushed
        # before the reactor stops (it would drop them). A client that no
        # longer reads must not hold the server up: give up once the
        # processes' grace and some slack have passed.
        proto.close_connection()
        limit = self._dispatcher.config.terminate_grace_ms / 1000.0 + FLUSH_SLACK_SECONDS
        d = proto.when_closed()
        d.addTimeout(limit, IReactorTime(self._reactor), onTimeoutCancel=lambda r, t: None)
        return d

    def _connection_ended(self) -> None:
        # While the service is being stopped the reactor is already stopping.
        if self._reactor.running and not self._stopping:
            self._reactor.stop()
