"""``clientcore.session``, the resume gating, start-retry and re-dial loops
the Twisted and asyncio clients share, driven without any network: fake
connections, a fake clock, ``asyncio.run`` only to step the coroutines."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import attrs
import pytest

from execserver import protocol as p
from execserver.clientcore.errors import (
    ConnectFailed,
    ConnectionClosed,
    OutcomeUnknown,
    SessionLost,
)
from execserver.clientcore.resume import ResumeAttempts
from execserver.clientcore.session import GaveUp, redial, through_drops

T = TypeVar("T")


@attrs.define
class Conn:
    session: str
    #: Each send on this connection: drop it (ConnectionClosed) or answer.
    drops: bool = False
    sent: list[tuple[str, bool]] = attrs.Factory(list)


def run(coro: Awaitable[T]) -> T:
    async def main() -> T:
        return await coro

    return asyncio.run(main())


def loop_over(conns: list[Conn]) -> Callable[[], Awaitable[Conn]]:
    queue = list(conns)

    async def next_connection() -> Conn:
        return queue.pop(0)

    return next_connection


def send_on(method: str) -> Callable[[Conn, bool], Awaitable[str]]:
    async def send(conn: Conn, again: bool) -> str:
        conn.sent.append((method, again))
        if conn.drops:
            raise ConnectionClosed("peer dropped")
        return f"answered on {conn.session}"

    return send


def follow(method: str, conns: list[Conn], following: bool = True) -> Any:
    return through_drops(
        loop_over(conns),
        send_on(method),
        method,
        None,
        following=lambda conn: following,
        session_of=lambda conn: conn.session,
        lost_error=lambda session: SessionLost(session, "not resumed"),
    )


def test_a_repeatable_call_is_sent_again_on_the_resumed_session() -> None:
    first, second = Conn("s1", drops=True), Conn("s1")
    assert run(follow(p.PROCESS_READ, [first, second])) == "answered on s1"
    assert first.sent == [(p.PROCESS_READ, False)]
    assert second.sent == [(p.PROCESS_READ, True)]


def test_a_call_that_is_not_repeatable_fails_as_outcome_unknown() -> None:
    first = Conn("s1", drops=True)
    with pytest.raises(OutcomeUnknown):
        run(follow(p.PROCESS_TERMINATE, [first, Conn("s1")]))


def test_a_start_is_sent_again_marked_again_and_fails_on_another_session() -> None:
    first, second = Conn("s1", drops=True), Conn("s1")
    run(follow(p.PROCESS_START, [first, second]))
    assert second.sent == [(p.PROCESS_START, True)]
    with pytest.raises(SessionLost):
        run(follow(p.PROCESS_START, [Conn("s1", drops=True), Conn("s2")]))


def test_a_client_not_following_keeps_the_drops_own_error() -> None:
    with pytest.raises(ConnectionClosed) as info:
        run(follow(p.PROCESS_READ, [Conn("s1", drops=True)], following=False))
    assert type(info.value) is ConnectionClosed


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    async def sleep(self, seconds: float) -> None:
        self.now += seconds


def redialling(dial: Callable[[], Awaitable[Conn]], clock: Clock, **kwargs: Any) -> Any:
    discarded: list[Conn] = kwargs.pop("discarded", [])

    async def discard(conn: Conn) -> None:
        discarded.append(conn)

    return redial(
        dial,
        "s1",
        ResumeAttempts(60.0, clock.now, "dropped"),
        session_of=lambda conn: conn.session,
        discard=discard,
        now=lambda: clock.now,
        sleep=clock.sleep,
        refused=lambda exc: True,
        stopped=kwargs.pop("stopped", lambda: False),
    )


def test_redial_gives_up_once_connections_are_refused_for_two_seconds() -> None:
    clock = Clock()

    async def refused() -> Conn:
        raise ConnectFailed("ws://h", "connection refused")

    outcome = run(redialling(refused, clock))
    assert isinstance(outcome, GaveUp) and outcome.stray is None
    assert outcome.cause == "the server is gone (connection refused)"
    assert 2.0 <= clock.now <= 4.0  # the refused window, plus the last backoff step


def test_redial_hands_back_a_connection_of_another_session_as_the_stray() -> None:
    other = Conn("s2")

    async def dial() -> Conn:
        return other

    outcome = run(redialling(dial, Clock()))
    assert outcome == GaveUp("the server started a new session", other)


def test_redial_returns_the_resumed_connection_or_discards_it_once_stopped() -> None:
    resumed = Conn("s1")

    async def dial() -> Conn:
        return resumed

    assert run(redialling(dial, Clock())) is resumed
    stopping = iter([False, True])
    discarded: list[Conn] = []
    assert (
        run(redialling(dial, Clock(), stopped=lambda: next(stopping), discarded=discarded)) is None
    )
    assert discarded == [resumed]
