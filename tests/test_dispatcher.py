"""Unit tests of the dispatcher: envelopes, routing, handshake gating, concurrency.

Everything runs over fakes (tests/support/fakes.py): a recording outbound, a fake
spawner and a ``task.Clock``; no reactor, no real process.
"""

from __future__ import annotations

from typing import Any

import pytest
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock

from execserver import protocol as p
from execserver.config import ServerConfig
from execserver.dispatcher import Connection, Dispatcher
from execserver.errors import RpcError
from execserver.registry import ResumableSession
from tests.support.fakes import FakeOutbound, Harness, exec_params

EXEC_METHODS = ["process/start", "process/read", "process/write", "process/terminate"]


def minimal_params(method: str) -> dict[str, Any]:
    if method == "process/start":
        return exec_params()
    if method == "process/write":
        return {"processId": "proc-1", "chunk": "aGVsbG8K"}
    return {"processId": "proc-1"}


# --- initialize -------------------------------------------------------------------------------


def test_initialize_reports_protocol_version_session_and_server_info() -> None:
    h = Harness()
    result = h.result("initialize", {"clientName": "test"})
    assert result["protocolVersion"] == "exec-server.v0"
    assert isinstance(result["sessionId"], str)
    assert len(result["sessionId"]) >= 16
    assert result["serverInfo"]["name"] == "exec-server"
    assert isinstance(result["serverInfo"]["version"], str)
    assert isinstance(result["capabilities"], list)


def test_each_connection_gets_its_own_unguessable_session_id() -> None:
    h = Harness()
    other = h.dispatcher.connect(h.outbound, "other")
    assert h.conn.session.session_id != other.session.session_id


def test_initialize_may_only_be_sent_once_per_connection() -> None:
    h = Harness()
    h.handshake()
    error = h.error("initialize", {"clientName": "test"})
    assert error == {"code": -32600, "message": "initialize may only be sent once per connection"}
    # The connection stays usable.
    assert h.result("process/terminate", {"processId": "x"}) == {"running": False}


@pytest.mark.parametrize("method", EXEC_METHODS)
def test_exec_methods_require_initialize(method: str) -> None:
    h = Harness()
    error = h.error(method, minimal_params(method))
    assert error == {
        "code": -32600,
        "message": "client must call initialize before using exec methods",
    }
    assert h.spawner.spawned == []


@pytest.mark.parametrize("method", EXEC_METHODS)
def test_exec_methods_require_initialized_notification_after_initialize(method: str) -> None:
    h = Harness()
    h.result("initialize", {"clientName": "test"})
    error = h.error(method, minimal_params(method))
    assert error == {
        "code": -32600,
        "message": "client must send initialized before using exec methods",
    }


def test_initialized_params_are_ignored() -> None:
    h = Harness()
    h.result("initialize", {"clientName": "test"})
    h.send({"method": "initialized", "params": {"anything": [1, 2]}})
    assert h.result("process/terminate", {"processId": "x"}) == {"running": False}
    h2 = Harness()
    h2.result("initialize", {"clientName": "test"})
    h2.send({"method": "initialized"})
    assert h2.result("process/terminate", {"processId": "x"}) == {"running": False}


# --- protocol violations close the connection -------------------------------------------------


def assert_closed_and_deaf(h: Harness) -> None:
    assert h.outbound.closed
    before = len(h.outbound.raw)
    h.request("initialize", {"clientName": "late"})
    h.conn.message_received(b"not json")
    assert len(h.outbound.raw) == before, "a closed connection must not answer"


def test_initialized_before_initialize_closes_the_connection() -> None:
    h = Harness()
    h.send({"method": "initialized", "params": {}})
    assert h.outbound.raw == []
    assert_closed_and_deaf(h)


def test_unknown_client_notification_closes_the_connection() -> None:
    h = Harness()
    h.handshake()
    h.send({"method": "process/output", "params": {}})
    assert_closed_and_deaf(h)


@pytest.mark.parametrize(
    "message",
    [
        {"id": 1, "result": {}},
        {"id": "a", "error": {"code": -32600, "message": "no"}},
    ],
)
def test_client_responses_and_errors_close_the_connection(message: dict[str, Any]) -> None:
    h = Harness()
    h.handshake()
    h.outbound.take()
    h.send(message)
    assert h.outbound.raw == []
    assert_closed_and_deaf(h)


# --- routing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("handshake", [False, True])
def test_unknown_methods_are_invalid_requests(handshake: bool) -> None:
    h = Harness()
    if handshake:
        h.handshake()
    error = h.error("process/unknown", {})
    assert error == {"code": -32600, "message": "unknown method: process/unknown"}
    assert not h.outbound.closed


@pytest.mark.parametrize(
    ("method", "announces"),
    [("fs/noSuchMethod", True), ("process/start", True), ("process/read", False)],
)
def test_a_file_uri_announces_the_current_dialect_only_for_the_methods_that_take_paths(
    method: str, announces: bool
) -> None:
    # Routed or not: the route table records what the dialect says once,
    # an unknown method asks the dialect itself.
    h = Harness()
    h.handshake()
    h.call(method, {"processId": "p", "path": "file:///tmp"})
    assert h.conn.speaks_current_dialect is announces
    unknown = h.error("no/suchMethod", {})
    assert unknown["code"] == (-32601 if announces else -32600)


def test_malformed_params_are_invalid_params_before_any_handshake_check() -> None:
    h = Harness()
    error = h.error("process/start", {"processId": "proc-1"})
    assert error["code"] == -32602
    assert "argv" in error["message"]


def test_initialize_without_client_name_is_invalid_params() -> None:
    h = Harness()
    error = h.error("initialize", {})
    assert error["code"] == -32602
    assert "clientName" in error["message"]
    # A failed initialize does not count as one.
    assert h.result("initialize", {"clientName": "x"})["protocolVersion"] == "exec-server.v0"


def test_string_and_integer_ids_are_echoed_exactly() -> None:
    h = Harness()
    h.request("initialize", {"clientName": "x"}, request_id="init-\u00e9")
    h.send({"method": "initialized"})
    h.request("process/terminate", {"processId": "x"}, request_id=0)
    h.request("process/terminate", {"processId": "x"}, request_id=-5)
    responses = h.outbound.responses()
    assert set(responses) == {"init-\u00e9", 0, -5}


def test_jsonrpc_field_is_accepted_and_never_sent() -> None:
    h = Harness()
    h.send({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"clientName": "x"}})
    h.send({"jsonrpc": "2.0", "method": "initialized"})
    h.send({"jsonrpc": "2.0", "id": 2, "method": "process/terminate", "params": {"processId": "x"}})
    assert [m["id"] for m in h.outbound.messages] == [1, 2]
    assert all(b"jsonrpc" not in raw for raw in h.outbound.raw)


# --- bad framing is answered, not fatal -------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "code"),
    [
        (b"not-json", -32700),
        (b"{", -32700),
        (b"[1,2]", -32600),
        (b"42", -32600),
        (b"{}", -32600),
        (b'{"id":null,"method":"initialize"}', -32600),
    ],
)
def test_bad_lines_get_one_error_with_null_id(line: bytes, code: int) -> None:
    h = Harness()
    h.conn.message_received(line)
    [reply] = h.outbound.take()
    assert reply["id"] is None
    assert reply["error"]["code"] == code
    assert not h.outbound.closed
    assert h.result("initialize", {"clientName": "x"})["protocolVersion"] == "exec-server.v0"


def test_oversized_message_gets_one_error_naming_the_limit() -> None:
    h = Harness(ServerConfig(max_message_bytes=4096))
    h.conn.oversized_message()
    [reply] = h.outbound.take()
    assert reply["id"] is None
    assert reply["error"]["code"] == -32600
    assert "4096" in reply["error"]["message"]
    assert "--max-message-bytes" in reply["error"]["message"]
    assert h.result("initialize", {"clientName": "x"})["protocolVersion"] == "exec-server.v0"


# --- concurrency ------------------------------------------------------------------------------


def test_a_long_poll_read_does_not_delay_a_later_request() -> None:
    h = Harness()
    h.handshake()
    h.start("proc-1")
    read_id = h.request("process/read", {"processId": "proc-1", "afterSeq": 0, "waitMs": 2000})
    assert h.response(read_id) is None
    terminate = h.call("process/terminate", {"processId": "other"})
    assert terminate["result"] == {"running": False}
    assert h.response(read_id) is None
    h.process("proc-1").output(b"late")
    read = h.response(read_id)
    assert read is not None
    ids = [m["id"] for m in h.outbound.messages if "id" in m]
    # Answered in completion order, not request order.
    assert ids.index(terminate["id"]) < ids.index(read_id)
    assert read["result"]["chunks"][0]["chunk"] == "bGF0ZQ=="


# Answered as an internal error, and logged.
@pytest.mark.allow_logged_errors(r"unexpected error handling test/slow(?s:.*)ValueError: kaboom")
def test_deferred_results_and_failures_are_answered_by_id() -> None:
    h = Harness()
    pending: list[Deferred[Any]] = []

    def slow(conn: Any, params: Any) -> Deferred[Any]:
        d: Deferred[Any] = Deferred()
        pending.append(d)
        return d

    h.dispatcher.add_route("test/slow", p.Empty, slow, family=None)
    first = h.request("test/slow", {})
    second = h.request("test/slow", {})
    third = h.request("test/slow", {})
    assert h.outbound.raw == []
    idle = h.conn.when_idle()
    pending[1].callback({"n": 2})
    pending[2].errback(RpcError.invalid_request("nope"))
    assert not idle.called
    pending[0].errback(ValueError("kaboom"))
    assert idle.called
    responses = h.outbound.responses()
    assert responses[second]["result"] == {"n": 2}
    assert responses[third]["error"] == {"code": -32600, "message": "nope"}
    assert responses[first]["error"]["code"] == -32603
    assert [m["id"] for m in h.outbound.messages] == [second, third, first]


# Answered as an internal error, and logged.
@pytest.mark.allow_logged_errors(r"unexpected error handling test/broken(?s:.*)KeyError")
def test_unexpected_handler_exceptions_are_internal_errors() -> None:
    h = Harness()

    def broken(conn: Any, params: Any) -> Any:
        raise KeyError("missing")

    h.dispatcher.add_route("test/broken", p.Empty, broken, family=None)
    error = h.error("test/broken", {})
    assert error["code"] == -32603
    assert error["message"].startswith("internal error")
    assert h.result("initialize", {"clientName": "x"})["protocolVersion"] == "exec-server.v0"


def test_when_idle_fires_at_once_without_requests_in_flight() -> None:
    h = Harness()
    assert h.conn.when_idle().called


def test_nothing_is_sent_after_the_transport_closed() -> None:
    h = Harness()
    h.handshake()
    h.start("proc-1")
    h.outbound.take()
    h.conn.transport_closed()
    h.process("proc-1").output(b"x")
    assert h.outbound.raw == []


def test_dispatcher_shutdown_ends_every_connection_and_its_processes() -> None:
    h = Harness()
    h.handshake()
    h.start("proc-1")
    done = h.dispatcher.shutdown()
    assert not done.called
    assert h.spawner.kill.sent, "shutdown must signal the process group"
    h.process("proc-1").exit(signal=15)
    assert done.called
    assert h.dispatcher.connections == set()
    assert h.dispatcher.stats.connections_active == 0


@pytest.mark.parametrize(
    "line",
    [
        b'{"id":1,"method":"\xff"}',
        b"[" * 100_000,
        b'{"id":1,"method":"initialize","params":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    ],
    ids=["utf8-method", "unclosed-deep", "deep-params"],
)
def test_undecodable_text_and_deep_nesting_are_answered_not_raised(line: bytes) -> None:
    h = Harness()
    h.conn.message_received(line)
    [reply] = h.outbound.take()
    assert reply["id"] is None
    assert reply["error"]["code"] == -32700
    assert h.result("initialize", {"clientName": "x"})["protocolVersion"] == "exec-server.v0"


def test_invalid_utf8_in_params_is_invalid_params_not_internal_error() -> None:
    h = Harness()
    h.conn.message_received(b'{"id":7,"method":"initialize","params":{"clientName":"\xff"}}')
    [reply] = h.outbound.take()
    assert reply["id"] == 7
    assert reply["error"]["code"] == -32602


# --- failures that must not take the connection down ---------------------------------------


# Answered as an internal error, and logged.
@pytest.mark.allow_logged_errors(r"test/odd")
def test_an_unencodable_result_is_an_internal_error_not_a_dead_connection() -> None:
    h = Harness()
    h.dispatcher.add_route("test/odd", p.Empty, lambda conn, params: object(), family=None)
    error = h.error("test/odd", {})
    assert error["code"] == -32603
    assert h.result("initialize", {"clientName": "x"})["protocolVersion"] == "exec-server.v0"


# Answered as an internal error, and logged.
@pytest.mark.allow_logged_errors(r"test/slow")
def test_an_unencodable_deferred_result_is_answered_and_the_request_completes() -> None:
    h = Harness()
    pending: list[Deferred[Any]] = []

    def slow(conn: Any, params: Any) -> Deferred[Any]:
        d: Deferred[Any] = Deferred()
        pending.append(d)
        return d

    h.dispatcher.add_route("test/slow", p.Empty, slow, family=None)
    request_id = h.request("test/slow", {})
    idle = h.conn.when_idle()
    pending[0].callback(object())
    response = h.response(request_id)
    assert response is not None
    assert response["error"]["code"] == -32603
    # Otherwise shutdown (which waits for requests in flight) would never end.
    assert idle.called


# Answered as an internal error, and logged.
@pytest.mark.allow_logged_errors(r"unexpected error decoding a message(?s:.*)simulated decoder bug")
def test_an_unexpected_decoding_failure_is_answered(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness()

    def broken(data: bytes | str) -> Any:
        raise RuntimeError("simulated decoder bug")

    monkeypatch.setattr("execserver.codec.decode_message", broken)
    h.conn.message_received(b'{"id":1,"method":"initialize"}')
    [reply] = h.outbound.take()
    assert reply["id"] is None
    assert reply["error"]["code"] == -32603
    assert not h.outbound.closed


# --- the dispatcher alone: routes, sessions and parts come from outside ------------------------


class _BareSession:
    """The least a connection's session must be (registry.ResumableSession)."""

    def __init__(self) -> None:
        self.session_id = "bare"
        self.ttl_ms = 0
        self.owner: object = None
        self.attached = True
        self.speaks_current_dialect = False
        self.ended = False

    def attach(self, send: Any) -> None:
        self.attached = True

    def detach(self) -> None:
        self.attached = False

    def shutdown(self) -> Deferred[None]:
        self.ended = True
        return succeed(None)

    def release(self) -> None:
        pass

    def release_held(self) -> None:
        pass

    def steer_flow_of(self, target: ResumableSession) -> None:
        pass

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


def test_a_bare_dispatcher_serves_only_the_routes_and_sessions_it_is_given() -> None:
    sessions: list[_BareSession] = []

    def new_session(conn: Connection) -> _BareSession:
        sessions.append(_BareSession())
        return sessions[-1]

    dispatcher = Dispatcher(ServerConfig(), Clock(), new_session)
    dispatcher.add_route("test/echo", p.Empty, lambda conn, params: {"ok": True}, family=None)
    closed: list[Connection] = []
    dispatcher.closed_hooks.append(closed.append)
    dispatcher.readiness_checks.append(lambda: None)
    dispatcher.readiness_checks.append(lambda: "wedged")
    outbound = FakeOutbound()
    conn = dispatcher.connect(outbound, "bare")
    assert conn.session is sessions[0]
    conn.message_received(b'{"id":1,"method":"test/echo","params":{}}')
    conn.message_received(b'{"id":2,"method":"initialize","params":{"clientName":"t"}}')
    replies = outbound.responses()
    assert replies[1]["result"] == {"ok": True}
    # No application, no handshake: initialize is as unknown as any method.
    assert replies[2]["error"] == {"code": -32600, "message": "unknown method: initialize"}
    assert dispatcher.not_ready_reason() == "wedged"
    assert dispatcher.application is None
    conn.transport_closed()
    assert closed == [conn]
    conn.shutdown()
    assert sessions[0].ended
    assert dispatcher.connections == set()
