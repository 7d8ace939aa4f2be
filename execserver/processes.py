"""One supervised child process: output capture, exit reporting, termination.

:class:`ManagedProcess` is the ``ProcessProtocol`` of one child. It numbers
and retains output, tells its :class:`ProcessObserver` (the session) about
output, exit and close, enforces the wall-clock and idle timeouts, and
escalates termination of the child's whole tree (SIGTERM, then SIGKILL
after a grace period): every descendant, as tracked by the
:class:`~execserver.containment.ProcessTree` the spawner attached to the
transport, or only the process group when there is none. It knows nothing of
JSON or connections; the clock and the signal sender are injected so unit
tests drive it with a fake clock and fake transports.

The session steers a process only through :class:`ChildProcess` (stdin,
signals, terminal size, termination, reading paused or not); this module is
the one that talks to the process transport
(:class:`~execserver.spawn.ChildTransport`, what both spawn paths give) and
its pipes.
"""

from __future__ import annotations

import signal as _signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, cast

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from execserver.cgroups import Usage
from execserver.containment import ProcessTree, proc_table
from execserver.exits import exit_status, signal_name
from execserver.limits import NO_LIMITS, Kind, Limits
from execserver.protocol import OutputStream, TimedOut
from execserver.retained import RetainedOutput, RetainedTally
from execserver.spawn import ChildTransport, TerminalTransport, group_alive, kill_group
from execserver.waiters import Latch, Waiters, cancel_call
from execserver.writebuffer import unsent_bytes

if TYPE_CHECKING:
    # Only the session renders output; this module knows no JSON.
    from execserver.codec import OutputEncoder

log = Logger()


class ProcessObserver(Protocol):
    def process_output(
        self, proc: ManagedProcess, stream: OutputStream, data: bytes, seq: int
    ) -> None: ...
    def process_exited(self, proc: ManagedProcess) -> None: ...
    def process_closed(self, proc: ManagedProcess) -> None: ...


class ChildProcess(Protocol):
    """How a session steers one of its processes (:class:`ManagedProcess` is one)."""

    @property
    def pid(self) -> int | None: ...

    @property
    def exited(self) -> bool: ...

    @property
    def closed(self) -> bool: ...

    @property
    def stdin_writable(self) -> bool:
        """Its stdin is open and can be written."""

    def stdin_unsent(self) -> int:
        """Bytes written to stdin that the child has not read yet."""

    def write_stdin(self, data: bytes) -> None: ...

    def close_stdin(self) -> bool:
        """Close a pipe's stdin after what is buffered; False if it was closed already."""

    def send_eof(self) -> None:
        """A terminal's EOF character (a PTY has no stdin of its own to close)."""

    def resize(self, rows: int, cols: int) -> None:
        """Set a PTY's window size (raises OSError)."""

    def send_signal(self, signum: int) -> bool: ...

    def terminate(self, grace_seconds: float) -> None: ...

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


#: After the SIGKILL, how long a tree may take to disappear before the
#: process counts as finished anyway (a member stuck in uninterruptible
#: sleep cannot die sooner; waiting for it would hold shutdown forever).
KILL_WAIT_LIMIT = 5.0


#: How often a process group that outlived its leader's output is checked
#: for being empty (without containment; the containment sweeps its own).
GROUP_SWEEP_INTERVAL = 1.0


#: Least interval between two reads of a running process's limit counters.
LIMIT_CHECK_INTERVAL = 0.1


class ProcessGroup:
    """The tree of a process without containment: its process group only.

    Calls ``kill``/``alive`` through the owner at each use, so tests can
    swap the owner's ``_kill``/``_group_alive`` after construction.
    """

    def __init__(self, proc: ManagedProcess, pgid: int) -> None:
        self._proc = proc
        self._pgid = pgid
        self._sweep: IDelayedCall | None = None
        self._on_empty: Callable[[], None] | None = None

    def signal(self, signum: int) -> None:
        self._proc._kill(self._pgid, signum)

    def kill(self) -> None:
        self._proc._kill(self._pgid, _signal.SIGKILL)

    def alive(self) -> bool:
        return self._proc._group_alive(self._pgid)

    def exceeded(self) -> tuple[Kind, int] | None:
        return None

    def usage(self) -> Usage:
        return Usage()

    def when_empty(self, callback: Callable[[], None]) -> None:
        self._on_empty = callback
        self._sweep = self._proc._clock.callLater(GROUP_SWEEP_INTERVAL, self._check)

    def _check(self) -> None:
        self._sweep = None
        if self.alive():
            self._sweep = self._proc._clock.callLater(GROUP_SWEEP_INTERVAL, self._check)
            return
        callback, self._on_empty = self._on_empty, None
        if callback is not None:
            callback()

    def release(self) -> None:
        cancel_call(self._sweep)
        self._sweep = None

    def pids(self) -> list[int]:
        """The running members of the group, from ``/proc``."""
        return [
            info.pid
            for info in proc_table().values()
            if info.pgrp == self._pgid and not info.zombie
        ]


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
        is_group_alive: Callable[[int], bool] = group_alive,
        tally: RetainedTally | None = None,
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
        #: The seqs of the exit and the close, once they happened.
        self.exit_seq: int | None = None
        self.close_seq: int | None = None
        #: Recent ``process/write`` writeIds, so a retried write is not repeated.
        self.write_ids: dict[str, None] = {}
        #: Reading stopped because protected output fills the retained cap.
        self.full_paused = False
        self.terminating = False
        self.stdin_open = False
        #: "wall" or "idle" once a timeout (not the client) ended the process.
        self.timed_out: TimedOut | None = None
        #: The tree's resource limits, and the one that ended or crippled it
        #: (with its figure), known at the exit.
        self.limits: Limits = NO_LIMITS
        self.limit_exceeded: tuple[Kind, int] | None = None
        self._limit_checked_at = -LIMIT_CHECK_INTERVAL
        #: Started under a sandbox; whether the sandbox probably stopped it
        #: (decided once, at exit: docs/protocol.md, "sandboxDenied").
        self.confined = False
        self.sandbox_denied: bool | None = None
        #: Renders this process's output notifications (set by the session).
        self.output_encoder: OutputEncoder | None = None
        self._observer = observer
        self._clock = clock
        self._kill = kill
        self._group_alive = is_group_alive
        self._sigkill_sent = False
        self._group_timer: IDelayedCall | None = None
        self._group_delay = 0.0
        self._tree: ProcessTree | None = None
        #: Closed while members of the tree still ran (a daemon, say).
        self._lingering = False
        self._killed_at: float | None = None
        self._changed: Waiters[None] = Waiters()
        self._kill_timer: IDelayedCall | None = None
        self._force_close_timer: IDelayedCall | None = None
        self._closed: Latch[None] = Latch()
        self._exited: Latch[None] = Latch()
        self._finished: Latch[None] = Latch()
        self._timeout_grace = 0.0
        self._wall_timer: IDelayedCall | None = None
        self._idle_timer: IDelayedCall | None = None
        self._idle_seconds = 0.0
        self._reading_paused = False
        self._last_output = 0.0
        self._child: ChildTransport | None = None
        self._tally = tally
        if tally is not None:
            tally.members.add(self)

    # --- ProcessProtocol ------------------------------------------------------

    def makeConnection(self, transport: Any) -> None:
        self.pid = transport.pid
        tree = getattr(transport, "tree", None)
        self._tree = tree if tree is not None else ProcessGroup(self, transport.pid)
        self._child = transport
        super().makeConnection(transport)

    # --- the session's interface (ChildProcess) -------------------------------

    @property
    def stdin_writable(self) -> bool:
        return self.stdin_open and self._child is not None

    def stdin_unsent(self) -> int:
        if self._child is None:
            return 0
        writer = self._child if self.tty else getattr(self._child, "pipes", {}).get(0)
        return unsent_bytes(writer)

    def write_stdin(self, data: bytes) -> None:
        if self._child is not None:
            self._child.write(data)

    def close_stdin(self) -> bool:
        if not self.stdin_open or self._child is None:
            return False
        self.stdin_open = False
        # Buffered input is still written before the pipe is closed.
        self._child.closeStdin()
        return True

    def send_eof(self) -> None:
        if self._child is not None and self.tty:
            terminal = cast(TerminalTransport, self._child)
            terminal.write(terminal.eof_char())

    def resize(self, rows: int, cols: int) -> None:
        if self._child is not None and self.tty:
            cast(TerminalTransport, self._child).set_window_size(rows, cols)

    @property
    def readable(self) -> bool:
        """Its output can still be paused or resumed (not closed)."""
        return not self.closed and self._child is not None

    def pause_reading(self) -> None:
        """Stop reading its output (flow control); nothing once it is closed."""
        if self.readable:
            assert self._child is not None
            self._child.pauseProducing()
            self.set_reading_paused(True)

    def resume_reading(self) -> None:
        if self.readable:
            assert self._child is not None
            self._child.resumeProducing()
            self.set_reading_paused(False)

    def acknowledge(self, seq: int) -> None:
        """The client has every seq up to ``seq`` (protected output may be dropped)."""
        output = self.output
        before = output.retained_bytes
        output.acknowledge(seq)
        tally = self._tally
        if tally is not None:
            tally.bytes += output.retained_bytes - before
            if tally.over:
                # Acknowledged chunks may go for the server's cap too.
                self.shed_output(tally.bytes - tally.cap)
            tally.released()

    def leave_tally(self) -> None:
        """Its session forgot it: its output no longer counts (idempotent)."""
        tally = self._tally
        if tally is not None:
            self._tally = None
            tally.bytes -= self.output.retained_bytes
            tally.members.discard(self)
            tally.forget(self)
            tally.released()

    @property
    def retention_full(self) -> bool:
        """Reading must wait: protected output fills its own cap or the server's."""
        output = self.output
        tally = self._tally
        return output.full or (output.protected and tally is not None and tally.over)

    def when_retention_room(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the server's total, now over its cap, is within it again."""
        if self._tally is not None:
            self._tally.when_room(self, callback)

    def shed_output(self, nbytes: int) -> None:
        """Drop up to ``nbytes`` of its oldest output for the server's cap (gaps)."""
        output = self.output
        before = output.retained_bytes
        output.shed(nbytes)
        if self._tally is not None:
            self._tally.bytes += output.retained_bytes - before

    @property
    def tree(self) -> ProcessTree:
        assert self._tree is not None, "not started"
        return self._tree

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        stream: OutputStream = "pty" if self.tty else ("stderr" if childFD == 2 else "stdout")
        output = self.output
        tally = self._tally
        if tally is None:
            seq = output.append(stream, data)
        else:
            before = output.retained_bytes
            seq = output.append(stream, data)
            tally.retained(self, output.retained_bytes - before)
        if self._idle_timer is not None:
            # Only note the time: the idle timer re-arms itself when it fires
            # early, so a chatty process costs no timer churn per chunk.
            self._last_output = self._clock.seconds()
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
        status = exit_status(reason)
        if status.signal is not None:
            self.signal = signal_name(status.signal)
        if self.limits:
            self.limit_exceeded = self._limit_exceeded(status.signal)
        self.exit_code = status.shell_code
        self.exited = True
        # One counter per process (as the reference): exit takes the seq
        # after the output read so far, close the one after everything.
        self.exit_seq = self.output.mark()
        self._observer.process_exited(self)
        self._wake()
        self._exited.fire(None)

    def limit_hit(self) -> tuple[Kind, int] | None:
        """The limit that ended (after the exit) or, so far, crippled the process.

        While it runs the cgroup's counters are read at most every
        :data:`LIMIT_CHECK_INTERVAL` (a read of a chatty process costs no
        file reads per chunk).
        """
        if self.exited or not self.limits or self._tree is None:
            return self.limit_exceeded
        now = self._clock.seconds()
        if now - self._limit_checked_at >= LIMIT_CHECK_INTERVAL:
            self._limit_checked_at = now
            self.limit_exceeded = self._tree.exceeded()
        return self.limit_exceeded

    def _limit_exceeded(self, signum: int | None) -> tuple[Kind, int] | None:
        found = self._tree.exceeded() if self._tree is not None else None
        size = self.limits.file_size_bytes
        if found is None and size is not None and signum == _signal.SIGXFSZ:
            found = ("fileSize", size)
        return found

    def processEnded(self, reason: Failure) -> None:
        if not self.exited:  # pragma: no cover - Twisted always reports exit first
            self.processExited(reason)
        self.closed = True
        self.stdin_open = False
        self._cancel_force_close()
        if self._kill_timer is not None:
            # A terminate is under way: its SIGKILL is still due unless the
            # rest of the group is gone too.
            self._group_delay = 0.01
            self._check_group()
        elif self._sigkill_sent:
            if self._tree is not None and self._tree.alive():
                self._killed_at = self._clock.seconds()
                self._group_delay = 0.01
                self._check_group()
        elif self._tree is not None and self._tree.alive():
            # Members that no longer hold our output live on: the process is
            # not finished until they are gone (or a terminate ends them).
            # The wall and idle limits keep running: they bound the tree.
            self._lingering = True
            self._tree.when_empty(self._tree_emptied)
        if not self._lingering:
            self._cancel_timeouts()
        self.close_seq = self.output.mark()
        # Long polls answer before the close is announced: a current-dialect
        # read that saw the exit waits for the close, and a client that takes
        # process/closed as the last word must find no read of it pending.
        self._wake()
        self._observer.process_closed(self)
        self._closed.fire(None)
        if self.finished:
            self._finish()

    def _tree_emptied(self) -> None:
        if self._lingering and self._kill_timer is None:
            self._lingering = False
            self._finish()

    # --- control --------------------------------------------------------------

    def start_timeouts(
        self, wall_seconds: float | None, idle_seconds: float | None, grace_seconds: float
    ) -> None:
        """Terminate the tree (with ``grace_seconds``) after a wall or idle limit.

        The limits bound the whole life of the tree, not only of its leader:
        one that expires after the leader exited but while other members
        still run (holding the output open or not, like a daemon) terminates
        them (the exit already reported stays as it was).
        """
        if self.finished:
            return
        self._timeout_grace = grace_seconds
        if wall_seconds is not None:
            self._wall_timer = self._clock.callLater(wall_seconds, self._wall_expired)
        if idle_seconds is not None:
            self._idle_seconds = idle_seconds
            self._last_output = self._clock.seconds()
            self._idle_timer = self._clock.callLater(idle_seconds, self._idle_check)

    def _wall_expired(self) -> None:
        self._wall_timer = None
        self._time_out("wall")

    def set_reading_paused(self, paused: bool) -> None:
        """Flow control stopped (or resumed) reading this process's output.

        While output is not being read, silence proves nothing: the process
        may be blocked writing into a full pipe. The idle clock restarts when
        reading resumes.
        """
        self._reading_paused = paused
        if not paused and self._idle_timer is not None:
            self._last_output = self._clock.seconds()

    def _idle_check(self) -> None:
        self._idle_timer = None
        if self._reading_paused:
            self._idle_timer = self._clock.callLater(self._idle_seconds, self._idle_check)
            return
        remaining = self._last_output + self._idle_seconds - self._clock.seconds()
        if remaining > 0:
            self._idle_timer = self._clock.callLater(remaining, self._idle_check)
            return
        self._time_out("idle")

    def _time_out(self, kind: TimedOut) -> None:
        self._cancel_timeouts()
        if self.finished or self.terminating:
            # A terminate already under way keeps the client's grace.
            return
        if not self.exited:
            self.timed_out = kind
        self.terminate(self._timeout_grace)

    def _cancel_timeouts(self) -> None:
        cancel_call(self._wall_timer)
        cancel_call(self._idle_timer)
        self._wall_timer = None
        self._idle_timer = None

    def send_signal(self, signum: int) -> bool:
        """Send ``signum`` to the process group; False once the process has exited.

        Only the group, as documented for ``process/signal``: a member that
        left it on purpose (a daemon) is not interrupted; terminate reaches it.
        """
        if self.exited or self.pid is None:
            return False
        return self._kill(self.pid, signum)

    def terminate(self, grace_seconds: float) -> None:
        """SIGTERM the whole tree now, SIGKILL it after ``grace_seconds``.

        Also used after the leader exited while others of its tree still run
        (holding its output open or not). A second call with a shorter grace
        brings the SIGKILL forward; a longer one never delays it. Once the
        process is finished (closed, its tree empty) it does nothing.
        """
        if self.pid is None or self._tree is None or self.finished:
            return
        self.terminating = True
        if grace_seconds <= 0 or self._sigkill_sent:
            # After a SIGKILL, a polite SIGTERM would only restart the grace.
            self._kill_now()
            return
        self._tree.signal(_signal.SIGTERM)
        if self.tty:
            # A shell on a PTY ignores SIGTERM; hanging up its terminal is the
            # conventional polite request to leave.
            self._tree.signal(_signal.SIGHUP)
        # A stopped member would keep SIGTERM pending until the SIGKILL.
        self._tree.signal(_signal.SIGCONT)
        if self._kill_timer is None:
            self._kill_timer = self._clock.callLater(grace_seconds, self._kill_now)
        elif self._kill_timer.getTime() > self._clock.seconds() + grace_seconds:
            self._kill_timer.reset(grace_seconds)
        if self.closed:
            # Nothing will report the end of members that do not hold our
            # output: watch the tree until it is empty.
            self._lingering = False
            self._group_delay = 0.01
            self._check_group()

    def _check_group(self) -> None:
        """After close, finish as soon as the tree is empty.

        Before the SIGKILL this ends the pending escalation early; after it,
        it waits for the kill to take effect (at most KILL_WAIT_LIMIT).
        """
        self._group_timer = None
        if self._tree is None:
            return
        if self._killed_at is None and self._kill_timer is None:
            return
        if not self._tree.alive():
            if self._kill_timer is not None:
                self._kill_timer.cancel()
                self._kill_timer = None
            self._killed_at = None
            if self.closed:
                self._finish()
            return
        if self._killed_at is not None:
            if self._clock.seconds() - self._killed_at >= KILL_WAIT_LIMIT:
                log.warn(
                    "process {process_id} (pid {pid}): members still alive "
                    "{limit} s after SIGKILL; no longer waiting for them",
                    process_id=self.process_id,
                    pid=self.pid,
                    limit=KILL_WAIT_LIMIT,
                )
                self._killed_at = None
                self._finish()
                return
            # A fork that raced the kill leaves a member behind: kill again.
            self._tree.kill()
        # Members still exiting are usually gone within milliseconds; back
        # off so a TERM-ignoring one costs only a few checks until SIGKILL.
        self._group_timer = self._clock.callLater(self._group_delay, self._check_group)
        self._group_delay = min(self._group_delay * 2, 0.5)

    def _kill_now(self) -> None:
        cancel_call(self._kill_timer)
        cancel_call(self._group_timer)
        self._kill_timer = None
        self._group_timer = None
        if self.pid is None or self._tree is None:
            return
        self._sigkill_sent = True
        self._lingering = False
        # Sent even after every stream closed: a member that ignores SIGTERM
        # and no longer holds our output must not outlive the terminate.
        self._tree.kill()
        if self.closed:
            self._killed_at = self._clock.seconds()
            self._group_delay = 0.01
            self._check_group()
            return
        if self._force_close_timer is None:
            # A member may have passed our pipes to a process that is beyond
            # reach (without containment: one that left the group); stop
            # waiting for it after a second and close our ends.
            self._force_close_timer = self._clock.callLater(1.0, self._force_close)

    def _force_close(self) -> None:
        self._force_close_timer = None
        if self.closed or self.transport is None:
            return
        if self._reading_paused and (self._tree is None or not self._tree.alive()):
            # Open only because flow control stopped reading it (a stalled
            # client): the tree is gone and its end-of-file is unread. Closing
            # our ends is the expected way out, not a member beyond reach.
            log.info(
                "process {process_id} (pid {pid}) killed while its output was paused; closing it",
                process_id=self.process_id,
                pid=self.pid,
            )
        else:
            log.warn(
                "process {process_id} (pid {pid}) output still open after SIGKILL; closing it",
                process_id=self.process_id,
                pid=self.pid,
            )
        self.transport.loseConnection()

    def _cancel_force_close(self) -> None:
        cancel_call(self._force_close_timer)
        self._force_close_timer = None

    def _finish(self) -> None:
        if self._finished.done:
            return
        self._cancel_timeouts()
        if self._tree is not None:
            self._tree.release()
        self._finished.fire(None)

    # --- waiting --------------------------------------------------------------

    def wait_for_change(self) -> Deferred[None]:
        """Fires at the next output, exit or close (or :meth:`wake_all`)."""
        return self._changed.wait()

    def when_closed(self) -> Deferred[None]:
        return self._closed.wait()

    def when_exited(self) -> Deferred[None]:
        """Fires when the process has exited (at once if it has)."""
        return self._exited.wait()

    @property
    def finished(self) -> bool:
        """Closed, and nothing of its tree is known to run: no escalation is
        under way and no member outlived the close."""
        return (
            self.closed
            and self._kill_timer is None
            and self._killed_at is None
            and not self._lingering
        )

    def when_finished(self) -> Deferred[None]:
        """Fires once :attr:`finished`: nothing of the process is still running."""
        if self.finished:
            self._finish()
        return self._finished.wait()

    def wake_all(self) -> None:
        self._wake()

    def descendant_pids(self) -> list[int]:
        """What still runs of the tree besides the leader (background jobs, daemons)."""
        if self._tree is None or self.finished:
            return []
        pids = getattr(self._tree, "pids", None)
        if pids is None:
            return []
        return sorted(pid for pid in pids() if pid != self.pid)

    def _wake(self) -> None:
        self._changed.fire(None)
