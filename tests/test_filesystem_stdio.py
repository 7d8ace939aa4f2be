"""fs/* through the real server over real stdio (``python -m execserver``).

Covers the handshake gate, every method's success path and errors, the
``--max-read-file-bytes`` flag, round trips of assorted payloads, and a
200 MiB read while a process streams output on the same connection (the
longest gap between output notifications is printed, and bounded only
generously).

The same checks run over WebSocket in ``test_filesystem_ws.py``, which
imports the ``check_*`` helpers from here.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import os
import stat
import time
from pathlib import Path
from typing import Any, Protocol

import msgspec
import pytest
import pytest_twisted

from execserver.codec import LineFramer
from tests.support.bounds import FS_READ_PAUSE_FRACTION
from tests.support.harness import RpcFailure, ServerProcess


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class RpcClient(Protocol):
    """What these checks need of a client: the stdio and WebSocket harnesses both fit."""

    async def request(
        self, method: str, params: Any = None, timeout: float = ...
    ) -> dict[str, Any]: ...

    async def call(self, method: str, params: Any = None, timeout: float = ...) -> Any: ...

    def notify(self, method: str, params: Any = None) -> None: ...


async def fs_error(server: RpcClient, method: str, params: dict[str, Any]) -> dict[str, Any]:
    response = await server.request(method, params)
    assert "error" in response, response
    error: dict[str, Any] = response["error"]
    return error


async def check_handshake_gate(server: RpcClient) -> None:
    """fs methods before initialize / before initialized, then allowed."""
    error = await fs_error(server, "fs/readFile", {"path": "/"})
    assert error == {
        "code": -32600,
        "message": "client must call initialize before using filesystem methods",
    }
    await server.call("initialize", {"clientName": "test"})
    error = await fs_error(server, "fs/getMetadata", {"path": "/"})
    assert error == {
        "code": -32600,
        "message": "client must send initialized before using filesystem methods",
    }
    server.notify("initialized", {})
    meta = await server.call("fs/getMetadata", {"path": "/"})
    assert meta["isDirectory"] is True


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


async def check_every_fs_method(server: RpcClient, root: str) -> None:
    """Each method's success path and errors, on a handshaken client."""
    # createDirectory
    assert await server.call("fs/createDirectory", {"path": f"{root}/a/b"}) == {}
    assert await server.call("fs/createDirectory", {"path": f"{root}/a/b"}) == {}
    error = await fs_error(server, "fs/createDirectory", {"path": f"{root}/a", "recursive": False})
    assert error == {
        "code": -32603,
        "message": "File exists (os error 17)",
        "data": {"kind": "alreadyExists", "errno": 17},
    }
    # writeFile / readFile
    payload = bytes(range(256)) * 3
    assert (
        await server.call("fs/writeFile", {"path": f"{root}/a/f.bin", "dataBase64": b64(payload)})
        == {}
    )
    read = await server.call("fs/readFile", {"path": f"{root}/a/f.bin"})
    assert read == {"dataBase64": b64(payload)}
    error = await fs_error(server, "fs/writeFile", {"path": f"{root}/a/bad", "dataBase64": "@"})
    assert error == {
        "code": -32600,
        "message": ("fs/writeFile requires valid base64 dataBase64: Invalid symbol 64, offset 0."),
        "data": {"kind": "invalidBase64"},
    }
    error = await fs_error(server, "fs/writeFile", {"path": f"{root}/missing/f", "dataBase64": ""})
    assert error == {
        "code": -32603,
        "message": "No such file or directory (os error 2)",
        "data": {"kind": "notFound", "errno": 2},
    }
    error = await fs_error(server, "fs/readFile", {"path": "relative.txt"})
    assert error["code"] == -32602
    assert error["message"] == "AbsolutePathBuf deserialized without a base path"
    error = await fs_error(server, "fs/readFile", {"path": root})
    assert error["data"] == {"kind": "isADirectory", "errno": 21}
    error = await fs_error(server, "fs/readFile", {"path": "/dev/null"})
    assert (error["code"], error["data"]) == (-32600, {"kind": "notRegularFile"})
    # getMetadata
    meta = await server.call("fs/getMetadata", {"path": f"{root}/a/f.bin"})
    assert meta["isFile"] is True and meta["isDirectory"] is False
    assert meta["size"] == len(payload) and meta["isSymlink"] is False
    assert isinstance(meta["createdAtMs"], int) and isinstance(meta["modifiedAtMs"], int)
    error = await fs_error(server, "fs/getMetadata", {"path": f"{root}/nope"})
    assert error["data"] == {"kind": "notFound", "errno": 2}
    # readDirectory
    os.symlink("f.bin", f"{root}/a/link")
    listing = await server.call("fs/readDirectory", {"path": f"{root}/a"})
    entries = {e["fileName"]: e for e in listing["entries"]}
    assert entries["b"]["isDirectory"] is True
    assert entries["f.bin"]["isFile"] is True
    assert entries["link"]["isFile"] is True and entries["link"]["isSymlink"] is True
    error = await fs_error(server, "fs/readDirectory", {"path": f"{root}/a/f.bin"})
    assert error["data"] == {"kind": "notADirectory", "errno": 20}
    # copy
    os.chmod(f"{root}/a/f.bin", 0o741)
    assert (
        await server.call(
            "fs/copy",
            {"sourcePath": f"{root}/a", "destinationPath": f"{root}/copy", "recursive": True},
        )
        == {}
    )
    with open(f"{root}/copy/f.bin", "rb") as f:
        assert f.read() == payload
    assert stat.S_IMODE(os.stat(f"{root}/copy/f.bin").st_mode) == 0o741
    assert os.readlink(f"{root}/copy/link") == "f.bin"
    error = await fs_error(
        server, "fs/copy", {"sourcePath": f"{root}/a", "destinationPath": f"{root}/c2"}
    )
    assert error["message"] == ("fs/copy requires recursive: true when sourcePath is a directory")
    error = await fs_error(
        server,
        "fs/copy",
        {"sourcePath": f"{root}/a", "destinationPath": f"{root}/a/b/c", "recursive": True},
    )
    assert error["message"] == (
        "fs/copy cannot copy a directory to itself or one of its descendants"
    )
    os.mkfifo(f"{root}/fifo")
    error = await fs_error(
        server, "fs/copy", {"sourcePath": f"{root}/fifo", "destinationPath": f"{root}/x"}
    )
    assert error["message"] == "fs/copy only supports regular files, directories, and symlinks"
    # remove
    assert await server.call("fs/remove", {"path": f"{root}/copy/link"}) == {}
    assert os.path.exists(f"{root}/copy/f.bin")
    error = await fs_error(server, "fs/remove", {"path": f"{root}/a", "recursive": False})
    assert error["data"]["kind"] == "directoryNotEmpty"
    assert await server.call("fs/remove", {"path": f"{root}/a"}) == {}
    assert not os.path.exists(f"{root}/a")
    assert await server.call("fs/remove", {"path": f"{root}/a"}) == {}
    error = await fs_error(server, "fs/remove", {"path": f"{root}/a", "force": False})
    assert error["data"] == {"kind": "notFound", "errno": 2}


async def check_round_trips(server: RpcClient, directory: Path) -> None:
    """writeFile then readFile of assorted sizes (slice edges included)."""
    for size in (0, 1, 2, 3, 4, 5, 1000, 65_537, 3 * 1024 * 1024 + 1):
        data = os.urandom(size)
        path = str(directory / f"f{size}")
        await server.call("fs/writeFile", {"path": path, "dataBase64": b64(data)})
        with open(path, "rb") as f:
            assert f.read() == data
        read = await server.call("fs/readFile", {"path": path})
        assert base64.b64decode(read["dataBase64"]) == data


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


STREAMER = (
    "import time\nwhile True:\n    print(time.monotonic(), flush=True)\n    time.sleep(0.002)\n"
)


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
