"""fs/watchMissing shares one inotify instance and is capped server-wide (issue 22, item 7).

Each watch had its own inotify instance: 128 watches used all of the
user's instances (``fs.inotify.max_user_instances``, 128 by default), so
other programs of that user got EMFILE, and no server-wide cap existed.
Through the real installed server over WebSocket (several connections).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest_twisted

from execserver.codex.watch import MAX_SERVER_WATCHES, MAX_WATCHES
from tests.support.harness import DEFAULT_TIMEOUT
from tests.support.polling import until
from tests.support.ws_harness import WsClientProtocol, WsServerProcess, connect

CODEX_INIT = {"clientName": "codex-environment", "resumeSessionId": None}


def inotify_instances(pid: int | None) -> int:
    assert pid is not None
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:inotify":
                count += 1
        except FileNotFoundError:
            pass
    return count


async def _client(server: WsServerProcess) -> WsClientProtocol:
    client = await connect(server.url)
    await client.call("initialize", CODEX_INIT)
    client.notify("initialized", {})
    return client


def _changed(client: WsClientProtocol, watch_id: object) -> Any:
    def match(m: dict[str, Any]) -> bool:
        return m.get("method") == "fs/missingChanged" and m["params"]["watchId"] == watch_id

    return client.wait_for(match, DEFAULT_TIMEOUT, f"fs/missingChanged {watch_id}")


async def _watch(client: WsClientProtocol, watch_id: object, *missing: Path) -> Any:
    params = {"watchId": watch_id, "missing": [str(m) for m in missing], "present": None}
    return await client.request("fs/watchMissing", params)


@pytest_twisted.ensureDeferred
async def test_watches_share_one_inotify_instance_and_each_fires_alone(tmp_path: Path) -> None:
    server = await WsServerProcess.start()
    try:
        clients = [await _client(server) for _ in range(3)]
        # 3 x 60 = 180 watches, more than a user's 128 instances, in 3 directories.
        for c, client in enumerate(clients):
            (tmp_path / f"d{c}").mkdir()
            for n in range(60):
                reply = await _watch(client, n, tmp_path / f"d{c}" / f"file{n}")
                assert reply["result"] == {"watching": True}, reply
        assert inotify_instances(server.pid) == 1
        (tmp_path / "d1" / "file7").write_text("x")
        await _changed(clients[1], 7)
        assert not [
            m
            for client in clients
            for m in client.notifications
            if m.get("method") == "fs/missingChanged" and m["params"]["watchId"] != 7
        ]
        # A watched directory deleted: the watches fall back to its parent and
        # still fire when the path appears.
        deep = tmp_path / "d0" / "sub" / "AGENTS.md"
        (tmp_path / "d0" / "sub").mkdir()
        assert (await _watch(clients[0], "deep", deep))["result"] == {"watching": True}
        (tmp_path / "d0" / "sub").rmdir()
        probe = await clients[0].call("fs/getMetadata", {"path": str(tmp_path / "d0")})
        assert probe["isDirectory"]
        (tmp_path / "d0" / "sub").mkdir()
        deep.write_text("rules\n")
        await _changed(clients[0], "deep")
        # The deletion did not cost the other directories their kernel watch
        # (Twisted's INotify closes its whole instance on IN_DELETE_SELF).
        (tmp_path / "d2" / "file3").write_text("x")
        await _changed(clients[2], 3)
        for client in clients:
            await client.close()
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_watches_beyond_the_server_cap_are_refused(tmp_path: Path) -> None:
    server = await WsServerProcess.start()
    try:
        clients = []
        held = 0
        while held < MAX_SERVER_WATCHES:
            client = await _client(server)
            clients.append(client)
            for n in range(min(MAX_WATCHES, MAX_SERVER_WATCHES - held)):
                reply = await _watch(client, n, tmp_path / f"absent-{held}")
                assert "result" in reply, reply
                held += 1
        extra = await _client(server)
        clients.append(extra)
        reply = await _watch(extra, "one-too-many", tmp_path / "absent")
        assert reply["error"] == {
            "code": -32600,
            "message": f"too many fs/watchMissing watches on this server (limit "
            f"{MAX_SERVER_WATCHES}); retry once others have fired or their connections have "
            "closed",
        }
        # A closed connection frees its watches for others.
        await clients[0].close()

        async def accepted() -> bool:
            return "result" in await _watch(extra, "retry", tmp_path / "absent")

        await until(accepted, "the closed connection's watches freed", timeout=DEFAULT_TIMEOUT)
        assert inotify_instances(server.pid) == 1
        for client in clients[1:]:
            await client.close()
    finally:
        assert await server.stop() == 0
