"""``execserver.waiters``: :class:`Waiters` fires only those waiting at the time
(dropping cancelled and forgotten waits), and :class:`Latch` fires once, then
answers every later wait at once.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import CancelledError, Deferred

from execserver.waiters import Latch, Waiters


def results(d: Deferred[Any]) -> list[object]:
    out: list[object] = []
    d.addBoth(out.append)
    return out


def test_waiters_fire_only_those_waiting_at_the_time() -> None:
    waiters: Waiters[int] = Waiters()
    first = results(waiters.wait())
    waiters.fire(1)
    second = results(waiters.wait())
    assert first == [1]
    assert second == []
    waiters.fire(2)
    assert second == [2]
    assert waiters.waiting == 0


def test_a_forgotten_or_cancelled_wait_is_dropped() -> None:
    waiters: Waiters[int] = Waiters()
    forgotten = waiters.wait()
    cancelled = waiters.wait()
    waiters.forget(forgotten)
    cancelled.addErrback(lambda f: f.trap(CancelledError))
    cancelled.cancel()
    assert waiters.waiting == 0
    assert results(forgotten) == []


def test_waiters_fail_errbacks_everyone() -> None:
    waiters: Waiters[int] = Waiters()
    got = results(waiters.wait())
    waiters.fail(ValueError("stopped"))
    assert len(got) == 1 and getattr(got[0], "type", None) is ValueError


def test_latch_fires_once_and_answers_later_waits_at_once() -> None:
    latch: Latch[str] = Latch()
    early = results(latch.wait())
    latch.fire("first")
    latch.fire("second")
    assert early == ["first"]
    assert results(latch.wait()) == ["first"]
    assert latch.done and latch.waiting == 0
