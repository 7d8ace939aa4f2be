"""``initialize``: the handshake that opens, or resumes, a connection's session.

The dispatcher gates every other family on it (``initialize`` requested,
then ``initialized`` received); this handler decides what the session is:
a new one owned by the connection's identity (within
``--max-sessions-per-identity``; for ``anonymous``, the oldest detached
session is ended to make room) or a detached one taken over with
``resumeSessionId``, and how long it outlives a disconnect
(docs/protocol.md, "Resumable sessions" and "Dialects").
"""

from __future__ import annotations

from typing import Final

import msgspec

from execserver import __version__
from execserver import protocol as p
from execserver.codex.environment_info import environment_info
from execserver.dispatcher import Connection
from execserver.errors import RpcError
from execserver.registry import ANONYMOUS
from execserver.sandbox.engine import SandboxEngine, describe_sandbox
from execserver.session import session_of

#: Session lifetime after a disconnect for current-dialect clients, which
#: never ask for one: the reference's (unless --default-session-ttl-ms is set).
#: Measured on codex exec-server 0.171.0: a session whose connection closed
#: is resumable 79.5 s later and unknown at 80 s (with or without processes,
#: and also with ``[sessions] detached_ttl_sec = 1`` in its exec-server.toml,
#: whose stored source default is 10 s: the released binary's rule is 80 s).
CURRENT_DIALECT_TTL_MS: Final = 80_000


def initialize(
    conn: Connection, params: p.InitializeParams, *, sandbox: SandboxEngine | None
) -> p.InitializeResponse:
    if conn.initialize_requested:
        raise RpcError.invalid_request("initialize may only be sent once per connection")
    config = conn.dispatcher.config
    registry = conn.dispatcher.sessions
    # The current reference client always sends the key (``null`` for a new
    # session); a seed-era client never does.
    current = params.resume_session_id is not msgspec.UNSET
    if current:
        conn.speaks_current_dialect = True
    resume_id = params.resume_session_id if isinstance(params.resume_session_id, str) else None
    if resume_id is not None:
        # Checked before anything changes: a refused resume leaves this
        # connection as it was (it may initialize again or resume later).
        conn.adopt(registry.take_over(resume_id, conn.identity))
        session = session_of(conn)
    else:
        limit = config.max_sessions_per_identity
        held = conn.dispatcher.sessions_of(conn.identity)
        # Every unauthenticated client is `anonymous`: one of them must not
        # lock the others out by parking sessions. The oldest detached one
        # makes room (only attached ones are refused).
        if (
            held >= limit
            and conn.identity == ANONYMOUS
            and registry.evict_oldest_detached(conn.identity) is not None
        ):
            conn.dispatcher.stats.sessions_evicted += 1
            held -= 1
        if held >= limit:
            conn.dispatcher.stats.refused["sessions_per_identity"] += 1
            raise RpcError.invalid_request(
                f"too many sessions: {conn.identity} already holds {held}, the limit set by "
                f"--max-sessions-per-identity is {limit}; close or resume one"
            )
        session = session_of(conn)
        session.owner = conn.identity
        if params.on_detached_full is not None:
            session.on_detached_full = params.on_detached_full
    if conn.resumable:
        asked = params.session_ttl_ms
        if asked is None:
            if resume_id:
                asked = session.ttl_ms
            elif current:
                asked = config.default_session_ttl_ms or CURRENT_DIALECT_TTL_MS
            else:
                asked = config.default_session_ttl_ms
        session.ttl_ms = min(asked, config.max_session_ttl_ms)
    if session.ttl_ms > 0:
        registry.register(session)
    else:
        registry.forget(session)
    conn.initialize_requested = True
    conn.client_name = params.client_name
    session.speaks_current_dialect = conn.speaks_current_dialect
    response = p.InitializeResponse(
        protocol_version=p.PROTOCOL_VERSION,
        session_id=session.session_id,
        server_info=p.ServerInfo(p.SERVER_NAME, __version__),
        capabilities=conn.dispatcher.capabilities,
    )
    described = (
        params.session_ttl_ms is not None
        or resume_id is not None
        or params.on_detached_full is not None
    )
    if current:
        response.environment_info = describe_sandbox(environment_info(), sandbox)
    if described or session.ttl_ms > 0:
        response.session_ttl_ms = session.ttl_ms
        response.on_detached_full = session.on_detached_full
        response.retained_output_bytes = config.retained_output_bytes
    return response
