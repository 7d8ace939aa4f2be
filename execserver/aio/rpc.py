"""JSON-RPC request/response correlation on asyncio futures.

:class:`AsyncRpc` is the asyncio twin of the Twisted client's ``RpcClient``:
each call gets the next integer id (:class:`~execserver.clientcore.calls.PendingCalls`)
and a future in the pending map; an answer settles the future with that id,
in whatever order the server answers; notifications go to handlers; when the
channel is lost every pending call fails at once with
:class:`~execserver.clientcore.errors.ConnectionClosed`, leaving the map empty.

A call whose ``await`` is cancelled or times out removes its entry before the
cancellation propagates, so nothing is left pending (a late answer is ignored).
Decoding and dispatching what the server sends is
:class:`~execserver.clientcore.rpc.RpcCore`, shared with the Twisted client.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import msgspec

from execserver import codec
from execserver import protocol as p
from execserver.clientcore.errors import ConnectionClosed, ExecServerError, ProtocolViolation
from execserver.clientcore.rpc import RpcCore

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


class AsyncRpc(RpcCore[asyncio.Future[Any]]):
    """Correlates requests and responses by id over one channel."""

    def __init__(self, label: str = "exec-server") -> None:
        super().__init__(label)
        self.channel: Channel | None = None
        self._closed = asyncio.Event()

    def on_notification(
        self, method: str, params_type: type[T], handler: Callable[[T], None]
    ) -> None:
        """Decode ``method``'s params as ``params_type`` and call ``handler``.

        A message that begins ``{"method":"METHOD"`` is decoded in one pass,
        params included; others go through the generic envelope. Params that
        do not decode are logged and dropped; the connection stays up.
        """
        self._register_typed(method, params_type, handler)

    # --- hooks of RpcCore -------------------------------------------------------------

    def _waiting(self, waiter: asyncio.Future[Any]) -> bool:
        return not waiter.done()

    def _resolve(self, waiter: asyncio.Future[Any], value: object) -> None:
        waiter.set_result(value)

    def _reject(self, waiter: asyncio.Future[Any], error: Exception) -> None:
        waiter.set_exception(error)

    def _untyped_notification(self, method: str, params: msgspec.Raw | None) -> None:
        log.debug("%s: ignoring unknown notification %s", self.label, method)

    def _on_closed(self, reason: str) -> None:
        self._closed.set()

    def _dropper(self) -> Callable[[], None] | None:
        channel = self.channel
        return channel.abort if channel is not None else None

    def _warn(self, text: str) -> None:
        log.warning("%s", text)

    def _debug(self, text: str) -> None:
        log.debug("%s", text)

    def _listener_failed(self) -> None:
        log.exception("connection-lost listener of %s failed", self.label)

    # --- caller side ----------------------------------------------------------------

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
