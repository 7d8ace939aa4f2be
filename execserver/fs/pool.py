"""The fs pool: blocking work off the reactor, bounded, with one wake-up per batch.

See :class:`PoolRunner`.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Final, Protocol, TypeGuard

import attrs
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.python.failure import Failure

from execserver.fs.paths import BUSY_KIND, closed_error, invalid
from execserver.waiters import cancel_call

#: Threads doing blocking file I/O (per server).
FS_THREADS: Final = 4
#: Default of ``--max-fs-ops-per-session``: operations one connection may
#: have on pool threads at once, so that it cannot occupy every thread.
FS_OPS_PER_OWNER: Final = 2

Runner = Callable[..., "Deferred[Any]"]


@attrs.define(eq=False)
class _Job:
    func: Callable[..., Any]
    args: tuple[Any, ...]
    owner: object
    deferred: Deferred[Any]
    started_at: float | None = None
    timer: IDelayedCall | None = None
    #: Set (from the reactor thread) when the job's answer is no longer
    #: wanted: its connection closed or its Deferred was cancelled. A long
    #: operation polls it through :func:`cancelled` and stops.
    cancelled: bool = False


_current = threading.local()


def cancelled() -> bool:
    """Whether the pool job running on this thread is no longer wanted (False off the pool)."""
    job: _Job | None = getattr(_current, "job", None)
    return job is not None and job.cancelled


def check_cancelled() -> None:
    """Stop a long operation whose answer is no longer wanted (see :func:`cancelled`)."""
    if cancelled():
        raise closed_error()


class PoolReactor(Protocol):
    """What the pool needs of a reactor beyond a clock.

    ``IReactorFromThreads.callFromThread`` (workers hand results back) and
    ``IReactorCore.addSystemEventTrigger`` (workers stop at shutdown).
    """

    def callFromThread(self, f: Callable[..., Any], *args: Any) -> object: ...

    def addSystemEventTrigger(
        self, phase: str, eventType: str, callable: Callable[..., Any], *args: Any
    ) -> object: ...


def runs_threads(reactor: object) -> TypeGuard[PoolReactor]:
    """True for a reactor that can run the pool (a fake clock cannot)."""
    return hasattr(reactor, "callFromThread") and hasattr(reactor, "addSystemEventTrigger")


class PoolRunner:
    """Runs blocking calls on a dedicated, bounded pool tied to the reactor's life.

    At most ``threads`` worker threads, started as work needs them and kept
    (idle ones wait on a condition, so a request costs one thread wake-up,
    not a thread pool's queue and context). The queue is kept here: a
    worker that finishes a job takes the next queued one itself (no round
    trip through the reactor between jobs), so a queued job can be dropped
    when its connection closes, fails with a ``busy`` error after
    ``wait_timeout`` seconds without a free thread, and is counted for
    /metrics. One owner (connection) runs at most ``per_owner`` jobs at
    once: its further jobs wait while others' jobs take the free threads,
    so a client sending many slow operations (a FIFO nobody writes, a huge
    file) cannot occupy the whole pool.

    Results go back to the reactor in batches: a worker appends its result
    to a list and wakes the reactor only if the list was empty, so every
    result completed before the reactor runs is delivered in one wake-up
    (at 64 requests in flight, far fewer wake-ups than results). The
    workers stop when the reactor shuts down.
    """

    def __init__(
        self,
        reactor: PoolReactor,
        threads: int = FS_THREADS,
        wait_timeout: float = 30.0,
        stall_after: float = 10.0,
        clock: IReactorTime | None = None,
        per_owner: int = FS_OPS_PER_OWNER,
    ) -> None:
        #: Jobs one owner may run at once (owner None: not limited).
        self.per_owner = per_owner
        #: Running jobs by owner (only owners with any).
        self._owner_running: dict[object, int] = {}
        self._reactor = reactor
        self._clock = clock if clock is not None else IReactorTime(reactor)
        self.threads = threads
        self.wait_timeout = wait_timeout
        self.stall_after = stall_after
        # Shared with the workers: the queue, the running set, the counts,
        # the finished results not yet delivered.
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: deque[_Job] = deque()
        self._handoff: deque[_Job] = deque()
        self._running: set[_Job] = set()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._done: list[tuple[_Job, bool, Any]] = []
        self._dequeued: list[_Job] = []
        self._started = False
        self._stopped = False

    @property
    def running(self) -> int:
        """Operations on a pool thread now."""
        return len(self._running)

    @property
    def queued(self) -> int:
        """Operations waiting for a free pool thread."""
        return len(self._queue)

    def __call__(self, func: Callable[..., Any], *args: Any, owner: object = None) -> Deferred[Any]:
        job = _Job(func, args, owner, Deferred(lambda _: self._cancel(job)))
        if self._stopped:
            # The workers are gone (the reactor is stopping).
            job.deferred.errback(invalid("the server is shutting down", "shuttingDown"))
            return job.deferred
        if not self._started:
            self._started = True
            self._reactor.addSystemEventTrigger("during", "shutdown", self.stop)
        spawn = False
        with self._lock:
            if len(self._running) < self.threads and self._may_start(job):
                # A free thread: an idle one takes it, or a new one starts.
                self._begin(job)
                self._handoff.append(job)
                if self._idle:
                    self._idle -= 1
                    self._wake.notify()
                elif len(self._threads) < self.threads:
                    spawn = True
                    self._threads.append(threading.Thread(target=self._work, daemon=True))
                # Else every thread exists and one is between two jobs: it
                # takes the handoff before it waits.
            else:
                self._queue.append(job)
        if spawn:
            self._threads[-1].name = f"exec-server-fs-{len(self._threads)}"
            self._threads[-1].start()
        elif job.started_at is None:
            job.timer = self._clock.callLater(self.wait_timeout, self._expire, job)
        return job.deferred

    def _may_start(self, job: _Job) -> bool:
        # (Called with the lock held.)
        return job.owner is None or self._owner_running.get(job.owner, 0) < self.per_owner

    def _begin(self, job: _Job) -> None:
        # (Called with the lock held.)
        job.started_at = self._clock.seconds()
        self._running.add(job)
        if job.owner is not None:
            self._owner_running[job.owner] = self._owner_running.get(job.owner, 0) + 1

    def _end(self, job: _Job) -> None:
        # (Called with the lock held.)
        self._running.discard(job)
        if job.owner is not None:
            left = self._owner_running[job.owner] - 1
            if left:
                self._owner_running[job.owner] = left
            else:
                del self._owner_running[job.owner]

    def _next_startable(self) -> _Job | None:
        """The oldest queued job whose owner is below ``per_owner`` (removed from the queue)."""
        # (Called with the lock held.)
        for index, job in enumerate(self._queue):
            if self._may_start(job):
                del self._queue[index]
                return job
        return None

    def _work(self) -> None:
        """A worker thread: run jobs handed to it or queued, until stopped."""
        job: _Job | None = None
        while True:
            with self._lock:
                while job is None:
                    if self._stopped:
                        return
                    if self._handoff:
                        job = self._handoff.popleft()
                    else:
                        self._idle += 1
                        self._wake.wait()
            _current.job = job
            try:
                result: Any = job.func(*job.args)
                success = True
            except BaseException:
                result = Failure()
                success = False
            finally:
                _current.job = None
            with self._lock:
                self._end(job)
                following = None
                if self._queue and not self._stopped:
                    following = self._next_startable()
                    if following is not None:
                        self._begin(following)
                        self._dequeued.append(following)
                first = not self._done
                self._done.append((job, success, result))
            # An idle worker must not keep its last result (a large reply) alive.
            del result
            if first:
                self._reactor.callFromThread(self._deliver)
            job = following

    def _deliver(self) -> None:
        """Fire every result finished since the last delivery (reactor thread)."""
        with self._lock:
            done, self._done = self._done, []
            started, self._dequeued = self._dequeued, []
        for job, success, result in done:
            if job.deferred.called:
                continue  # cancelled while running: the result is dropped here
            if success:
                job.deferred.callback(result)
            else:
                job.deferred.errback(result)
        for job in started:
            self._stop_timer(job)  # it left the queue for a thread: no timeout

    @staticmethod
    def _stop_timer(job: _Job) -> None:
        cancel_call(job.timer)
        job.timer = None

    def _unqueue(self, job: _Job) -> bool:
        with self._lock:
            if job in self._queue:
                self._queue.remove(job)
                return True
            return False

    def _cancel(self, job: _Job) -> None:
        job.cancelled = True
        if self._unqueue(job):
            self._stop_timer(job)
        job.deferred.errback(closed_error())

    def _expire(self, job: _Job) -> None:
        job.timer = None
        if not self._unqueue(job):
            return  # a worker took it meanwhile
        waited = round(self.wait_timeout * 1000)
        with self._lock:
            own = self._owner_running.get(job.owner, 0) if job.owner is not None else 0
        if own >= self.per_owner:
            why = (
                f"this connection already runs {own} fs operations, the limit set by "
                "--max-fs-ops-per-session"
            )
        else:
            why = f"all {self.threads} are busy"
        job.deferred.errback(
            invalid(
                f"filesystem busy: no worker thread became free within {waited} ms "
                f"({why}; --fs-wait-timeout-ms); retry later",
                BUSY_KIND,
            )
        )

    def cancel_owner(self, owner: object) -> None:
        """Drop the queued jobs of ``owner``; tell its running ones to stop (:func:`cancelled`)."""
        # Taken off the queue in one pass (not a scan of it per job).
        with self._lock:
            for job in self._running:
                if job.owner is owner:
                    job.cancelled = True
            mine = [job for job in self._queue if job.owner is owner]
            if mine:
                self._queue = deque(job for job in self._queue if job.owner is not owner)
        for job in mine:
            self._stop_timer(job)
            job.deferred.errback(closed_error())

    def stall_reason(self) -> str | None:
        """Why the pool is wedged, or None.

        Wedged: every thread has been busy on one operation for longer than
        ``stall_after`` seconds, so new requests would wait for them.
        """
        with self._lock:
            started = [job.started_at for job in self._running]
            waiting = len(self._queue)
        if len(started) < self.threads:
            return None
        now = self._clock.seconds()
        youngest = max(now if at is None else at for at in started)
        if now - youngest <= self.stall_after:
            return None
        return (
            f"filesystem pool wedged: all {self.threads} worker threads have been busy "
            f"on one operation each for over {self.stall_after:g} s; "
            f"{waiting} request(s) waiting"
        )

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._wake.notify_all()


def thread_pool_runner(
    reactor: PoolReactor, threads: int = FS_THREADS, **options: Any
) -> PoolRunner:
    return PoolRunner(reactor, threads, **options)


def inline_runner(func: Callable[..., Any], *args: Any, owner: object = None) -> Deferred[Any]:
    """Run at once (for dispatchers built on a fake clock in unit tests)."""
    return maybeDeferred(func, *args)
