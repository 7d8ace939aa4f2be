"""The one bounded poll, for conditions that raise no event.

Most waits in the suite are on a Deferred (``with_timeout``) or a message
(``wait_for``); a few conditions have no event to wait on: a process seen
only in /proc, a gauge on ``/metrics``, a line in a server's stderr, state
another thread owns. Those poll, always through one of these three (one per
way a test runs), each with a timeout the caller must give and a failure
that names what was awaited:

- :func:`until`: on the reactor (pytest-twisted tests); the condition may be
  a plain function or an ``async`` one (e.g. an HTTP request per poll).
- :func:`until_asyncio`: inside an asyncio scenario (``tests/support/aio_harness.py``).
- :func:`until_blocking`: where no event loop may run (a thread, or a test
  that blocks its loop on purpose).

The poll interval is the only pause: a bounded wait between two looks at
the condition, never a sleep standing in for synchronisation.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater

from tests.support.harness import reactor, with_timeout

#: Seconds between two looks at a condition (every helper's default).
POLL_INTERVAL = 0.02

Condition = Callable[[], object]
"""A function (or ``async`` function) whose truthy result ends the wait."""


def _failure(what: str, timeout: float, detail: Callable[[], object] | None) -> str:
    message = f"timed out after {timeout}s waiting for {what}"
    if detail is not None:
        message += f" (last seen: {detail()!r})"
    return message


async def _holds(condition: Callable[[], object] | Callable[[], Awaitable[object]]) -> bool:
    """One look at ``condition``: its result (awaited if awaitable) as a bool."""
    result = condition()
    if inspect.isawaitable(result):
        result = await result
    return bool(result)


async def until(
    condition: Callable[[], object] | Callable[[], Awaitable[object]],
    what: str,
    *,
    timeout: float,
    interval: float = POLL_INTERVAL,
    detail: Callable[[], object] | None = None,
) -> float:
    """Poll ``condition`` on the reactor until it is truthy; the seconds it took.

    ``condition`` may return an awaitable (an ``async def``): each poll
    awaits it, and the whole wait, those awaits included, is bounded by
    ``timeout``. Raises :class:`TimeoutError` naming ``what`` (and, with
    ``detail``, what was last seen) when the time is up.
    """
    started = reactor.seconds()

    async def poll() -> None:
        while not await _holds(condition):
            await deferLater(reactor, interval, lambda: None)

    try:
        await with_timeout(Deferred.fromCoroutine(poll()), timeout, what)
    except TimeoutError:
        raise TimeoutError(_failure(what, timeout, detail)) from None
    elapsed: float = reactor.seconds() - started
    return elapsed


async def until_asyncio(
    condition: Callable[[], object] | Callable[[], Awaitable[object]],
    what: str,
    *,
    timeout: float,
    interval: float = POLL_INTERVAL,
    detail: Callable[[], object] | None = None,
) -> float:
    """:func:`until` inside an asyncio event loop (an ``async`` condition too)."""
    loop = asyncio.get_running_loop()
    started = loop.time()

    try:
        async with asyncio.timeout(timeout):
            while not await _holds(condition):
                await asyncio.sleep(interval)
    except TimeoutError:
        raise TimeoutError(_failure(what, timeout, detail)) from None
    return loop.time() - started


def until_blocking(
    condition: Condition,
    what: str,
    *,
    timeout: float,
    interval: float = POLL_INTERVAL,
    detail: Callable[[], object] | None = None,
) -> float:
    """:func:`until` without an event loop: blocks the calling thread meanwhile."""
    started = time.monotonic()
    deadline = started + timeout
    while not condition():
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(_failure(what, timeout, detail))
        time.sleep(min(interval, left))
    return time.monotonic() - started


__all__: list[str] = ["POLL_INTERVAL", "until", "until_asyncio", "until_blocking"]
