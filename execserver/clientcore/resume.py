"""When a client that lost its connection stops trying to resume the session.

:class:`ResumeAttempts` is the retry policy of a session resume, free of any
event loop: the caller dials, reports each failed dial with the time on its
own clock, sleeps :meth:`~ResumeAttempts.next_delay` between attempts, and
gives up with the cause it is handed. It gives up

- when the server answers that the session is unknown (it expired or the
  server restarted): no later attempt can succeed;
- when the upgrade is refused (:class:`AuthRefused`, 401/403): the session
  belongs to the identity that created it, and a token refused now will not
  be accepted on a retry either;
- when connections have been refused for :data:`REFUSED_GIVE_UP_SECONDS`
  (nothing listens any more: the server is gone, and so is the session);
- after the session's TTL.
"""

from __future__ import annotations

from typing import TypeGuard

from execserver.clientcore.errors import AuthRefused, ConnectFailed, ServerError

#: After a drop, how long refused connections are retried before the
#: session counts as lost.
REFUSED_GIVE_UP_SECONDS = 2.0


#: How the server words its answer to a resume of a session it does not
#: have (expired, ended, restarted, or another identity's): the reference's
#: text, followed by the id.
UNKNOWN_SESSION_PREFIX = "unknown session id"


def is_unknown_session(exc: BaseException) -> TypeGuard[ServerError]:
    """The server answered that the session is unknown: no resume can succeed."""
    return isinstance(exc, ServerError) and exc.message.startswith(UNKNOWN_SESSION_PREFIX)


class ResumeAttempts:
    """The attempts to resume one session after one drop."""

    def __init__(
        self,
        ttl: float,
        now: float,
        cause: str,
        *,
        initial_delay: float = 0.05,
        max_delay: float = 2.0,
    ) -> None:
        self.ttl = ttl
        #: Why the last attempt failed (at first: why the connection dropped).
        self.cause = cause
        self._initial_delay = initial_delay
        self._max_delay = max_delay
        self.restart(now, cause)

    def restart(self, now: float, cause: str) -> None:
        """Dropped again right after a resume: attempts start over."""
        self.cause = cause
        self._started = now
        self._refused_since: float | None = None
        self._delay = self._initial_delay

    def failed(self, exc: Exception, now: float, *, refused: bool) -> str | None:
        """A dial failed with ``exc``; the cause to give up with, or None to go on.

        ``refused``: the connection was refused (each client tells it by the
        typed cause its own network layer raises, not by the text).
        """
        if isinstance(exc, ServerError):
            if is_unknown_session(exc):
                return exc.message
            self.cause = exc.message  # "already attached": the server has not noticed yet
            return None
        if isinstance(exc, AuthRefused):
            return exc.reason
        self.cause = exc.reason if isinstance(exc, ConnectFailed) else str(exc)
        if refused:
            if self._refused_since is None:
                self._refused_since = now
            if now - self._refused_since >= REFUSED_GIVE_UP_SECONDS:
                return f"the server is gone ({self.cause})"
        else:
            self._refused_since = None
        return None

    def expired(self, now: float) -> str | None:
        """The cause to give up with once the TTL has passed, else None."""
        if now - self._started >= self.ttl:
            return f"no connection within its {self.ttl:g} s TTL ({self.cause})"
        return None

    def next_delay(self) -> float:
        """Seconds to wait before the next attempt (doubling up to the maximum)."""
        delay = self._delay
        self._delay = min(delay * 2, self._max_delay)
        return delay
