"""Sessions a peer parks are counted and cannot lock others out (issue 22, items 6 and 13).

Through the real installed server on an unauthenticated loopback listener,
where every client is ``anonymous``: ``exec_server_sessions`` counted 0
while three detached sessions ran processes; one peer that parked
``--max-sessions-per-identity`` sessions refused every other client for the
length of their TTL.
"""

from __future__ import annotations

import re
from typing import Any

import pytest_twisted

from tests.support.harness import DEFAULT_TIMEOUT
from tests.support.polling import until
from tests.support.ws_harness import WsServerProcess, connect, get_request, http_get

TTL_MS = 600_000


async def _gauges(server: WsServerProcess) -> dict[str, int]:
    """The unlabelled samples of /metrics."""
    host, port = server.host_port
    status, _, body = await http_get(host, port, get_request("/metrics"))
    assert status == 200
    return {
        m.group(1).decode(): int(m.group(2))
        for m in re.finditer(rb"^(exec_server_[a-z_]+) (\d+)$", body, re.MULTILINE)
    }


async def _park(server: WsServerProcess, process: bool = True) -> str:
    """A session with a TTL (and a running process), left detached."""
    client = await connect(server.url)
    result: dict[str, Any] = await client.call(
        "initialize", {"clientName": "parker", "sessionTtlMs": TTL_MS}
    )
    client.notify("initialized", {})
    if process:
        await client.start_process("p", ["sleep", "60"])
    await client.close()
    return str(result["sessionId"])


@pytest_twisted.ensureDeferred
async def test_detached_sessions_are_counted_by_the_sessions_gauges() -> None:
    server = await WsServerProcess.start()
    try:
        for _ in range(3):
            await _park(server)

        async def counted() -> bool:
            gauges = await _gauges(server)
            return gauges.get("exec_server_connections") == 0

        await until(counted, "the parkers' connections closed", timeout=DEFAULT_TIMEOUT)
        gauges = await _gauges(server)
        assert gauges["exec_server_sessions"] == 3
        assert gauges["exec_server_sessions_detached"] == 3
        assert gauges["exec_server_processes_running"] == 3
        # A resumed one is attached again: still a session, no longer detached.
        client = await connect(server.url)
        await client.handshake()
        gauges = await _gauges(server)
        assert (gauges["exec_server_sessions"], gauges["exec_server_sessions_detached"]) == (4, 3)
        await client.close()
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_an_anonymous_peer_parking_sessions_cannot_lock_others_out() -> None:
    server = await WsServerProcess.start("--max-sessions-per-identity", "3")
    try:
        parked = [await _park(server) for _ in range(3)]
        # Another anonymous client still gets a session: the oldest parked one
        # is ended to make room.
        other = await connect(server.url)
        await other.handshake()
        result = await other.start_process("mine", ["echo", "served"])
        assert result == {"processId": "mine"}
        await other.wait_closed("mine")
        probe = await connect(server.url)
        reply = await probe.request("initialize", {"clientName": "t", "resumeSessionId": parked[0]})
        assert reply["error"] == {"code": -32600, "message": f"unknown session id {parked[0]}"}
        resumed = await probe.call("initialize", {"clientName": "t", "resumeSessionId": parked[1]})
        assert resumed["sessionId"] == parked[1]
        # Attached sessions are never evicted: with 3 attached, a 4th is refused.
        third = await connect(server.url)
        await third.call("initialize", {"clientName": "t", "resumeSessionId": parked[2]})
        fourth = await connect(server.url)
        reply = await fourth.request("initialize", {"clientName": "t"})
        assert reply["error"]["message"] == (
            "too many sessions: anonymous already holds 3, the limit set by "
            "--max-sessions-per-identity is 3; close or resume one"
        )
        gauges = await _gauges(server)
        assert gauges["exec_server_sessions_evicted_total"] == 1
        for client in (other, probe, third, fourth):
            await client.close()
    finally:
        assert await server.stop() == 0
