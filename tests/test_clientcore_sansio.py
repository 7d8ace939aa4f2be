"""The sans-IO client pieces driven with no event loop and no reactor.

``RpcCore``, ``ProcessCore``, the ranged transfer loops and the start
params are shared by the Twisted and the asyncio clients; here they run
with plain lists as waiters and queues and a coroutine stepped by hand, so
what they decide is checked apart from either client's I/O.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
import pytest

from execserver import protocol as p
from execserver.clientcore import errors, transfer
from execserver.clientcore.defaults import DEFAULT_PATH
from execserver.clientcore.errors import (
    AuthRefused,
    ConnectFailed,
    ConnectionClosed,
    OutputGap,
    OutputLagged,
    ProtocolViolation,
    RangesNotSupported,
    ServerError,
)
from execserver.clientcore.framing import (
    STDERR_TAIL_BYTES,
    LineInput,
    describe_exit,
    keep_stderr_tail,
    server_exited,
)
from execserver.clientcore.process import EMPTY, OutputQueue, ProcessCore
from execserver.clientcore.resume import REFUSED_GIVE_UP_SECONDS, ResumeAttempts
from execserver.clientcore.rpc import RpcCore
from execserver.clientcore.start import exec_params, next_process_id
from execserver.clientcore.types import GapEvent, OutputEvent, OutputParams
from execserver.retained import CHUNK_OVERHEAD_BYTES

# --- RpcCore ------------------------------------------------------------------------------


class _Waiter:
    def __init__(self) -> None:
        self.outcome: list[object] = []


class _Rpc(RpcCore[_Waiter]):
    def __init__(self) -> None:
        super().__init__("test")
        self.log: list[str] = []
        self.untyped: list[tuple[str, msgspec.Raw | None]] = []
        self.dropped = 0
        self.closed_with: list[str] = []

    def expect(self, method: str, result_type: type[Any]) -> tuple[int, _Waiter]:
        waiter = _Waiter()
        return self._pending.add(method, result_type, waiter), waiter

    def _resolve(self, waiter: _Waiter, value: object) -> None:
        waiter.outcome.append(value)

    def _reject(self, waiter: _Waiter, error: Exception) -> None:
        waiter.outcome.append(error)

    def _untyped_notification(self, method: str, params: msgspec.Raw | None) -> None:
        self.untyped.append((method, params))

    def _on_closed(self, reason: str) -> None:
        self.closed_with.append(reason)

    def _dropper(self) -> Callable[[], None] | None:
        def drop() -> None:
            self.dropped += 1

        return drop

    def _warn(self, text: str) -> None:
        self.log.append(f"warn {text}")

    def _debug(self, text: str) -> None:
        self.log.append(f"debug {text}")

    def _listener_failed(self) -> None:
        self.log.append("listener failed")


def test_rpc_core_settles_answers_by_id_in_any_order() -> None:
    rpc = _Rpc()
    first, w1 = rpc.expect("a", p.Empty)
    second, w2 = rpc.expect("b", p.WriteResponse)
    rpc.message_received(b'{"id":%d,"error":{"code":-32600,"message":"no"}}' % second)
    rpc.message_received(b'{"id":%d,"result":{}}' % first)
    rpc.message_received(b'{"id":%d,"result":{}}' % first)  # late twin: ignored
    assert w1.outcome == [p.Empty()]
    [error] = w2.outcome
    assert isinstance(error, ServerError) and error.code == -32600
    assert rpc.pending_count == 0
    assert rpc.log == [f"debug test: ignoring response to unknown request id {first}"]


def test_rpc_core_a_result_of_the_wrong_shape_fails_only_its_call() -> None:
    rpc = _Rpc()
    request_id, waiter = rpc.expect("process/write", p.WriteResponse)
    rpc.message_received(b'{"id":%d,"result":[1]}' % request_id)
    [error] = waiter.outcome
    assert isinstance(error, ProtocolViolation)
    assert str(error).startswith("invalid process/write result from server")
    assert not rpc.is_closed


def test_rpc_core_typed_notifications_fast_and_generic_paths() -> None:
    rpc = _Rpc()
    seen: list[OutputParams] = []
    rpc._register_typed(p.PROCESS_OUTPUT, OutputParams, seen.append)
    params = b'{"processId":"a","seq":%d,"stream":"stdout","chunk":"aGk="}'
    fast = b'{"method":"process/output","params":' + params % 1 + b"}"
    generic = b'{"params":' + params % 2 + b',"method":"process/output"}'
    rpc.message_received(fast)
    rpc.message_received(generic)
    assert [(n.seq, n.chunk) for n in seen] == [(1, "aGk="), (2, "aGk=")]
    rpc.message_received(b'{"method":"process/output","params":{"seq":"x"}}')
    assert len(seen) == 2 and rpc.log[-1].startswith("warn test: invalid process/output")
    rpc.message_received(b'{"method":"other/thing","params":[1]}')
    assert rpc.untyped == [("other/thing", msgspec.Raw(b"[1]"))]
    assert not rpc.is_closed


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (b"{not json", "protocol error: undecodable message from server"),
        (b'{"id":7,"method":"x"}', "protocol error: unexpected JSON-RPC request from server: x"),
        (b'{"id":7}', "protocol error: message from server is neither a response"),
    ],
)
def test_rpc_core_protocol_errors_fail_every_call_and_drop_the_channel(
    message: bytes, reason: str
) -> None:
    rpc = _Rpc()
    _, waiter = rpc.expect("a", p.Empty)
    lost: list[str] = []
    rpc.add_lost_listener(lost.append)
    rpc.message_received(message)
    [error] = waiter.outcome
    assert isinstance(error, ConnectionClosed) and reason in str(error)
    assert rpc.dropped == 1 and (rpc.closed_reason or "").startswith(reason)
    assert lost == rpc.closed_with == [rpc.closed_reason]
    rpc.message_received(b'{"id":1,"result":{}}')  # after the close: nothing
    assert waiter.outcome == [error]


def test_rpc_core_an_unmatched_error_is_logged_and_keeps_the_connection() -> None:
    rpc = _Rpc()
    rpc.message_received(b'{"id":null,"error":{"code":-32700,"message":"Parse error"}}')
    assert rpc.log == [
        "warn test: server error not matched to a request (id None): -32700 Parse error"
    ]
    assert not rpc.is_closed


# --- framing ----------------------------------------------------------------------------


def test_line_input_frames_lines_and_an_oversized_one_ends_the_connection() -> None:
    rpc = _Rpc()
    lines = LineInput(rpc, max_message_bytes=64)
    _, waiter = rpc.expect("a", p.Empty)
    lines.feed(b'{"id":1,"res')
    assert waiter.outcome == []
    lines.feed(b'ult":{}}\n' + b"x" * 65)
    assert waiter.outcome == [p.Empty()] and not rpc.is_closed
    lines.feed(b"\n" + b'{"id":2,"result":{}}\n')
    assert rpc.closed_reason == "protocol error: message larger than 64 bytes"
    lines.finish()  # nothing after the close
    assert rpc.dropped == 1


def test_line_input_delivers_a_last_line_without_its_newline_at_the_end() -> None:
    rpc = _Rpc()
    lines = LineInput(rpc)
    _, waiter = rpc.expect("a", p.Empty)
    lines.feed(b'{"id":1,"result":{}}')
    assert waiter.outcome == []
    lines.finish()
    assert waiter.outcome == [p.Empty()]


def test_the_stderr_tail_keeps_the_last_bytes() -> None:
    tail = keep_stderr_tail(b"", b"a" * STDERR_TAIL_BYTES)
    tail = keep_stderr_tail(tail, b"end")
    assert len(tail) == STDERR_TAIL_BYTES and tail.endswith(b"aend")


def test_how_a_local_server_ended_is_worded_once() -> None:
    assert server_exited(3, None) == "exec-server exited (exit code 3)"
    assert server_exited(None, 9) == "exec-server exited (killed by signal 9)"
    assert describe_exit(None, None) == "exit code None"  # not known yet


# --- ProcessCore --------------------------------------------------------------------------


class _Queue:
    def __init__(self) -> None:
        self.events: list[OutputEvent] = []
        self.ended = False
        self.error: Exception | None = None

    def push(self, event: OutputEvent) -> None:
        self.events.append(event)

    def end(self) -> None:
        self.ended = True

    def fail(self, error: Exception) -> None:
        self.error = error


class _Handle(ProcessCore[_Queue]):
    def __init__(self, backlog_bytes: int) -> None:
        self.fired: list[str] = []
        self._init_process("p", backlog_bytes)

    def _fire_exited(self, exit_code: int | None) -> None:
        self.fired.append(f"exited {exit_code}")

    def _fire_closed(self) -> None:
        self.fired.append("closed")

    def _backlog_overflow(self) -> None:
        self.fired.append("overflow")

    def _listener_failed(self) -> None:
        self.fired.append("listener failed")

    def _gap_unheard(self, error: OutputGap) -> None:
        self.fired.append(f"gap unheard {error.from_seq}-{error.to_seq}")


def _event(seq: int, size: int) -> OutputEvent:
    return OutputEvent("p", "stdout", b"x" * size, seq)


def test_an_acknowledgement_is_due_at_a_quarter_of_the_retention_counted_as_the_server() -> None:
    handle = _Handle(1024)
    retention = 4 * (1000 + CHUNK_OVERHEAD_BYTES)
    assert not handle.ack_due(500, retention)
    assert handle.unacked_bytes == 500 + CHUNK_OVERHEAD_BYTES
    assert handle.ack_due(500, retention)  # 1000 bytes and two chunks' overhead
    assert handle.unacked_bytes == 0
    assert not handle.ack_due(10, retention)
    assert handle.ack_due(0, retention, now=True) and handle.unacked_bytes == 0


def test_process_core_backlog_overflow_reaches_the_first_reader() -> None:
    handle = _Handle(backlog_bytes=10)
    handle.deliver_output(_event(1, 6))
    handle.deliver_output(_event(2, 6))  # over the backlog: dropped, reported
    handle.deliver_output(_event(3, 1))  # after the overflow: dropped too
    queue = handle._add_queue(_Queue(), fail_if_lost=False)
    assert [e.seq for e in queue.events] == [1]
    assert isinstance(queue.error, OutputLagged) and queue.error.after_seq == 1
    assert handle.fired == ["overflow"]
    handle.deliver_output(_event(4, 100))  # readers now: no backlog bound
    assert [e.seq for e in queue.events] == [1, 4]


def test_process_core_listeners_survive_a_failing_one_and_exit_close_fire_once() -> None:
    handle = _Handle(backlog_bytes=100)
    got: list[int | None] = []

    def broken(event: OutputEvent) -> None:
        raise ValueError(event.seq)

    handle.add_output_listener(broken)
    handle.add_output_listener(lambda e: got.append(e.seq))
    handle.deliver_output(_event(1, 1))
    handle.mark_exited(3, "SIGQUIT")
    handle.mark_exited(4)
    handle.mark_closed()
    handle.connection_lost()
    assert got == [1]
    assert (handle.exit_code, handle.signal) == (3, "SIGQUIT")
    assert handle.fired == ["listener failed", "exited 3", "closed"]


@pytest.mark.parametrize("fail_if_lost", [True, False])
def test_process_core_a_lost_handle_fails_its_queues(fail_if_lost: bool) -> None:
    handle = _Handle(backlog_bytes=100)
    early = handle._add_queue(_Queue(), fail_if_lost=fail_if_lost)
    lost = ConnectionClosed("gone")
    handle.fail(lost)
    assert early.error is lost and early.ended
    assert handle.has_exited and handle.exit_code is None and handle.lost_reason is lost
    late = handle._add_queue(_Queue(), fail_if_lost=fail_if_lost)
    if fail_if_lost:
        assert late.error is lost and not late.ended
    else:
        assert late.error is None and late.ended


# --- ranged transfers ---------------------------------------------------------------------


def _run(coro: Coroutine[Any, Any, int]) -> int:
    """Step a coroutine whose awaits all complete at once."""
    try:
        coro.send(None)
    except StopIteration as stop:
        result: int = stop.value
        return result
    raise AssertionError("the coroutine suspended")


class _FakeFs:
    def __init__(self, content: bytes) -> None:
        self.content = content
        self.calls: list[tuple[str, object]] = []

    async def call(self, method: str, params: object, result_type: type[Any], /) -> Any:
        self.calls.append((method, params))
        if isinstance(params, transfer.RangedRead):
            data = self.content[params.offset : params.offset + params.length]
            return transfer.RangedReadResult(data, len(self.content))
        if isinstance(params, transfer.RangedWrite):
            if params.truncate:
                self.content = b""
            assert params.offset == len(self.content)
            self.content += params.data_base64
        elif isinstance(params, p.FsWriteFileParams):
            self.content = params.data_base64
        return p.Empty()


def test_download_reads_ranges_until_the_end(tmp_path: Any) -> None:
    fs = _FakeFs(b"0123456789")
    progress: list[tuple[int, int | None]] = []
    target = tmp_path / "out"
    copied = _run(
        transfer.download(
            fs.call,
            list(transfer.RANGE_CAPABILITIES),
            "/r",
            target,
            chunk_bytes=4,
            progress=lambda done, total: progress.append((done, total)),
        )
    )
    assert copied == 10 and target.read_bytes() == b"0123456789"
    assert [params.offset for _, params in fs.calls] == [0, 4, 8]  # type: ignore[attr-defined]
    assert progress == [(4, 10), (8, 10), (10, 10)]


def test_upload_one_chunk_is_a_plain_write_and_more_are_ranges(tmp_path: Any) -> None:
    source = tmp_path / "in"
    source.write_bytes(b"abc")
    fs = _FakeFs(b"old")
    assert _run(transfer.upload(fs.call, [], "/r", source, chunk_bytes=4)) == 3
    assert fs.content == b"abc" and [type(params) for _, params in fs.calls] == [
        p.FsWriteFileParams
    ]
    source.write_bytes(b"0123456789")
    fs = _FakeFs(b"old")
    assert _run(transfer.upload(fs.call, None, "/r", source, chunk_bytes=4)) == 10
    assert fs.content == b"0123456789"
    writes = [params for _, params in fs.calls]
    assert [(w.offset, w.truncate) for w in writes] == [(0, True), (4, None), (8, None)]  # type: ignore[attr-defined]


def test_transfers_refuse_before_sending_without_the_range_capability(tmp_path: Any) -> None:
    source = tmp_path / "in"
    source.write_bytes(b"0123456789")
    fs = _FakeFs(b"")
    with pytest.raises(RangesNotSupported):
        _run(transfer.upload(fs.call, [], "/r", source, chunk_bytes=4))
    with pytest.raises(RangesNotSupported):
        _run(transfer.download(fs.call, [], "/r", tmp_path / "out"))
    assert fs.calls == [] and not (tmp_path / "out").exists()


# --- start params -------------------------------------------------------------------------


def test_exec_params_defaults_and_ids() -> None:
    ids = iter(["proc-9"])
    params = exec_params(["true"], lambda: next(ids), size=(24, 80))
    assert params.process_id == "proc-9" and params.argv == ["true"]
    assert params.env == {"PATH": DEFAULT_PATH} and params.size == p.TerminalSize(24, 80)
    given = p.ExecParams(process_id="x", argv=["y"], cwd="/", env={}, tty=False)
    assert exec_params(given, lambda: "unused") is given
    assert next_process_id(1, {"proc-1", "proc-2"}) == ("proc-3", 4)


@pytest.mark.parametrize(
    "package", ["execserver.client", "execserver.client.errors", "execserver.aio"]
)
def test_every_client_package_exports_every_error_class(package: str) -> None:
    module = importlib.import_module(package)
    for name in errors.__all__:
        assert name in module.__all__
        assert getattr(module, name) is getattr(errors, name)


# --- ResumeAttempts ---------------------------------------------------------------------

REFUSED = ConnectFailed("ws://h:1", "connection refused (is the server running?)")
TIMED_OUT = ConnectFailed("ws://h:1", "timed out")


def test_resume_gives_up_at_once_on_an_unknown_session_or_a_refused_token() -> None:
    attempts = ResumeAttempts(60.0, 0.0, "dropped")
    unknown = ServerError(p.INITIALIZE, -32600, "unknown session id s-1")
    assert attempts.failed(unknown, 0.1, refused=False) == "unknown session id s-1"
    withdrawn = AuthRefused("ws://h:1", 401, "HTTP 401: token refused")
    assert attempts.failed(withdrawn, 0.1, refused=False) == "HTTP 401: token refused"
    # "already attached": the server has not noticed the drop yet; go on.
    attached = ServerError(
        p.INITIALIZE, -32010, "session s-1 is already attached to another connection"
    )
    assert attempts.failed(attached, 0.1, refused=False) is None
    assert attempts.cause == "session s-1 is already attached to another connection"


def test_resume_retries_refused_connections_for_two_seconds_then_the_server_is_gone() -> None:
    attempts = ResumeAttempts(60.0, 0.0, "dropped")
    assert attempts.failed(REFUSED, refused=True, now=1.0) is None
    assert attempts.failed(REFUSED, refused=True, now=1.0 + REFUSED_GIVE_UP_SECONDS - 0.01) is None
    gone = attempts.failed(REFUSED, refused=True, now=1.0 + REFUSED_GIVE_UP_SECONDS)
    assert gone == "the server is gone (connection refused (is the server running?))"
    # Another failure in between starts the refusals' clock again.
    attempts = ResumeAttempts(60.0, 0.0, "dropped")
    assert attempts.failed(REFUSED, refused=True, now=1.0) is None
    assert attempts.failed(TIMED_OUT, 2.0, refused=False) is None
    assert attempts.failed(REFUSED, refused=True, now=3.5) is None
    assert attempts.failed(REFUSED, refused=True, now=3.5 + REFUSED_GIVE_UP_SECONDS) is not None


def test_resume_ends_with_the_ttl_and_backs_off_doubling() -> None:
    attempts = ResumeAttempts(5.0, 10.0, "dropped")
    assert attempts.expired(14.9) is None
    assert attempts.expired(15.0) == "no connection within its 5 s TTL (dropped)"
    assert [attempts.next_delay() for _ in range(8)] == [
        0.05,
        0.1,
        0.2,
        0.4,
        0.8,
        1.6,
        2.0,
        2.0,
    ]
    # Dropped again right after a resume: the TTL and the backoff start over.
    attempts.restart(20.0, "dropped again")
    assert attempts.expired(24.9) is None and attempts.next_delay() == 0.05
    assert attempts.expired(25.0) == "no connection within its 5 s TTL (dropped again)"


# --- gaps: loud by default, events on request -------------------------------------------


class _Pull(OutputQueue):
    def _wake(self) -> None:
        pass


class _PullHandle(ProcessCore[_Pull]):
    def __init__(self) -> None:
        self.fired: list[str] = []
        self._init_process("p", 1 << 20)

    def _fire_exited(self, exit_code: int | None) -> None:
        pass

    def _fire_closed(self) -> None:
        pass

    def _backlog_overflow(self) -> None:
        pass

    def _listener_failed(self) -> None:
        self.fired.append("listener failed")

    def _gap_unheard(self, error: OutputGap) -> None:
        self.fired.append(str(error))


def _resume_with_a_gap(handle: ProcessCore[Any]) -> None:
    """Seq 1 (3 stdout bytes) and 2 (2 stderr bytes) arrive live; a resume finds
    seqs 3..6 dropped and 7 retained."""
    handle.accept_output(OutputEvent("p", "stdout", b"abc", 1))
    handle.accept_output(OutputEvent("p", "stderr", b"de", 2))
    handle.begin_catch_up()
    read = p.ReadResponse(
        chunks=[p.ProcessOutputChunk(7, "stdout", b"tail")],
        next_seq=8,
        exited=False,
        exit_code=None,
        gap=p.SeqGap(3, 6),
    )
    assert handle.catch_up(read)
    handle.end_catch_up()


def test_a_default_reader_gets_the_gap_raised_with_its_range_and_continues_after_it() -> None:
    handle = _PullHandle()
    queue = handle._add_queue(_Pull("p", 1 << 20), fail_if_lost=False)
    _resume_with_a_gap(handle)
    assert [queue.take(), queue.take()] == [
        OutputEvent("p", "stdout", b"abc", 1),
        OutputEvent("p", "stderr", b"de", 2),
    ]
    with pytest.raises(OutputGap) as raised:
        queue.take()
    gap = raised.value
    assert (gap.process_id, gap.from_seq, gap.to_seq) == ("p", 3, 6)
    assert gap.delivered == {"stdout": 3, "stderr": 2}
    assert "dropped output seqs 3-6" in str(gap) and "stdout 3 bytes, stderr 2 bytes" in str(gap)
    assert queue.take() == OutputEvent("p", "stdout", b"tail", 7)
    assert queue.take() is EMPTY
    assert [(g.from_seq, g.to_seq) for g in handle.gaps] == [(3, 6)]


def test_gap_events_reach_only_readers_that_ask_for_them() -> None:
    handle = _PullHandle()
    queue = handle._add_queue(_Pull("p", 1 << 20, gaps=True), fail_if_lost=False)
    aware: list[OutputEvent] = []
    plain: list[OutputEvent] = []
    handle.add_output_listener(aware.append, gaps=True)
    handle.add_output_listener(plain.append)
    _resume_with_a_gap(handle)
    [gap_event] = [e for e in aware if isinstance(e, GapEvent)]
    assert (gap_event.from_seq, gap_event.to_seq) == (3, 6)
    assert gap_event.delivered == (("stdout", 3), ("stderr", 2))
    assert [e.seq for e in plain] == [1, 2, 7]  # the plain listener never sees it ...
    assert handle.fired == [str(gap_event.error())]  # ... and the gap is logged instead
    assert [queue.take() for _ in range(4)][2] == gap_event


def test_a_gap_in_a_pty_names_the_terminal_stream() -> None:
    handle = _PullHandle()
    events: list[OutputEvent] = []
    handle.add_output_listener(events.append, gaps=True)
    handle.accept_output(OutputEvent("p", "pty", b"$ ", 1))
    handle.begin_catch_up()
    handle.catch_up(p.ReadResponse([], 9, False, None, gap=p.SeqGap(2, 8)))
    handle.end_catch_up()
    gap = events[-1]
    assert isinstance(gap, GapEvent) and gap.stream == "pty"
    assert gap.delivered == (("pty", 2),)
