"""Checks of the fs/* methods that run over any transport (stdio or WebSocket):
the handshake gate, round trips, every method once, and the streaming child
used for pause measurements.
"""

from __future__ import annotations

import base64
import os
import stat
from pathlib import Path
from typing import Any, Protocol

from tests.support.harness import b64


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


STREAMER = (
    "import time\nwhile True:\n    print(time.monotonic(), flush=True)\n    time.sleep(0.002)\n"
)
