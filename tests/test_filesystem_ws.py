"""fs/* through the real server over real WebSockets on 127.0.0.1.

The same checks as over stdio (handshake gate, every method's success path
and errors, round trips), plus the issue's concurrency check: a 200 MiB
``fs/readFile`` by one client while another client streams process output.
The longest pause of that second client's output (timed in processes of its
own) must stay within ``tests.support.bounds.FS_READ_PAUSE_FRACTION`` of the read's
duration, which a server reading and encoding the file on its event loop
cannot meet.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import time
from pathlib import Path

import pytest
import pytest_twisted

from tests.support.bounds import FS_READ_PAUSE_FRACTION
from tests.support.fs_checks import check_every_fs_method, check_handshake_gate, check_round_trips
from tests.support.ws_harness import OutputGapObserver, WsClientProtocol, WsServerProcess, connect


@pytest_twisted.ensureDeferred
async def test_fs_methods_need_the_handshake_over_websocket() -> None:
    server = await WsServerProcess.start()
    try:
        client = await connect(server.url)
        await check_handshake_gate(client)
        await client.close()
    finally:
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_every_fs_method_and_its_errors_over_websocket(tmp_path: Path) -> None:
    server = await WsServerProcess.start()
    try:
        client = await connect(server.url)
        await client.handshake()
        await check_every_fs_method(client, str(tmp_path))
        await check_round_trips(client, tmp_path)
        await client.close()
    finally:
        await server.stop()


_ID = re.compile(rb'^\{"id":(\d+),')


class BigReader(WsClientProtocol):
    """Keeps large responses undecoded so this test process stays responsive."""

    def __init__(self) -> None:
        super().__init__()
        self.big: dict[int, bytes] = {}
        self.received_at: list[float] = []

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        match = _ID.match(payload[:64])
        if len(payload) > 1 << 20 and match is not None:
            self.received_at.append(time.monotonic())
            request_id = int(match.group(1))
            self.big[request_id] = payload
            d = self.pending.pop(request_id, None)
            if d is not None:
                d.callback({"id": request_id, "result": None})
            return
        super().onMessage(payload, isBinary)


@pytest.mark.slow
@pytest_twisted.ensureDeferred
async def test_200_mib_read_while_another_client_streams(tmp_path: Path) -> None:
    size = 200 * 1024 * 1024
    path = tmp_path / "big.bin"
    block = os.urandom(1024 * 1024)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for _ in range(size // len(block)):
            f.write(block)
            digest.update(block)
    server = await WsServerProcess.start()
    try:
        # The other client and its clock run in processes of their own, so
        # this process receiving 266 MiB cannot pass for a server pause.
        other = await OutputGapObserver.start(server.url, str(tmp_path / "stop"), timeout=30)
        reader = await connect(
            server.url,
            protocol=BigReader,
            max_message_bytes=512 * 1024 * 1024,
            utf8validateIncoming=False,
        )
        assert isinstance(reader, BigReader)
        await reader.handshake()
        sent = time.monotonic()
        response = await reader.request("fs/readFile", {"path": str(path)}, timeout=120)
        answered = time.monotonic()
        report = await other.finish()
        took = answered - sent
        pause = OutputGapObserver.longest_pause(report, sent, answered)
        print(
            f"\n200 MiB fs/readFile over WebSocket: answered in {took:.2f}s; meanwhile "
            f"another client's output never paused longer than {pause * 1000:.0f} ms "
            f"({pause / took:.2f} of the read)"
        )
        assert pause <= FS_READ_PAUSE_FRACTION * took, (
            f"another client's output paused {pause:.2f}s of the read's {took:.2f}s"
        )
        payload = reader.big[response["id"]]
        prefix = b'{"id":%d,"result":{"dataBase64":"' % response["id"]
        assert payload.startswith(prefix) and payload.endswith(b'"}}')
        data = base64.b64decode(memoryview(payload)[len(prefix) : -3])
        assert len(data) == size
        assert hashlib.sha256(data).digest() == digest.digest()
        del data, payload
        await reader.close()
    finally:
        await server.stop(timeout=60)
