"""``clientcore.session``, the resume gating, start-retry and re-dial loops
the Twisted and asyncio clients share, driven without any network: fake
connections, a fake clock, ``asyncio.run`` only to step the coroutines."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import attrs
import pytest

from execserver import protocol as p
from execserver.clientcore.errors import (
    AuthRefused,
    ConnectFailed,
    ConnectionClosed,
    OutcomeUnknown,
    SessionLost,
)
from execserver.clientcore.resume import ResumeAttempts
from execserver.clientcore.session import (
    Dialing,
    GaveUp,
    first_dial,
    redial,
    resume_session,
    through_drops,
)

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


def dialing(
    dial: Callable[[], Awaitable[Any]],
    clock: Clock,
    discard: Callable[[Any], Awaitable[None]],
    *,
    refused: bool,
    stopped: Callable[[], bool],
) -> Dialing[Any]:
    """The dial hooks of a client of ``Conn``/``Resumed`` sessions on ``clock``."""
    return Dialing(
        dial,
        session_of=lambda conn: conn.session,
        discard=discard,
        now=lambda: clock.now,
        sleep=clock.sleep,
        refused=lambda exc: refused,
        stopped=stopped,
    )


def redialling(dial: Callable[[], Awaitable[Conn]], clock: Clock, **kwargs: Any) -> Any:
    discarded: list[Conn] = kwargs.pop("discarded", [])

    async def discard(conn: Conn) -> None:
        discarded.append(conn)

    return redial(
        dialing(dial, clock, discard, refused=True, stopped=kwargs.pop("stopped", lambda: False)),
        "s1",
        ResumeAttempts(60.0, clock.now, "dropped"),
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


# --- resume_session: after the redial -------------------------------------------------


@attrs.define
class Resumed:
    session: str
    #: Whether it is still up once adopted (False: it dropped during the catch-up).
    up: bool = True


def resuming(dials: list[Resumed | Exception], clock: Clock, trail: list[object]) -> Any:
    queue = list(dials)

    async def dial() -> Resumed:
        answer = queue.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def discard(conn: Resumed) -> None:
        trail.append(("discard", conn.session))

    async def adopt(conn: Resumed) -> None:
        trail.append(("adopt", conn.session, conn.up))

    return resume_session(
        dialing(dial, clock, discard, refused=False, stopped=lambda: False),
        "s1",
        ResumeAttempts(60.0, clock.now, "dropped"),
        adopt=adopt,
        is_up=lambda conn: conn.up,
        dropped_because=lambda conn: "dropped again",
        resumed=lambda conn: trail.append(("resumed", conn.session)),
        give_up=lambda cause: trail.append(("gave up", cause)),
    )


def test_resume_adopts_then_releases_the_waiting_calls() -> None:
    trail: list[object] = []
    clock = Clock()
    run(resuming([ConnectFailed("ws://h", "reset"), Resumed("s1")], clock, trail))
    assert trail == [("adopt", "s1", True), ("resumed", "s1")]
    assert clock.now == 0.05  # one backoff step


def test_a_drop_during_the_catch_up_resumes_again_before_releasing_anything() -> None:
    trail: list[object] = []
    run(resuming([Resumed("s1", up=False), Resumed("s1")], Clock(), trail))
    assert trail == [("adopt", "s1", False), ("adopt", "s1", True), ("resumed", "s1")]


def test_resume_gives_up_first_then_discards_the_stray_of_another_session() -> None:
    trail: list[object] = []
    run(resuming([Resumed("s2")], Clock(), trail))
    assert trail == [("gave up", "the server started a new session"), ("discard", "s2")]


# --- first_dial: a cut during the first handshake --------------------------------------


def first(dials: Sequence[Conn | Exception], clock: Clock, budget: float = 5.0) -> Any:
    queue = list(dials)

    async def dial() -> Conn:
        answer = queue.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    return first_dial(
        dial,
        budget,
        now=lambda: clock.now,
        sleep=clock.sleep,
        refused=lambda exc: isinstance(exc, ConnectFailed) and "refused" in exc.reason,
        give_up=lambda reason: ConnectFailed("ws://h", reason),
        budget_note=", --session-ttl-ms",
    )


def test_a_cut_during_the_first_handshake_is_dialled_again() -> None:
    clock = Clock()
    conn = Conn("s1")
    assert run(first([ConnectionClosed("cut"), ConnectionClosed("cut"), conn], clock)) is conn
    assert clock.now == pytest.approx(0.15)  # 50 ms, then 100 ms


def test_other_first_failures_and_a_zero_budget_raise_at_once() -> None:
    for error in (ConnectFailed("ws://h", "connection refused"), SessionLost("s", "x")):
        with pytest.raises(type(error)):
            run(first([error], Clock()))
    with pytest.raises(ConnectionClosed):
        run(first([ConnectionClosed("cut")], Clock(), budget=0))


def test_after_a_cut_an_answer_ends_it_and_every_cut_gives_up_clearly() -> None:
    refused_token = AuthRefused("ws://h", 401, "authentication refused (HTTP 401 Unauthorized)")
    with pytest.raises(AuthRefused):
        run(first([ConnectionClosed("cut"), refused_token], Clock()))
    clock = Clock()
    with pytest.raises(ConnectFailed) as info:
        run(first([ConnectionClosed("cut")] * 100, clock, budget=1.0))
    assert str(info.value) == (
        "cannot connect to ws://h: the connection was lost during the handshake "
        "(re-dialled within 1 s, --session-ttl-ms): exec-server connection closed: cut"
    )
    assert 1.0 <= clock.now <= 2.0
    with pytest.raises(ConnectFailed, match=r"the server is gone \(connection refused\)"):
        run(
            first(
                [ConnectionClosed("cut")] + [ConnectFailed("ws://h", "connection refused")] * 99,
                Clock(),
            )
        )
