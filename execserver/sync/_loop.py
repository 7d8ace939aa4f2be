"""One asyncio event loop in a daemon thread, and blocking calls into it.

Every :class:`execserver.sync.Client` runs its :mod:`execserver.aio` client
on the same loop, in a thread started by the first client and stopped when
the last one closes (or at interpreter exit). Callers in any thread block on
a queue of their own while the coroutine runs there, so:

- the asyncio client is only ever touched from its loop's thread (it needs
  no locks), and any number of threads can call at once;
- a blocking call has a bound: when it expires, or when the waiting thread
  is interrupted (KeyboardInterrupt), the coroutine is cancelled and the
  caller waits (briefly, bounded) for its cleanup before the exception
  propagates, so a cancelled ``run`` leaves no process behind;
- progress callbacks run in the caller's thread, not in the loop's, so a
  slow or blocking callback never stalls other threads' calls.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from execserver.clientcore.errors import ConnectionClosed

T = TypeVar("T")

#: How long an interrupted or timed-out call waits for its coroutine's
#: cleanup (e.g. terminating the process of a cancelled ``run``).
CANCEL_GRACE = 10.0
#: How long stopping the loop waits for its remaining tasks and the thread.
STOP_GRACE = 10.0

_RESULT = 0
_ERROR = 1
_PROGRESS = 2


class LoopThread:
    """The shared loop: started by the first user, stopped after the last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._users = 0

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    @property
    def users(self) -> int:
        return self._users

    def acquire(self) -> asyncio.AbstractEventLoop:
        """The running loop (started now if need be); pair with :meth:`release`."""
        with self._lock:
            if self._loop is None:
                self._start_locked()
            assert self._loop is not None
            self._users += 1
            return self._loop

    def release(self) -> None:
        """One user fewer; the last one stops the loop and joins its thread."""
        with self._lock:
            self._users -= 1
            if self._users <= 0:
                self._users = 0
                self._stop_locked()

    def _start_locked(self) -> None:
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            try:
                loop.run_forever()
            finally:
                _drain(loop)

        thread = threading.Thread(target=run, name="execserver-sync-loop", daemon=True)
        thread.start()
        ready.wait(STOP_GRACE)
        self._loop, self._thread = loop, thread

    def _stop_locked(self) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is None or thread is None:
            return
        with contextlib.suppress(RuntimeError):  # already closed
            loop.call_soon_threadsafe(loop.stop)
        if thread is not threading.current_thread():
            thread.join(STOP_GRACE)

    def stop(self) -> None:
        """Stop the loop whatever its users (interpreter exit)."""
        with self._lock:
            self._users = 0
            self._stop_locked()


def _drain(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what is left on a stopped loop, let it unwind, and close the loop."""
    try:
        tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            gathered = asyncio.gather(*tasks, return_exceptions=True)
            loop.run_until_complete(asyncio.wait_for(gathered, STOP_GRACE))
        loop.run_until_complete(loop.shutdown_asyncgens())
    except Exception:
        pass
    finally:
        loop.close()
        _abandon(loop)


#: Calls started and not finished, by loop: a loop that stops fails them
#: (a call scheduled just as the last client closed would wait forever).
_INFLIGHT: dict[asyncio.AbstractEventLoop, set[Call[Any]]] = {}
_INFLIGHT_LOCK = threading.Lock()


def _abandon(loop: asyncio.AbstractEventLoop) -> None:
    with _INFLIGHT_LOCK:
        calls = _INFLIGHT.pop(loop, set())
    for call in calls:
        call.fail(_loop_stopped())


LOOP = LoopThread()


def _loop_stopped() -> Exception:
    return ConnectionClosed("the client's event loop has stopped")


class Call(Generic[T]):
    """One coroutine run on the loop for a blocked caller."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        factory: Callable[[], Awaitable[T]],
        what: str,
    ) -> None:
        self._loop = loop
        self._factory = factory
        self._what = what
        self._items: queue.Queue[tuple[int, Any]] = queue.Queue()
        self._finished = threading.Event()
        self._task: asyncio.Task[None] | None = None
        self._cancelled = False
        #: (result,) of a call that completed while its caller was being
        #: interrupted: the caller may keep it (an output event is not lost).
        self.leftover: tuple[T] | None = None

    def progress(self, *args: Any) -> None:
        """Hand ``args`` to the caller's progress callback (from the loop thread)."""
        self._items.put((_PROGRESS, args))

    def start(self) -> None:
        with _INFLIGHT_LOCK:
            _INFLIGHT.setdefault(self._loop, set()).add(self)
        try:
            self._loop.call_soon_threadsafe(self._start)
        except RuntimeError:
            self._finish()
            raise _loop_stopped() from None

    def _finish(self) -> None:
        with _INFLIGHT_LOCK:
            calls = _INFLIGHT.get(self._loop)
            if calls is not None:
                calls.discard(self)
        self._finished.set()

    def fail(self, error: Exception) -> None:
        """End the call with ``error`` unless it has ended (its loop stopped)."""
        if not self._finished.is_set():
            self._items.put((_ERROR, error))
            self._finish()

    def _start(self) -> None:
        if self._cancelled:
            self._finish()
            return
        self._task = self._loop.create_task(self._run())

    async def _run(self) -> None:
        try:
            result = await self._factory()
        except asyncio.CancelledError:
            if not self._cancelled:
                # Not by this caller: the loop is stopping (interpreter exit).
                self._items.put((_ERROR, _loop_stopped()))
            raise
        except BaseException as exc:
            self._items.put((_ERROR, exc))
            if not isinstance(exc, Exception):
                raise
        else:
            self._items.put((_RESULT, result))
        finally:
            self._finish()

    def _cancel(self) -> None:
        self._cancelled = True
        if self._task is None:
            self._finish()
        else:
            self._task.cancel()

    def cancel(self, grace: float = CANCEL_GRACE) -> None:
        """Cancel the coroutine and wait up to ``grace`` seconds for it to unwind."""
        with contextlib.suppress(RuntimeError):  # the loop is gone: nothing to cancel
            self._loop.call_soon_threadsafe(self._cancel)
            self._finished.wait(grace)

    def wait(self, timeout: float | None, on_progress: Callable[..., object] | None = None) -> T:
        """Block until the result; TimeoutError (and cancellation) after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"{self._what}: no result within {timeout:g}s")
                try:
                    kind, value = self._items.get(timeout=remaining)
                except queue.Empty:
                    continue
                if kind == _PROGRESS:
                    if on_progress is not None:
                        on_progress(*value)
                    continue
                break
        except BaseException as exc:
            # Timed out, or interrupted (KeyboardInterrupt, an exception from
            # the progress callback): the coroutine must not live on.
            self.cancel()
            outcome = self._outcome()
            if outcome is None or not isinstance(exc, TimeoutError):
                if outcome is not None and outcome[0] == _RESULT:
                    self.leftover = (outcome[1],)
                raise
            # It ended as the bound expired: what it got is not thrown away.
            kind, value = outcome
        if kind == _ERROR:
            raise value
        result: T = value
        return result

    def _outcome(self) -> tuple[int, Any] | None:
        """The result or error already queued, if any (without waiting)."""
        while True:
            try:
                kind, value = self._items.get_nowait()
            except queue.Empty:
                return None
            if kind != _PROGRESS:
                return kind, value


def blocking(
    loop: asyncio.AbstractEventLoop,
    factory: Callable[[], Awaitable[T]],
    timeout: float | None,
    what: str,
) -> T:
    """Run ``factory()`` on ``loop`` and wait for it at most ``timeout`` seconds."""
    check_not_loop_thread()
    call = Call(loop, factory, what)
    call.start()
    return call.wait(timeout)


def check_not_loop_thread() -> None:
    if threading.current_thread() is LOOP.thread:
        raise RuntimeError(
            "execserver.sync: a blocking call from the client's own event-loop thread "
            "would wait for itself; use execserver.aio in asyncio code"
        )


atexit.register(LOOP.stop)
