"""One supervised child process: output capture, exit reporting, termination.

:class:`ManagedProcess` is the ``ProcessProtocol`` of one child. It numbers
and retains output, tells its :class:`ProcessObserver` (the session) about
output, exit and close, and escalates termination of the child's whole
process group (SIGTERM, then SIGKILL after a grace period). It knows
nothing of JSON or connections; the clock and the signal sender are
injected so unit tests drive it with a fake clock and fake transports.
"""

from __future__ import annotations

import signal as _signal
from collections.abc import Callable
from typing import Any, Protocol

from twisted.internet import error as _error
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from execserver.protocol import OutputStream
from execserver.retained import RetainedOutput
from execserver.spawn import kill_group

log = Logger()


class ProcessObserver(Protocol):
    def process_output(
        self, proc: ManagedProcess, stream: OutputStream, data: bytes, seq: int
    ) -> None: ...
    def process_exited(self, proc: ManagedProcess) -> None: ...
    def process_closed(self, proc: ManagedProcess) -> None: ...


def signal_name(signum: int) -> str:
    try:
        return _signal.Signals(signum).name
    except ValueError:
        return f"SIG{signum}"


class ManagedProcess(ProcessProtocol):
    """Protocol and state of one child, keyed by its client-chosen id."""

    def __init__(
        self,
        process_id: str,
        tty: bool,
        retained_bytes: int,
        observer: ProcessObserver,
        clock: IReactorTime,
        argv: tuple[str, ...] = (),
        kill: Callable[[int, int], bool] = kill_group,
    ) -> None:
        self.process_id = process_id
        self.tty = tty
        self.argv = argv
        self.output = RetainedOutput(retained_bytes)
        self.pid: int | None = None
        self.exit_code: int | None = None
        self.signal: str | None = None
        self.exited = False
        self.closed = False
        self.terminating = False
        self.stdin_open = False
        self._observer = observer
        self._clock = clock
        self._kill = kill
        self._waiters: list[Deferred[None]] = []
        self._kill_timer: IDelayedCall | None = None
        self._force_close_timer: IDelayedCall | None = None
        self._closed_waiters: list[Deferred[None]] = []

    # --- ProcessProtocol ------------------------------------------------------

    def makeConnection(self, transport: Any) -> None:
        self.pid = transport.pid
        super().makeConnection(transport)

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        stream: OutputStream = "pty" if self.tty else ("stderr" if childFD == 2 else "stdout")
        seq = self.output.append(stream, data)
        self._observer.process_output(self, stream, data, seq)
        self._wake()

    def childConnectionLost(self, childFD: int) -> None:
        if childFD == 0:
            self.stdin_open = False

    def processExited(self, reason: Failure) -> None:
        # Everything the child wrote before it died is already in the pipe:
        # take it now so that it is sent before the exit notification.
        drain = getattr(self.transport, "drain_output", None)
        if drain is not None:
            drain()
        value = reason.value
        code = getattr(value, "exitCode", None)
        sig = getattr(value, "signal", None)
        if sig is not None:
            self.signal = signal_name(sig)
            self.exit_code = 128 + sig
        elif isinstance(value, _error.ProcessDone):
            self.exit_code = 0
        else:
            self.exit_code = code if code is not None else -1
        self.exited = True
        self._observer.process_exited(self)
        self._wake()

    def processEnded(self, reason: Failure) -> None:
        if not self.exited:  # pragma: no cover - Twisted always reports exit first
            self.processExited(reason)
        self.closed = True
        self.stdin_open = False
        self._cancel_timers()
        self._observer.process_closed(self)
        self._wake()
        waiters, self._closed_waiters = self._closed_waiters, []
        for d in waiters:
            d.callback(None)

    # --- control --------------------------------------------------------------

    def terminate(self, grace_seconds: float) -> None:
        """SIGTERM the whole group now, SIGKILL it after ``grace_seconds``.

        Also used after the leader exited while others in its group still hold
        its output open; a no-op once every stream is closed.
        """
        if self.closed or self.pid is None:
            return
        self.terminating = True
        if grace_seconds <= 0:
            self._kill_now()
            return
        self._kill(self.pid, _signal.SIGTERM)
        if self.tty:
            # A shell on a PTY ignores SIGTERM; hanging up its terminal is the
            # conventional polite request to leave.
            self._kill(self.pid, _signal.SIGHUP)
        if self._kill_timer is None:
            self._kill_timer = self._clock.callLater(grace_seconds, self._kill_now)

    def _kill_now(self) -> None:
        self._kill_timer = None
        if self.closed or self.pid is None:
            return
        self._kill(self.pid, _signal.SIGKILL)
        if self._force_close_timer is None:
            # A process that escaped the group (setsid) may still hold our
            # pipes; stop waiting for it after a second and close our ends.
            self._force_close_timer = self._clock.callLater(1.0, self._force_close)

    def _force_close(self) -> None:
        self._force_close_timer = None
        if self.closed or self.transport is None:
            return
        log.warn(
            "process {process_id} (pid {pid}) output still open after SIGKILL; closing it",
            process_id=self.process_id,
            pid=self.pid,
        )
        self.transport.loseConnection()

    def _cancel_timers(self) -> None:
        for timer in (self._kill_timer, self._force_close_timer):
            if timer is not None and timer.active():
                timer.cancel()
        self._kill_timer = None
        self._force_close_timer = None

    # --- waiting --------------------------------------------------------------

    def wait_for_change(self) -> Deferred[None]:
        """Fires at the next output, exit or close (or :meth:`wake_all`)."""
        d: Deferred[None] = Deferred()
        self._waiters.append(d)
        return d

    def when_closed(self) -> Deferred[None]:
        d: Deferred[None] = Deferred()
        if self.closed:
            d.callback(None)
        else:
            self._closed_waiters.append(d)
        return d

    def wake_all(self) -> None:
        self._wake()

    def _wake(self) -> None:
        if self._waiters:
            waiters, self._waiters = self._waiters, []
            for d in waiters:
                d.callback(None)
