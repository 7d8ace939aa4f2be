"""Unit tests for timeouts, escalation and the process-control handlers.

Time is a ``task.Clock``; processes are fake transports driven through the
real ``ProcessProtocol`` event order (output, ``processExited``,
``processEnded``); signals go to a fake kill function that models the group.
"""

from __future__ import annotations

import signal
from typing import Any

import pytest
from twisted.internet import error, task
from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

from execserver import protocol as p
from execserver.config import ServerConfig
from execserver.errors import RpcError
from execserver.processes import ManagedProcess
from execserver.protocol import OutputStream
from execserver.session import Session, parse_signal
from execserver.spawn import ProcessSpec
from tests.support.polling import until_blocking

PID = 4242


class FakeGroup:
    """The process group of one child: records signals, decides who dies."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.alive = True

    def kill(self, pid: int, sig: int) -> bool:
        assert pid == PID
        self.sent.append(sig)
        alive = self.alive
        if sig == signal.SIGKILL:
            self.alive = False
        return alive

    def is_alive(self, pid: int) -> bool:
        return self.alive


class FakeTransport:
    def __init__(self, pid: int = PID) -> None:
        self.pid = pid
        self.written: list[bytes] = []
        self.stdin_closed = False
        self.lost = False
        self.size: tuple[int, int] | None = None
        self.pipes: dict[int, Any] = {}

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def closeStdin(self) -> None:
        self.stdin_closed = True

    def loseConnection(self) -> None:
        self.lost = True

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def set_window_size(self, rows: int, cols: int) -> None:
        self.size = (rows, cols)

    def eof_char(self) -> bytes:
        return b"\x02"


class Observer:
    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def process_output(
        self, proc: ManagedProcess, stream: OutputStream, data: bytes, seq: int
    ) -> None:
        self.events.append(("output", data))

    def process_exited(self, proc: ManagedProcess) -> None:
        self.events.append(("exited", (proc.exit_code, proc.signal, proc.timed_out)))

    def process_closed(self, proc: ManagedProcess) -> None:
        self.events.append(("closed", None))


def killed_by(sig: int) -> Failure:
    return Failure(error.ProcessTerminated(exitCode=None, signal=sig))


def make_process(
    tty: bool = False,
) -> tuple[ManagedProcess, task.Clock, FakeGroup, Observer, FakeTransport]:
    clock = task.Clock()
    group = FakeGroup()
    observer = Observer()
    proc = ManagedProcess(
        "p", tty, 1 << 20, observer, clock, kill=group.kill, is_group_alive=group.is_alive
    )
    transport = FakeTransport()
    proc.makeConnection(transport)
    return proc, clock, group, observer, transport


def end(proc: ManagedProcess, reason: Failure) -> None:
    proc.processExited(reason)
    proc.processEnded(reason)


# --- escalation -------------------------------------------------------------------


def test_terminate_sends_sigterm_then_sigkill_after_the_grace() -> None:
    proc, clock, group, _, _ = make_process()
    proc.terminate(2.0)
    assert group.sent == [signal.SIGTERM, signal.SIGCONT]
    clock.advance(1.999)
    assert signal.SIGKILL not in group.sent
    clock.advance(0.001)
    assert group.sent[-1] == signal.SIGKILL
    end(proc, killed_by(signal.SIGKILL))
    assert proc.exit_code == 137
    assert proc.signal == "SIGKILL"
    assert proc.finished
    assert clock.getDelayedCalls() == []


def test_terminate_of_a_pty_also_hangs_up() -> None:
    proc, _, group, _, _ = make_process(tty=True)
    proc.terminate(1.0)
    assert group.sent == [signal.SIGTERM, signal.SIGHUP, signal.SIGCONT]


def test_zero_grace_kills_at_once() -> None:
    proc, _, group, _, _ = make_process()
    proc.terminate(0)
    assert group.sent == [signal.SIGKILL]


def test_a_shorter_grace_brings_the_sigkill_forward_a_longer_one_does_not_delay_it() -> None:
    proc, clock, group, _, _ = make_process()
    proc.terminate(5.0)
    proc.terminate(1.0)
    clock.advance(1.0)
    assert group.sent[-1] == signal.SIGKILL

    proc, clock, group, _, _ = make_process()
    proc.terminate(1.0)
    proc.terminate(5.0)
    clock.advance(1.0)
    assert group.sent[-1] == signal.SIGKILL


def test_terminate_after_the_sigkill_does_not_restart_the_grace() -> None:
    proc, clock, group, _, _ = make_process()
    proc.terminate(0)
    proc.terminate(10.0)
    assert group.sent == [signal.SIGKILL, signal.SIGKILL]
    # Only the force-close timer is pending, no new SIGKILL timer.
    assert [c.getTime() for c in clock.getDelayedCalls()] == [1.0]


def test_output_still_open_a_second_after_sigkill_is_closed() -> None:
    proc, clock, _, _, transport = make_process()
    proc.terminate(0)
    clock.advance(0.999)
    assert not transport.lost
    clock.advance(0.001)
    assert transport.lost


def test_escalation_continues_after_close_while_the_group_lives() -> None:
    # The leader died of SIGTERM, its streams closed, but a member that
    # ignores SIGTERM (and no longer holds the output) is still running.
    proc, clock, group, _, _ = make_process()
    proc.terminate(2.0)
    finished: Deferred[None] = proc.when_finished()
    end(proc, killed_by(signal.SIGTERM))
    assert proc.closed
    assert not finished.called
    clock.advance(1.0)
    assert signal.SIGKILL not in group.sent
    clock.advance(1.0)
    assert group.sent[-1] == signal.SIGKILL
    assert finished.called
    assert clock.getDelayedCalls() == []


def test_escalation_ends_as_soon_as_the_group_is_gone() -> None:
    proc, clock, group, _, _ = make_process()
    proc.terminate(2.0)
    finished = proc.when_finished()
    end(proc, killed_by(signal.SIGTERM))
    assert not finished.called
    group.alive = False  # the last member exits a moment later
    clock.advance(0.05)
    assert finished.called
    assert signal.SIGKILL not in group.sent
    assert clock.getDelayedCalls() == []


def test_an_empty_group_at_close_finishes_at_once() -> None:
    proc, clock, group, _, _ = make_process()
    proc.terminate(2.0)
    group.alive = False
    end(proc, killed_by(signal.SIGTERM))
    assert proc.finished
    assert clock.getDelayedCalls() == []


def test_terminate_after_the_whole_tree_is_gone_is_a_no_op() -> None:
    proc, clock, group, _, _ = make_process()
    group.alive = False
    end(proc, Failure(error.ProcessDone(0)))
    assert proc.finished
    proc.terminate(1.0)
    assert group.sent == []
    assert clock.getDelayedCalls() == []


def test_a_member_outliving_the_close_keeps_the_process_unfinished_until_terminated() -> None:
    # The leader exited normally; a member that let go of the output (a
    # daemon) still runs: the process is closed but not finished, and a
    # terminate still reaches the tree.
    proc, clock, group, _, _ = make_process()
    end(proc, Failure(error.ProcessDone(0)))
    assert proc.closed
    assert not proc.finished
    finished = proc.when_finished()
    proc.terminate(1.0)
    assert group.sent == [signal.SIGTERM, signal.SIGCONT]
    clock.advance(1.0)
    assert group.sent[-1] == signal.SIGKILL
    assert finished.called
    assert clock.getDelayedCalls() == []


def test_send_signal_reaches_the_group_until_exit() -> None:
    proc, _, group, _, _ = make_process()
    assert proc.send_signal(signal.SIGINT) is True
    assert group.sent == [signal.SIGINT]
    proc.processExited(killed_by(signal.SIGINT))
    assert proc.send_signal(signal.SIGINT) is False
    assert group.sent == [signal.SIGINT]
    assert proc.exit_code == 130


# --- timeouts -----------------------------------------------------------------------


def test_wall_timeout_terminates_and_is_reported() -> None:
    proc, clock, group, observer, _ = make_process()
    proc.start_timeouts(3.0, None, 0.5)
    clock.advance(2.9)
    assert group.sent == []
    clock.advance(0.1)
    assert group.sent == [signal.SIGTERM, signal.SIGCONT]
    clock.advance(0.5)
    assert group.sent[-1] == signal.SIGKILL
    end(proc, killed_by(signal.SIGKILL))
    assert ("exited", (137, "SIGKILL", "wall")) in observer.events


def test_output_postpones_the_idle_timeout() -> None:
    proc, clock, group, observer, _ = make_process()
    proc.start_timeouts(None, 1.0, 2.0)
    clock.advance(0.6)
    proc.childDataReceived(1, b"tick")
    clock.advance(0.6)  # 1.2 s since start, 0.6 s since output
    assert group.sent == []
    clock.advance(0.4)  # 1.0 s of silence
    assert group.sent == [signal.SIGTERM, signal.SIGCONT]
    end(proc, killed_by(signal.SIGTERM))
    assert observer.events[-2] == ("exited", (143, "SIGTERM", "idle"))


def test_idle_timer_is_not_rescheduled_per_chunk() -> None:
    proc, clock, _, _, _ = make_process()
    proc.start_timeouts(None, 1.0, 2.0)
    for _ in range(100):
        proc.childDataReceived(1, b"x")
    assert len(clock.getDelayedCalls()) == 1


def test_client_terminate_is_not_reported_as_a_timeout() -> None:
    proc, clock, _, _, _ = make_process()
    proc.start_timeouts(1.0, None, 5.0)
    proc.terminate(5.0)
    clock.advance(1.0)  # the wall limit passes while the process is dying
    end(proc, killed_by(signal.SIGTERM))
    assert proc.timed_out is None


def test_timeout_after_exit_terminates_the_rest_of_the_group_silently() -> None:
    # The leader exited; a grandchild still holds the output open.
    proc, clock, group, observer, _ = make_process()
    proc.start_timeouts(2.0, None, 0.5)
    proc.processExited(Failure(error.ProcessDone(0)))
    clock.advance(2.0)
    assert group.sent == [signal.SIGTERM, signal.SIGCONT]
    assert proc.timed_out is None
    assert observer.events == [("exited", (0, None, None))]


def test_the_end_of_the_whole_tree_cancels_the_timeouts() -> None:
    proc, clock, group, _, _ = make_process()
    proc.start_timeouts(2.0, 1.0, 0.5)
    group.alive = False
    end(proc, Failure(error.ProcessDone(0)))
    assert clock.getDelayedCalls() == []


def test_a_group_that_outlived_the_close_finishes_once_it_is_empty() -> None:
    proc, clock, group, _, _ = make_process()
    finished = proc.when_finished()
    end(proc, Failure(error.ProcessDone(0)))
    clock.advance(1.0)
    assert not finished.called
    group.alive = False  # the background member exits on its own
    clock.advance(1.0)
    assert finished.called
    assert group.sent == []
    assert clock.getDelayedCalls() == []


def test_the_wall_timeout_still_ends_a_tree_that_outlived_the_close() -> None:
    # A daemon left behind by a leader that exited normally.
    proc, clock, group, observer, _ = make_process()
    proc.start_timeouts(2.0, None, 0.5)
    end(proc, Failure(error.ProcessDone(0)))
    assert not proc.finished
    clock.advance(2.0)
    assert group.sent == [signal.SIGTERM, signal.SIGCONT]
    clock.advance(0.5)
    assert group.sent[-1] == signal.SIGKILL
    assert proc.finished
    assert proc.timed_out is None
    assert observer.events[-2:] == [("exited", (0, None, None)), ("closed", None)]
    assert clock.getDelayedCalls() == []


# --- session handlers ---------------------------------------------------------------


class FakeSpawner:
    def __init__(self, group: FakeGroup) -> None:
        self.group = group
        self.transports: list[FakeTransport] = []
        self.specs: list[ProcessSpec] = []

    def spawn(self, proto: Any, spec: ProcessSpec) -> Any:
        assert isinstance(proto, ManagedProcess)
        # Route the process's signals to the fake group.
        proto._kill = self.group.kill
        proto._group_alive = self.group.is_alive
        transport = FakeTransport()
        proto.makeConnection(transport)
        self.transports.append(transport)
        self.specs.append(spec)
        return transport


def make_session(**config: Any) -> tuple[Session, task.Clock, FakeSpawner, list[object]]:
    clock = task.Clock()
    sent: list[object] = []
    spawner = FakeSpawner(FakeGroup())
    session = Session(ServerConfig(**config), clock, spawner, sent.append)
    return session, clock, spawner, sent


def start(session: Session, process_id: str = "p", **extra: Any) -> ManagedProcess:
    params = p.ExecParams(
        process_id=process_id, argv=["x"], cwd="/", env={}, tty=extra.pop("tty", False), **extra
    )
    session.start(params)
    return session.processes[process_id]


def test_start_passes_pipe_stdin_size_and_timeouts() -> None:
    session, clock, spawner, _ = make_session(terminate_grace_ms=500)
    proc = start(session, pipe_stdin=True, size=p.TerminalSize(rows=10, cols=20), timeout_ms=3000)
    spec = spawner.specs[0]
    assert spec.pipe_stdin is True
    assert (spec.rows, spec.cols) == (10, 20)
    assert proc.stdin_open
    clock.advance(3.0)
    assert spawner.group.sent == [signal.SIGTERM, signal.SIGCONT]
    clock.advance(0.5)
    assert spawner.group.sent[-1] == signal.SIGKILL


def test_pipe_stdin_is_ignored_for_a_pty() -> None:
    session, _, spawner, _ = make_session()
    start(session, tty=True, pipe_stdin=True)
    assert spawner.specs[0].pipe_stdin is False


def test_wait_times_out_and_forgets_its_waiter() -> None:
    session, clock, _, _ = make_session()
    proc = start(session)
    d = session.wait(p.WaitParams("p", timeout_ms=1000))
    assert isinstance(d, Deferred)
    clock.advance(1.0)
    assert d.called
    assert proc._exited.waiting == 0  # the timed-out wait left no waiter behind
    result: list[p.WaitResponse] = []
    d.addCallback(result.append)
    assert result == [p.WaitResponse(exited=False, exit_code=None)]


def test_wait_is_answered_by_the_exit() -> None:
    session, clock, _, _ = make_session()
    proc = start(session, timeout_ms=500)
    result: list[p.WaitResponse] = []
    d = session.wait(p.WaitParams("p"))
    assert isinstance(d, Deferred)
    d.addCallback(result.append)
    clock.advance(0.5)
    proc.processExited(killed_by(signal.SIGTERM))
    assert result == [
        p.WaitResponse(exited=True, exit_code=143, signal="SIGTERM", timed_out="wall")
    ]
    # After exit, wait answers at once.
    assert session.wait(p.WaitParams("p", timeout_ms=5)) == result[0]


def test_signal_close_stdin_and_resize_handlers() -> None:
    session, _, spawner, _ = make_session()
    start(session, "pipe", pipe_stdin=True)
    start(session, "tty", tty=True)
    pipe_t, tty_t = spawner.transports
    assert session.signal(p.SignalParams("pipe", "HUP")) == p.SignalResponse(delivered=True)
    assert spawner.group.sent == [signal.SIGHUP]
    assert session.close_stdin(p.CloseStdinParams("pipe")).closed
    assert pipe_t.stdin_closed
    assert not session.close_stdin(p.CloseStdinParams("pipe")).closed
    assert session.close_stdin(p.CloseStdinParams("tty")).closed
    assert tty_t.written == [b"\x02"]
    session.resize(p.ResizeParams("tty", 50, 132))
    assert tty_t.size == (50, 132)
    with pytest.raises(RpcError) as info:
        session.resize(p.ResizeParams("pipe", 50, 132))
    assert (info.value.code, info.value.message) == (-32600, "process pipe is not a tty")


def test_shutdown_waits_for_the_sigkill_of_a_term_ignoring_member() -> None:
    session, clock, spawner, _ = make_session(terminate_grace_ms=2000)
    proc = start(session)
    done = session.shutdown()
    end(proc, killed_by(signal.SIGTERM))  # leader gone, a member lives on
    assert not done.called
    clock.advance(2.0)
    assert spawner.group.sent[-1] == signal.SIGKILL
    assert done.called


def test_list_reports_every_retained_process() -> None:
    session, _, _, _ = make_session()
    start(session, "a")
    b = start(session, "b", tty=True)
    end(b, Failure(error.ProcessDone(0)))
    listed = session.list(p.ListParams()).processes
    assert [(e.process_id, e.pid, e.running, e.exit_code, e.tty) for e in listed] == [
        ("a", PID, True, None, False),
        ("b", PID, False, 0, True),
    ]


@pytest.mark.parametrize(
    ("value", "number"),
    [
        ("SIGINT", signal.SIGINT),
        ("INT", signal.SIGINT),
        ("sigterm", signal.SIGTERM),
        (9, 9),
        ("9", 9),
        ("SIGRTMIN", signal.SIGRTMIN),
        ("RTMIN+2", signal.SIGRTMIN + 2),
        ("SIGRTMAX-1", signal.SIGRTMAX - 1),
    ],
)
def test_parse_signal(value: int | str, number: int) -> None:
    assert parse_signal(value) == number


@pytest.mark.parametrize("value", ["SIGFOO", "", "RTMIN+99", 0, -1, signal.NSIG, "SIG"])
def test_parse_signal_rejects(value: int | str) -> None:
    with pytest.raises(RpcError) as info:
        parse_signal(value)
    assert info.value.code == -32602


def test_shutdown_waits_for_an_escalation_the_registry_already_released() -> None:
    session, clock, spawner, _ = make_session(terminate_grace_ms=2000, exit_retention_ms=0)
    proc = start(session)
    session.terminate(p.TerminateParams("p"))
    end(proc, killed_by(signal.SIGTERM))  # a member ignoring SIGTERM lives on
    clock.advance(0)  # the zero retention releases the id
    assert "p" not in session.processes
    done = session.shutdown()
    assert not done.called
    clock.advance(2.0)
    assert spawner.group.sent[-1] == signal.SIGKILL
    assert done.called


def test_idle_timeout_waits_while_flow_control_stops_reading() -> None:
    # A process blocked on a full pipe because the client is slow is not idle.
    session, clock, spawner, _ = make_session()
    start(session, idle_timeout_ms=1000)
    session.pauseProducing()
    clock.advance(5.0)
    assert spawner.group.sent == []
    session.resumeProducing()
    clock.advance(0.9)
    assert spawner.group.sent == []
    clock.advance(1.2)
    assert spawner.group.sent[:1] == [signal.SIGTERM]


def test_group_alive_ignores_zombies(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import subprocess

    from execserver.spawn import groups as spawn

    monkeypatch.setattr(spawn, "_group_scan", None)
    leader = subprocess.Popen(
        ["sh", "-c", "sleep 300 & echo started; wait"],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert leader.stdout is not None
        leader.stdout.readline()
        assert spawn.group_alive(leader.pid)
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait(10)
        # The orphaned sleep may linger as a zombie (this container's init
        # reaps late): it must not count. Poll past the scan cache's lifetime.
        until_blocking(
            lambda: not spawn.group_alive(leader.pid),
            "the group to be reported gone",
            timeout=10,
            interval=spawn.GROUP_SCAN_TTL,
        )
    finally:
        if leader.poll() is None:
            os.killpg(leader.pid, signal.SIGKILL)
            leader.wait()
        if leader.stdout is not None:
            leader.stdout.close()


def test_a_timeout_during_a_client_terminate_keeps_the_clients_grace() -> None:
    proc, clock, group, _, _ = make_process()
    proc.start_timeouts(1.0, None, 0.5)
    proc.terminate(10.0)
    clock.advance(1.0)  # the wall limit passes
    clock.advance(0.5)  # the timeout's own grace would end here
    assert signal.SIGKILL not in group.sent
    clock.advance(8.5)
    assert group.sent[-1] == signal.SIGKILL
