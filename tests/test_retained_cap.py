"""``--max-total-retained-bytes`` holds as output arrives (issue 22, item 5).

It was only checked at ``process/start``: 40 detached sessions x 5 chatty
processes retained 188 MiB under a 64 MiB cap. Now a chunk that takes the
server's total over the cap makes the oldest output go (its reader's first,
then the largest retainer's), reported as gaps; a ``pause`` session's
unacknowledged output is never dropped: its child stops being read until
there is room. Unit tests on a fake clock, then the real installed server.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest_twisted

from execserver.config import ServerConfig
from execserver.fdreads import READ_SIZE
from execserver.retained import CHUNK_OVERHEAD_BYTES
from tests.support.fakes import FakeOutbound, Harness, exec_params
from tests.support.harness import DEFAULT_TIMEOUT
from tests.support.polling import until
from tests.support.ws_harness import WsServerProcess, connect, get_request, http_get

CHUNK = 1000
COST = CHUNK + CHUNK_OVERHEAD_BYTES


def _ready(cap: int, **init: Any) -> Harness:
    h = Harness(ServerConfig(max_total_retained_bytes=cap))
    h.result("initialize", {"clientName": "t", **init})
    h.send({"method": "initialized", "params": {}})
    h.outbound.take()
    return h


def _retained(h: Harness) -> int:
    return sum(proc.output.retained_bytes for proc in h.session.processes.values())


def test_output_over_the_server_cap_drops_the_oldest_with_gaps_reported() -> None:
    h = _ready(3 * COST)
    h.start("a")
    h.start("b")
    for _ in range(3):
        h.process("a").output(b"a" * CHUNK)
    assert _retained(h) == 3 * COST
    # b's one chunk takes the total over: b keeps its newest, a (the largest) pays.
    h.process("b").output(b"b" * CHUNK)
    assert _retained(h) == 3 * COST
    read = h.result("process/read", {"processId": "a", "afterSeq": 0})
    assert read["gap"] == {"fromSeq": 1, "toSeq": 1}
    assert [c["seq"] for c in read["chunks"]] == [2, 3]
    assert [c["seq"] for c in h.result("process/read", {"processId": "b"})["chunks"]] == [1]
    # A chatty reader pays with its own oldest first.
    for _ in range(10):
        h.process("b").output(b"b" * CHUNK)
    assert _retained(h) <= 3 * COST
    read = h.result("process/read", {"processId": "b", "afterSeq": 0})
    assert read["gap"]["fromSeq"] == 1
    assert read["chunks"][-1]["seq"] == 11


def test_a_pause_session_is_not_read_while_the_server_is_over_its_cap() -> None:
    h = _ready(2 * COST, sessionTtlMs=60_000, onDetachedFull="pause")
    h.start("a")
    child = h.process("a")
    child.output(b"x" * CHUNK)
    child.output(b"x" * CHUNK)
    assert not child.paused
    child.output(b"x" * CHUNK)  # over: nothing unacknowledged may go
    assert child.paused
    assert _retained(h) == 3 * COST
    read = h.result("process/read", {"processId": "a", "afterSeq": 0})
    assert [c["seq"] for c in read["chunks"]] == [1, 2, 3]
    assert "gap" not in read
    # Acknowledging makes room: read again.
    h.result("process/read", {"processId": "a", "afterSeq": 2})
    assert _retained(h) <= 2 * COST
    assert not child.paused


def test_room_made_elsewhere_resumes_a_paused_process() -> None:
    h = _ready(2 * COST, sessionTtlMs=60_000, onDetachedFull="pause")
    h.start("a")
    h.start("b")
    h.process("a").output(b"x" * CHUNK)
    h.process("a").output(b"x" * CHUNK)
    h.process("b").output(b"y" * CHUNK)
    assert h.process("b").paused and not h.process("a").paused
    h.result("process/read", {"processId": "a", "afterSeq": 2})
    assert not h.process("b").paused


def test_room_made_by_dropped_output_resumes_a_paused_process() -> None:
    # A pause session's process and another connection's (drop) process share the cap.
    h = _ready(3 * COST, sessionTtlMs=60_000, onDetachedFull="pause")
    other = h.dispatcher.connect(FakeOutbound(), "other")
    for message in (
        {"id": 1, "method": "initialize", "params": {"clientName": "other"}},
        {"method": "initialized", "params": {}},
        {"id": 2, "method": "process/start", "params": exec_params("drop")},
    ):
        other.message_received(json.dumps(message).encode())
    h.start("paused")
    paused, drop = h.process("paused"), h.process("drop")
    paused.output(b"p" * CHUNK)
    paused.output(b"p" * CHUNK)
    drop.output(b"d" * CHUNK)  # at the cap
    paused.output(b"p" * 10)  # over, and nothing may go: not read
    assert paused.paused
    # The drop process's next chunk makes it drop its older one: room again.
    drop.output(b"d" * 10)
    assert not paused.paused


# --- the real server --------------------------------------------------------------------------

CAP = 1 << 20
SESSIONS = 4
PROCESSES = 3
#: Each process writes 4 MiB (more than its own 1 MiB cap, and together 48
#: times the server's cap) once the file $1 exists: every process is started
#: before the total reaches the cap (from then on process/start is refused).
CHATTY = 'while [ ! -e "$1" ]; do sleep 0.01; done; head -c 4194304 /dev/zero'


async def _retained_gauge(host: str, port: int) -> int:
    status, _, body = await http_get(host, port, get_request("/metrics"))
    assert status == 200
    found = re.search(rb"^exec_server_retained_output_bytes (\d+)$", body, re.MULTILINE)
    assert found is not None
    return int(found.group(1))


@pytest_twisted.ensureDeferred
async def test_detached_chatty_sessions_stay_within_the_server_cap(tmp_path: Path) -> None:
    go = tmp_path / "go"
    server = await WsServerProcess.start("--max-total-retained-bytes", str(CAP))
    host, port = server.host_port
    try:
        sessions = []
        for _ in range(SESSIONS):
            client = await connect(server.url)
            result = await client.call("initialize", {"clientName": "t", "sessionTtlMs": 60_000})
            client.notify("initialized", {})
            for n in range(PROCESSES):
                await client.start_process(f"p{n}", ["sh", "-c", CHATTY, "sh", str(go)])
            sessions.append(result["sessionId"])
            await client.close()
        go.touch()

        async def all_closed() -> bool:
            status, _, body = await http_get(host, port, get_request("/metrics"))
            return status == 200 and b"\nexec_server_processes_running 0\n" in body

        await until(all_closed, "every chatty process ended", timeout=DEFAULT_TIMEOUT)
        # The cap plus at most the newest chunk of each process (one pipe
        # read), the bound operations.md gives; each process alone may keep
        # 1 MiB (--retained-output-bytes): 12 MiB without the server's cap.
        newest = READ_SIZE + CHUNK_OVERHEAD_BYTES
        assert await _retained_gauge(host, port) <= CAP + SESSIONS * PROCESSES * newest
        # What was dropped is reported as a gap, never silently.
        client = await connect(server.url)
        await client.call("initialize", {"clientName": "t", "resumeSessionId": sessions[0]})
        client.notify("initialized", {})
        read = await client.call("process/read", {"processId": "p0", "afterSeq": 0})
        assert read["gap"]["fromSeq"] == 1
        await client.close()
    finally:
        assert await server.stop() == 0
