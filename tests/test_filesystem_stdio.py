"""fs/* through the real server over real stdio (``python -m execserver``).

Covers the handshake gate, every method's success path and errors, the
``--max-read-file-bytes`` flag, round trips of assorted payloads, and a
200 MiB read while a process streams output on the same connection (the
longest gap between output notifications is printed, and bounded only
generously).

The same checks run over WebSocket in ``test_filesystem_ws.py``: both use
the ``check_*`` helpers of ``tests/support/fs_checks.py``.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import os
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_twisted

from execserver.codec import LineFramer
from tests.support.bounds import FS_READ_PAUSE_FRACTION
from tests.support.fs_checks import (
    STREAMER,
    check_every_fs_method,
    check_handshake_gate,
    check_round_trips,
)
from tests.support.harness import RpcFailure
from tests.support.stdio_server import ServerProcess


@pytest_twisted.ensureDeferred
async def test_fs_methods_need_the_handshake_over_stdio() -> None:
    server = ServerProcess.start()
    try:
        await check_handshake_gate(server)
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_every_fs_method_and_its_errors_over_stdio(tmp_path: Path) -> None:
    server = ServerProcess.start()
    try:
        await server.handshake()
        await check_every_fs_method(server, str(tmp_path))
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_round_trips_of_assorted_sizes_over_stdio(tmp_path: Path) -> None:
    server = ServerProcess.start()
    try:
        await server.handshake()
        await check_round_trips(server, tmp_path)
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_max_read_file_bytes_flag(tmp_path: Path) -> None:
    server = ServerProcess.start("--max-read-file-bytes", "10")
    try:
        await server.handshake()
        (tmp_path / "small").write_bytes(b"0123456789")
        (tmp_path / "big").write_bytes(b"0123456789!")
        read = await server.call("fs/readFile", {"path": str(tmp_path / "small")})
        assert base64.b64decode(read["dataBase64"]) == b"0123456789"
        with pytest.raises(RpcFailure) as info:
            await server.call("fs/readFile", {"path": str(tmp_path / "big")})
        assert info.value.code == -32600
        assert info.value.message == "file is too large to read: limit is 10 bytes"
    finally:
        assert await server.stop() == 0


class BigLineServer(ServerProcess):
    """A client whose line splitting stays linear for multi-hundred-MB lines.

    It timestamps every ``process/output`` notification and the window in
    which a large line (the readFile response) was arriving.
    """

    def __init__(self) -> None:
        super().__init__()
        self.framer = LineFramer(1 << 31)
        self.output_times: list[float] = []
        self.partial_since: float | None = None
        self.big_line_windows: list[tuple[float, float]] = []

    def outReceived(self, data: bytes) -> None:
        now = time.monotonic()
        if self.partial_since is None:
            self.partial_since = now
        for line in self.framer.feed(data):
            assert isinstance(line, bytes | bytearray)
            message: dict[str, Any] = msgspec.json.decode(line)
            if message.get("method") == "process/output":
                self.output_times.append(now)
            if len(line) <= 1 << 20:
                self.messages.append(message)
            else:
                # The window ends once the line is parsed: this client's own
                # decoding time is not the server's doing.
                now = time.monotonic()
                self.big_line_windows.append((self.partial_since, now))
            self._dispatch(message)
        if not self.framer.buffered_bytes:
            self.partial_since = None


def longest_gap_outside(times: list[float], window: tuple[float, float]) -> float:
    """Longest gap between consecutive ``times``, not counting ``window`` itself."""
    longest = 0.0
    for a, b in itertools.pairwise(times):
        straddles = a <= window[0] and b >= window[1]
        longest = max(longest, max(window[0] - a, b - window[1]) if straddles else b - a)
    return longest


@pytest.mark.slow
@pytest_twisted.ensureDeferred
async def test_200_mib_read_while_output_streams(tmp_path: Path) -> None:
    """The read runs on the pool: output keeps flowing until the response is sent.

    On one stdio connection the response line itself (266 MiB of base64)
    holds up everything queued behind it; that transfer window is reported
    separately from the longest gap outside it.
    """
    size = 200 * 1024 * 1024
    path = tmp_path / "big.bin"
    block = os.urandom(1024 * 1024)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for _ in range(size // len(block)):
            f.write(block)
            digest.update(block)
    server = BigLineServer.start()
    assert isinstance(server, BigLineServer)
    try:
        await server.handshake()
        await server.start_process("streamer", ["python3", "-u", "-c", STREAMER])
        await server.wait_notification("process/output", "streamer")
        await server.wait_for(lambda _: len(server.output_times) >= 20, 30, "steady output", False)
        before = len(server.output_times)
        sent = time.monotonic()
        response = await server.request("fs/readFile", {"path": str(path)}, timeout=120)
        answered = time.monotonic()
        # The stream keeps flowing afterwards (checking the data waits until
        # then: it would stall this client's own reactor).
        seen = len(server.output_times)
        await server.wait_for(
            lambda _: len(server.output_times) >= seen + 20, 30, "output after the read", False
        )
        (window,) = server.big_line_windows
        during = [t for t in server.output_times[before:] if t < window[0]]
        times = [t for t in server.output_times if t >= sent - 0.5]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        outside = longest_gap_outside(times, window)
        print(
            f"\n200 MiB fs/readFile over stdio: answered {answered - sent:.2f}s after the "
            f"request; {len(during)} output notifications arrived before the response "
            f"started; longest gap between output notifications {max(gaps) * 1000:.0f} ms "
            f"overall, {outside * 1000:.0f} ms not counting the "
            f"{(window[1] - window[0]) * 1000:.0f} ms spent receiving the "
            f"{size * 4 // 3 // 2**20} MiB response line on the same connection"
        )
        assert during, "no output arrived while the file was being read"
        data = base64.b64decode(response["result"]["dataBase64"])
        assert len(data) == size
        assert hashlib.sha256(data).digest() == digest.digest()
        del data, response
        # Output can be seen only until the response line starts (it then
        # holds the connection; after it, gaps are this process parsing 266
        # MiB). A server reading and encoding on its event loop would pause
        # from the request until the line: most of the read.
        took = answered - sent
        marks = [sent, *during, window[0]]
        pause = max(b - a for a, b in itertools.pairwise(marks))
        print(f"longest pause before the line: {pause:.2f}s, {pause / took:.2f} of the read")
        assert pause <= FS_READ_PAUSE_FRACTION * took, (
            f"output paused {pause:.2f}s before the response of a {took:.2f}s read"
        )
        await server.call("process/terminate", {"processId": "streamer"})
        await server.wait_closed("streamer", timeout=30)
    finally:
        assert await server.stop(timeout=60) == 0
