"""fs/readFile replies are bounded in memory (issue 15, item 4).

Through the real server over WebSocket: a client asks for several large
files and stops reading. The server builds one reply at a time for it (the
connection's reply budget holds one), the rest wait holding no memory, and
the server's peak RSS above idle stays within the bound docs/filesystem.md
states: twice the reply budget in use, plus 64 MiB. When the connection
closes, the budget is released at once (/metrics), the waiting requests
are dropped, and the queued reply's memory is returned (RSS falls back).

The file is 64 MiB (its reply 85.3 MiB) and the budget is scaled with the
flags, so the test stays small.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest_twisted

from execserver import fs
from tests.support.fs_stalls import gauges_of
from tests.support.harness import status_bytes
from tests.support.polling import until
from tests.support.ws_harness import WsServerProcess, connect

MiB = 1024 * 1024
FILE_BYTES = 64 * MiB
REQUESTS = 6
#: The documented bound on RSS above idle: 2 x the reply budget in use + 64 MiB.
SLACK = 64 * MiB


async def _until(server: WsServerProcess, what: str, check: object, timeout: float = 60) -> None:
    """Poll /metrics (every 50 ms, at most ``timeout`` s) until ``check(gauges)`` holds."""
    assert callable(check)
    seen: list[dict[str, float]] = [{}]

    async def holds() -> bool:
        seen[0] = await gauges_of(server)
        return bool(check(seen[0]))

    await until(holds, what, timeout=timeout, interval=0.05, detail=lambda: seen[0])


@pytest_twisted.ensureDeferred
async def test_replies_to_a_client_that_does_not_read_stay_within_the_budget(
    tmp_path: Path,
) -> None:
    path = tmp_path / "big.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(FILE_BYTES))
    reply = fs.encoded_result_size(FILE_BYTES)
    budget = reply + MiB  # one reply per connection; the server's twice that
    server = await WsServerProcess.start(
        "--connection-reply-budget-bytes",
        str(budget),
        "--reply-budget-bytes",
        str(2 * budget),
    )
    assert server.pid is not None
    try:
        client = await connect(server.url, max_message_bytes=256 * MiB)
        await client.handshake()
        # Warm up (threads, code, one small reply), then take the idle figure.
        small = tmp_path / "small"
        small.write_bytes(b"s" * 1000)
        await client.call("fs/readFile", {"path": str(small)})
        idle = status_bytes(server.pid)
        # Stop reading, then ask for the large file several times.
        client.transport.pauseProducing()  # type: ignore[union-attr]
        for request_id in range(100, 100 + REQUESTS):
            client.send({"id": request_id, "method": "fs/readFile", "params": {"path": str(path)}})
        await _until(
            server,
            "one reply queued and the others waiting for budget",
            lambda g: (
                g["exec_server_reply_bytes_queued"] >= reply
                and g["exec_server_reply_budget_waiting"] == REQUESTS - 1
                and g["exec_server_fs_operations_running"] == 0
            ),
        )
        gauges = await gauges_of(server)
        peak = status_bytes(server.pid, "VmHWM") - idle
        in_use = gauges["exec_server_reply_bytes_queued"]
        print(
            f"\nidle RSS {idle / MiB:.0f} MiB; peak above idle {peak / MiB:.0f} MiB "
            f"with {in_use / MiB:.1f} MiB of reply budget in use "
            f"(bound {(2 * in_use + SLACK) / MiB:.0f} MiB)"
        )
        assert in_use <= budget
        assert peak <= 2 * in_use + SLACK
        # The client goes away without reading: everything is let go at once.
        held = status_bytes(server.pid)
        client.transport.abortConnection()  # type: ignore[union-attr]
        await _until(
            server,
            "the budget released and the waiting requests dropped",
            lambda g: (
                g["exec_server_reply_bytes_queued"] == 0
                and g["exec_server_reply_budget_waiting"] == 0
                and g["exec_server_fs_operations_queued"] == 0
                and g["exec_server_connections"] == 0
            ),
        )
        after = status_bytes(server.pid)
        print(
            f"RSS while held {held / MiB:.0f} MiB, after the close {after / MiB:.0f} MiB "
            f"(idle {idle / MiB:.0f} MiB)"
        )
        assert after <= idle + SLACK
    finally:
        await server.stop()
