"""The sans-IO half of a JSON-RPC client: decoding and dispatching what a server sends.

:class:`RpcCore` holds everything the Twisted ``RpcClient`` and the asyncio
``AsyncRpc`` share: the pending-call map, typed notification handlers (with
the one-pass fast path for ``{"method":"NAME"`` messages), the decoding and
classification of each incoming message, failing every pending call when
the connection ends, and the lost listeners. What each client waits on (a
``Deferred``, a ``Future``), how it logs and how it drops its channel are
the few hooks a subclass fills in; sending stays in the subclass, since
that is where the two differ (a synchronous ``send_message`` vs an
awaited ``send``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Final, Generic, TypeVar

import attrs
import msgspec

from execserver import protocol as p
from execserver.clientcore.calls import PendingCalls
from execserver.clientcore.errors import ConnectionClosed, ProtocolViolation, ServerError
from execserver.codec import decode_as

T = TypeVar("T")
W = TypeVar("W")


class _ServerMessage(msgspec.Struct):
    """Any message a server sends: a response, an error or a notification."""

    id: int | str | msgspec.UnsetType | None = msgspec.UNSET
    method: str | msgspec.UnsetType = msgspec.UNSET
    params: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    result: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    error: p.ErrorObject | msgspec.UnsetType = msgspec.UNSET


_message_decoder: Final = msgspec.json.Decoder(_ServerMessage)


@attrs.frozen
class _TypedNotification:
    params_type: type[Any]
    handler: Callable[[Any], None]
    #: How the server starts such a message (``{"method":"NAME"``), and a
    #: decoder of the whole message straight into ``params_type``.
    prefix: bytes
    decoder: msgspec.json.Decoder[Any]


class RpcCore(ABC, Generic[W]):
    """Incoming messages and pending calls of one connection; ``W`` is what a call waits on."""

    def __init__(self, label: str = "exec-server") -> None:
        self.label = label
        self._pending: PendingCalls[W] = PendingCalls()
        self._closed_reason: str | None = None
        self._lost_listeners: list[Callable[[str], None]] = []
        self._typed: dict[str, _TypedNotification] = {}

    # --- hooks ------------------------------------------------------------------------

    def _waiting(self, waiter: W) -> bool:
        """Whether ``waiter`` still waits (an asyncio future may be cancelled)."""
        return True

    @abstractmethod
    def _resolve(self, waiter: W, value: object) -> None:
        """Settle ``waiter`` with a decoded result."""

    @abstractmethod
    def _reject(self, waiter: W, error: Exception) -> None:
        """Fail ``waiter`` with ``error``."""

    def _untyped_notification(self, method: str, params: msgspec.Raw | None) -> None:
        """A notification with no typed handler registered."""

    def _detach(self) -> None:
        """The connection is ending: forget the channel before pending calls fail."""

    def _on_closed(self, reason: str) -> None:
        """The connection ended; every pending call has failed already."""

    def _dropper(self) -> Callable[[], None] | None:
        """What drops the channel after a protocol error (taken before it is forgotten)."""
        return None

    @abstractmethod
    def _warn(self, text: str) -> None:
        """Log a warning (already formatted)."""

    @abstractmethod
    def _debug(self, text: str) -> None:
        """Log a debug line (already formatted)."""

    @abstractmethod
    def _listener_failed(self) -> None:
        """Called inside ``except``: a lost listener raised; log it with its traceback."""

    # --- registration and state -------------------------------------------------------

    def _register_typed(
        self, method: str, params_type: type[T], handler: Callable[[T], None]
    ) -> None:
        envelope = msgspec.defstruct(
            "TypedNotification",
            [
                ("method", str),
                ("params", params_type),
                ("id", int | str | None | msgspec.UnsetType, msgspec.UNSET),
            ],
        )
        prefix = b'{"method":' + msgspec.json.encode(method)
        self._typed[method] = _TypedNotification(
            params_type, handler, prefix, msgspec.json.Decoder(envelope)
        )

    @property
    def pending_count(self) -> int:
        """Calls sent and not yet answered (the reference's pending_request_count)."""
        return len(self._pending)

    @property
    def is_closed(self) -> bool:
        return self._closed_reason is not None

    @property
    def closed_reason(self) -> str | None:
        return self._closed_reason

    def add_lost_listener(self, listener: Callable[[str], None]) -> None:
        self._lost_listeners.append(listener)

    # --- channel side -----------------------------------------------------------------

    def message_received(self, data: bytes | bytearray | str) -> None:
        """Handle one complete message from the server."""
        if self._closed_reason is not None:
            return
        if self._typed and isinstance(data, bytes | bytearray) and data.startswith(b'{"method":'):
            for typed in self._typed.values():
                if data.startswith(typed.prefix):
                    try:
                        fast = typed.decoder.decode(data)
                    except msgspec.DecodeError:
                        break  # the generic path reports what is wrong
                    if fast.id is msgspec.UNSET:
                        typed.handler(fast.params)
                        return
                    break
        try:
            message = _message_decoder.decode(data)
        except msgspec.DecodeError as exc:
            self.protocol_error(f"undecodable message from server: {exc}")
            return
        if not isinstance(message.method, msgspec.UnsetType):
            if not isinstance(message.id, msgspec.UnsetType):
                self.protocol_error(f"unexpected JSON-RPC request from server: {message.method}")
                return
            params = message.params if isinstance(message.params, msgspec.Raw) else None
            entry = self._typed.get(message.method)
            if entry is None:
                self._untyped_notification(message.method, params)
                return
            try:
                value = decode_as(params, entry.params_type)
            except msgspec.DecodeError as exc:
                self._warn(f"{self.label}: invalid {message.method} notification: {exc}")
                return
            entry.handler(value)
            return
        if isinstance(message.error, p.ErrorObject):
            self._settle_error(message.id, message.error)
        elif isinstance(message.result, msgspec.Raw) and isinstance(message.id, int | str):
            self._settle_result(message.id, message.result)
        else:
            self.protocol_error("message from server is neither a response nor a notification")

    def connection_lost(self, reason: str = "connection closed") -> None:
        """The channel is gone: fail every pending call at once."""
        if self._closed_reason is not None:
            return
        self._closed_reason = reason
        self._detach()
        for entry in self._pending.take_all():
            if self._waiting(entry.waiter):
                self._reject(entry.waiter, ConnectionClosed(reason))
        self._on_closed(reason)
        for listener in list(self._lost_listeners):
            try:
                listener(reason)
            except Exception:
                self._listener_failed()

    def protocol_error(self, reason: str) -> None:
        """The server broke the protocol: fail every pending call, drop the channel."""
        self._warn(f"{self.label}: closing after protocol error: {reason}")
        drop = self._dropper()
        self.connection_lost(f"protocol error: {reason}")
        if drop is not None:
            drop()

    # --- internals --------------------------------------------------------------------

    def _settle_result(self, request_id: int | str, raw: msgspec.Raw) -> None:
        entry = self._pending.pop(request_id)
        if entry is None or not self._waiting(entry.waiter):
            self._debug(f"{self.label}: ignoring response to unknown request id {request_id!r}")
            return
        try:
            value = decode_as(raw, entry.result_type)
        except msgspec.DecodeError as exc:
            self._reject(
                entry.waiter,
                ProtocolViolation(f"invalid {entry.method} result from server: {exc}"),
            )
            return
        self._resolve(entry.waiter, value)

    def _settle_error(self, request_id: object, error: p.ErrorObject) -> None:
        entry = self._pending.pop(request_id)
        if entry is None:
            # id null: the server could not read one of our messages.
            self._warn(
                f"{self.label}: server error not matched to a request"
                f" (id {request_id!r}): {error.code} {error.message}"
            )
            return
        if self._waiting(entry.waiter):
            self._reject(
                entry.waiter, ServerError(entry.method, error.code, error.message, error.data)
            )
