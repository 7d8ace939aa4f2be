"""The session-following core (``clientcore.follow.ProcessTable``) with no event loop.

Both clients follow their processes through it: start registration before
the request, re-keying under the server's id, close and linger, the "pause"
acknowledgement, and the catch-up after a resume with gap reporting. Here it
runs with a hand-stepped clock, a fake ``call`` and plain lists, so what it
decides is checked apart from either client's I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest

from execserver import protocol as p
from execserver.clientcore.calls import after_drop
from execserver.clientcore.errors import (
    ConnectionClosed,
    ExecServerError,
    OutcomeUnknown,
    OutputGap,
    ServerError,
    SessionLost,
)
from execserver.clientcore.follow import ProcessTable, acknowledge, end_processes
from execserver.clientcore.initialize import initialize_params
from execserver.clientcore.process import ProcessCore
from execserver.clientcore.types import GapEvent, InitializeResult, OutputEvent
from execserver.retained import CHUNK_OVERHEAD_BYTES

T = TypeVar("T")


class _Queue:
    def push(self, event: OutputEvent) -> None:
        pass

    def end(self) -> None:
        pass

    def fail(self, error: Exception) -> None:
        pass


class _Handle(ProcessCore[_Queue]):
    def __init__(self, process_id: str = "p") -> None:
        self.events: list[object] = []
        self._init_process(process_id, 1 << 20)
        self.add_output_listener(self.events.append, gaps=True)

    def _fire_exited(self, exit_code: int | None) -> None:
        self.events.append(("exited", exit_code))

    def _fire_closed(self) -> None:
        self.events.append("closed")

    def _backlog_overflow(self) -> None:
        raise AssertionError("no backlog overflow expected")

    def _listener_failed(self) -> None:
        raise AssertionError("no listener failure expected")

    def _gap_unheard(self, error: OutputGap) -> None:
        raise AssertionError("every gap has a listener here")


class _Clock:
    """``schedule`` of the table, stepped by hand."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[tuple[float, Callable[[], None], list[bool]]] = []

    def schedule(self, seconds: float, fn: Callable[[], None]) -> Callable[[], None]:
        cancelled = [False]
        self.timers.append((self.now + seconds, fn, cancelled))

        def cancel() -> None:
            cancelled[0] = True

        return cancel

    def advance(self, seconds: float) -> None:
        self.now += seconds
        due = [t for t in self.timers if t[0] <= self.now]
        self.timers = [t for t in self.timers if t[0] > self.now]
        for _, fn, cancelled in due:
            if not cancelled[0]:
                fn()

    @property
    def pending(self) -> int:
        return sum(1 for _, _, cancelled in self.timers if not cancelled[0])


class _Server:
    """A ``call`` answering ``process/read`` from a script of answers."""

    def __init__(self, answers: list[p.ReadResponse | Exception]) -> None:
        self.answers = answers
        self.sent: list[p.ReadParams] = []

    async def call(self, method: str, params: object, result_type: type[T], /) -> T:
        assert method == p.PROCESS_READ and result_type is p.ReadResponse
        assert isinstance(params, p.ReadParams)
        self.sent.append(params)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[return-value]


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Step a coroutine whose awaits all complete at once."""
    try:
        coro.send(None)
    except StopIteration as stop:
        result: T = stop.value
        return result
    raise AssertionError("the coroutine suspended")


def _pause(retention: int = 4096) -> InitializeResult:
    return InitializeResult(
        "exec-server.v1",
        session_id="s",
        session_ttl_ms=1000,
        on_detached_full="pause",
        retained_output_bytes=retention,
    )


def _read(chunks: list[tuple[int, bytes]], next_seq: int, **extra: Any) -> p.ReadResponse:
    return p.ReadResponse(
        chunks=[p.ProcessOutputChunk(seq, "stdout", data) for seq, data in chunks],
        next_seq=next_seq,
        exited=extra.pop("exited", False),
        exit_code=extra.pop("exit_code", None),
        **extra,
    )


# --- start registration -----------------------------------------------------------------


def test_a_start_registers_before_its_answer_and_is_rekeyed_by_it() -> None:
    table: ProcessTable[_Handle] = ProcessTable(_Clock().schedule)
    handle = _Handle("proc-1")
    table.claim("proc-1")
    table.register(handle)
    # Output racing the answer finds the handle under the requested id.
    assert table.get("proc-1") is handle
    table.started("proc-1", handle, p.ExecResponse("server-7"))
    assert table.get("proc-1") is None
    assert table.get("server-7") is handle
    assert handle.process_id == "server-7"
    assert len(table) == 1


def test_a_live_id_is_refused_and_a_failed_start_leaves_no_handle() -> None:
    table: ProcessTable[_Handle] = ProcessTable(_Clock().schedule)
    first = _Handle("a")
    table.register(first)
    with pytest.raises(ExecServerError, match="process id a is already in use by this client"):
        table.claim("a")
    first.mark_closed()
    table.claim("a")  # a closed handle's id may be used again
    second = _Handle("a")
    table.register(second)
    table.unregister("a", first)  # not the registered one: nothing happens
    assert table.get("a") is second
    table.unregister("a", second)
    assert table.get("a") is None and len(table) == 0


# --- close and linger -------------------------------------------------------------------


def test_an_exit_without_a_close_is_forgotten_after_the_linger() -> None:
    clock = _Clock()
    table: ProcessTable[_Handle] = ProcessTable(clock.schedule, linger_seconds=10.0)
    handle = _Handle()
    table.register(handle)
    handle.mark_exited(0)
    table.linger(handle)
    table.linger(handle)  # once per process
    assert clock.pending == 1
    clock.advance(9.9)
    assert table.get("p") is handle and not handle.is_closed
    clock.advance(0.1)
    assert table.get("p") is None and handle.is_closed
    assert handle.events == [("exited", 0), "closed"]


def test_a_close_forgets_at_once_and_cancels_the_linger() -> None:
    clock = _Clock()
    table: ProcessTable[_Handle] = ProcessTable(clock.schedule, linger_seconds=10.0)
    handle = _Handle()
    table.register(handle)
    handle.mark_exited(0)
    table.linger(handle)
    table.forget(handle)
    assert clock.pending == 0 and table.get("p") is None and handle.is_closed


def test_a_drop_cancels_every_linger_and_take_all_empties_the_table() -> None:
    clock = _Clock()
    table: ProcessTable[_Handle] = ProcessTable(clock.schedule)
    handles = [_Handle("a"), _Handle("b")]
    for handle in handles:
        table.register(handle)
        handle.mark_exited(1)
        table.linger(handle)
    table.cancel_lingers()
    assert clock.pending == 0
    assert table.take_all() == handles
    assert len(table) == 0
    clock.advance(100.0)
    assert not any(h.is_closed for h in handles)


# --- acknowledgement --------------------------------------------------------------------


def test_pause_acknowledges_each_quarter_of_the_retention() -> None:
    table: ProcessTable[_Handle] = ProcessTable(_Clock().schedule)
    handle = _Handle()
    retention = 4 * (100 + CHUNK_OVERHEAD_BYTES)
    result = _pause(retention)
    handle.accept_output(OutputEvent("p", "stdout", b"x" * 99, 1))
    assert table.ack_params(handle, 99, result, True) is None
    handle.accept_output(OutputEvent("p", "stdout", b"x", 2))
    # 99 + 1 bytes with two chunks' overhead reach a quarter of the retention.
    assert table.ack_params(handle, 1, result, True) == p.ReadParams("p", 2, 1, 0)
    assert handle.unacked_bytes == 0


def test_no_acknowledgement_without_pause_before_output_or_when_disconnected() -> None:
    table: ProcessTable[_Handle] = ProcessTable(_Clock().schedule)
    handle = _Handle()
    assert table.ack_params(handle, 0, _pause(), True, now=True) is None  # nothing yet
    handle.accept_output(OutputEvent("p", "stdout", b"x", 1))
    drop = InitializeResult("exec-server.v1", on_detached_full="drop")
    assert table.ack_params(handle, 1, drop, True, now=True) is None
    assert table.ack_params(handle, 1, None, True, now=True) is None
    assert table.ack_params(handle, 1, _pause(), False, now=True) is None
    assert table.ack_params(handle, 1, _pause(), True, now=True) == p.ReadParams("p", 1, 1, 0)


def test_acknowledge_if_due_sends_only_a_due_acknowledgement_in_the_background() -> None:
    table: ProcessTable[_Handle] = ProcessTable(_Clock().schedule)
    handle = _Handle()
    handle.accept_output(OutputEvent("p", "stdout", b"x", 1))
    server = _Server([_read([], 1)])
    spawned: list[Coroutine[Any, Any, None]] = []
    table.acknowledge_if_due(server.call, handle, 1, _pause(), False, spawned.append, now=True)
    assert spawned == []  # disconnected: none due
    table.acknowledge_if_due(server.call, handle, 1, _pause(), True, spawned.append, now=True)
    (ack,) = spawned
    _run(ack)
    assert server.sent[-1] == p.ReadParams("p", 1, 1, 0)


def test_the_acknowledging_read_delivers_what_it_brings_and_ignores_errors() -> None:
    handle = _Handle()
    handle.accept_output(OutputEvent("p", "stdout", b"a", 1))
    server = _Server([_read([(1, b"a"), (2, b"b")], 3), ConnectionClosed("gone")])
    _run(acknowledge(server.call, handle, p.ReadParams("p", 1, 1, 0)))
    _run(acknowledge(server.call, handle, p.ReadParams("p", 2, 1, 0)))
    chunks = [e.chunk for e in handle.events if isinstance(e, OutputEvent)]
    assert chunks == [b"a", b"b"]  # seq 1 never twice
    assert handle.last_seq == 2


# --- catch-up after a resume ------------------------------------------------------------


def test_catch_up_reads_in_order_reports_a_gap_then_delivers_the_held_back_events() -> None:
    table: ProcessTable[_Handle] = ProcessTable(_Clock().schedule)
    handle = _Handle()
    handle.accept_output(OutputEvent("p", "stdout", b"one", 1))
    table.adopt([handle])
    assert handle.catching_up
    # A live event arrives during the catch-up: it waits its turn.
    assert not handle.accept_output(OutputEvent("p", "stdout", b"live", 5))
    server = _Server([_read([(4, b"four")], 5, gap=p.SeqGap(2, 3)), _read([], 6)])
    spawned: list[Coroutine[Any, Any, None]] = []
    error = _run(table.catch_up(server.call, handle, _pause(), lambda: True, spawned.append))
    assert error is None
    # One read: it ends right where the held-back live event continues.
    assert [params.after_seq for params in server.sent] == [1]
    outputs = [e for e in handle.events if isinstance(e, OutputEvent)]
    assert isinstance(outputs[1], GapEvent)
    assert (outputs[1].from_seq, outputs[1].to_seq) == (2, 3)
    assert [e.chunk for e in outputs if not isinstance(e, GapEvent)] == [b"one", b"four", b"live"]
    assert not handle.catching_up and handle.last_seq == 5
    # Then one acknowledgement of everything, the held-back event included.
    (ack,) = spawned
    _run(ack)
    assert server.sent[-1] == p.ReadParams("p", 5, 1, 0)


def test_catch_up_acknowledges_through_the_given_call() -> None:
    table: ProcessTable[_Handle] = ProcessTable(_Clock().schedule)
    handle = _Handle()
    handle.accept_output(OutputEvent("p", "stdout", b"x", 1))
    table.adopt([handle])
    server = _Server([_read([], 2), _read([], 2)])
    spawned: list[Coroutine[Any, Any, None]] = []
    assert _run(table.catch_up(server.call, handle, _pause(), lambda: True, spawned.append)) is None
    (ack,) = spawned
    _run(ack)
    assert server.sent[-1] == p.ReadParams("p", 1, 1, 0)


def test_catch_up_of_a_closed_process_forgets_it_without_an_acknowledgement() -> None:
    table: ProcessTable[_Handle] = ProcessTable(_Clock().schedule)
    handle = _Handle()
    table.adopt([handle])
    done = {"exited": True, "exit_code": 3, "exited_seq": 2, "closed": True, "closed_seq": 3}
    server = _Server([_read([(1, b"x")], 4, **done), _read([], 4, **done)])
    spawned: list[Coroutine[Any, Any, None]] = []
    assert _run(table.catch_up(server.call, handle, _pause(), lambda: True, spawned.append)) is None
    assert handle.events[-2:] == [("exited", 3), "closed"]
    assert table.get("p") is None and spawned == []


def test_a_drop_during_catch_up_keeps_the_handle_waiting() -> None:
    table: ProcessTable[_Handle] = ProcessTable(_Clock().schedule)
    handle = _Handle()
    table.adopt([handle])
    server = _Server([ConnectionClosed("dropped again")])
    spawned: list[Coroutine[Any, Any, None]] = []
    assert (
        _run(table.catch_up(server.call, handle, _pause(), lambda: False, spawned.append)) is None
    )
    assert handle.catching_up and table.get("p") is handle and not handle.is_closed


@pytest.mark.parametrize(
    "failure",
    [ServerError(p.PROCESS_READ, -32600, "unknown process id p"), ValueError("malformed")],
)
def test_a_failed_catch_up_ends_the_handle_with_its_error(failure: Exception) -> None:
    table: ProcessTable[_Handle] = ProcessTable(_Clock().schedule)
    handle = _Handle()
    table.adopt([handle])
    server = _Server([failure])
    spawned: list[Coroutine[Any, Any, None]] = []
    error = _run(table.catch_up(server.call, handle, _pause(), lambda: True, spawned.append))
    assert error is failure
    assert handle.lost_reason is failure and handle.is_closed
    assert not handle.catching_up and table.get("p") is None and spawned == []


# --- idempotent retry after a drop ------------------------------------------------------


def test_a_call_in_flight_at_a_drop_is_repeated_only_when_that_is_harmless() -> None:
    drop = ConnectionClosed("connection lost")
    read = p.ReadParams("p", 1)
    # Following a resumable session: a read is sent again, a start is not.
    assert after_drop(p.PROCESS_READ, read, drop, following=True) is None
    unknown = after_drop(p.PROCESS_START, None, drop, following=True)
    assert isinstance(unknown, OutcomeUnknown)
    assert unknown.method == p.PROCESS_START and "(connection lost)" in str(unknown)
    # A write is repeated only with a writeId (the server writes it once).
    keyed = p.WriteParams("p", b"x", write_id="w1")
    assert after_drop(p.PROCESS_WRITE, keyed, drop, following=True) is None
    plain = p.WriteParams("p", b"x")
    assert isinstance(after_drop(p.PROCESS_WRITE, plain, drop, following=True), OutcomeUnknown)
    # Not following (closing, or no resumable session): the drop's error stands.
    assert after_drop(p.PROCESS_READ, read, drop, following=False) is drop
    # A lost session is final.
    lost = SessionLost("s", "expired")
    assert after_drop(p.PROCESS_READ, read, lost, following=True) is lost


# --- the initialize params --------------------------------------------------------------


def test_initialize_sends_only_what_is_asked_for() -> None:
    # A baseline client's initialize is exactly the reference's.
    assert initialize_params("c") == {"clientName": "c"}
    # A resumable session pauses rather than drop unread output, unless told.
    assert initialize_params("c", session_ttl_ms=5000) == {
        "clientName": "c",
        "sessionTtlMs": 5000,
        "onDetachedFull": "pause",
    }
    assert initialize_params(
        "c", session_ttl_ms=5000, resume_session_id="s1", on_detached_full="drop"
    ) == {
        "clientName": "c",
        "sessionTtlMs": 5000,
        "resumeSessionId": "s1",
        "onDetachedFull": "drop",
    }
    # A TTL of 0 asks for no resumable session: no default.
    assert initialize_params("c", session_ttl_ms=0) == {"clientName": "c", "sessionTtlMs": 0}


# --- the start sequence and close (ProcessTable.start, end_processes) -----------------


class _Starts:
    """A ``call`` answering ``process/start`` (and the catch-up's reads) from a script."""

    def __init__(self, table: ProcessTable[_Handle], *answers: p.ExecResponse | Exception) -> None:
        self.table = table
        self.answers = list(answers)
        #: (method, whether the handle was registered when the start was sent)
        self.sent: list[tuple[str, bool]] = []

    async def call(self, method: str, params: object, result_type: type[T], /) -> T:
        if method == p.PROCESS_READ:
            return _read([], 1) if result_type is p.ReadResponse else None  # type: ignore[return-value]
        assert isinstance(params, p.ExecParams)
        self.sent.append((method, self.table.get(params.process_id) is not None))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[return-value]


def _params(process_id: str = "proc-1") -> p.ExecParams:
    return p.ExecParams(process_id, ["true"], "/", {}, False)


def test_start_registers_before_the_request_and_keeps_it_out_of_a_resume_meanwhile() -> None:
    table: ProcessTable[_Handle] = ProcessTable(_Clock().schedule)
    handle = _Handle("proc-1")
    caught: list[_Handle] = []

    async def catch_up(h: _Handle) -> None:
        caught.append(h)

    server = _Starts(table, p.ExecResponse("server-1"))
    seen_settled: list[list[_Handle]] = []
    inner = server.call

    async def call(method: str, params: object, result_type: type[T], /) -> T:
        seen_settled.append(table.settled())
        return await inner(method, params, result_type)

    _run(table.start(call, handle, _params(), False, catch_up))
    assert server.sent == [(p.PROCESS_START, True)]
    assert seen_settled == [[]], "a start in flight is not caught up by a resume"
    assert table.get("server-1") is handle and table.settled() == [handle]
    assert caught == [] and not table.starting


def test_a_start_sent_again_is_adopted_already_started_and_caught_up() -> None:
    table: ProcessTable[_Handle] = ProcessTable(_Clock().schedule)
    handle = _Handle("proc-1")
    caught: list[_Handle] = []

    async def catch_up(h: _Handle) -> None:
        assert h.catching_up, "its live events wait for the catch-up"
        caught.append(h)

    exists = ServerError(p.PROCESS_START, -32600, "process proc-1 already exists")
    server = _Starts(table, exists)
    _run(table.start(server.call, handle, _params(), True, catch_up))
    assert table.get("proc-1") is handle and caught == [handle]


def test_a_failed_start_unregisters_and_a_failed_resend_abandons_the_catch_up() -> None:
    table: ProcessTable[_Handle] = ProcessTable(_Clock().schedule)
    handle = _Handle("proc-1")

    async def catch_up(h: _Handle) -> None:
        raise AssertionError("nothing to catch up")

    refused = ServerError(p.PROCESS_START, -32602, "bad")
    with pytest.raises(ServerError):
        _run(table.start(_Starts(table, refused).call, handle, _params(), False, catch_up))
    assert len(table) == 0 and not table.starting
    with pytest.raises(ConnectionClosed):
        _run(
            table.start(
                _Starts(table, ConnectionClosed("x")).call, handle, _params(), True, catch_up
            )
        )
    assert len(table) == 0 and not handle.catching_up


def test_after_start_fails_on_a_lost_session_ends_on_a_drop_for_good() -> None:
    table: ProcessTable[_Handle] = ProcessTable(_Clock().schedule)
    kept, ended, failed = _Handle("a"), _Handle("b"), _Handle("c")
    assert table.after_start(kept, up=False, following=True, lost=None) is True
    assert table.after_start(ended, up=False, following=False, lost=None) is False
    lost = SessionLost("s", "gone")
    assert table.after_start(failed, up=True, following=True, lost=lost) is False
    assert not kept.has_exited
    assert ended.has_exited and ended.exit_code is None and ended.is_closed
    assert failed.lost_reason is lost


def test_end_processes_terminates_what_runs_and_waits_for_the_exits() -> None:
    table: ProcessTable[_Handle] = ProcessTable(_Clock().schedule)
    running, detached, exited, gone = _Handle("r"), _Handle("d"), _Handle("e"), _Handle("g")
    detached.detach = True
    exited.mark_exited(0)
    for handle in (running, detached, exited, gone):
        table.register(handle)
    terminated: list[str] = []
    waited: list[str] = []

    async def terminate(process_id: str) -> None:
        terminated.append(process_id)
        if process_id == "g":
            raise ServerError(p.PROCESS_TERMINATE, -32600, "unknown process id g")

    async def wait_exit(handle: _Handle) -> None:
        waited.append(handle.process_id)

    async def within(jobs: Any, seconds: float) -> bool:
        assert seconds == 10.0
        for job in jobs:
            await job
        return True

    assert _run(end_processes(table.to_end(), terminate, wait_exit, within))
    assert sorted(terminated) == ["g", "r"], "not the detached, not the exited"
    assert waited == ["r"], "a failed terminate is not waited for"
    assert _run(end_processes([], terminate, wait_exit, within))
