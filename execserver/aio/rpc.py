"""JSON-RPC request/response correlation on asyncio futures.

:class:`AsyncRpc` is the asyncio twin of the Twisted client's ``RpcClient``:
each call gets the next integer id (:class:`~execserver.clientcore.calls.PendingCalls`)
and a future in the pending map; an answer settles the future with that id,
in whatever order the server answers; notifications go to handlers; when the
channel is lost every pending call fails at once with
:class:`~execserver.clientcore.errors.ConnectionClosed`, leaving the map empty.

A call whose ``await`` is cancelled or times out removes its entry before the
cancellation propagates, so nothing is left pending (a late answer is ignored).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Final, Protocol, TypeVar

import attrs
import msgspec

from execserver import codec
from execserver import protocol as p
from execserver.clientcore.calls import PendingCalls
from execserver.clientcore.errors import (
    ConnectionClosed,
    ExecServerError,
    ProtocolViolation,
    ServerError,
)

T = TypeVar("T")
log = logging.getLogger("execserver.aio")


class Channel(Protocol):
    """What carries the messages: stdio pipes, a WebSocket."""

    async def send(self, data: bytes) -> None:
        """Send one encoded JSON-RPC message (the channel adds framing)."""

    async def aclose(self) -> None:
        """Close; the channel then calls :meth:`AsyncRpc.connection_lost`."""

    def abort(self) -> None:
        """Drop at once, without a close handshake."""


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


@attrs.frozen
class _TypedNotification:
    params_type: type[Any]
    handler: Callable[[Any], None]
    #: ``{"method":"NAME"``: how a server encoding in field order starts it.
    prefix: bytes
    decoder: msgspec.json.Decoder[Any]


class AsyncRpc:
    """Correlates requests and responses by id over one channel."""

    def __init__(self, label: str = "exec-server") -> None:
        self.label = label
        self.channel: Channel | None = None
        self._pending: PendingCalls[asyncio.Future[Any]] = PendingCalls()
        self._closed_reason: str | None = None
        self._closed = asyncio.Event()
        self._lost_listeners: list[Callable[[str], None]] = []
        self._typed: dict[str, _TypedNotification] = {}

    def on_notification(
        self, method: str, params_type: type[T], handler: Callable[[T], None]
    ) -> None:
        """Decode ``method``'s params as ``params_type`` and call ``handler``.

        A message that begins ``{"method":"METHOD"`` is decoded in one pass,
        params included; others go through the generic envelope. Params that
        do not decode are logged and dropped; the connection stays up.
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

    # --- channel side -------------------------------------------------------------

    def message_received(self, data: bytes | bytearray) -> None:
        """Handle one complete message from the server."""
        if self._closed_reason is not None:
            return
        if data.startswith(b'{"method":'):
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
            entry = self._typed.get(message.method)
            if entry is None:
                log.debug("%s: ignoring unknown notification %s", self.label, message.method)
                return
            params = message.params if isinstance(message.params, msgspec.Raw) else None
            try:
                value = decode_as(params, entry.params_type)
            except msgspec.DecodeError as exc:
                log.warning("%s: invalid %s notification: %s", self.label, message.method, exc)
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
        for entry in self._pending.take_all():
            if not entry.waiter.done():
                entry.waiter.set_exception(ConnectionClosed(reason))
        self._closed.set()
        for listener in list(self._lost_listeners):
            try:
                listener(reason)
            except Exception:
                log.exception("connection-lost listener of %s failed", self.label)

    def protocol_error(self, reason: str) -> None:
        """The server broke the protocol: fail every pending call, drop the channel."""
        log.warning("%s: closing after protocol error: %s", self.label, reason)
        channel = self.channel
        self.connection_lost(f"protocol error: {reason}")
        if channel is not None:
            channel.abort()

    # --- caller side ----------------------------------------------------------------

    @property
    def pending_count(self) -> int:
        """Calls sent and not yet answered."""
        return len(self._pending)

    @property
    def is_closed(self) -> bool:
        return self._closed_reason is not None

    @property
    def closed_reason(self) -> str | None:
        return self._closed_reason

    def add_lost_listener(self, listener: Callable[[str], None]) -> None:
        self._lost_listeners.append(listener)

    async def wait_closed(self) -> str:
        await self._closed.wait()
        return self._closed_reason or "connection closed"

    async def call(
        self, method: str, params: object, result_type: type[T], timeout: float | None = None
    ) -> T:
        """Send a request and wait for its decoded result.

        Raises :class:`ServerError` for an error answer,
        :class:`ConnectionClosed` if the channel is or becomes closed,
        :class:`ProtocolViolation` if the result does not match
        ``result_type``, and ``TimeoutError`` after ``timeout`` seconds. A
        cancelled or timed-out call leaves no pending entry.
        """
        channel = self.channel
        if channel is None or self._closed_reason is not None:
            raise ConnectionClosed(self._closed_reason or "not connected")
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        request_id = self._pending.add(method, result_type, future)
        try:
            try:
                data = codec.encode(p.Request(request_id, method, params))
            except (TypeError, ValueError, msgspec.EncodeError) as exc:
                raise ProtocolViolation(f"cannot encode {method} params: {exc}") from None
            try:
                await channel.send(data)
            except ExecServerError:
                raise
            except Exception as exc:
                if future.done():
                    return future.result()  # the loss settled it first (raises)
                raise ConnectionClosed(f"sending {method} failed: {exc}") from None
            if timeout is None:
                return await future
            async with asyncio.timeout(timeout):
                return await future
        finally:
            # Answered: already gone. Cancelled, timed out, failed: forget it.
            self._pending.discard(request_id)
            if not future.done():
                future.cancel()

    async def notify(self, method: str, params: object) -> None:
        channel = self.channel
        if channel is None or self._closed_reason is not None:
            raise ConnectionClosed(self._closed_reason or "not connected")
        await channel.send(codec.encode(p.Notification(method, params)))

    # --- internals ------------------------------------------------------------------

    def _settle_result(self, request_id: int | str, raw: msgspec.Raw) -> None:
        entry = self._pending.pop(request_id)
        if entry is None or entry.waiter.done():
            log.debug("%s: ignoring response to unknown request id %r", self.label, request_id)
            return
        try:
            value = decode_as(raw, entry.result_type)
        except msgspec.DecodeError as exc:
            entry.waiter.set_exception(
                ProtocolViolation(f"invalid {entry.method} result from server: {exc}")
            )
            return
        entry.waiter.set_result(value)

    def _settle_error(self, request_id: object, error: p.ErrorObject) -> None:
        entry = self._pending.pop(request_id)
        if entry is None:
            # id null: the server could not read one of our messages.
            log.warning(
                "%s: server error not matched to a request (id %r): %s %s",
                self.label,
                request_id,
                error.code,
                error.message,
            )
            return
        if not entry.waiter.done():
            entry.waiter.set_exception(
                ServerError(entry.method, error.code, error.message, error.data)
            )
