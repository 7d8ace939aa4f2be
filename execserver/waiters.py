"""Deferreds handed to callers waiting for something to happen.

Server, transports and client all keep "who is waiting for X" lists; these two
classes are that bookkeeping, once:

- :class:`Waiters`: each :meth:`~Waiters.wait` fires at the *next*
  :meth:`~Waiters.fire` (output arrived, no request in flight, connected).
- :class:`Latch`: something that happens once (exited, closed, connection
  lost); waiting after it happened fires at once with the same result.

A waiter whose Deferred was cancelled, or that its caller :meth:`forget`-s
(a long poll that timed out), is dropped, so abandoned waits never pile up.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall

T = TypeVar("T")


class Waiters(Generic[T]):
    __slots__ = ("_pending",)

    def __init__(self) -> None:
        # A dict (in order of waiting) so a forgotten waiter leaves in O(1):
        # a process's silent long polls time out, each forgetting its own.
        self._pending: dict[Deferred[T], None] = {}

    @property
    def waiting(self) -> int:
        """How many callers are waiting."""
        return len(self._pending)

    def wait(self) -> Deferred[T]:
        d: Deferred[T] = Deferred(self.forget)
        self._pending[d] = None
        return d

    def forget(self, d: Deferred[T]) -> None:
        self._pending.pop(d, None)

    def fire(self, result: T) -> None:
        if self._pending:
            pending, self._pending = self._pending, {}
            for d in pending:
                if not d.called:
                    d.callback(result)

    def fail(self, error: BaseException) -> None:
        pending, self._pending = self._pending, {}
        for d in pending:
            if not d.called:
                d.errback(error)


def cancel_call(call: IDelayedCall | None) -> None:
    """Cancel a timer that may be absent, already fired or already cancelled."""
    if call is not None and call.active():
        call.cancel()


class Latch(Generic[T]):
    __slots__ = ("_result", "_waiters", "done")

    def __init__(self) -> None:
        self._waiters: Waiters[T] = Waiters()
        self.done = False

    @property
    def waiting(self) -> int:
        """How many callers are still waiting."""
        return self._waiters.waiting

    def wait(self) -> Deferred[T]:
        if self.done:
            return succeed(self._result)
        return self._waiters.wait()

    def forget(self, d: Deferred[T]) -> None:
        self._waiters.forget(d)

    def fire(self, result: T) -> None:
        """Happen (once; later calls are ignored)."""
        if not self.done:
            self.done = True
            self._result = result
            self._waiters.fire(result)
