"""No client can stall the filesystem for everyone (issue 15, item 3).

Through the real server over WebSocket: a FIFO held open by a process that
never reads, four 1 MiB ``fs/writeFile`` calls to it (which used to switch
the descriptor to blocking mode and occupy every pool thread for ever),
and meanwhile another client's ``fs/getMetadata``. Every non-regular
target (FIFO, character device) of every method is refused or described
at once; ``/readyz`` stays 200 and the pool gauges return to zero. The
holder process is always killed and reaped.
"""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path
from typing import Any

import pytest_twisted
from twisted.internet.defer import Deferred, gatherResults

from tests.support.fs_stalls import NOT_REGULAR_READ, gauges_of, held_fifo
from tests.support.harness import with_timeout
from tests.support.ws_harness import WsServerProcess, connect, get_request, http_get

__all__ = ["held_fifo"]  # fixtures, used by name


NOT_REGULAR_WRITE = {
    "code": -32600,
    "message": "fs/writeFile only supports regular files",
    "data": {"kind": "notRegularFile"},
}
UNSUPPORTED_COPY = {
    "code": -32600,
    "message": "fs/copy only supports regular files, directories, and symlinks",
    "data": {"kind": "unsupportedFileType"},
}


@pytest_twisted.ensureDeferred
async def test_writes_to_a_fifo_nobody_reads_do_not_stall_other_clients(held_fifo: Path) -> None:
    payload = base64.b64encode(os.urandom(1024 * 1024)).decode()
    server = await WsServerProcess.start()
    try:
        attacker = await connect(server.url)
        victim = await connect(server.url)
        await attacker.handshake()
        await victim.handshake()
        writes = [
            Deferred.fromCoroutine(
                attacker.request("fs/writeFile", {"path": str(held_fifo), "dataBase64": payload})
            )
            for _ in range(4)
        ]
        # They used to hang here for ever, holding all four pool threads.
        replies: list[dict[str, Any]] = await with_timeout(
            gatherResults(writes), 10, "the four fs/writeFile replies"
        )
        assert [reply["error"] for reply in replies] == [NOT_REGULAR_WRITE] * 4
        # The attacker leaves; everyone else carries on.
        attacker.abort()
        started = time.monotonic()
        meta = await victim.call("fs/getMetadata", {"path": str(held_fifo)}, timeout=10)
        gap = time.monotonic() - started
        print(f"\nanother client's fs/getMetadata answered in {gap * 1000:.1f} ms")
        assert meta["isFile"] is False and meta["isDirectory"] is False
        listing = await victim.call("fs/readDirectory", {"path": str(held_fifo.parent)})
        assert [e["fileName"] for e in listing["entries"]] == ["f"]
        host, port = server.host_port
        status, _, _ = await http_get(host, port, get_request("/readyz"))
        assert status == 200
        gauges = await gauges_of(server)
        assert gauges["exec_server_fs_operations_running"] == 0
        assert gauges["exec_server_fs_operations_queued"] == 0
        await victim.close()
    finally:
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_no_method_opens_a_fifo_or_a_device(held_fifo: Path, tmp_path: Path) -> None:
    regular = tmp_path / "regular"
    regular.write_bytes(b"data")
    server = await WsServerProcess.start()
    try:
        client = await connect(server.url)
        await client.handshake()

        async def error(method: str, params: dict[str, Any]) -> Any:
            response = await client.request(method, params, timeout=10)
            assert "error" in response, (method, params, response)
            return response["error"]

        fifo = str(held_fifo)
        for path in (fifo, "/dev/null", "/dev/zero"):
            assert await error("fs/writeFile", {"path": path, "dataBase64": "eA=="}) == (
                NOT_REGULAR_WRITE
            )
        for path in (fifo, "/dev/zero", "/dev/urandom", "/dev/tty"):
            if os.path.exists(path):
                assert await error("fs/readFile", {"path": path}) == NOT_REGULAR_READ
        for source, destination in (
            (fifo, str(tmp_path / "out")),
            (str(regular), fifo),
            (str(regular), "/dev/null"),
            ("/dev/zero", str(tmp_path / "out")),
        ):
            params = {"sourcePath": source, "destinationPath": destination}
            assert await error("fs/copy", params) == UNSUPPORTED_COPY
        assert not (tmp_path / "out").exists()
        # A directory holding the FIFO copies (the FIFO is skipped) and lists.
        await client.call(
            "fs/copy",
            {
                "sourcePath": str(tmp_path),
                "destinationPath": f"/tmp/..{tmp_path}-copy",
                "recursive": True,
            },
        )
        assert sorted(os.listdir(f"{tmp_path}-copy")) == ["regular"]
        await client.call("fs/remove", {"path": f"{tmp_path}-copy"})
        # Describing and removing never open the FIFO.
        meta = await client.call("fs/getMetadata", {"path": fifo})
        assert (meta["isFile"], meta["isDirectory"], meta["size"]) == (False, False, 0)
        await client.call("fs/remove", {"path": fifo})
        assert not held_fifo.exists()
        await client.close()
    finally:
        await server.stop()
