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
the in-process dispatcher. Nothing here touches a reactor. Decoding and
dispatching what the server sends is
:class:`~execserver.clientcore.rpc.RpcCore`, shared with the asyncio client.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import msgspec
from twisted.internet.defer import Deferred, fail
from twisted.logger import Logger

from execserver import codec
from execserver import protocol as p
from execserver.client.errors import ConnectionClosed, ProtocolViolation
from execserver.clientcore.rpc import RpcCore
from execserver.waiters import Latch

T = TypeVar("T")
log = Logger()


class MessageSink(Protocol):
    """What a channel offers the RPC client."""

    def send_message(self, data: bytes) -> None:
        """Send one encoded JSON-RPC message (the channel adds framing)."""

    def close(self) -> None:
        """Close the channel; it must call :meth:`RpcClient.connection_lost` once closed."""


NotificationHandler = Callable[[str, msgspec.Raw | None], None]


class RpcClient(RpcCore[Deferred[Any]]):
    """Correlates requests and responses by id over one channel."""

    def __init__(self, label: str = "exec-server") -> None:
        super().__init__(label)
        self.on_notification: NotificationHandler | None = None
        self._sink: MessageSink | None = None
        self._closed: Latch[str] = Latch()

    def on_typed_notification(
        self, method: str, params_type: type[T], handler: Callable[[T], None]
    ) -> None:
        """Decode ``method``'s params as ``params_type`` and call ``handler``.

        A message that begins ``{"method":"METHOD"`` (how servers encoding in
        field order write notifications) is decoded in one pass, params
        included; others go through the generic envelope. Params that do not
        decode are logged and dropped, the connection stays up.
        """
        self._register_typed(method, params_type, handler)

    # --- hooks of RpcCore -----------------------------------------------------

    def _resolve(self, waiter: Deferred[Any], value: object) -> None:
        waiter.callback(value)

    def _reject(self, waiter: Deferred[Any], error: Exception) -> None:
        waiter.errback(error)

    def _untyped_notification(self, method: str, params: msgspec.Raw | None) -> None:
        if self.on_notification is not None:
            self.on_notification(method, params)

    def _detach(self) -> None:
        self._sink = None

    def _on_closed(self, reason: str) -> None:
        self._closed.fire(reason)

    def _dropper(self) -> Callable[[], None] | None:
        sink = self._sink
        return sink.close if sink is not None else None

    def _warn(self, text: str) -> None:
        log.warn("{text}", text=text)

    def _debug(self, text: str) -> None:
        log.debug("{text}", text=text)

    def _listener_failed(self) -> None:
        log.failure("connection-lost listener of {label} failed", label=self.label)

    # --- channel side ---------------------------------------------------------

    def attach(self, sink: MessageSink) -> None:
        """The channel is open: messages can be sent through ``sink``."""
        if self._closed_reason is None:
            self._sink = sink

    # --- caller side ----------------------------------------------------------

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
