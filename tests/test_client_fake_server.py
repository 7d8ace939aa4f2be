"""The reference's client tests (client/tests.rs), ported to scripted fake servers.

Every exchange is scripted over a ``StringTransport``; timeouts run on a
``task.Clock``, so nothing here sleeps or touches the network.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import pytest_twisted
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.defer import CancelledError, Deferred
from twisted.python.failure import Failure

from execserver import protocol as p
from execserver.client import (
    ClosedEvent,
    ConnectionClosed,
    DisconnectedEvent,
    ExecServerClient,
    ExitedEvent,
    InitializeTimeout,
    OutputEvent,
    OutputLagged,
    ProtocolViolation,
    ServerError,
)
from tests.support.client_fakes import ScriptedServer
from tests.support.harness import b64


def _failure_of(d: Deferred[Any]) -> BaseException:
    failures: list[BaseException] = []

    def record(failure: Failure) -> None:
        assert failure.value is not None
        failures.append(failure.value)

    d.addErrback(record)
    assert failures, "expected the Deferred to have failed"
    return failures[0]


@pytest_twisted.ensureDeferred
async def test_connect_performs_initialize_handshake() -> None:
    server = ScriptedServer()
    d = server.connect()
    (init,) = server.expect(1)
    assert init["method"] == "initialize"
    assert init["params"] == {"clientName": "test-client"}
    assert "jsonrpc" not in init
    assert not d.called
    server.reply(init["id"], {"protocolVersion": p.PROTOCOL_VERSION})
    client = await d
    assert server.expect(1) == [{"method": "initialized", "params": {}}]
    # A baseline server's lean result is accepted; extensions default empty.
    assert client.initialize_result is not None
    assert client.initialize_result.protocol_version == "exec-server.v0"
    assert client.capabilities == []
    assert client.session_id is None


@pytest_twisted.ensureDeferred
async def test_initialize_result_extensions_are_read() -> None:
    server = ScriptedServer()
    d = server.connect()
    (init,) = server.expect(1)
    server.reply(
        init["id"],
        {
            "protocolVersion": "exec-server.v0",
            "sessionId": "abc",
            "serverInfo": {"name": "exec-server", "version": "9"},
            "capabilities": ["process/resize"],
            "somethingNew": 1,
        },
    )
    client = await d
    assert client.session_id == "abc"
    assert client.supports("process/resize")
    assert not client.supports("process/signal")


@pytest_twisted.ensureDeferred
async def test_matches_out_of_order_responses_by_request_id() -> None:
    server = ScriptedServer()
    client = await server.handshake()
    read = client.read(p.ReadParams("proc-1", wait_ms=0))
    terminate = client.terminate("proc-1")
    first, second = server.expect(2)
    assert {first["method"], second["method"]} == {"process/read", "process/terminate"}
    read_req = first if first["method"] == "process/read" else second
    term_req = second if read_req is first else first
    assert client.pending_request_count == 2
    server.reply(term_req["id"], {"running": False})
    assert terminate.called and not read.called
    server.reply(read_req["id"], {"chunks": [], "nextSeq": 1, "exited": False, "exitCode": None})
    read_result = await read
    terminate_result = await terminate
    assert read_result.next_seq == 1
    assert not read_result.exited
    assert not terminate_result.running
    assert client.pending_request_count == 0


@pytest_twisted.ensureDeferred
async def test_returns_initialize_errors() -> None:
    server = ScriptedServer()
    d = server.connect()
    (init,) = server.expect(1)
    server.error(init["id"], -32600, "rejected")
    error = _failure_of(d)
    assert isinstance(error, ServerError)
    assert (error.code, error.message, error.data) == (-32600, "rejected", None)
    # A failed handshake closes the channel.
    assert server.transport.disconnecting


@pytest_twisted.ensureDeferred
async def test_times_out_during_initialize_handshake() -> None:
    server = ScriptedServer()
    d = server.connect(initialize_timeout=0.025)
    server.expect(1)
    server.clock.advance(0.024)
    assert not d.called
    server.clock.advance(0.002)
    error = _failure_of(d)
    assert isinstance(error, InitializeTimeout)
    assert error.timeout == 0.025
    assert server.rpc.pending_count == 0
    assert server.transport.disconnecting


@pytest_twisted.ensureDeferred
async def test_start_process_cleans_up_registered_process_after_request_error() -> None:
    server = ScriptedServer()
    client = await server.handshake()
    d = client.start_process(["bash", "-lc", "true"], process_id="proc-1", tty=True)
    (start,) = server.expect(1)
    assert start["method"] == "process/start"
    assert client.tracked_process_count == 1
    server.error(start["id"], -32600, "duplicate process")
    error = _failure_of(d)
    assert isinstance(error, ServerError)
    assert (error.code, error.message) == (-32600, "duplicate process")
    assert client.pending_request_count == 0
    assert client.tracked_process_count == 0


async def _started(server: ScriptedServer, reply_id: str = "proc-1") -> Any:
    client = await server.handshake()
    d = client.start_process(["bash", "-lc", "true"], process_id="proc-1", tty=True)
    (start,) = server.expect(1)
    assert start["params"]["processId"] == "proc-1"
    assert start["params"]["tty"] is True
    assert start["params"]["arg0"] is None
    server.reply(start["id"], {"processId": reply_id})
    return client, await d


@pytest_twisted.ensureDeferred
async def test_start_process_preserves_output_stream_metadata() -> None:
    server = ScriptedServer()
    client, process = await _started(server)
    output = process.subscribe()
    server.notify(
        "process/output", {"processId": "proc-1", "stream": "stderr", "chunk": "ZXJyb3IK"}
    )
    event = await output.next()
    assert event == OutputEvent("proc-1", "stderr", b"error\n", None)
    assert client.pending_request_count == 0


@pytest_twisted.ensureDeferred
async def test_terminate_does_not_mark_process_exited_before_exit_notification() -> None:
    server = ScriptedServer()
    _client, process = await _started(server)
    exited = process.exited()
    terminate = process.terminate()
    (req,) = server.expect(1)
    assert req["method"] == "process/terminate"
    server.reply(req["id"], {"running": True})
    assert (await terminate).running
    server.clock.advance(0.025)
    assert not process.has_exited, "terminate should not imply exit"
    assert process.exit_code is None
    assert not exited.called
    server.notify("process/exited", {"processId": "proc-1", "exitCode": 143, "signal": "SIGTERM"})
    assert await exited == 143
    assert process.has_exited
    assert process.signal == "SIGTERM"


@pytest_twisted.ensureDeferred
async def test_start_process_uses_protocol_process_ids() -> None:
    server = ScriptedServer()
    client, process = await _started(server, reply_id="other-proc")
    assert process.process_id == "other-proc"
    assert client.process("other-proc") is process
    assert client.process("proc-1") is None


@pytest_twisted.ensureDeferred
async def test_start_process_routes_output_for_protocol_process_ids() -> None:
    server = ScriptedServer()
    client = await server.handshake()
    first_d = client.start_process(["true"], process_id="proc-1")
    second_d = client.start_process(["true"], process_id="proc-2")
    one, two = server.expect(2)
    server.reply(two["id"], {"processId": "proc-2"})
    server.reply(one["id"], {"processId": "proc-1"})
    first, second = await first_d, await second_d
    got: list[tuple[str, bytes]] = []
    first.add_output_listener(lambda e: got.append(("first", e.chunk)))
    second.add_output_listener(lambda e: got.append(("second", e.chunk)))
    server.notify(
        "process/output",
        {"processId": "proc-1", "stream": "stdout", "chunk": "YWxpdmUK", "seq": 1},
    )
    server.notify(
        "process/output", {"processId": "proc-2", "stream": "stdout", "chunk": b64(b"two")}
    )
    assert got == [("first", b"alive\n"), ("second", b"two")]


@pytest_twisted.ensureDeferred
async def test_output_racing_the_start_response_is_kept() -> None:
    server = ScriptedServer()
    client = await server.handshake()
    d = client.start_process(["true"], process_id="proc-1")
    (start,) = server.expect(1)
    server.notify(
        "process/output", {"processId": "proc-1", "stream": "stdout", "chunk": b64(b"early")}
    )
    server.reply(start["id"], {"processId": "proc-1"})
    process = await d
    event = await process.subscribe().next()
    assert event is not None and event.chunk == b"early"


@pytest_twisted.ensureDeferred
async def test_transport_shutdown_marks_processes_exited_without_exit_codes() -> None:
    server = ScriptedServer()
    client, process = await _started(server)
    events: list[object] = []
    client.add_event_listener(events.append)
    sub = process.subscribe()
    exited = process.exited()
    server.drop()
    assert process.has_exited
    assert process.exit_code is None
    assert await exited is None
    assert await sub.next() is None
    assert not client.is_connected
    assert client.tracked_process_count == 0
    assert events == [DisconnectedEvent("connection closed by the server")]


@pytest_twisted.ensureDeferred
async def test_transport_loss_fails_every_pending_call_at_once() -> None:
    server = ScriptedServer()
    client = await server.handshake()
    calls: list[Deferred[Any]] = [client.read("p", wait_ms=10_000) for _ in range(5)]
    calls.append(client.write("p", b"x"))
    assert client.pending_request_count == 6
    server.drop()
    for d in calls:
        error = _failure_of(d)
        assert isinstance(error, ConnectionClosed)
        assert "connection closed" in str(error)
    assert client.pending_request_count == 0
    # Later calls fail immediately with the same clear error.
    assert isinstance(_failure_of(client.terminate("p")), ConnectionClosed)


@pytest_twisted.ensureDeferred
async def test_server_errors_carry_code_message_and_data() -> None:
    server = ScriptedServer()
    client = await server.handshake()
    d = client.start_process(["nope"], process_id="p")
    (req,) = server.expect(1)
    server.error(req["id"], -32603, "failed to start `nope`", {"kind": "spawnNotFound", "errno": 2})
    error = _failure_of(d)
    assert isinstance(error, ServerError)
    assert error.code == -32603
    assert error.data == {"kind": "spawnNotFound", "errno": 2}
    assert error.kind == "spawnNotFound"
    assert error.method == "process/start"


@pytest_twisted.ensureDeferred
async def test_cancelled_call_leaves_no_pending_state() -> None:
    server = ScriptedServer()
    client = await server.handshake()
    d = client.read("p", wait_ms=5000)
    (req,) = server.expect(1)
    d.cancel()
    assert isinstance(_failure_of(d), CancelledError)
    assert client.pending_request_count == 0
    # The late answer is ignored.
    server.reply(req["id"], {"chunks": [], "nextSeq": 1, "exited": False, "exitCode": None})
    assert client.is_connected


@pytest_twisted.ensureDeferred
async def test_mistyped_result_is_a_protocol_violation_for_that_call() -> None:
    server = ScriptedServer()
    client = await server.handshake()
    d = client.terminate("p")
    (req,) = server.expect(1)
    server.reply(req["id"], {"running": "yes"})
    error = _failure_of(d)
    assert isinstance(error, ProtocolViolation)
    assert "process/terminate" in str(error)
    assert client.is_connected


@pytest.mark.parametrize(
    "line",
    [b"not json\n", b'{"id": 1, "method": "process/start", "params": {}}\n', b"[1,2]\n"],
)
@pytest_twisted.ensureDeferred
async def test_invalid_server_messages_close_the_connection_clearly(line: bytes) -> None:
    server = ScriptedServer()
    client = await server.handshake()
    pending = client.read("p", wait_ms=1000)
    server.protocol.dataReceived(line)
    error = _failure_of(pending)
    assert isinstance(error, ConnectionClosed)
    assert "protocol error" in str(error)
    assert server.transport.disconnecting
    assert client.pending_request_count == 0


@pytest_twisted.ensureDeferred
async def test_unmatched_responses_and_unknown_notifications_are_ignored() -> None:
    server = ScriptedServer()
    client = await server.handshake()
    server.reply(999, {"x": 1})
    server.error(None, -32600, "message exceeds the maximum size")
    server.notify("process/somethingNew", {"processId": "x"})
    server.notify("process/output", {"processId": "unknown", "stream": "bogus", "chunk": "x"})
    assert client.is_connected
    d = client.terminate("p")
    (req,) = server.expect(1)
    server.reply(req["id"], {"running": False})
    assert not (await d).running


@pytest_twisted.ensureDeferred
async def test_exit_then_closed_notifications() -> None:
    server = ScriptedServer()
    client, process = await _started(server)
    events: list[object] = []
    client.add_event_listener(events.append)
    sub = process.subscribe()
    closed = process.closed()
    out = {"processId": "proc-1", "stream": "pty", "chunk": b64(b"bye"), "seq": 1}
    server.notify("process/output", out)
    server.notify("process/exited", {"processId": "proc-1", "exitCode": 0, "seq": 2})
    assert process.exit_code == 0 and not closed.called
    server.notify("process/closed", {"processId": "proc-1", "seq": 2})
    await closed
    assert [e async for e in sub] == [OutputEvent("proc-1", "pty", b"bye", 1)]
    assert client.tracked_process_count == 0
    assert events == [
        OutputEvent("proc-1", "pty", b"bye", 1),
        ExitedEvent("proc-1", 0),
        ClosedEvent("proc-1"),
    ]


@pytest_twisted.ensureDeferred
async def test_exited_process_without_closed_is_forgotten_after_linger() -> None:
    server = ScriptedServer()
    client, process = await _started(server)
    server.notify("process/exited", {"processId": "proc-1", "exitCode": 1})
    assert client.tracked_process_count == 1
    server.clock.advance(31)
    assert client.tracked_process_count == 0
    assert process.is_closed


@pytest_twisted.ensureDeferred
async def test_slow_subscription_fails_with_lag_error_not_silently() -> None:
    server = ScriptedServer()
    _client, process = await _started(server)
    sub = process.subscribe(limit=10)
    for seq in (1, 2, 3):
        server.notify(
            "process/output",
            {"processId": "proc-1", "stream": "stdout", "chunk": b64(b"12345"), "seq": seq},
        )
    first = await sub.next()
    assert first is not None and first.seq == 1
    second = await sub.next()
    assert second is not None and second.seq == 2
    with pytest.raises(OutputLagged) as info:
        await sub.next()
    assert info.value.after_seq == 2


@pytest_twisted.ensureDeferred
async def test_close_fails_pending_calls_and_is_idempotent() -> None:
    server = ScriptedServer()
    client = await server.handshake()
    pending = client.read("p", wait_ms=1000)
    closing = client.close()
    assert server.transport.disconnecting
    server.protocol.connectionLost(None)
    await closing
    await client.close()
    assert isinstance(_failure_of(pending), ConnectionClosed)


@given(
    st.lists(st.sampled_from(["call", "answer", "error", "cancel"]), max_size=40),
    st.randoms(use_true_random=False),
    st.booleans(),
)
@settings(max_examples=100, deadline=None)
def test_id_map_invariants(ops: list[str], rnd: Any, drop_at_end: bool) -> None:
    """Any interleaving of calls, answers (in any order), errors and
    cancellations: every call settles exactly once, only answered ids leave the
    map, and a drop empties it."""
    server = ScriptedServer()
    d = server.connect()
    (init,) = server.expect(1)
    server.reply(init["id"], {"protocolVersion": "exec-server.v0"})
    client = cast(ExecServerClient, d.result)
    server.expect(1)
    outstanding: dict[int, Deferred[Any]] = {}
    settled: dict[int, int] = {}

    def track(request_id: int, call: Deferred[Any]) -> None:
        settled[request_id] = 0

        def done(result: object) -> None:
            settled[request_id] += 1

        call.addBoth(done)

    for op in ops:
        if op == "call":
            call = client.terminate("p")
            (req,) = server.expect(1)
            outstanding[req["id"]] = call
            track(req["id"], call)
        elif outstanding:
            request_id = rnd.choice(sorted(outstanding))
            call = outstanding.pop(request_id)
            if op == "answer":
                server.reply(request_id, {"running": True})
            elif op == "error":
                server.error(request_id, -32600, "no")
            else:
                call.cancel()
        assert client.pending_request_count == len(outstanding)
    if drop_at_end:
        server.drop()
        outstanding.clear()
        assert client.pending_request_count == 0
    assert all(count == 1 for rid, count in settled.items() if rid not in outstanding)
    assert all(settled[rid] == 0 for rid in outstanding)


@pytest_twisted.ensureDeferred
async def test_compact_and_reordered_notifications_decode_alike() -> None:
    server = ScriptedServer()
    _client, process = await _started(server)
    got: list[OutputEvent] = []
    process.add_output_listener(got.append)
    chunk = b64(b"abc")
    # As this server writes it (method first, compact): the one-pass path.
    server.protocol.dataReceived(
        b'{"method":"process/output","params":{"processId":"proc-1","stream":"stdout",'
        b'"chunk":"' + chunk.encode() + b'","seq":1}}\n'
    )
    # Another key order and spacing: the generic path.
    server.protocol.dataReceived(
        b'{"params": {"seq": 2, "chunk": "' + chunk.encode() + b'", "stream": "stderr", '
        b'"processId": "proc-1"}, "jsonrpc": "2.0", "method": "process/output"}\n'
    )
    # Invalid params in either form: logged and dropped, connection kept.
    server.protocol.dataReceived(
        b'{"method":"process/output","params":{"processId":"proc-1","stream":"nope"}}\n'
    )
    assert got == [
        OutputEvent("proc-1", "stdout", b"abc", 1),
        OutputEvent("proc-1", "stderr", b"abc", 2),
    ]
    assert server.rpc.is_closed is False
    # A request disguised with a notification's prefix is still a violation.
    server.protocol.dataReceived(
        b'{"method":"process/output","params":{"processId":"proc-1","stream":"stdout",'
        b'"chunk":""},"id":5}\n'
    )
    assert server.rpc.is_closed
    assert "unexpected JSON-RPC request" in (server.rpc.closed_reason or "")
