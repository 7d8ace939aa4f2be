"""Typed exceptions raised by every exec-server client (Twisted, asyncio, blocking).

Every failure a client reports is an :class:`ExecServerError`, so an
application can catch one class; the subclasses say what went wrong. The
classes live here, free of Twisted, so that :mod:`execserver.client`,
:mod:`execserver.aio` and the blocking client raise the very same classes
for the same situation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Every client package exports these (``from ... import *`` takes exactly them).
__all__ = [
    "AuthRefused",
    "ConnectFailed",
    "ConnectTimeout",
    "ConnectionClosed",
    "ExecServerError",
    "InitializeTimeout",
    "NotConnected",
    "OutcomeUnknown",
    "OutputGap",
    "OutputLagged",
    "ProtocolViolation",
    "RangesNotSupported",
    "ServerError",
    "SessionLost",
    "SpawnFailed",
]


class ExecServerError(Exception):
    """Base class of every client error."""


class ServerError(ExecServerError):
    """The server answered a request with a JSON-RPC error.

    ``code`` is the JSON-RPC code (-32600 invalid request, -32602 invalid
    params, -32603 internal error), ``message`` the server's text and ``data``
    its machine-readable detail, if any (e.g. ``{"kind": "spawnNotFound"}``).
    """

    def __init__(self, method: str, code: int, message: str, data: Any = None) -> None:
        super().__init__(f"{method}: server error {code}: {message}")
        self.method = method
        self.code = code
        self.message = message
        self.data = data

    @property
    def kind(self) -> str | None:
        """``data.kind`` when the server sent one."""
        if isinstance(self.data, dict):
            kind = self.data.get("kind")
            return kind if isinstance(kind, str) else None
        return None


class ConnectionClosed(ExecServerError):
    """The connection ended; pending and later calls fail with this."""

    def __init__(self, reason: str = "connection closed") -> None:
        super().__init__(f"exec-server connection closed: {reason}")
        self.reason = reason


class ProtocolViolation(ExecServerError):
    """The server sent something the protocol does not allow."""


class InitializeTimeout(ExecServerError):
    def __init__(self, timeout: float) -> None:
        super().__init__(f"exec-server did not answer initialize within {timeout:g}s")
        self.timeout = timeout


#: ``ConnectFailed.reason`` when nothing listens at the address (each client
#: tells it by its own network layer's typed error).
REFUSED_REASON = "connection refused (is the server running?)"
#: ``ConnectFailed.reason`` when the host name does not resolve.
HOST_NOT_FOUND_REASON = "host name not found"


def error_text(exc: BaseException) -> str:
    """The text of an error that has no reason of its own: its message, else its class."""
    return str(exc).strip() or type(exc).__name__


class ConnectFailed(ExecServerError):
    """The server could not be reached (refused, unresolvable, TLS, HTTP error)."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"cannot connect to {url}: {reason}")
        self.url = url
        self.reason = reason


class ConnectTimeout(ConnectFailed):
    def __init__(self, url: str, timeout: float) -> None:
        super().__init__(url, f"no WebSocket connection within {timeout:g}s")
        self.timeout = timeout


class AuthRefused(ConnectFailed):
    """The WebSocket upgrade was answered with HTTP 401 or 403."""

    def __init__(self, url: str, status: int, reason: str) -> None:
        super().__init__(url, reason)
        self.status = status


class SpawnFailed(ExecServerError):
    """A local server could not be launched, or died before the handshake."""


class NotConnected(ExecServerError):
    """A reconnecting client stayed disconnected longer than a call may wait."""

    def __init__(self, url: str, waited: float, last_error: Exception | None = None) -> None:
        detail = f"; last attempt: {last_error}" if last_error is not None else ""
        super().__init__(f"not connected to {url} (waited {waited:g}s for a reconnect{detail})")
        self.url = url
        self.waited = waited
        self.last_error = last_error


class OutputLagged(ExecServerError):
    """An output subscription fell too far behind and was dropped.

    Catch up with ``process/read`` from ``after_seq``.
    """

    def __init__(self, process_id: str, after_seq: int | None, limit: int) -> None:
        super().__init__(
            f"output subscription of process {process_id} exceeded {limit} buffered bytes; "
            f"catch up with read(after_seq={after_seq})"
        )
        self.process_id = process_id
        self.after_seq = after_seq


class OutputGap(ExecServerError):
    """Output of a process is lost: the server dropped seqs ``from_seq..to_seq``
    (inclusive) before this client read them (a session resumed after its
    retention overflowed with ``onDetachedFull: "drop"``).

    ``delivered`` maps each stream to the bytes of it delivered before the
    gap: the lost output follows them. Raised by the default iteration over
    a process's output where the gap falls (iterating again continues after
    it); ``gaps=True`` delivers a :class:`~execserver.clientcore.types.GapEvent`
    in its place instead. ``run()`` raises it after the process ended, with
    ``result`` holding what did arrive.
    """

    def __init__(
        self, process_id: str, from_seq: int, to_seq: int, delivered: Mapping[str, int]
    ) -> None:
        streams = ", ".join(f"{name} {count} bytes" for name, count in delivered.items())
        super().__init__(
            f"output of process {process_id} lost: the server dropped output seqs "
            f"{from_seq}-{to_seq} before this client read them (delivered before the gap: "
            f"{streams or 'nothing'})"
        )
        self.process_id = process_id
        self.from_seq = from_seq
        self.to_seq = to_seq
        self.delivered = dict(delivered)
        #: ``run()``: the result of what arrived (the gap left out).
        self.result: Any = None


class OutcomeUnknown(ConnectionClosed):
    """The connection dropped while a call that is not safe to repeat was in
    flight: the server may or may not have carried it out."""

    def __init__(self, method: str, reason: str) -> None:
        super().__init__(
            f"{method}: the connection was lost before the answer arrived ({reason}); "
            "the server may or may not have carried it out"
        )
        self.method = method


class SessionLost(ConnectionClosed):
    """The session could not be resumed: its processes are out of reach."""

    def __init__(self, session_id: str | None, cause: str) -> None:
        super().__init__(f"session {session_id} could not be resumed: {cause}")
        self.session_id = session_id
        self.cause = cause


class RangesNotSupported(ExecServerError):
    """The server does not take ranged fs calls (a baseline server)."""
