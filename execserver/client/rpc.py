"""JSON-RPC request/response correlation over any message channel.

:class:`RpcClient` is the client's half of the wire, modelled on Twisted's
AMP: each call gets the next integer id and a Deferred kept in an id ->
pending map; a response or error settles the Deferred with that id, in
whatever order the server answers; notifications go to a callback; and when
the channel is lost every pending call fails at once with
:class:`ConnectionClosed`, leaving the map empty.

The channel is anything that implements :class:`MessageSink` (send one
encoded message, close) and calls :meth:`RpcClient.message_received` and
:meth:`RpcClient.connection_lost`: NDJSON over a pipe, WebSocket frames, or
the in-process dispatcher. Nothing here touches a reactor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, Protocol, TypeVar

import attrs
import msgspec
from twisted.internet.defer import Deferred, fail
from twisted.logger import Logger

from execserver import codec
from execserver import protocol as p
from execserver.client.errors import ConnectionClosed, ProtocolViolation, ServerError
from execserver.clientcore.calls import PendingCalls
from execserver.waiters import Latch

T = TypeVar("T")
log = Logger()


class MessageSink(Protocol):
    """What a channel offers the RPC client."""

    def send_message(self, data: bytes) -> None:
        """Send one encoded JSON-RPC message (the channel adds framing)."""

    def close(self) -> None:
        """Close the channel; it must call :meth:`RpcClient.connection_lost` once closed."""


class _ServerMessage(msgspec.Struct):
    """Any message a server sends: a response, an error or a notification."""

    id: int | str | msgspec.UnsetType | None = msgspec.UNSET
    method: str | msgspec.UnsetType = msgspec.UNSET
    params: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    result: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    error: p.ErrorObject | msgspec.UnsetType = msgspec.UNSET


_message_decoder: Final = msgspec.json.Decoder(_ServerMessage)
_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {}


def decode_as(raw: msgspec.Raw | bytes | None, result_type: type[T]) -> T:
    """Decode a result or params into ``result_type`` (cached decoder per type)."""
    decoder = _decoders.get(result_type)
    if decoder is None:
        decoder = _decoders[result_type] = msgspec.json.Decoder(result_type)
    result: T = decoder.decode(raw if raw is not None else b"null")
    return result


NotificationHandler = Callable[[str, msgspec.Raw | None], None]


@attrs.frozen
class _TypedNotification:
    params_type: type[Any]
    handler: Callable[[Any], None]
    #: How the server starts such a message (``{"method":"NAME"``), and a
    #: decoder of the whole message straight into ``params_type``.
    prefix: bytes
    decoder: msgspec.json.Decoder[Any]


class RpcClient:
    """Correlates requests and responses by id over one channel."""

    def __init__(self, label: str = "exec-server") -> None:
        self.label = label
        self.on_notification: NotificationHandler | None = None
        self._sink: MessageSink | None = None
        self._pending: PendingCalls[Deferred[Any]] = PendingCalls()
        self._closed_reason: str | None = None
        self._closed: Latch[str] = Latch()
        self._lost_listeners: list[Callable[[str], None]] = []
        self._typed: dict[str, _TypedNotification] = {}

    def on_typed_notification(
        self, method: str, params_type: type[T], handler: Callable[[T], None]
    ) -> None:
        """Decode ``method``'s params as ``params_type`` and call ``handler``.

        A message that begins ``{"method":"METHOD"`` (how servers encoding in
        field order write notifications) is decoded in one pass, params
        included; others go through the generic envelope. Params that do not
        decode are logged and dropped, the connection stays up.
        """
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

    # --- channel side ---------------------------------------------------------

    def attach(self, sink: MessageSink) -> None:
        """The channel is open: messages can be sent through ``sink``."""
        if self._closed_reason is None:
            self._sink = sink

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
            if entry is not None:
                try:
                    value = decode_as(params, entry.params_type)
                except msgspec.DecodeError as exc:
                    log.warn(
                        "{label}: invalid {method} notification: {exc}",
                        label=self.label,
                        method=message.method,
                        exc=exc,
                    )
                    return
                entry.handler(value)
            elif self.on_notification is not None:
                self.on_notification(message.method, params)
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
        self._sink = None
        for entry in self._pending.take_all():
            entry.waiter.errback(ConnectionClosed(reason))
        self._closed.fire(reason)
        for listener in list(self._lost_listeners):
            try:
                listener(reason)
            except Exception:
                log.failure("connection-lost listener of {label} failed", label=self.label)

    # --- caller side ----------------------------------------------------------

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

    def when_closed(self) -> Deferred[str]:
        """Fires with the reason once the channel is lost."""
        return self._closed.wait()

    def call(self, method: str, params: object, result_type: type[T]) -> Deferred[T]:
        """Send a request; the Deferred fires with the decoded result.

        Fails with :class:`ServerError` for an error response,
        :class:`ConnectionClosed` if the channel is or becomes closed, and
        :class:`ProtocolViolation` if the result does not match ``result_type``.
        Cancelling the Deferred forgets the request (a late answer is ignored).
        """
        sink = self._sink
        if sink is None:
            return fail(ConnectionClosed(self._closed_reason or "not connected"))
        request_id = 0

        def cancel(_: Deferred[T]) -> None:
            self._pending.discard(request_id)

        d: Deferred[T] = Deferred(cancel)
        # Register before sending: an in-process server answers synchronously.
        request_id = self._pending.add(method, result_type, d)
        try:
            data = codec.encode(p.Request(request_id, method, params))
        except (TypeError, ValueError, msgspec.EncodeError) as exc:
            self._pending.discard(request_id)
            return fail(ProtocolViolation(f"cannot encode {method} params: {exc}"))
        try:
            sink.send_message(data)
        except Exception as exc:
            if self._pending.pop(request_id) is not None:
                d.errback(ConnectionClosed(f"sending {method} failed: {exc}"))
        return d

    def notify(self, method: str, params: object) -> None:
        """Send a notification; raises :class:`ConnectionClosed` if closed."""
        sink = self._sink
        if sink is None:
            raise ConnectionClosed(self._closed_reason or "not connected")
        sink.send_message(codec.encode(p.Notification(method, params)))

    def close(self) -> None:
        """Close the channel (pending calls fail once it reports the loss)."""
        sink = self._sink
        if sink is not None:
            sink.close()

    # --- internals ------------------------------------------------------------

    def _settle_result(self, request_id: int | str, raw: msgspec.Raw) -> None:
        entry = self._pending.pop(request_id)
        if entry is None:
            log.debug("ignoring response to unknown request id {id!r}", id=request_id)
            return
        try:
            value = decode_as(raw, entry.result_type)
        except msgspec.DecodeError as exc:
            entry.waiter.errback(
                ProtocolViolation(f"invalid {entry.method} result from server: {exc}")
            )
            return
        entry.waiter.callback(value)

    def _settle_error(self, request_id: object, error: p.ErrorObject) -> None:
        entry = self._pending.pop(request_id)
        if entry is None:
            # id null: the server could not read one of our messages.
            log.warn(
                "{label}: server error not matched to a request (id {id!r}): {code} {message}",
                label=self.label,
                id=request_id,
                code=error.code,
                message=error.message,
            )
            return
        entry.waiter.errback(ServerError(entry.method, error.code, error.message, error.data))

    def protocol_error(self, reason: str) -> None:
        """The channel or a message broke the protocol: close, failing every pending call."""
        log.warn("{label}: closing after protocol error: {reason}", label=self.label, reason=reason)
        sink = self._sink
        self.connection_lost(f"protocol error: {reason}")
        if sink is not None:
            sink.close()
