"""Where the ``exec-server`` script's log lines go: stderr, without ever blocking the reactor.

A server whose stderr is a pipe nobody reads (a supervisor that only reads
stdout) must keep answering. :class:`StderrSink` hands each formatted line to
one writer thread through a bounded queue (:data:`SINK_CAPACITY_BYTES`): the
reactor never waits on fd 2, and a line that finds the queue full is dropped
and counted. Once the writer has caught up, one line says how many messages
were dropped. The descriptor itself is left as it is (no ``O_NONBLOCK``,
which would change the open file description the server shares with its
parent and its siblings).

Two more rules keep the log readable and small under abuse:

- :class:`RepeatLimiter`: a line of the same kind (namespace and format)
  is written at most ``burst`` times per ``interval``; the rest are counted
  and one summary line says how many were left out.
- :func:`format_event`: one event's text (a traceback included) is cut to
  :data:`EVENT_TEXT_LIMIT` characters, head and tail kept.
"""

from __future__ import annotations

import io
import os
import select
import stat
import threading
from collections import deque
from collections.abc import Hashable
from typing import IO, Any, cast

from attrs import define, field
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import (
    FileLogObserver,
    FilteringLogObserver,
    ILogObserver,
    LogLevel,
    LogLevelFilterPredicate,
    formatEventAsClassicLogText,
)
from zope.interface import implementer

#: Formatted log text waiting for the writer thread, at most.
SINK_CAPACITY_BYTES = 1 << 20

#: One event's text (message and traceback), at most; longer text keeps
#: its head and tail.
EVENT_TEXT_LIMIT = 16 * 1024

#: Lines of one kind written per window before the rest are only counted.
REPEAT_BURST = 5
#: The window of :data:`REPEAT_BURST`, in seconds.
REPEAT_INTERVAL_SECONDS = 10.0

#: Windows remembered at most (one per kind of line seen in the last interval).
_MAX_WINDOWS = 1024


class StderrSink:
    """A file-like object whose ``write`` never blocks: one thread writes to ``fd``.

    ``write`` queues the text (or drops it, counted, when
    ``capacity`` bytes are already queued). The thread writes what is
    queued; when it has written everything and lines were dropped meanwhile,
    it writes ``exec-server: N log messages dropped (stderr was not read)``
    (or, when more lines come first, writes that line before them).
    """

    def __init__(self, fd: int = 2, capacity: int = SINK_CAPACITY_BYTES) -> None:
        self._fd = fd
        self._capacity = capacity
        self._lock = threading.Condition()
        self._pending: deque[bytes] = deque()
        self._pending_bytes = 0
        self._dropped = 0
        self._writing = False
        self._thread: threading.Thread | None = None
        #: Messages dropped since the sink was made.
        self.dropped_total = 0
        self._poll = select.poll()
        self._poll.register(fd, select.POLLOUT)
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            mode = 0
        self._inline = stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISREG(mode)

    def write(self, text: str) -> None:
        data = text.encode("utf-8", "backslashreplace")
        with self._lock:
            if self._write_now(data):
                return
            if self._pending_bytes + len(data) > self._capacity:
                self._dropped += 1
                self.dropped_total += 1
                return
            if self._dropped:
                # The writer has caught up since: say what is missing, in order.
                self._pending.append(dropped_notice(self._dropped))
                self._dropped = 0
            self._pending.append(data)
            self._pending_bytes += len(data)
            self._start_thread()

    def flush(self) -> None:
        """Nothing to do: the writer thread writes as soon as it can."""

    def _write_now(self, data: bytes) -> bool:
        """Write ``data`` at once when that cannot block; True if it was written.

        Only with nothing queued (order is kept), at most ``PIPE_BUF`` bytes,
        on a pipe, socket or regular file that polls writable: a pipe then
        has a free page, so the write completes without waiting. (A
        terminal may still stall a writer: its lines always go through the
        thread.)
        """
        if not self._inline or self._pending or self._writing or self._dropped:
            return False
        if len(data) > select.PIPE_BUF:
            return False
        try:
            if not self._poll.poll(0):
                return False
            written = os.write(self._fd, data)
        except OSError:
            return False
        if written < len(data):
            # (Not expected after POLLOUT; the rest goes through the thread.)
            rest = data[written:]
            self._pending.append(rest)
            self._pending_bytes += len(rest)
            self._start_thread()
        return True

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="exec-server stderr", daemon=True
            )
            self._thread.start()
        self._lock.notify()

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the queue to be written; True if it was."""
        with self._lock:
            return self._lock.wait_for(
                lambda: not self._pending and not self._writing and not self._dropped, timeout
            )

    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: bool(self._pending or self._dropped))
                if self._pending:
                    data = self._pending.popleft()
                    self._pending_bytes -= len(data)
                else:
                    data = dropped_notice(self._dropped)
                    self._dropped = 0
                self._writing = True
            try:
                _write_all(self._fd, data)
            except OSError:
                # stderr is gone (closed, EPIPE): nothing more can be said there.
                with self._lock:
                    self._pending.clear()
                    self._pending_bytes = 0
                    self._dropped = 0
                    self._writing = False
                    self._lock.notify_all()
                return
            with self._lock:
                self._writing = False
                self._lock.notify_all()


class SinkStream(io.TextIOBase):
    """``sys.stderr`` for the script: every write goes through the sink, in order.

    Prints (the ``listening on`` lines, the terminal hint, a stray write that
    the stdio guard sends to stderr) and log lines then share one queue: no
    print can block the reactor, and none lands in the middle of a log line.
    """

    def __init__(self, sink: StderrSink, fd: int = 2) -> None:
        super().__init__()
        self._sink = sink
        self._fd = fd
        #: Text after the last newline, sent with the line it belongs to.
        self._partial = ""

    def write(self, text: str) -> int:
        pending = self._partial + text
        end = pending.rfind("\n") + 1
        self._partial = pending[end:]
        if end:
            self._sink.write(pending[:end])
        return len(text)

    def flush(self) -> None:
        if self._partial:
            text, self._partial = self._partial, ""
            self._sink.write(text)

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return os.isatty(self._fd)

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"


def dropped_notice(count: int) -> bytes:
    return f"exec-server: {count} log messages dropped (stderr was not read)\n".encode()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def cut_text(text: str, limit: int = EVENT_TEXT_LIMIT) -> str:
    """``text``, or its head and tail with how much was left out when longer than ``limit``."""
    if len(text) <= limit:
        return text
    keep = limit // 2
    omitted = len(text) - 2 * keep
    return f"{text[:keep]}\n[... {omitted} characters omitted ...]\n{text[-keep:]}"


def format_event(event: dict[str, Any]) -> str | None:
    """Twisted's classic log text for ``event``, cut to :data:`EVENT_TEXT_LIMIT`."""
    text = formatEventAsClassicLogText(event)
    if text is None:
        return None
    if len(text) <= EVENT_TEXT_LIMIT:
        return text
    return cut_text(text.rstrip("\n")) + "\n"


def event_kind(event: dict[str, Any]) -> Hashable:
    """What makes two events "the same line" for :class:`RepeatLimiter`."""
    what = event.get("log_format")
    if what is None:
        message = event.get("message")
        failure = event.get("log_failure")
        what = repr(message)[:200] if message else type(getattr(failure, "value", None)).__name__
    return (event.get("log_namespace"), what)


@define
class _Window:
    start: float
    written: int = 1
    suppressed: int = 0
    timer: IDelayedCall | None = None
    sample: dict[str, Any] = field(factory=dict)


@implementer(ILogObserver)
@define
class RepeatLimiter:
    """Passes on at most ``burst`` events of one kind per ``interval`` seconds.

    The rest are counted; when the window ends, one warning says how many
    lines like it were not logged (``N more lines like "..." in the last
    10 s were not logged``).
    """

    observer: ILogObserver
    clock: IReactorTime
    burst: int = REPEAT_BURST
    interval: float = REPEAT_INTERVAL_SECONDS
    _windows: dict[Hashable, _Window] = field(factory=dict, init=False)

    def __call__(self, event: dict[str, Any]) -> None:
        key = event_kind(event)
        now = self.clock.seconds()
        window = self._windows.get(key)
        if window is None or now - window.start >= self.interval:
            if window is not None:
                self._close(key)
            if len(self._windows) >= _MAX_WINDOWS:
                self._forget_old(now)
            self._windows[key] = _Window(start=now)
            self.observer(event)
            return
        if window.written < self.burst:
            window.written += 1
            self.observer(event)
            return
        window.suppressed += 1
        if window.timer is None:
            window.sample = event
            window.timer = self.clock.callLater(
                max(0.0, window.start + self.interval - now), self._close, key
            )

    def _forget_old(self, now: float) -> None:
        for key, window in list(self._windows.items()):
            if now - window.start >= self.interval:
                self._close(key)

    def _close(self, key: Hashable) -> None:
        window = self._windows.pop(key, None)
        if window is None:
            return
        if window.timer is not None and window.timer.active():
            window.timer.cancel()
        if window.suppressed:
            sample = window.sample
            what = sample.get("log_format") or str(event_kind(sample)[1])  # type: ignore[index]
            self.observer(
                {
                    "log_format": (
                        '{count} more lines like "{what}" in the last {interval:g} s '
                        "were not logged"
                    ),
                    "count": window.suppressed,
                    "what": what,
                    "interval": self.interval,
                    "log_level": LogLevel.warn,
                    "log_namespace": sample.get("log_namespace", "execserver.logsink"),
                    "log_time": self.clock.seconds(),
                    "log_source": None,
                }
            )


def stderr_observer(sink: IO[Any] | StderrSink, clock: IReactorTime, verbose: bool) -> ILogObserver:
    """The console script's observer: level filter, repeat limit, cut text, ``sink``.

    ``sink`` is a file-like object (``write``/``flush``), normally a
    :class:`StderrSink`.
    """
    level = LogLevel.info if verbose else LogLevel.warn
    return FilteringLogObserver(
        RepeatLimiter(FileLogObserver(cast(IO[Any], sink), format_event), clock),
        [LogLevelFilterPredicate(defaultLogLevel=level)],
    )


@define
class OncePerInterval:
    """A warning said at most once per ``interval`` seconds, with how often it happened.

    :meth:`hit` counts one occurrence and answers how many there were since
    the last line when a line is due now, else None (counted for the next).
    """

    clock: IReactorTime
    interval: float = REPEAT_INTERVAL_SECONDS
    _last: float | None = field(default=None, init=False)
    _count: int = field(default=0, init=False)

    def hit(self) -> int | None:
        self._count += 1
        now = self.clock.seconds()
        if self._last is not None and now - self._last < self.interval:
            return None
        self._last = now
        count, self._count = self._count, 0
        return count
