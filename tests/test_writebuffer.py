"""The write-buffer adapter reads figures Twisted keeps private: they must still move."""

from __future__ import annotations

import base64
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import ClientFactory, Factory, Protocol
from zope.interface import implementer

from execserver import writebuffer
from tests.support.harness import RpcFailure
from tests.support.stdio_server import ServerProcess

TOTAL = 32 * 1024 * 1024
HIGH_WATER = 1024 * 1024
TIMEOUT = 60.0


def test_this_twisted_keeps_the_fields_read() -> None:
    assert writebuffer.PROBLEM is None


def test_a_changed_buffer_layout_is_named() -> None:
    class Renamed:
        dataBuffer = b""
        bufferSize = 65536

        def __init__(self, reactor: object = None) -> None:
            self._pending: list[bytes] = []

    problem = writebuffer.check_fields(Renamed)
    assert problem is not None
    assert "offset" in problem and "_tempDataLen" in problem


def test_this_twisted_lets_the_high_water_mark_differ_from_the_read_size() -> None:
    assert writebuffer.HIGH_WATER_PROBLEM is None


def test_a_changed_pause_decision_is_named() -> None:
    class Renamed:
        def _isSendBufferFull(self, limit: int) -> bool:
            return False

    class Inlined:
        def _isSendBufferFull(self) -> bool:
            return False

        def _maybePauseProducer(self) -> None:
            pass

    assert "_isSendBufferFull(self)" in (writebuffer.check_high_water(Renamed) or "")
    assert "does not ask" in (writebuffer.check_high_water(Inlined) or "")


@implementer(IPushProducer)
class Producer:
    def __init__(self, transport: Any) -> None:
        self.transport = transport
        #: Unsent bytes when Twisted first paused the producer.
        self.first_pause: int | None = None
        self.drained: Deferred[None] = Deferred()

    def pauseProducing(self) -> None:
        if self.first_pause is None:
            self.first_pause = writebuffer.unsent_bytes(self.transport)

    def resumeProducing(self) -> None:
        if not self.drained.called:
            self.drained.callback(None)

    def stopProducing(self) -> None:
        pass


class Sender(Protocol):
    def connectionMade(self) -> None:
        self.factory.sender.callback(self)


class Reader(Protocol):
    def connectionMade(self) -> None:
        # Read nothing until told: the sender's buffer has to hold the rest.
        self.transport.pauseProducing()  # type: ignore[union-attr]
        self.factory.reader.callback(self)


@contextlib.asynccontextmanager
async def connected(client_factory: Any) -> AsyncIterator[tuple[Protocol, Any]]:
    """A real loopback TCP connection: the server's :class:`Sender` and the client's protocol.

    The client protocol calls back ``client_factory.reader`` once connected.
    """
    server_factory: Any = Factory.forProtocol(Sender)
    server_factory.sender = Deferred()
    client_factory.reader = Deferred()
    port: Any = reactor.listenTCP(0, server_factory, interface="127.0.0.1")
    connector = reactor.connectTCP("127.0.0.1", port.getHost().port, client_factory)
    try:
        sender: Protocol = await server_factory.sender.addTimeout(TIMEOUT, reactor)
        client: Any = await client_factory.reader.addTimeout(TIMEOUT, reactor)
        yield sender, client
    finally:
        connector.disconnect()
        stopped = port.stopListening()
        if stopped is not None:
            await stopped


@pytest.mark.parametrize("separate", [True, False], ids=["own-mark", "fallback-buffer-size"])
@pytest_twisted.ensureDeferred
async def test_the_unsent_figure_follows_a_real_socket_and_the_high_water_mark_pauses(
    separate: bool,
) -> None:
    client_factory: Any = ClientFactory.forProtocol(Reader)
    async with connected(client_factory) as (sender, reader):
        transport: Any = sender.transport
        read_size = transport.bufferSize
        writebuffer.set_high_water(transport, HIGH_WATER, separate=separate)
        # Socket reads keep Twisted's size (the fallback makes them the mark).
        assert transport.bufferSize == (read_size if separate else HIGH_WATER)
        producer = Producer(transport)
        transport.registerProducer(producer, True)
        assert writebuffer.unsent_bytes(transport) == 0
        piece = b"x" * (64 * 1024)
        for _ in range(TOTAL // len(piece)):
            transport.write(piece)
        # Nothing is sent before the reactor runs again: every byte is unsent,
        # and the producer was paused on crossing the high-water mark.
        assert writebuffer.unsent_bytes(transport) == TOTAL
        assert producer.first_pause is not None
        assert HIGH_WATER < producer.first_pause <= HIGH_WATER + len(piece)
        reader.transport.resumeProducing()
        # Twisted resumes the producer once the buffer is empty.
        await producer.drained.addTimeout(TIMEOUT, reactor)
        assert writebuffer.unsent_bytes(transport) == 0


class Collector(Protocol):
    def connectionMade(self) -> None:
        self.received = bytearray()
        self.factory.reader.callback(self)

    def dataReceived(self, data: bytes) -> None:
        self.received += data
        if len(self.received) >= self.factory.expected and not self.factory.done.called:
            self.factory.done.callback(None)


@implementer(IPushProducer)
class Inner:
    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


@pytest_twisted.ensureDeferred
async def test_an_outbox_hands_twisted_one_piece_at_a_time_and_twisted_sends_it_uncopied() -> None:
    """Twisted joins what it holds before sending: two pieces would be copied into a third.

    Pieces smaller than the high-water mark, so that only the Outbox's own
    pause (not Twisted's high-water mark) keeps a second one out.
    """
    pieces = [bytes([65 + i]) * (768 * 1024) for i in range(6)]
    message = [b'{"id":1,"result":"', *pieces, b'"}\n']
    client_factory: Any = ClientFactory.forProtocol(Collector)
    client_factory.done = Deferred()
    client_factory.expected = sum(len(part) for part in message)
    async with connected(client_factory) as (sender, collector):
        transport: Any = sender.transport
        writebuffer.set_high_water(transport, 2 * 1024 * 1024)
        outbox = writebuffer.Outbox(transport, transport, Inner())
        transport.registerProducer(outbox, True)
        sent_from: list[bytes] = []
        real_write_some = transport.writeSomeData

        def write_some(data: Any) -> Any:
            if type(data) is bytes:  # a new buffer (a slice of one is a memoryview)
                sent_from.append(data)
            return real_write_some(data)

        transport.writeSomeData = write_some
        outbox.write_parts(message)
        await client_factory.done.addTimeout(TIMEOUT, reactor)
        await outbox.when_drained().addTimeout(TIMEOUT, reactor)
        assert bytes(collector.received) == b"".join(message)
        large = [data for data in sent_from if len(data) > writebuffer.SMALL_PIECE_BYTES]
        assert large, "no large buffer sent"
        copies = [len(data) for data in large if not any(data is piece for piece in pieces)]
        assert not copies, f"Twisted sent from copies of {copies} bytes, not the pieces"
        transport.unregisterProducer()


# --- the stdin bound of process/write, against a real child that never reads -------

STDIN_LIMIT = 16 * 1024 * 1024  # docs/protocol.md: "more than 16 MiB already waiting"
CHUNK = 1024 * 1024


# A pipe only: a terminal in canonical mode keeps discarding input past its
# 4 KiB line buffer, so what it accepts depends on timing, not on the bound.
@pytest_twisted.ensureDeferred
async def test_stdin_of_a_child_that_does_not_read_is_bounded() -> None:
    server = ServerProcess.start()
    try:
        await server.handshake()
        await server.start_process("p", ["sleep", "300"], pipeStdin=True)
        chunk = base64.b64encode(b"y" * CHUNK).decode()
        accepted = 0
        refusal: RpcFailure | None = None
        # Four times the limit: without a working bound this ends the loop.
        while refusal is None and accepted <= 4 * STDIN_LIMIT:
            try:
                await server.call("process/write", {"processId": "p", "chunk": chunk})
            except RpcFailure as exc:
                refusal = exc
            else:
                accepted += CHUNK
        assert refusal is not None, f"{accepted} bytes accepted by a child that reads nothing"
        assert refusal.code == -32600
        assert "stdin of process p is not being read" in refusal.message
        waiting = int(refusal.message.split(": ", 1)[1].split()[0])
        assert STDIN_LIMIT - CHUNK < waiting <= STDIN_LIMIT
        # What the kernel's pipe took is the rest.
        assert STDIN_LIMIT - CHUNK < accepted <= STDIN_LIMIT + CHUNK
        await server.call("process/terminate", {"processId": "p"})
    finally:
        assert await server.stop() == 0
