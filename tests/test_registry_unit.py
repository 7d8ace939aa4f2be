"""The session registry and TTL expiry on a fake clock (issue 11).

Connections are dispatcher connections over fake outbounds; children are
fake transports whose signals are recorded (tests/support/fakes.py). Nothing here
sleeps: the clock is advanced by hand.
"""

from __future__ import annotations

import signal
from typing import Any

from execserver.config import ServerConfig
from execserver.registry import ANONYMOUS
from tests.support.fakes import Harness, Second, drop


class Resumable(Harness):
    session_id: str


def resumable(ttl_ms: int = 5000, config: ServerConfig | None = None, **extra: Any) -> Resumable:
    h = Resumable(config)
    result = h.result("initialize", {"clientName": "t", "sessionTtlMs": ttl_ms, **extra})
    h.send({"method": "initialized", "params": {}})
    h.session_id = result["sessionId"]
    return h


def test_a_detached_session_keeps_running_until_its_ttl_then_its_tree_is_terminated() -> None:
    h = resumable(5000, ServerConfig(terminate_grace_ms=1000))
    h.start("p")
    proc = h.process("p")
    drop(h)
    h.clock.advance(4.999)
    assert h.spawner.kill.signals_to(proc.pid) == []
    assert h.dispatcher.sessions.detached_count == 1
    h.clock.advance(0.001)
    assert signal.SIGTERM in h.spawner.kill.signals_to(proc.pid)
    h.clock.advance(1.0)
    assert signal.SIGKILL in h.spawner.kill.signals_to(proc.pid)
    assert h.dispatcher.sessions.detached_count == 0
    other = Second(h)
    response = other.call("initialize", {"clientName": "t", "resumeSessionId": h.session_id})
    assert response["error"] == {
        "code": -32600,
        "message": f"unknown session id {h.session_id}",
    }


def test_resume_within_the_ttl_cancels_the_expiry_and_output_flows_again() -> None:
    h = resumable(5000)
    h.start("p")
    proc = h.process("p")
    drop(h)
    proc.output(b"while away")
    h.clock.advance(3)
    other = Second(h)
    result = other.call("initialize", {"clientName": "t", "resumeSessionId": h.session_id})[
        "result"
    ]
    assert result["sessionId"] == h.session_id
    assert result["sessionTtlMs"] == 5000
    other.conn.message_received(b'{"method":"initialized","params":{}}')
    read = other.call("process/read", {"processId": "p", "afterSeq": 0})["result"]
    assert [c["seq"] for c in read["chunks"]] == [1]
    proc.output(b"live")
    assert [n["seq"] for n in other.outbound.notifications("process/output")] == [2]
    h.clock.advance(10)
    assert h.spawner.kill.signals_to(proc.pid) == []


def test_an_attached_session_cannot_be_taken_and_is_never_replaced() -> None:
    h = resumable()
    other = Second(h)
    response = other.call("initialize", {"clientName": "t", "resumeSessionId": h.session_id})
    # codex exec-server 0.171.0's answer (its client retries on -32010).
    assert response["error"] == {
        "code": -32010,
        "message": f"session {h.session_id} is already attached to another connection",
    }
    # The refused connection can still create its own session.
    fresh = other.call("initialize", {"clientName": "t"})["result"]
    assert fresh["sessionId"] != h.session_id


def test_only_the_identity_that_created_a_session_resumes_it() -> None:
    h = resumable()
    assert h.conn.identity == ANONYMOUS
    drop(h)
    stranger = Second(h, identity="someone-else")
    response = stranger.call("initialize", {"clientName": "t", "resumeSessionId": h.session_id})
    assert response["error"]["message"] == f"unknown session id {h.session_id}"
    owner = Second(h)
    assert "result" in owner.call(
        "initialize",
        {"clientName": "t", "resumeSessionId": h.session_id},
    )


def test_without_a_ttl_a_drop_terminates_at_once() -> None:
    h = Harness()
    h.handshake()
    h.start("p")
    proc = h.process("p")
    drop(h)
    assert signal.SIGTERM in h.spawner.kill.signals_to(proc.pid)
    assert h.dispatcher.sessions.detached_count == 0


def test_ttl_is_capped_by_the_server_and_defaulted() -> None:
    h = resumable(10**9, ServerConfig(max_session_ttl_ms=1234))
    assert h.conn.session.ttl_ms == 1234
    plain = Harness(ServerConfig(default_session_ttl_ms=777))
    assert plain.result("initialize", {"clientName": "t"})["sessionTtlMs"] == 777


def test_server_shutdown_terminates_detached_sessions() -> None:
    h = resumable(60_000)
    h.start("p")
    proc = h.process("p")
    drop(h)
    assert h.spawner.kill.signals_to(proc.pid) == []
    h.dispatcher.shutdown()
    assert signal.SIGTERM in h.spawner.kill.signals_to(proc.pid)


def test_pause_stops_reading_a_full_child_until_acknowledged() -> None:
    chunk = b"x" * 1000
    h = resumable(
        60_000, ServerConfig(retained_output_bytes=2 * (1000 + 96)), onDetachedFull="pause"
    )
    h.start("p")
    proc = h.process("p")
    drop(h)
    proc.output(chunk)
    assert not proc.paused
    proc.output(chunk)
    assert proc.paused, "unacknowledged output fills the cap"
    other = Second(h)
    other.call("initialize", {"clientName": "t", "resumeSessionId": h.session_id})
    other.conn.message_received(b'{"method":"initialized","params":{}}')
    read = other.call("process/read", {"processId": "p", "afterSeq": 0})["result"]
    assert [c["seq"] for c in read["chunks"]] == [1, 2]
    assert proc.paused, "reading is not an acknowledgement"
    other.call("process/read", {"processId": "p", "afterSeq": 2})
    assert not proc.paused
