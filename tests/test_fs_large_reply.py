"""Large replies leave through an Outbox: whole, in order, in about one copy.

- Hypothesis drives :class:`execserver.writebuffer.Outbox` against a model
  of Twisted's write buffer (pause above the high-water mark, resume once
  empty): any interleaving of small messages, large pieced messages and
  partial drains comes out as the same messages, whole and in order, with
  the buffer bounded and the unsent figure exact.
- Autobahn's own frames (pong, close) written while a large message is
  queued follow it instead of landing inside its payload.
- Through the real server over stdio and WebSocket, a whole-file
  ``fs/readFile`` of 128 MiB while a process streams output on the same
  connection: byte-exact, every message parses, and the server's peak RSS
  grows by at most ``FS_READ_FILE_RSS_FACTOR`` times the file
  (docs/filesystem.md).
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.interfaces import IPushProducer
from twisted.internet.task import Clock
from zope.interface import implementer

from execserver.writebuffer import Outbox, unsent_bytes
from tests.support.bounds import FS_READ_FILE_RSS_FACTOR
from tests.support.fs_checks import STREAMER
from tests.support.harness import status_bytes
from tests.support.ws_wire import clock, make_factory, open_raw, server_frames

MiB = 1 << 20

__all__ = ["clock"]  # the fixture


@implementer(IPushProducer)
class _Inner:
    def __init__(self) -> None:
        self.paused = False

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False

    def stopProducing(self) -> None:
        pass


class _Writer:
    """Twisted's FileDescriptor write buffer as far as an Outbox sees it."""

    def __init__(self, high_water: int) -> None:
        self.bufferSize = high_water
        self.dataBuffer = b""
        self.offset = 0
        self._tempDataBuffer: list[bytes] = []
        self._tempDataLen = 0
        self.producer: Any = None
        self.paused = False
        self.sent = bytearray()
        self.outbox: Outbox | None = None

    def write(self, data: bytes) -> None:
        assert type(data) is bytes
        # Nothing is pushed into a full buffer while a message waits.
        assert self.outbox is not None
        assert not (self.paused and self.outbox.busy)
        self._tempDataBuffer.append(data)
        self._tempDataLen += len(data)
        if self._tempDataLen > self.bufferSize:
            self.paused = True
            self.producer.pauseProducing()

    def drain(self, count: int) -> None:
        joined = b"".join(self._tempDataBuffer)
        self.sent += joined[:count]
        rest = joined[count:]
        self._tempDataBuffer = [rest] if rest else []
        self._tempDataLen = len(rest)
        if not rest and self.paused:
            self.paused = False
            self.producer.resumeProducing()


_message = st.tuples(
    st.booleans(),  # written as pieces (a large message) or whole (a small one)
    st.lists(st.integers(0, 40), min_size=1, max_size=6),  # piece sizes
)
_step = st.one_of(_message, st.integers(0, 120))  # a message, or a drain of N bytes


@given(high_water=st.integers(1, 64), slice_bytes=st.integers(1, 32), steps=st.lists(_step))
def test_messages_leave_whole_and_in_order(
    high_water: int, slice_bytes: int, steps: list[Any]
) -> None:
    writer = _Writer(high_water)
    inner = _Inner()
    outbox = Outbox(writer, writer, inner, slice_bytes=slice_bytes)
    writer.producer = writer.outbox = outbox
    expected = bytearray()
    for number, step in enumerate(steps):
        if isinstance(step, int):
            writer.drain(step)
        else:
            pieced, sizes = step
            tag = b"%d:" % number
            parts = [tag, *(bytes([65 + number % 26]) * size for size in sizes), b";"]
            expected += b"".join(parts)
            if pieced:
                # Non-bytes pieces too (what stdio hands over after a partial writev).
                outbox.write_parts(
                    [memoryview(part) if i % 2 else part for i, part in enumerate(parts)]
                )
            else:
                outbox.write(b"".join(parts))
        assert len(writer.sent) + unsent_bytes(writer) == len(expected)
        # The producer behind stays paused while anything waits here.
        if outbox.busy:
            assert inner.paused
    while writer._tempDataLen or outbox.busy:
        writer.drain(7)
    assert bytes(writer.sent) == bytes(expected)
    assert unsent_bytes(writer) == 0
    assert not inner.paused
    assert outbox.when_drained().called


def test_autobahn_frames_wait_behind_a_queued_message(clock: Clock) -> None:
    proto, transport = open_raw(make_factory(clock))
    outbox: Any = transport.producer
    outbox.pauseProducing()  # as TCP does with its buffer above the mark
    payload = b"x" * (2 * MiB)
    proto.write_message_parts((b'{"id":1,"result":"', payload, b'"}'))
    assert outbox.busy
    proto.sendPong(b"late")
    proto.write_message(b'{"id":2,"result":{}}')
    assert transport.value() == b""
    outbox.resumeProducing()  # the buffer has drained
    frames = server_frames(transport.value())
    assert [opcode for opcode, _ in frames] == [1, 10, 1]
    assert frames[0][1] == b'{"id":1,"result":"' + payload + b'"}'
    assert frames[1][1] == b"late"
    assert frames[2][1] == b'{"id":2,"result":{}}'


# --- through the real server ---------------------------------------------------------------


def _big_file(path: Path, size: int) -> bytes:
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for _ in range(size // (8 * MiB)):
            block = os.urandom(8 * MiB)
            f.write(block)
            digest.update(block)
    return digest.digest()


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["stdio", "websocket"])
@pytest_twisted.ensureDeferred
async def test_whole_file_read_keeps_one_copy_of_its_text(transport: str, tmp_path: Path) -> None:
    from tests.support.stdio_server import ServerProcess
    from tests.support.ws_harness import WsServerProcess, connect

    size = 128 * MiB
    path = tmp_path / "big.bin"
    digest = _big_file(path, size)
    server: Any
    client: Any
    if transport == "stdio":
        server = client = ServerProcess.start()
    else:
        server = await WsServerProcess.start()
    assert server.pid is not None
    try:
        if transport != "stdio":
            client = await connect(server.url)
        await client.handshake()
        # Warm up the fs path, then measure from here.
        await client.call("fs/readFile", {"path": str(path), "offset": 0, "length": 1000})
        await client.start_process("streamer", ["python3", "-u", "-c", STREAMER])
        await client.wait_notification("process/output", "streamer")
        idle = status_bytes(server.pid)
        result = await client.call("fs/readFile", {"path": str(path)}, timeout=120)
        peak = status_bytes(server.pid, "VmHWM") - idle
        # Output keeps coming after the read: the stream was not broken by it.
        seen = len(client.notifications)
        await client.wait_for(
            lambda _: len(client.notifications) >= seen + 5, 30, "output after the read", False
        )
        await client.call("process/terminate", {"processId": "streamer"})
        data = base64.b64decode(result["dataBase64"])
        del result
        assert len(data) == size
        assert hashlib.sha256(data).digest() == digest
        del data
        print(
            f"\n{transport}: 128 MiB fs/readFile, server peak RSS above idle "
            f"{peak / MiB:.0f} MiB = {peak / size:.2f}x the file"
        )
        assert peak <= FS_READ_FILE_RSS_FACTOR * size
    finally:
        await server.stop()
