"""Request-id allocation and the map of calls awaiting an answer.

Pure bookkeeping shared by the clients' RPC layers: each call gets the next
integer id and an entry holding its method, result type and whatever the
client waits on (a Twisted ``Deferred``, an asyncio ``Future``). An entry
leaves the map exactly once: with its answer (:meth:`PendingCalls.pop`),
when its caller gives up (:meth:`PendingCalls.discard`), or when the
connection ends (:meth:`PendingCalls.take_all`).

Also here: which calls may be sent again on a resumed session.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import attrs

from execserver import protocol as p
from execserver.clientcore.errors import ConnectionClosed, OutcomeUnknown, SessionLost

W = TypeVar("W")


@attrs.define
class PendingCall(Generic[W]):
    method: str
    result_type: type[Any]
    waiter: W


class PendingCalls(Generic[W]):
    """id -> :class:`PendingCall`; ids are 1, 2, 3, ... and never reused."""

    __slots__ = ("_entries", "_next_id")

    def __init__(self) -> None:
        self._next_id = 1
        self._entries: dict[int | str, PendingCall[W]] = {}

    def add(self, method: str, result_type: type[Any], waiter: W) -> int:
        """Register a call; returns its id (register before sending: an
        in-process server may answer synchronously)."""
        request_id = self._next_id
        self._next_id += 1
        self._entries[request_id] = PendingCall(method, result_type, waiter)
        return request_id

    def pop(self, request_id: object) -> PendingCall[W] | None:
        """The entry answered by ``request_id`` (None: unknown, or given up)."""
        if not isinstance(request_id, int | str):
            return None
        return self._entries.pop(request_id, None)

    def discard(self, request_id: int) -> None:
        """The caller gave up (cancelled, timed out): a late answer is ignored."""
        self._entries.pop(request_id, None)

    def take_all(self) -> list[PendingCall[W]]:
        """Every entry, leaving the map empty (the connection ended)."""
        entries = list(self._entries.values())
        self._entries = {}
        return entries

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries


#: Methods whose repetition changes nothing (process/write only with a
#: writeId): those declared ``repeatable`` in :data:`execserver.protocol.METHODS`.
REPEATABLE = frozenset(method.name for method in p.METHODS if method.repeatable)


def repeatable(method: str, params: object) -> bool:
    """Whether a call in flight at a drop may be sent again on the resumed session."""
    if method == p.PROCESS_WRITE:
        return isinstance(params, p.WriteParams) and params.write_id is not None
    return method in REPEATABLE


def after_drop(
    method: str, params: object, error: ConnectionClosed, *, following: bool
) -> ConnectionClosed | None:
    """A call was in flight when its connection dropped: None to send it again
    once the session is resumed, otherwise the error to fail it with.

    ``following``: the client follows a resumable session across connections
    (it is not closing or stopped). Then a call that is safe to repeat
    (:func:`repeatable`) is sent again, and any other fails with
    :class:`OutcomeUnknown` (the server may or may not have carried it out);
    a :class:`SessionLost` is final. Otherwise the drop's own error stands.
    """
    if not following or isinstance(error, SessionLost):
        return error
    if not repeatable(method, params):
        return OutcomeUnknown(method, error.reason)
    return None
