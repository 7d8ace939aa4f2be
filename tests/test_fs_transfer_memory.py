"""A whole-file fs/readFile or fs/writeFile of 16 MiB holds its text about once.

Through the real server: its peak RSS above idle stays within
``FS_TRANSFER_RSS_FACTOR`` times the file (docs/filesystem.md, "Memory and
throughput"). At this size the fixed part of the cost weighs most: the
text alone is 1.33x the file, so the read buffer, the copies the transport
makes and the memory the allocator keeps after freeing must stay within
about 2.7 MiB together, over stdio and over WebSocket alike. A WebSocket
request arrives through Autobahn's parser, which copies each socket read
a few times: reads as large as the 2 MiB high-water mark (before
``writebuffer.set_high_water`` set the mark apart from the read size) made
a write 1.70-1.75x (docs/filesystem.md).
"""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted

from tests.support.bounds import FS_TRANSFER_RSS_FACTOR
from tests.support.harness import status_bytes
from tests.support.stdio_server import ServerProcess
from tests.support.ws_harness import WsServerProcess, connect

MiB = 1 << 20
SIZE = 16 * MiB


@pytest.mark.parametrize(
    ("transport", "method"),
    [
        ("stdio", "fs/readFile"),
        ("stdio", "fs/writeFile"),
        ("websocket", "fs/readFile"),
        ("websocket", "fs/writeFile"),
    ],
)
@pytest_twisted.ensureDeferred
async def test_a_16_mib_transfer_holds_its_text_about_once(
    transport: str, method: str, tmp_path: Path
) -> None:
    data = os.urandom(SIZE)
    source = tmp_path / "source.bin"
    source.write_bytes(data)
    target = tmp_path / "target.bin"
    text = base64.b64encode(data).decode()
    server: Any
    client: Any
    if transport == "stdio":
        server = client = ServerProcess.start("--max-message-bytes", str(64 * MiB))
    else:
        server = await WsServerProcess.start("--max-message-bytes", str(64 * MiB))
    assert server.pid is not None
    try:
        if transport != "stdio":
            client = await connect(server.url, max_message_bytes=64 * MiB)
        await client.handshake()
        # Warm up both paths (pool threads, code), then measure from here.
        await client.call("fs/readFile", {"path": str(source), "offset": 0, "length": 1000})
        await client.call("fs/writeFile", {"path": str(target), "dataBase64": text[:1000]})
        idle = status_bytes(server.pid)
        if method == "fs/readFile":
            result = await client.call(method, {"path": str(source)}, timeout=120)
            assert result["dataBase64"] == text
        else:
            await client.call(method, {"path": str(target), "dataBase64": text}, timeout=120)
            assert target.read_bytes() == data
        peak = status_bytes(server.pid, "VmHWM") - idle
        print(
            f"\n{transport} {method} of 16 MiB: server peak RSS above idle "
            f"{peak / MiB:.1f} MiB = {peak / SIZE:.2f}x the file"
        )
        assert peak <= FS_TRANSFER_RSS_FACTOR * SIZE
    finally:
        await server.stop()
