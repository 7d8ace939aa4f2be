"""Running :mod:`execserver.aio` code from the Twisted-driven test suite.

The suite runs on pytest-twisted's reactor (which also drives the server
harnesses and the cutting proxy), so an asyncio scenario runs with
``asyncio.run`` in a reactor worker thread: the reactor keeps serving the
harness meanwhile. Every scenario is bounded by a timeout inside the event
loop, so the thread always ends. From the scenario, :func:`on_reactor` runs
a function on the reactor (e.g. ``proxy.cut``) and waits for its result.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from twisted.internet import threads
from twisted.internet.defer import Deferred

from tests.support.harness import reactor

T = TypeVar("T")

#: A whole asyncio scenario (a busy 2-core machine; typically well under 5 s).
SCENARIO_TIMEOUT = 60.0


def in_asyncio(
    scenario: Callable[[], Awaitable[T]], timeout: float = SCENARIO_TIMEOUT
) -> Deferred[T]:
    """Run ``scenario()`` in a fresh event loop on a worker thread."""

    async def bounded() -> T:
        async with asyncio.timeout(timeout):
            return await scenario()

    return threads.deferToThread(asyncio.run, bounded())


async def on_reactor(fn: Callable[..., Any], *args: Any) -> Any:
    """Call ``fn(*args)`` on the reactor thread (waiting for a Deferred it returns)."""
    return await asyncio.to_thread(threads.blockingCallFromThread, reactor, fn, *args)


class Stderr:
    """Collects a spawned server's stderr (``connect(stderr=...)``)."""

    def __init__(self) -> None:
        self.data = b""

    def __call__(self, data: bytes) -> None:
        self.data += data

    def check(self) -> None:
        assert b"Traceback" not in self.data, self.data.decode(errors="replace")


# --- recording channels: a client's RPC layer driven with no server ---------------------


class RecordingChannel:
    """An ``AsyncRpc`` channel that keeps every message sent, decoded."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def send(self, data: bytes) -> None:
        self.sent.append(json.loads(data))

    async def aclose(self) -> None:
        pass

    def abort(self) -> None:
        pass


class RecordingSink:
    """The same for the Twisted ``RpcClient`` (``attach``)."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send_message(self, data: bytes) -> None:
        self.sent.append(json.loads(data))

    def close(self) -> None:
        pass
