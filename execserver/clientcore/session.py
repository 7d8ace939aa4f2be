"""Following one resumable session across connections, free of any event loop.

What the Twisted clients (:mod:`execserver.client.reconnect`) and the
asyncio client (:mod:`execserver.aio.client`) share once a connection of a
resumable session drops; each supplies only its way to wait (coroutines
returning its connection type ``C``, a ``now`` and a ``sleep``) and to dial:

- **resume gating** (:func:`through_drops`): a call in flight at a drop is
  sent again on the resumed session when repeating it is harmless
  (:func:`execserver.clientcore.calls.after_drop`) and fails with
  :class:`~execserver.clientcore.errors.OutcomeUnknown` otherwise; a call
  whose session could not be resumed fails with the client's
  :class:`~execserver.clientcore.errors.SessionLost`;
- **the start-retry loop** (:func:`through_drops` with ``p.PROCESS_START``): a
  ``process/start`` in flight at a drop is sent again with the same
  ``processId`` once the session is resumed (``again=True``), where
  "process ID already exists" says the first one was carried out
  (:func:`execserver.clientcore.follow.send_start`);
- **re-dialling** (:func:`redial`, with the client's :class:`Dialing`
  hooks): dial with the backoff and give-up rules of
  :class:`~execserver.clientcore.resume.ResumeAttempts` until a
  connection of the same session comes, or the cause to give up;
- **resuming** (:func:`resume_session`): after a drop, re-dial
  (:func:`redial`), then adopt the handles on the resumed connection and
  catch them up, resume again if it dropped meanwhile, and only then hand
  the connection to the calls waiting for it; or give up;
- **the first dial** (:func:`first_dial`): a connection cut during its
  first ``initialize`` leaves no session to resume but nothing started
  either, so it is dialled again with the same backoff, within the TTL the
  session asks for.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import attrs

from execserver import protocol as p
from execserver.clientcore.calls import after_drop
from execserver.clientcore.errors import (
    AuthRefused,
    ConnectFailed,
    ConnectionClosed,
    OutcomeUnknown,
    SessionLost,
)
from execserver.clientcore.resume import ResumeAttempts

C = TypeVar("C")
T = TypeVar("T")


async def through_drops(
    next_connection: Callable[[], Awaitable[C]],
    send: Callable[[C, bool], Awaitable[T]],
    method: str,
    params: object,
    *,
    following: Callable[[C], bool],
    session_of: Callable[[C], str | None],
    lost_error: Callable[[str], Exception],
    first: C | None = None,
) -> T:
    """``send(connection, again)`` on the current (or next) connection until
    it is answered, following the session across drops.

    ``following(connection)``: the client rides through a drop of it (a
    resumable session, the client neither closing nor stopped). After a drop
    the call is sent again on the next connection when
    :func:`~execserver.clientcore.calls.after_drop` allows it -- and always
    for ``process/start`` (``again=True`` then: the same ``processId`` makes
    the resend safe); a next connection of another session (the old one
    could not be resumed) fails it with ``lost_error(session_id)``.
    ``first``: the connection to send on first (already awaited by the caller).
    """
    session: str | None = None
    again = False
    connection = first
    while True:
        if connection is None:
            connection = await next_connection()
        if session is not None and session_of(connection) != session:
            # The session the call belonged to could not be resumed.
            raise lost_error(session)
        try:
            return await send(connection, again)
        except ConnectionClosed as exc:
            error = after_drop(method, params, exc, following=following(connection))
            if error is exc:
                raise
            if error is not None and method != p.PROCESS_START:
                raise error from None
            # Safe to send again once the session is resumed (a start: unknown
            # whether the server started it; "already exists" will tell).
            session = session_of(connection) or ""
            again = True
            connection = None


@attrs.frozen
class GaveUp(Generic[C]):
    """:func:`redial` gave up: the session is lost, for ``cause``."""

    cause: str
    #: A connection of another session (the server started a new one), for
    #: the caller to close once it has failed what waited for the old one.
    stray: C | None = None


@attrs.frozen
class Dialing(Generic[C]):
    """How a client dials its session again: the hooks :func:`redial` (and
    :func:`resume_session` through it) follow a session with.

    ``dial()`` makes a connection; ``session_of`` names its session;
    ``discard`` closes one not wanted; ``now``/``sleep`` are the client's
    clock; ``refused`` tells a refused connection by the client's own typed
    cause; ``stopped()`` says the client stopped; a dial failing with
    ``retry_on`` is retried (``on_retry(cause)`` told before the backoff).
    """

    dial: Callable[[], Awaitable[C]]
    session_of: Callable[[C], str | None]
    discard: Callable[[C], Awaitable[None]]
    now: Callable[[], float]
    sleep: Callable[[float], Awaitable[None]]
    refused: Callable[[Exception], bool]
    stopped: Callable[[], bool]
    retry_on: type[Exception] = Exception
    on_retry: Callable[[str], None] = lambda cause: None


async def redial(
    dialing: Dialing[C], session_id: str | None, attempts: ResumeAttempts
) -> C | GaveUp[C] | None:
    """Dial until a connection of ``session_id`` comes (returned), or until
    ``attempts`` gives up (:class:`GaveUp`); None once ``stopped()`` (a
    connection that came meanwhile is ``discard``-ed).

    A dial failing with ``retry_on`` is reported to ``attempts`` (``refused``
    tells a refused connection by the client's own typed cause); a
    connection of another session (the server started a new one: the old one
    is gone) ends the attempts, handed back as the ``stray`` to close.
    """
    while not dialing.stopped():
        try:
            connection = await dialing.dial()
        except dialing.retry_on as exc:
            cause = attempts.failed(exc, dialing.now(), refused=dialing.refused(exc))
            if cause is not None:
                return GaveUp(cause)
        else:
            if dialing.stopped():
                await dialing.discard(connection)
                return None
            if dialing.session_of(connection) != session_id:
                return GaveUp("the server started a new session", connection)
            return connection
        expired = attempts.expired(dialing.now())
        if expired is not None:
            return GaveUp(expired)
        dialing.on_retry(attempts.cause)
        await dialing.sleep(attempts.next_delay())
    return None


async def resume_session(
    dialing: Dialing[C],
    session_id: str | None,
    attempts: ResumeAttempts,
    *,
    adopt: Callable[[C], Awaitable[None]],
    is_up: Callable[[C], bool],
    dropped_because: Callable[[C], str | None],
    resumed: Callable[[C], None],
    give_up: Callable[[str], None],
) -> None:
    """Follow session ``session_id`` after a drop, until it is resumed, lost
    or the client stops: what the asyncio client and ``ResumingClient`` do
    once a connection of theirs dropped.

    :func:`redial` until a connection of the session comes; ``adopt`` it
    (the client takes it as its connection and catches every handle up
    from its last seq); if it dropped again meanwhile, the attempts start
    over from that drop (``dropped_because``) and the handles keep
    waiting; otherwise ``resumed`` hands it to the calls waiting for a
    connection. When :func:`redial` gives up, ``give_up(cause)`` fails the
    handles and the waiting calls with the client's ``SessionLost``, then
    a stray connection of another session is ``discard``-ed.
    """
    while True:
        outcome = await redial(dialing, session_id, attempts)
        if outcome is None:
            return
        if isinstance(outcome, GaveUp):
            give_up(outcome.cause)
            if outcome.stray is not None:
                await dialing.discard(outcome.stray)
            return
        await adopt(outcome)
        if not is_up(outcome):
            attempts.restart(dialing.now(), dropped_because(outcome) or attempts.cause)
            continue
        resumed(outcome)
        return


def handshake_cut(exc: BaseException) -> bool:
    """``exc`` ended a dial whose connection was up and dropped before the
    ``initialize`` answer (not a refusal, a timeout or an answer)."""
    return isinstance(exc, ConnectionClosed) and not isinstance(exc, SessionLost | OutcomeUnknown)


async def first_dial(
    dial: Callable[[], Awaitable[C]],
    budget: float,
    *,
    now: Callable[[], float],
    sleep: Callable[[float], Awaitable[None]],
    refused: Callable[[Exception], bool],
    give_up: Callable[[str], Exception],
    budget_note: str = "",
    on_retry: Callable[[str], None] = lambda cause: None,
    initial_delay: float = 0.05,
    max_delay: float = 2.0,
) -> C:
    """The first connection of a session that is to outlive drops.

    A first dial that fails otherwise than by a cut during its handshake
    (:func:`handshake_cut`) raises at once, as before. After such a cut --
    no session exists yet, and nothing was started -- it is dialled again
    with the backoff of a resume (``initial_delay`` doubling up to
    ``max_delay``) for at most ``budget`` seconds (the session TTL asked
    for; 0: no re-dial); a later attempt refused for 2 s (nothing listens
    any more), answered with an error or refused by the token ends it too.
    Giving up raises ``give_up(reason)``, the reason naming the cut, the
    budget (``budget_note`` says where it comes from) and the last cause.
    """
    attempts: ResumeAttempts | None = None
    while True:
        try:
            return await dial()
        except Exception as exc:
            if attempts is None:
                if budget <= 0 or not handshake_cut(exc):
                    raise
                attempts = ResumeAttempts(
                    budget, now(), str(exc), initial_delay=initial_delay, max_delay=max_delay
                )
            elif not handshake_cut(exc) and (
                not isinstance(exc, ConnectFailed) or isinstance(exc, AuthRefused)
            ):
                raise  # an answer (an error, a refused token): no retry changes it
            cause = attempts.failed(exc, now(), refused=refused(exc))
            if cause is None and attempts.expired(now()) is not None:
                cause = attempts.cause
            if cause is not None:
                raise give_up(
                    f"the connection was lost during the handshake (re-dialled within "
                    f"{budget:g} s{budget_note}): {cause}"
                ) from exc
            on_retry(attempts.cause)
        await sleep(attempts.next_delay())
