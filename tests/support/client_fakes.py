"""Helpers for the client tests (no tests here).

- :class:`ScriptedServer`: a fake server on a ``StringTransport``: the test
  reads what the client sent and scripts every answer; time is a
  ``task.Clock``.
- :class:`LocalWsServer`: a test-local Autobahn WebSocket server on
  ``127.0.0.1`` in front of a real :class:`Dispatcher` (optionally demanding
  a bearer token, or ignoring every message), stoppable and restartable on
  the same port.
- :func:`wait`: a Deferred, bounded (polls go through ``tests/support/polling.py``).
"""

from __future__ import annotations

import json
from typing import Any

from autobahn.twisted.websocket import WebSocketServerFactory, WebSocketServerProtocol
from autobahn.websocket.types import ConnectionDeny
from twisted.internet import task
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionDone
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from execserver import writebuffer
from execserver.app import build_dispatcher
from execserver.client import ConnectOptions, ExecServerClient, RpcClient
from execserver.client.channels import NdjsonProtocol
from execserver.config import ServerConfig
from execserver.dispatcher import Connection, Dispatcher
from execserver.spawn import PosixSpawner
from tests.support.harness import DEFAULT_TIMEOUT, reactor, with_timeout
from tests.support.polling import until

TIMEOUT = 10.0


async def wait(d: Deferred[Any], what: str, timeout: float = TIMEOUT) -> Any:
    return await with_timeout(d, timeout, what)


# --- scripted fake server over a StringTransport ----------------------------------------


class ScriptedServer:
    """The server side of one client connection, driven by the test."""

    def __init__(self) -> None:
        self.clock = task.Clock()
        self.rpc = RpcClient(label="test")
        self.protocol = NdjsonProtocol(self.rpc)
        self.transport = StringTransport()
        self.protocol.makeConnection(self.transport)
        self._read = 0

    def connect(
        self, client_name: str = "test-client", initialize_timeout: float = 1.0
    ) -> Deferred[ExecServerClient]:
        return ExecServerClient.connect_rpc(
            self.rpc, self.clock, ConnectOptions(client_name, initialize_timeout)
        )

    def received(self) -> list[dict[str, Any]]:
        """Messages the client sent since the last call."""
        data = self.transport.value()
        new, self._read = data[self._read :], len(data)
        return [json.loads(line) for line in new.split(b"\n") if line]

    def expect(self, count: int) -> list[dict[str, Any]]:
        messages = self.received()
        assert len(messages) == count, messages
        return messages

    def send(self, message: dict[str, Any]) -> None:
        self.protocol.dataReceived(json.dumps(message).encode() + b"\n")

    def reply(self, request_id: Any, result: Any) -> None:
        self.send({"id": request_id, "result": result})

    def error(self, request_id: Any, code: int, message: str, data: Any = None) -> None:
        error: dict[str, Any] = {"code": code, "message": message}
        if data is not None:
            error["data"] = data
        self.send({"id": request_id, "error": error})

    def notify(self, method: str, params: Any) -> None:
        self.send({"method": method, "params": params})

    def drop(self) -> None:
        self.transport.loseConnection()
        self.protocol.connectionLost(Failure(ConnectionDone()))

    async def handshake(self) -> ExecServerClient:
        """Connect a client, answering like a baseline server."""
        d = self.connect()
        (init,) = self.expect(1)
        self.reply(init["id"], {"protocolVersion": "exec-server.v0"})
        client: ExecServerClient = await d
        (initialized,) = self.expect(1)
        assert initialized == {"method": "initialized", "params": {}}
        return client


# --- a test-local WebSocket server ------------------------------------------------------


def make_dispatcher() -> Dispatcher:
    return build_dispatcher(ServerConfig(terminate_grace_ms=500), reactor, PosixSpawner(reactor))


class LocalServerProtocol(WebSocketServerProtocol):
    server: LocalWsServer
    connection: Connection | None = None

    def onConnect(self, request: Any) -> None:
        token = self.server.token
        if token is not None and request.headers.get("authorization") != f"Bearer {token}":
            raise ConnectionDeny(401, "Unauthorized")
        self.server.connect_count += 1

    def onOpen(self) -> None:
        self.server.protocols.add(self)
        if not self.server.silent:
            self.connection = self.server.dispatcher.connect(self, "test-ws")

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        if self.connection is not None:
            self.connection.message_received(payload)

    def onClose(self, wasClean: bool, code: Any, reason: Any) -> None:
        self.server.protocols.discard(self)
        if self.connection is not None:
            self.connection.transport_closed()
            self.connection.shutdown().addErrback(lambda f: None)

    def write_message(self, data: bytes) -> None:
        self.sendMessage(data, isBinary=False)

    def close_connection(self) -> None:
        self.sendClose()

    def unsent_bytes(self) -> int:
        return writebuffer.unsent_bytes(self.transport)

    def discard_unsent(self) -> None:
        writebuffer.discard_unsent(self.transport)


class LocalWsServer:
    """An Autobahn server on 127.0.0.1 in front of a real dispatcher."""

    def __init__(self, token: str | None = None, silent: bool = False, port: int = 0) -> None:
        self.token = token
        self.silent = silent
        self.port = port
        self.dispatcher = make_dispatcher()
        self.protocols: set[LocalServerProtocol] = set()
        self.connect_count = 0
        self._listening: Any = None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def start(self) -> LocalWsServer:
        factory = WebSocketServerFactory()
        server = self

        class Proto(LocalServerProtocol):
            pass

        Proto.server = server
        factory.protocol = Proto
        self._listening = reactor.listenTCP(self.port, factory, interface="127.0.0.1")
        self.port = self._listening.getHost().port
        return self

    async def stop(self) -> None:
        """Stop listening, drop every connection, end every session."""
        if self._listening is not None:
            await self._listening.stopListening()
            self._listening = None
        for proto in list(self.protocols):
            transport: Any = proto.transport
            if transport is not None:
                transport.abortConnection()
        await wait(self.dispatcher.shutdown(), "dispatcher shutdown")
        await until(
            lambda: not self.protocols, "server connections to close", timeout=DEFAULT_TIMEOUT
        )
