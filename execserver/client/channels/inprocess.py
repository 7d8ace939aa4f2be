"""Bytes between an RpcClient and a dispatcher ``Connection`` in this process."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.logger import Logger

from execserver.client.rpc import RpcClient
from execserver.waiters import Latch

log = Logger()


class InProcessChannel:
    """Bytes between an RpcClient and a dispatcher Connection, with no transport.

    It is the dispatcher's ``Outbound`` (server -> client) and the RpcClient's
    ``MessageSink`` (client -> server); messages are delivered synchronously.
    """

    def __init__(self, rpc: RpcClient) -> None:
        self.rpc = rpc
        self.connection: Any = None
        self._shutdown: Deferred[None] | None = None
        self._done: Latch[None] = Latch()

    # Outbound (dispatcher side)
    def write_message(self, data: bytes) -> None:
        self.rpc.message_received(data)

    def close_connection(self) -> None:
        self.rpc.connection_lost("the server closed the connection")
        self.shutdown().addErrback(lambda f: log.failure("in-process shutdown failed", f))

    def unsent_bytes(self) -> int:
        return 0  # (delivered as written)

    def discard_unsent(self) -> None:
        pass

    # MessageSink (client side)
    def send_message(self, data: bytes) -> None:
        self.connection.message_received(data)

    def close(self) -> None:
        self.rpc.connection_lost("closed by the client")
        self.shutdown().addErrback(lambda f: log.failure("in-process shutdown failed", f))

    def shutdown(self) -> Deferred[None]:
        """Terminate the session's processes; fires when they are all closed."""
        if self._shutdown is None:
            self.connection.transport_closed()
            self._shutdown = self.connection.shutdown()
            self._shutdown.addBoth(self._shut_down)
        return self._done.wait()

    def _shut_down(self, outcome: object) -> object:
        self._done.fire(None)
        return outcome
