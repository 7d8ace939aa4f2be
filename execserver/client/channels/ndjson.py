"""NDJSON framing: one JSON-RPC message per line, over any byte stream."""

from __future__ import annotations

from twisted.internet import error
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure

from execserver.client.rpc import RpcClient
from execserver.clientcore.framing import MAX_MESSAGE_BYTES, LineInput

#: Largest message the client accepts from a server (shared by every client).
DEFAULT_MAX_MESSAGE_BYTES = MAX_MESSAGE_BYTES


def _describe(reason: Failure | None) -> str:
    """Why a stream ended, as a client's ``closed_reason``."""
    if reason is None:
        return "connection closed"
    if reason.check(error.ConnectionDone):
        return "connection closed by the server"
    return reason.getErrorMessage()


class NdjsonProtocol(Protocol):
    """An RPC channel over any stream transport."""

    def __init__(self, rpc: RpcClient, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.rpc = rpc
        self._input = LineInput(rpc, max_message_bytes)

    def connectionMade(self) -> None:
        self.rpc.attach(self)

    def dataReceived(self, data: bytes) -> None:
        self._input.feed(data)

    def connectionLost(self, reason: Failure | None = None) -> None:
        self._input.finish()
        self.rpc.connection_lost(_describe(reason))

    def send_message(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.writeSequence((data, b"\n"))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.loseConnection()
