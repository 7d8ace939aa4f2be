"""Unit tests of the session (process/* semantics) and ManagedProcess, over fakes.

Time is a ``task.Clock``; children are fake transports that deliver Twisted's
events in the real order; signals go to a recording fake (tests/support/fakes.py).
"""

from __future__ import annotations

import json
import signal
from typing import Any

import pytest
from twisted.internet.task import Clock

from execserver.config import ServerConfig
from execserver.processes import ChildProcess, ManagedProcess
from execserver.spawn import ProcessSpec, SpawnError
from tests.support.fakes import (
    FAKE_PID_BASE,
    FakeKill,
    FakeOutbound,
    FakeProcessTransport,
    FakeSpawner,
    Harness,
    exec_params,
)
from tests.support.harness import b64


def ready(config: ServerConfig | None = None, spawner: FakeSpawner | None = None) -> Harness:
    h = Harness(config, spawner)
    h.handshake()
    h.outbound.take()
    return h


# --- process/start ----------------------------------------------------------------------------


def test_exec_echoes_client_process_ids() -> None:
    h = ready()
    assert h.result("process/start", exec_params("proc-1")) == {"processId": "proc-1"}
    assert h.result("process/start", exec_params("proc-2")) == {"processId": "proc-2"}


def test_start_passes_argv_cwd_env_tty_and_arg0_exactly() -> None:
    h = ready()
    env = {"PATH": "/usr/bin", "EMPTY": "", "UNICODE": "é"}
    h.result(
        "process/start",
        exec_params("p", argv=["prog", "a b", ""], cwd="/tmp", env=env, tty=True, arg0="argv0"),
    )
    spec = h.process("p").spec
    assert spec == ProcessSpec(
        argv=("prog", "a b", ""), cwd="/tmp", env=env, tty=True, arg0="argv0"
    )


def test_empty_argv_is_invalid_params() -> None:
    h = ready()
    assert h.error("process/start", exec_params(argv=[])) == {
        "code": -32602,
        "message": "argv must not be empty",
    }


def test_host_default_sandbox_is_rejected_until_supported() -> None:
    h = ready()
    error = h.error("process/start", exec_params(sandbox={"mode": "hostDefault"}))
    assert error == {
        "code": -32600,
        "message": "sandbox mode `hostDefault` is not supported by exec-server yet",
    }
    assert h.spawner.spawned == []


@pytest.mark.parametrize("sandbox", [None, {"mode": "none"}])
def test_no_sandbox_and_explicit_none_are_accepted(sandbox: Any) -> None:
    h = ready()
    assert h.result("process/start", exec_params(sandbox=sandbox)) == {"processId": "proc-1"}


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"cwd": "relative/dir"}, "absolute"),
        ({"cwd": ""}, "absolute"),
        ({"argv": ["a\0b"]}, "NUL"),
        ({"env": {"A=B": "x"}}, "A=B"),
        ({"env": {"": "x"}}, "environment"),
        ({"env": {"K": "v\0"}}, "NUL"),
        ({"arg0": "a\0"}, "NUL"),
    ],
)
def test_start_validation_errors_are_invalid_params(params: dict[str, Any], needle: str) -> None:
    h = ready()
    error = h.error("process/start", exec_params(**params))
    assert error["code"] == -32602
    assert needle in error["message"]
    assert h.spawner.spawned == []


def test_duplicate_starts_back_to_back_exactly_one_wins() -> None:
    h = ready()
    # Both requests arrive before either child reports anything.
    first = h.request("process/start", exec_params("proc-1"))
    second = h.request("process/start", exec_params("proc-1"))
    responses = h.outbound.responses()
    outcomes = [responses[first], responses[second]]
    assert sum("result" in r for r in outcomes) == 1
    errors = [r["error"] for r in outcomes if "error" in r]
    assert errors == [{"code": -32600, "message": "process proc-1 already exists"}]
    assert len(h.spawner.spawned) == 1


def test_spawn_failure_is_an_error_with_kind_and_leaves_the_id_free() -> None:
    h = ready()
    h.spawner.fail_with = SpawnError("spawnNotFound", 2, "failed to start `nope`: not found")
    error = h.error("process/start", exec_params("proc-1", argv=["nope"]))
    assert error["code"] == -32603
    assert error["data"] == {"kind": "spawnNotFound", "errno": 2}
    h.spawner.fail_with = None
    assert h.result("process/start", exec_params("proc-1")) == {"processId": "proc-1"}


def test_max_processes_limit_names_the_limit_and_frees_on_exit() -> None:
    h = ready(ServerConfig(max_processes=2))
    h.start("a")
    h.start("b")
    error = h.error("process/start", exec_params("c"))
    assert error["code"] == -32600
    assert "--max-processes" in error["message"]
    assert "2" in error["message"]
    h.process("a").exit(0)
    assert h.result("process/start", exec_params("c")) == {"processId": "c"}


# --- notifications ----------------------------------------------------------------------------


def test_output_notifications_carry_stream_and_seq() -> None:
    h = ready()
    h.start("proc-1")
    proc = h.process("proc-1")
    proc.output(b"out", fd=1)
    proc.output(b"err", fd=2)
    proc.output(b"\x00\xff", fd=1)
    assert h.outbound.notifications("process/output") == [
        {"processId": "proc-1", "stream": "stdout", "chunk": b64(b"out"), "seq": 1},
        {"processId": "proc-1", "stream": "stderr", "chunk": b64(b"err"), "seq": 2},
        {"processId": "proc-1", "stream": "stdout", "chunk": b64(b"\x00\xff"), "seq": 3},
    ]


def test_pty_output_is_the_pty_stream() -> None:
    h = ready()
    h.start("proc-1", tty=True)
    h.process("proc-1").output(b"ready\r\n")
    [note] = h.outbound.notifications("process/output")
    assert note["stream"] == "pty"


def test_exit_is_notified_after_all_output_in_order() -> None:
    h = ready()
    h.start("proc-1")
    h.outbound.take()
    proc = h.process("proc-1")
    proc.output(b"bye")
    proc.exit(3)
    methods = [m.get("method") for m in h.outbound.messages]
    assert methods[:2] == ["process/output", "process/exited"]
    [exited] = h.outbound.notifications("process/exited")
    assert exited["processId"] == "proc-1"
    assert exited["exitCode"] == 3
    assert "signal" not in exited


def test_exit_by_signal_reports_128_plus_signal_and_its_name() -> None:
    h = ready()
    h.start("proc-1")
    h.process("proc-1").exit(signal=signal.SIGKILL)
    [exited] = h.outbound.notifications("process/exited")
    assert exited["exitCode"] == 128 + 9
    assert exited["signal"] == "SIGKILL"


def test_exit_and_close_take_the_next_seqs_of_the_one_counter() -> None:
    h = ready()
    h.start("proc-1")
    proc = h.process("proc-1")
    proc.output(b"a")
    proc.output(b"b")
    reason = proc.exit_leaving_group(0)
    assert h.outbound.notifications("process/closed") == []
    proc.output(b"c")  # a grandchild still writes
    proc.end(reason)
    methods = [m.get("method") for m in h.outbound.messages]
    assert methods.count("process/closed") == 1
    assert methods.index("process/exited") < methods.index("process/closed")
    # As the reference numbers them: a=1, b=2, exit=3, c=4 (after the exit), close=5.
    assert h.outbound.notifications("process/exited")[0]["seq"] == 3
    assert [n["seq"] for n in h.outbound.notifications("process/output")] == [1, 2, 4]
    assert h.outbound.notifications("process/closed") == [{"processId": "proc-1", "seq": 5}]
    read = h.result("process/read", {"processId": "proc-1", "afterSeq": 0})
    assert (read["exitedSeq"], read["closedSeq"]) == (3, 5)
    assert [c["seq"] for c in read["chunks"]] == [1, 2, 4]


# --- process/read -----------------------------------------------------------------------------


def test_read_returns_retained_output_and_exit_state() -> None:
    h = ready()
    h.start("proc-1")
    proc = h.process("proc-1")
    proc.output(b"hello")
    proc.exit(0)
    read = h.result("process/read", {"processId": "proc-1", "waitMs": 1000})
    assert read["chunks"] == [{"seq": 1, "stream": "stdout", "chunk": b64(b"hello")}]
    assert read["nextSeq"] == 2
    assert read["exited"] is True
    assert read["exitCode"] == 0


def test_read_of_a_running_process_without_output_reports_exit_code_null() -> None:
    h = ready()
    h.start("proc-1")
    read = h.result("process/read", {"processId": "proc-1", "afterSeq": 0, "waitMs": 0})
    assert read["chunks"] == []
    assert read["nextSeq"] == 1
    assert read["exited"] is False
    assert read["exitCode"] is None


def test_read_paginates_without_skipping_omitted_chunks() -> None:
    h = ready()
    h.start("proc-1")
    proc = h.process("proc-1")
    proc.output(b"abc", fd=1)
    proc.output(b"def", fd=2)
    first = h.result("process/read", {"processId": "proc-1", "afterSeq": 0, "maxBytes": 3})
    assert first["chunks"] == [{"seq": 1, "stream": "stdout", "chunk": b64(b"abc")}]
    assert first["nextSeq"] == 2
    second = h.result(
        "process/read",
        {"processId": "proc-1", "afterSeq": first["nextSeq"] - 1, "maxBytes": 3, "waitMs": 0},
    )
    assert second["chunks"] == [{"seq": 2, "stream": "stderr", "chunk": b64(b"def")}]
    assert second["nextSeq"] == 3


def test_read_of_an_unknown_process_is_an_invalid_request() -> None:
    h = ready()
    assert h.error("process/read", {"processId": "missing"}) == {
        "code": -32600,
        "message": "unknown process id missing",
    }


def test_long_poll_wakes_on_output() -> None:
    h = ready()
    h.start("proc-1")
    read_id = h.request("process/read", {"processId": "proc-1", "afterSeq": 0, "waitMs": 5000})
    h.clock.advance(1)
    assert h.response(read_id) is None
    h.process("proc-1").output(b"x")
    response = h.response(read_id)
    assert response is not None
    assert [c["seq"] for c in response["result"]["chunks"]] == [1]
    assert h.clock.getDelayedCalls() == [], "the long-poll timer must be cancelled"


def test_long_poll_ignores_output_before_after_seq_and_wakes_on_exit() -> None:
    h = ready()
    h.start("proc-1")
    proc = h.process("proc-1")
    proc.output(b"old")
    read_id = h.request("process/read", {"processId": "proc-1", "afterSeq": 1, "waitMs": 5000})
    assert h.response(read_id) is None
    proc.exit(7)
    response = h.response(read_id)
    assert response is not None
    assert response["result"]["chunks"] == []
    assert response["result"]["exited"] is True
    assert response["result"]["exitCode"] == 7


def test_long_poll_times_out_on_the_clock() -> None:
    h = ready()
    h.start("proc-1")
    read_id = h.request("process/read", {"processId": "proc-1", "afterSeq": 0, "waitMs": 250})
    h.clock.advance(0.249)
    assert h.response(read_id) is None
    h.clock.advance(0.001)
    response = h.response(read_id)
    assert response is not None
    baseline = {"chunks": [], "nextSeq": 1, "exited": False, "exitCode": None}
    assert {k: response["result"][k] for k in baseline} == baseline


def test_long_polls_of_a_silent_process_that_time_out_leave_no_waiter() -> None:
    # A client polling a quiet process for hours must not grow the server.
    h = ready()
    h.start("proc-1")
    for _ in range(100):
        read_id = h.request("process/read", {"processId": "proc-1", "waitMs": 250})
        h.clock.advance(0.25)
        assert h.response(read_id) is not None
    assert h.session.processes["proc-1"]._changed.waiting == 0


def test_running_count_follows_starts_and_exits() -> None:
    h = ready()
    h.start("a")
    h.start("b")
    assert h.session.running_count() == 2
    h.process("a").exit(0)
    assert h.session.running_count() == 1


def test_read_of_an_exited_process_never_waits() -> None:
    h = ready()
    h.start("proc-1")
    h.process("proc-1").exit(0)
    read = h.result("process/read", {"processId": "proc-1", "afterSeq": 5, "waitMs": 10_000})
    assert read["exited"] is True


# --- exit retention ---------------------------------------------------------------------------


def test_exited_ids_stay_reserved_for_exit_retention_then_become_free() -> None:
    h = ready(ServerConfig(exit_retention_ms=500))
    h.start("proc-1")
    h.process("proc-1").output(b"kept")
    h.process("proc-1").exit(0)
    h.clock.advance(0.499)
    assert h.error("process/start", exec_params("proc-1"))["message"] == (
        "process proc-1 already exists"
    )
    read = h.result("process/read", {"processId": "proc-1"})
    assert read["exited"] is True
    assert read["chunks"][0]["chunk"] == b64(b"kept")
    h.clock.advance(0.001)
    assert h.error("process/read", {"processId": "proc-1"})["message"] == (
        "unknown process id proc-1"
    )
    assert h.result("process/terminate", {"processId": "proc-1"}) == {"running": False}
    assert h.result("process/start", exec_params("proc-1")) == {"processId": "proc-1"}


def test_a_detached_session_keeps_exited_ids_until_a_connection_had_their_retention() -> None:
    # A resuming client sends its in-flight process/start again and reads
    # "already exists" as "the first one ran": an id released while nobody
    # was connected would run the command twice.
    h = ready(ServerConfig(exit_retention_ms=500))
    h.start("proc-1")
    h.process("proc-1").exit(0)
    session = h.session
    session.detach()
    h.clock.advance(60.0)
    sent: list[object] = []
    session.attach(sent.append)
    h.clock.advance(0.499)
    assert h.error("process/start", exec_params("proc-1"))["message"] == (
        "process proc-1 already exists"
    )
    h.clock.advance(0.001)
    assert h.error("process/read", {"processId": "proc-1"})["message"] == (
        "unknown process id proc-1"
    )


def test_total_retained_output_counts_until_the_output_is_released() -> None:
    # Retained bytes count against --max-total-retained-bytes from the output
    # that arrives until the process is forgotten (the count is kept as output
    # comes and goes, not summed per start).
    h = ready(ServerConfig(exit_retention_ms=500, max_total_retained_bytes=2 * (1000 + 96)))
    h.start("a")
    h.process("a").output(b"x" * 1000)
    h.start("b")
    h.process("b").output(b"y" * 1000)
    refused = h.error("process/start", exec_params("c"))["message"]
    assert refused.startswith("the server retains 2192 bytes of output, the limit set by ")
    h.process("a").exit(0)
    h.clock.advance(0.5)
    assert h.result("process/start", exec_params("c")) == {"processId": "c"}
    h.process("c").output(b"z" * 1000)
    assert h.error("process/start", exec_params("d"))["message"] == refused


def test_output_of_an_ended_session_no_longer_counts_against_the_server() -> None:
    h = ready(ServerConfig(max_total_retained_bytes=1000 + 96))
    other = h.dispatcher.connect(FakeOutbound(), "other")
    for message in (
        {"id": 1, "method": "initialize", "params": {"clientName": "other"}},
        {"method": "initialized", "params": {}},
        {"id": 2, "method": "process/start", "params": exec_params("theirs")},
    ):
        other.message_received(json.dumps(message).encode())
    h.spawner.by_id("theirs").output(b"x" * 1000)
    assert h.error("process/start", exec_params("mine"))["message"].startswith(
        "the server retains 1096 bytes of output"
    )
    other.transport_closed()
    done = other.shutdown()
    h.spawner.by_id("theirs").exit(signal=signal.SIGTERM)
    assert done.called
    assert h.result("process/start", exec_params("mine")) == {"processId": "mine"}


def test_terminate_keeps_process_ids_reserved_until_retention_expires() -> None:
    h = ready(ServerConfig(exit_retention_ms=100))
    h.start("proc-1")
    assert h.result("process/terminate", {"processId": "proc-1"}) == {"running": True}
    assert "proc-1" in h.session.processes
    h.process("proc-1").exit(signal=signal.SIGTERM)
    assert "proc-1" in h.session.processes
    h.clock.advance(0.1)
    assert "proc-1" not in h.session.processes


# --- process/write ----------------------------------------------------------------------------


def test_writes_to_pipe_backed_processes_are_rejected() -> None:
    h = ready()
    h.start("proc-1", tty=False)
    assert h.error("process/write", {"processId": "proc-1", "chunk": b64(b"hello\n")}) == {
        "code": -32600,
        "message": "stdin is closed for process proc-1",
    }


def test_writes_to_unknown_processes_are_rejected() -> None:
    h = ready()
    assert h.error("process/write", {"processId": "missing", "chunk": b64(b"hello\n")}) == {
        "code": -32600,
        "message": "unknown process id missing",
    }


def test_writes_to_a_pty_reach_the_terminal_byte_for_byte() -> None:
    h = ready()
    h.start("proc-1", tty=True)
    every_byte = bytes(range(256))
    assert h.result("process/write", {"processId": "proc-1", "chunk": b64(every_byte)}) == {
        "accepted": True
    }
    assert h.result("process/write", {"processId": "proc-1", "chunk": ""}) == {"accepted": True}
    assert h.process("proc-1").written == every_byte


def test_writes_to_an_exited_pty_are_rejected() -> None:
    h = ready()
    h.start("proc-1", tty=True)
    h.process("proc-1").exit(0)
    error = h.error("process/write", {"processId": "proc-1", "chunk": b64(b"x")})
    assert error["code"] in (-32600, -32603)
    assert "proc-1" in error["message"]


def test_writes_beyond_the_stdin_buffer_limit_are_refused() -> None:
    h = ready(ServerConfig(max_stdin_buffer_bytes=10))
    h.start("proc-1", tty=True)
    proc = h.process("proc-1")
    proc.dataBuffer = b"12345678"  # bytes the child has not read yet
    error = h.error("process/write", {"processId": "proc-1", "chunk": b64(b"abc")})
    assert error["code"] == -32600
    assert "not being read" in error["message"]
    assert proc.written == b""


def test_write_with_undecodable_chunk_is_invalid_params() -> None:
    h = ready()
    h.start("proc-1", tty=True)
    error = h.error("process/write", {"processId": "proc-1", "chunk": "not base64!"})
    assert error["code"] == -32602
    assert "chunk" in error["message"]


# --- process/terminate ------------------------------------------------------------------------


def test_terminate_unknown_processes_report_running_false() -> None:
    h = ready()
    assert h.result("process/terminate", {"processId": "missing"}) == {"running": False}


def test_terminate_escalates_sigterm_then_sigkill_after_the_grace() -> None:
    h = ready(ServerConfig(terminate_grace_ms=2000))
    h.start("proc-1")
    pid = h.process("proc-1").pid
    assert h.result("process/terminate", {"processId": "proc-1"}) == {"running": True}
    assert h.spawner.kill.signals_to(pid)[0] == signal.SIGTERM
    assert signal.SIGKILL not in h.spawner.kill.signals_to(pid)
    h.clock.advance(1.999)
    assert signal.SIGKILL not in h.spawner.kill.signals_to(pid)
    h.clock.advance(0.001)
    assert h.spawner.kill.signals_to(pid)[-1] == signal.SIGKILL
    h.process("proc-1").exit(signal=signal.SIGKILL)
    assert h.outbound.notifications("process/exited")[0]["signal"] == "SIGKILL"


def test_terminate_of_a_pty_also_hangs_up_its_terminal() -> None:
    h = ready()
    h.start("proc-1", tty=True)
    pid = h.process("proc-1").pid
    h.result("process/terminate", {"processId": "proc-1"})
    sent = h.spawner.kill.signals_to(pid)
    assert signal.SIGTERM in sent
    assert signal.SIGHUP in sent


def test_no_sigkill_when_the_process_ends_within_the_grace() -> None:
    h = ready(ServerConfig(terminate_grace_ms=2000))
    h.start("proc-1")
    pid = h.process("proc-1").pid
    h.result("process/terminate", {"processId": "proc-1"})
    h.process("proc-1").exit(signal=signal.SIGTERM)
    h.clock.advance(10)
    assert signal.SIGKILL not in h.spawner.kill.signals_to(pid)
    [exited] = h.outbound.notifications("process/exited")
    assert exited["exitCode"] == 128 + signal.SIGTERM


def test_terminate_after_exit_reports_running_false() -> None:
    h = ready()
    h.start("proc-1")
    h.process("proc-1").exit(0)
    assert h.result("process/terminate", {"processId": "proc-1"}) == {"running": False}


def test_terminate_does_not_imply_exit() -> None:
    h = ready()
    h.start("proc-1")
    h.result("process/terminate", {"processId": "proc-1"})
    read = h.result("process/read", {"processId": "proc-1"})
    assert read["exited"] is False
    assert read["exitCode"] is None
    assert h.outbound.notifications("process/exited") == []


def test_terminate_of_an_exited_leader_leaves_its_group_unless_asked() -> None:
    h = ready()
    h.start("proc-1")
    proc = h.process("proc-1")
    proc.exit_leaving_group(0)
    # As the reference: an exited process is left alone (background jobs live on).
    assert h.result("process/terminate", {"processId": "proc-1"}) == {"running": False}
    assert h.spawner.kill.signals_to(proc.pid) == []
    terminate = {"processId": "proc-1", "descendants": True}
    assert h.result("process/terminate", terminate) == {"running": False}
    assert signal.SIGTERM in h.spawner.kill.signals_to(proc.pid)


# --- ManagedProcess, directly -----------------------------------------------------------------


class RecordingObserver:
    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def process_output(self, proc: ManagedProcess, stream: Any, data: bytes, seq: int) -> None:
        self.events.append(("output", (stream, data, seq)))

    def process_exited(self, proc: ManagedProcess) -> None:
        self.events.append(("exited", proc.exit_code))

    def process_closed(self, proc: ManagedProcess) -> None:
        self.events.append(("closed", None))


def managed(tty: bool = False) -> tuple[ManagedProcess, FakeProcessTransport, FakeKill, Clock]:
    clock = Clock()
    kill = FakeKill()
    proc = ManagedProcess("p", tty, 1 << 20, RecordingObserver(), clock, kill=kill)
    spec = ProcessSpec(argv=("x",), cwd="/", env={}, tty=tty)
    transport = FakeProcessTransport(proc, spec, FAKE_PID_BASE + 99)
    proc.makeConnection(transport)
    return proc, transport, kill, clock


def test_zero_grace_kills_at_once() -> None:
    proc, transport, kill, _ = managed()
    proc.terminate(0)
    assert kill.signals_to(transport.pid) == [signal.SIGKILL]


def test_output_still_open_a_second_after_sigkill_is_closed_by_the_server() -> None:
    proc, transport, _, clock = managed()
    proc.terminate(0.5)
    clock.advance(0.5)
    assert not transport.lost
    clock.advance(1.0)
    assert transport.lost


def test_escalation_timers_are_cancelled_once_the_process_is_gone() -> None:
    proc, transport, kill, clock = managed()
    proc.terminate(2.0)
    transport.exit(signal=signal.SIGTERM)
    clock.advance(60)
    assert kill.signals_to(transport.pid).count(signal.SIGKILL) == 0
    assert clock.getDelayedCalls() == []


def test_when_closed_fires_after_process_ended() -> None:
    proc, transport, _, _ = managed()
    closed = proc.when_closed()
    reason = transport.exit_leaving_group(0)
    assert not closed.called
    transport.end(reason)
    assert closed.called
    assert proc.when_closed().called


# --- flow control -----------------------------------------------------------------------------


def test_pause_producing_pauses_every_process_and_new_ones_start_paused() -> None:
    h = ready()
    h.start("a")
    h.start("b")
    session = h.session
    session.pauseProducing()
    assert session.paused
    assert h.process("a").paused
    assert h.process("b").paused
    h.start("c")
    assert h.process("c").paused
    session.resumeProducing()
    assert not session.paused
    assert not any(t.paused for t in h.spawner.spawned)


def test_pause_and_resume_are_idempotent_and_skip_closed_processes() -> None:
    h = ready()
    h.start("a")
    h.start("b")
    h.process("b").exit(0)
    session = h.session
    session.pauseProducing()
    session.pauseProducing()
    assert h.process("a").pause_calls == 1
    assert h.process("b").pause_calls == 0
    session.resumeProducing()
    session.resumeProducing()
    assert h.process("a").resume_calls == 1


# --- shutdown ---------------------------------------------------------------------------------


def test_shutdown_terminates_every_group_and_answers_pending_reads() -> None:
    h = ready()
    h.start("a")
    h.start("b", tty=True)
    read_id = h.request("process/read", {"processId": "a", "waitMs": 60_000})
    done = h.conn.shutdown()
    for name in ("a", "b"):
        assert signal.SIGTERM in h.spawner.kill.signals_to(h.process(name).pid)
    h.process("a").exit(signal=signal.SIGTERM)
    response = h.response(read_id)
    assert response is not None
    assert response["result"]["exited"] is True
    assert not done.called
    h.process("b").exit(signal=signal.SIGHUP)
    assert done.called


def test_shutdown_refuses_new_processes() -> None:
    h = ready()
    h.start("a")
    h.session.shutdown()
    error = h.error("process/start", exec_params("b"))
    assert error["code"] == -32600
    h.process("a").exit(0)


def test_shutdown_escalates_to_sigkill_after_the_grace() -> None:
    h = ready(ServerConfig(terminate_grace_ms=300))
    h.start("a")
    done = h.conn.shutdown()
    h.clock.advance(0.3)
    assert h.spawner.kill.signals_to(h.process("a").pid)[-1] == signal.SIGKILL
    h.process("a").exit(signal=signal.SIGKILL)
    assert done.called


# --- a child that is gone before its spawn returns ----------------------------------------------


class ReapedDuringSpawn(FakeSpawner):
    """Twisted's ``Process.__init__`` ends with ``registerReapProcessHandler``,
    which reaps a child that already exited and calls ``processExited``
    synchronously (Twisted's own comment: "That's probably not ideal"); the
    exit drain then reads the child's output, still inside ``spawn()``. This
    is what happens to ``printf hi`` or ``true`` under load.
    """

    def spawn(self, proto: Any, spec: ProcessSpec) -> FakeProcessTransport:
        transport = super().spawn(proto, spec)
        transport.output(b"hi")
        reason = transport.exit_leaving_group(0)
        transport.end(reason)
        return transport


def test_start_response_precedes_the_events_of_a_child_that_exited_during_spawn() -> None:
    h = ready(spawner=ReapedDuringSpawn())
    request_id = h.request("process/start", exec_params("fast", argv=["printf", "hi"]))
    order = [m.get("id", m.get("method")) for m in h.outbound.messages]
    assert order[0] == request_id, order


def test_events_of_a_child_that_exited_during_spawn_are_all_delivered() -> None:
    h = ready(spawner=ReapedDuringSpawn())
    assert h.result("process/start", exec_params("fast")) == {"processId": "fast"}
    methods = [m.get("method") for m in h.outbound.messages if "method" in m]
    assert methods == ["process/output", "process/exited", "process/closed"]
    read = h.result("process/read", {"processId": "fast"})
    assert read["exited"] is True
    assert read["chunks"][0]["chunk"] == b64(b"hi")


# --- the session's interface to its processes ---------------------------------------------


def test_a_process_is_steered_through_the_child_process_interface() -> None:
    h = ready()
    h.result("process/start", exec_params(pipeStdin=True))
    child: ChildProcess = h.session.processes["proc-1"]
    transport = h.spawner.by_id("proc-1")
    stdin = transport.pipes[0]
    assert child.stdin_writable
    child.write_stdin(b"abc")
    assert transport.written == b"abc"
    # What stdin's pipe holds unsent is what bounds process/write.
    stdin.dataBuffer = b"x" * 10
    assert child.stdin_unsent() == 10
    child.pause_reading()
    assert transport.paused
    child.resume_reading()
    assert not transport.paused
    assert child.close_stdin() is True
    assert child.close_stdin() is False
    assert not child.stdin_writable
    transport.exit(0)
    # Closed: flow control no longer reaches the transport.
    calls = transport.pause_calls
    child.pause_reading()
    assert transport.pause_calls == calls


def test_a_terminal_gets_its_eof_character_and_size_through_the_interface() -> None:
    h = ready()
    h.result("process/start", exec_params(tty=True))
    child: ChildProcess = h.session.processes["proc-1"]
    transport: Any = h.spawner.by_id("proc-1")
    sizes: list[tuple[int, int]] = []
    transport.eof_char = lambda: b"\x02"
    transport.set_window_size = lambda rows, cols: sizes.append((rows, cols))
    child.send_eof()
    child.resize(50, 132)
    assert transport.written == b"\x02"
    assert sizes == [(50, 132)]
