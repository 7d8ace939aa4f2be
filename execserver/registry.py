"""Sessions that outlive their connection (docs/protocol.md, "Resumable sessions").

The :class:`SessionRegistry` is server-wide. A session that asked for a
lifetime after a disconnect (``initialize`` ``sessionTtlMs``) is registered
under its id; when its connection goes it is *detached*: its processes keep
running, their output is retained, their timers run and they count against
every limit. Within the TTL a new connection may take it over with
``resumeSessionId``; when the TTL expires its processes are terminated
(whole trees) and the id becomes unknown. Server shutdown terminates
detached sessions too.

Ownership: a session records the identity of the connection that created
it and is resumed only by a connection with an equal identity. Until
authentication exists every listener connection has :data:`ANONYMOUS`; an
authenticating transport sets ``identity`` on its protocol object (the
dispatcher's ``Outbound``) and nothing else changes. A mismatch answers
exactly like an unknown id, so ids cannot be probed across owners.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, Protocol

from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.logger import Logger
from zope.interface import implementer

from execserver.errors import RpcError
from execserver.waiters import cancel_call

log = Logger()

#: The identity of every connection until a transport authenticates.
ANONYMOUS: Final = "anonymous"

#: The current reference's code for a resume of a session attached elsewhere.
SESSION_ALREADY_ATTACHED = -32010


@implementer(IPushProducer)
class ResumableSession(Protocol):
    """A session as its connection and this registry handle it.

    The application's session (:class:`execserver.session.Session`) is one;
    the dispatcher and the registry know it only through this. It is also
    the flow-control producer its transport registers.
    """

    session_id: str
    #: How long the session outlives a disconnect, in ms (0: it does not).
    ttl_ms: int
    #: Who created it: only the same identity may resume it.
    owner: object
    #: True while a connection carries it.
    attached: bool
    #: The client speaks the reference's current dialect.
    speaks_current_dialect: bool

    def attach(self, send: Callable[[object], None]) -> None:
        """A connection carries the session from now on, sending through ``send``."""

    def detach(self) -> None:
        """Its connection is gone: keep running, send nothing."""

    def shutdown(self) -> Deferred[None]:
        """End everything the session runs; fires when all of it is gone."""

    def release(self) -> None:
        """After shutdown: drop what the session holds."""

    def release_held(self) -> None:
        """Send the events held back until a response had been written."""

    def steer_flow_of(self, target: ResumableSession) -> None:
        """Let this session's flow control (its transport's) steer ``target``."""

    def pauseProducing(self) -> None: ...

    def resumeProducing(self) -> None: ...

    def stopProducing(self) -> None: ...


class SessionRegistry:
    """Resumable sessions by id, with their expiry timers."""

    def __init__(self, clock: IReactorTime) -> None:
        self._clock = clock
        self._sessions: dict[str, ResumableSession] = {}
        self._expiry: dict[str, IDelayedCall] = {}
        #: Expired sessions still terminating, so shutdown waits for them.
        self._ending: set[Deferred[None]] = set()

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    @property
    def detached_count(self) -> int:
        return len(self._expiry)

    def detached_sessions(self) -> list[ResumableSession]:
        """Sessions waiting to be resumed (their expiry timer runs)."""
        return [self._sessions[sid] for sid in self._expiry if sid in self._sessions]

    def detached_owned_by(self, identity: object) -> int:
        return sum(1 for session in self.detached_sessions() if session.owner == identity)

    @property
    def ending_count(self) -> int:
        """Expired or evicted sessions still terminating their processes."""
        return len(self._ending)

    def evict_oldest_detached(self, identity: object) -> ResumableSession | None:
        """End the session of ``identity`` detached the longest, as if its TTL expired.

        (``_expiry`` keeps detach order: a resume removes a session, a
        detach appends it.) None when ``identity`` has no detached session.
        """
        for sid in self._expiry:
            session = self._sessions.get(sid)
            if session is not None and session.owner == identity:
                self._cancel_expiry(sid)
                del self._sessions[sid]
                log.info(
                    "session {session_id} of {identity} evicted (the oldest detached one: "
                    "--max-sessions-per-identity reached); terminating its processes",
                    session_id=sid,
                    identity=identity,
                )
                self._end(session)
                return session
        return None

    def register(self, session: ResumableSession) -> None:
        self._sessions[session.session_id] = session

    def forget(self, session: ResumableSession) -> None:
        """The session ended (its connection closed without a TTL)."""
        if self._sessions.get(session.session_id) is session:
            del self._sessions[session.session_id]
        self._cancel_expiry(session.session_id)

    def take_over(self, session_id: str, identity: object) -> ResumableSession:
        """The detached session ``session_id`` for a connection of ``identity``.

        Raises the exact errors of the contract: ``unknown session id ID``
        (never created, expired, ended, or owned by someone else) and, as
        codex exec-server 0.171.0, ``-32010`` ``session ID is already attached
        to another connection`` (the code its client's recovery retries on).
        """
        session = self._sessions.get(session_id)
        if session is None or session.owner != identity:
            raise RpcError.invalid_request(f"unknown session id {session_id}")
        if session.attached:
            raise RpcError(
                SESSION_ALREADY_ATTACHED,
                f"session {session_id} is already attached to another connection",
            )
        self._cancel_expiry(session_id)
        return session

    def detach(self, session: ResumableSession) -> None:
        """Its connection is gone: keep it for ``ttl_ms``, then end it."""
        session.detach()
        self._cancel_expiry(session.session_id)
        self._expiry[session.session_id] = self._clock.callLater(
            session.ttl_ms / 1000.0, self._expire, session
        )

    def _cancel_expiry(self, session_id: str) -> None:
        cancel_call(self._expiry.pop(session_id, None))

    def _expire(self, session: ResumableSession) -> None:
        self._expiry.pop(session.session_id, None)
        if self._sessions.get(session.session_id) is session:
            del self._sessions[session.session_id]
        log.info(
            "session {session_id} expired after {ttl} ms detached; terminating its processes",
            session_id=session.session_id,
            ttl=session.ttl_ms,
        )
        self._end(session)

    def _end(self, session: ResumableSession) -> Deferred[None]:
        d = session.shutdown()
        self._ending.add(d)

        def done(result: object) -> object:
            self._ending.discard(d)
            session.release()
            return result

        d.addBoth(done)
        return d

    def shutdown(self) -> Deferred[None]:
        """Terminate every detached session (server stop)."""
        for sid in list(self._expiry):
            self._cancel_expiry(sid)
            session = self._sessions.pop(sid, None)
            if session is not None:
                self._end(session)
        if not self._ending:
            return succeed(None)
        return DeferredList(list(self._ending)).addCallback(lambda _: None)
