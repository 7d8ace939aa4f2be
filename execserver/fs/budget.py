"""The reply budget: bytes of ``fs/readFile`` replies being built or not yet sent."""

from __future__ import annotations

from collections import deque

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from execserver.fs.paths import BUSY_KIND, closed_error, invalid
from execserver.replies import Charged
from execserver.waiters import cancel_call

# --- reply budget ---------------------------------------------------------------


@attrs.define(eq=False)
class Charge:
    """Bytes of one reply, held against a :class:`ReplyBudget` until released."""

    budget: ReplyBudget
    owner: object
    size: int
    released: bool = False

    def resize(self, size: int) -> None:
        """Charge what the reply actually took (a file may grow while read)."""
        if not self.released:
            self.budget._adjust(self, size)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.budget._adjust(self, 0)


@attrs.define(eq=False)
class _BudgetWait:
    owner: object
    size: int
    deferred: Deferred[Charge]
    timer: IDelayedCall | None = None


class ReplyBudget:
    """Bytes of replies being built or queued unsent, per connection and per server.

    :meth:`reserve` grants a :class:`Charge` once the reply fits both
    limits; requests wait in order (a request held back by the server-wide
    limit holds back all later ones; one held back by its own connection's
    limit holds back only that connection's later ones), at most
    ``wait_timeout`` seconds. A reply that could never fit fails at once.
    """

    def __init__(
        self, clock: IReactorTime, limit: int, connection_limit: int, wait_timeout: float
    ) -> None:
        self._clock = clock
        self.limit = limit
        self.connection_limit = connection_limit
        self.wait_timeout = wait_timeout
        self.used = 0
        self._owned: dict[object, int] = {}
        self._waits: deque[_BudgetWait] = deque()
        # What the last serving of the queue found (kept until it is served
        # again): the owners held back by their connection's limit, and
        # whether a wait is held back by the server-wide one.
        self._held: set[int] = set()
        self._stalled = False

    @property
    def waiting(self) -> int:
        return len(self._waits)

    def owned(self, owner: object) -> int:
        return self._owned.get(owner, 0)

    def try_reserve(self, owner: object, size: int) -> Charge | None:
        """A charge at once if nothing waits and ``size`` fits now, else None."""
        if self._waits or self.used + size > self.limit:
            return None
        owned = self.owned(owner) + size
        if owned > self.connection_limit:
            return None
        self.used += size
        self._owned[owner] = owned
        return Charge(self, owner, size)

    def reserve(self, owner: object, size: int) -> Deferred[Charge]:
        if size > min(self.limit, self.connection_limit):
            flag, cap = (
                ("--connection-reply-budget-bytes", self.connection_limit)
                if self.connection_limit <= self.limit
                else ("--reply-budget-bytes", self.limit)
            )
            raise invalid(
                f"fs/readFile reply of {size} bytes exceeds the reply budget "
                f"of {cap} bytes ({flag})",
                "replyTooLarge",
            )
        wait = _BudgetWait(owner, size, Deferred(lambda _: self._cancel(wait)))
        # The queue was served whenever room was made or a wait left, so
        # nothing in it can be granted now: only the new wait may be, when no
        # earlier one waits for server-wide room and none of its connection's
        # waits (no scan of the whole queue per request).
        if not self._stalled and id(owner) not in self._held:
            owned = self.owned(owner) + size
            if owned > self.connection_limit:
                self._held.add(id(owner))
            elif self.used + size > self.limit:
                self._stalled = True
            else:
                self.used += size
                self._owned[owner] = owned
                wait.deferred.callback(Charge(self, owner, size))
                return wait.deferred
        self._waits.append(wait)
        wait.timer = self._clock.callLater(self.wait_timeout, self._expire, wait)
        return wait.deferred

    def _serve(self) -> None:
        # One pass, keeping what still waits in a new queue: removing each
        # granted wait from the middle of the deque made a long queue quadratic.
        granted: list[tuple[_BudgetWait, Charge]] = []
        held: set[int] = set()
        stalled = False
        waits = self._waits
        kept: deque[_BudgetWait] = deque()
        while waits:
            wait = waits.popleft()
            if id(wait.owner) in held:
                kept.append(wait)
                continue
            owned = self.owned(wait.owner) + wait.size
            if owned > self.connection_limit:
                held.add(id(wait.owner))
                kept.append(wait)
                continue
            if self.used + wait.size > self.limit:
                kept.append(wait)
                kept.extend(waits)
                stalled = True
                break
            self._stop_timer(wait)
            self.used += wait.size
            self._owned[wait.owner] = owned
            granted.append((wait, Charge(self, wait.owner, wait.size)))
        self._waits = kept
        self._held = held
        self._stalled = stalled
        # Fired after the scan: callbacks may release or reserve again.
        for wait, charge in granted:
            wait.deferred.callback(charge)

    def _adjust(self, charge: Charge, size: int) -> None:
        delta = size - charge.size
        charge.size = size
        self.used += delta
        owned = self.owned(charge.owner) + delta
        if owned:
            self._owned[charge.owner] = owned
        else:
            self._owned.pop(charge.owner, None)
        if delta < 0:
            self._serve()

    @staticmethod
    def _stop_timer(wait: _BudgetWait) -> None:
        cancel_call(wait.timer)
        wait.timer = None

    def _cancel(self, wait: _BudgetWait) -> None:
        if wait in self._waits:
            self._waits.remove(wait)
        self._stop_timer(wait)
        wait.deferred.errback(closed_error())
        self._serve()

    def _expire(self, wait: _BudgetWait) -> None:
        wait.timer = None
        if wait not in self._waits:
            return
        self._waits.remove(wait)
        waited = round(self.wait_timeout * 1000)
        wait.deferred.errback(
            invalid(
                f"fs/readFile could not get {wait.size} bytes of reply budget within "
                f"{waited} ms (--fs-wait-timeout-ms): replies being built or not yet sent "
                f"hold {self.used} of {self.limit} bytes on this server and "
                f"{self.owned(wait.owner)} of {self.connection_limit} on this connection; "
                "retry later",
                BUSY_KIND,
            )
        )
        self._serve()

    def cancel_owner(self, owner: object) -> None:
        """Drop the waiting reservations of ``owner`` (its connection closed)."""
        dropped = [wait for wait in self._waits if wait.owner is owner]
        if not dropped:
            return
        # Taken off the queue together, then served once (not once per wait).
        self._waits = deque(wait for wait in self._waits if wait.owner is not owner)
        for wait in dropped:
            self._stop_timer(wait)
            wait.deferred.errback(closed_error())
        self._serve()


__all__ = ["Charge", "Charged", "ReplyBudget"]
