"""The reference's wire-observable behaviour, ported, against the real server over stdio.

Sources (the reference implementation's own test suite): the handler tests, the routing tests,
``tests/stdio_smoke.rs`` and the client tests that describe what the server
does. Each test names the reference test it ports where there is one.
"""

from __future__ import annotations

import json
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.internet.defer import Deferred

from tests.support.harness import (
    REPO_ROOT,
    RpcFailure,
    b64,
    child_env,
    unb64,
    with_timeout,
)
from tests.support.polling import until
from tests.support.stdio_server import ServerProcess

ECHO_SCRIPT = "printf 'ready\\n'; while IFS= read -r line; do printf 'echo:%s\\n' \"$line\"; done"


@asynccontextmanager
async def serving(*args: str, handshake: bool = True) -> AsyncIterator[ServerProcess]:
    server = ServerProcess.start(*args)
    try:
        if handshake:
            await server.handshake()
        yield server
    finally:
        await server.stop()


def exec_params(process_id: str = "proc-1", **extra: Any) -> dict[str, Any]:
    params: dict[str, Any] = {
        "processId": process_id,
        "argv": ["bash", "-lc", "true"],
        "cwd": str(REPO_ROOT),
        "env": child_env(),
        "tty": False,
        "arg0": None,
    }
    params.update(extra)
    return params


async def error_of(server: ServerProcess, method: str, params: Any) -> dict[str, Any]:
    response = await server.request(method, params)
    assert "error" in response, response
    error: dict[str, Any] = response["error"]
    return error


async def wait_output_containing(
    server: ServerProcess, process_id: str, needle: bytes, timeout: float = 10.0
) -> bytes:
    await server.wait_for(
        lambda _: needle in server.output_of(process_id),
        timeout,
        f"{needle!r} in the output of {process_id}",
    )
    return server.output_of(process_id)


# --- stdio_smoke.rs ---------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_exec_server_accepts_initialize_over_stdio() -> None:
    async with serving(handshake=False) as server:
        server.send_raw(
            b'{"id":1,"method":"initialize","params":{"clientName":"exec-server-test"}}\n'
        )
        response = await server.wait_for(lambda m: m.get("id") == 1, what="initialize response")
        assert set(response) == {"id", "result"}
        assert response["result"]["protocolVersion"] == "exec-server.v0"
        # The envelope on the wire carries no "jsonrpc" member.
        assert all(b'"jsonrpc"' not in line for line in server.raw_lines)
        server.notify("initialized", {})


@pytest_twisted.ensureDeferred
async def test_exec_server_accepts_explicit_none_sandbox_over_stdio() -> None:
    async with serving() as server:
        result = await server.call(
            "process/start",
            exec_params(argv=["printf", "sandbox-none"], env={}, sandbox={"mode": "none"}),
        )
        assert result == {"processId": "proc-1"}
        output = await server.wait_notification("process/output", "proc-1")
        assert output["stream"] == "stdout"
        assert output["chunk"] == "c2FuZGJveC1ub25l"


@pytest_twisted.ensureDeferred
async def test_exec_server_rejects_host_default_sandbox_over_stdio() -> None:
    async with serving() as server:
        error = await error_of(
            server, "process/start", exec_params(env={}, sandbox={"mode": "hostDefault"})
        )
        assert error == {
            "code": -32600,
            "message": "sandbox mode `hostDefault` is not supported by exec-server yet",
        }


@pytest_twisted.ensureDeferred
async def test_exec_server_client_streams_output_and_accepts_writes() -> None:
    """Also the README's example session: ready, write, echo, terminate, exited."""
    async with serving() as server:
        await server.start_process("proc-1", ["bash", "-lc", ECHO_SCRIPT], tty=True)
        await wait_output_containing(server, "proc-1", b"ready")
        outputs = [n["params"] for n in server.notifications if n["method"] == "process/output"]
        assert {o["stream"] for o in outputs} == {"pty"}
        accepted = await server.call(
            "process/write", {"processId": "proc-1", "chunk": b64(b"hello\n")}
        )
        assert accepted == {"accepted": True}
        await wait_output_containing(server, "proc-1", b"echo:hello")
        assert await server.call("process/terminate", {"processId": "proc-1"}) == {"running": True}
        exited = await server.wait_notification("process/exited", "proc-1")
        assert isinstance(exited["exitCode"], int)


# --- handler tests ----------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_initialize_response_reports_protocol_version() -> None:
    async with serving(handshake=False) as server:
        result = await server.call("initialize", {"clientName": "test"})
        assert result["protocolVersion"] == "exec-server.v0"


@pytest_twisted.ensureDeferred
async def test_exec_methods_require_initialize() -> None:
    async with serving(handshake=False) as server:
        error = await error_of(server, "process/start", exec_params(tty=True))
        assert error == {
            "code": -32600,
            "message": "client must call initialize before using exec methods",
        }


@pytest_twisted.ensureDeferred
async def test_exec_methods_require_initialized_notification_after_initialize() -> None:
    async with serving(handshake=False) as server:
        await server.call("initialize", {"clientName": "test"})
        error = await error_of(server, "process/start", exec_params(tty=True))
        assert error == {
            "code": -32600,
            "message": "client must send initialized before using exec methods",
        }


@pytest_twisted.ensureDeferred
async def test_initialized_before_initialize_is_a_protocol_error() -> None:
    server = ServerProcess.start()
    try:
        server.notify("initialized", {})
        # The reference drops the connection: for stdio the server closes its
        # output and ends without answering anything.
        await with_timeout(server.exited(), 10, "server exit after protocol error")
        assert server.messages == []
    finally:
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_initialize_may_only_be_sent_once_per_connection() -> None:
    async with serving(handshake=False) as server:
        await server.call("initialize", {"clientName": "test"})
        error = await error_of(server, "initialize", {"clientName": "test"})
        assert error == {
            "code": -32600,
            "message": "initialize may only be sent once per connection",
        }


@pytest_twisted.ensureDeferred
async def test_exec_echoes_client_process_ids() -> None:
    async with serving() as server:
        first = await server.call(
            "process/start", exec_params("proc-1", argv=["bash", "-lc", "sleep 30"])
        )
        assert first == {"processId": "proc-1"}
        second = await server.call("process/start", exec_params("proc-2"))
        assert second == {"processId": "proc-2"}


@pytest_twisted.ensureDeferred
async def test_concurrent_duplicate_execs_reserve_process_ids_atomically() -> None:
    async with serving() as server:
        params = exec_params("proc-1", argv=["bash", "-lc", "sleep 30"])
        first = {"id": 101, "method": "process/start", "params": params}
        second = {"id": 102, "method": "process/start", "params": params}
        # Both requests in one write: the server sees them back to back.
        server.send_raw(json.dumps(first).encode() + b"\n" + json.dumps(second).encode() + b"\n")
        responses = [
            await server.wait_for(lambda m, i=i: m.get("id") == i, what=f"response {i}")  # type: ignore[misc]
            for i in (101, 102)
        ]
        assert sum("result" in r for r in responses) == 1
        errors = [r["error"]["message"] for r in responses if "error" in r]
        assert errors == ["process proc-1 already exists"]


@pytest_twisted.ensureDeferred
async def test_writes_to_pipe_backed_processes_are_rejected() -> None:
    async with serving() as server:
        await server.call("process/start", exec_params(argv=["bash", "-lc", "sleep 30"]))
        error = await error_of(
            server, "process/write", {"processId": "proc-1", "chunk": b64(b"hello\n")}
        )
        assert error == {"code": -32600, "message": "stdin is closed for process proc-1"}


@pytest_twisted.ensureDeferred
async def test_writes_to_unknown_processes_are_rejected() -> None:
    async with serving() as server:
        error = await error_of(
            server, "process/write", {"processId": "missing", "chunk": b64(b"input")}
        )
        assert error == {"code": -32600, "message": "unknown process id missing"}


@pytest_twisted.ensureDeferred
async def test_terminate_unknown_processes_report_running_false() -> None:
    async with serving() as server:
        result = await server.call("process/terminate", {"processId": "missing"})
        assert result == {"running": False}


@pytest_twisted.ensureDeferred
async def test_terminate_keeps_process_ids_reserved_until_retention_expires() -> None:
    async with serving("--exit-retention-ms", "300") as server:
        await server.call("process/start", exec_params(argv=["bash", "-lc", "sleep 30"]))
        assert await server.call("process/terminate", {"processId": "proc-1"}) == {"running": True}
        error = await error_of(server, "process/start", exec_params())
        assert error["message"] == "process proc-1 already exists"
        await server.wait_notification("process/exited", "proc-1")

        # Retained, then released: poll with reads (each answered at once).
        async def released() -> bool:
            response = await server.request("process/read", {"processId": "proc-1"})
            if "error" in response:
                assert response["error"]["message"] == "unknown process id proc-1"
                return True
            return False

        await until(released, "proc-1 to be released", timeout=10, interval=0.05)
        assert await server.call("process/start", exec_params()) == {"processId": "proc-1"}


@pytest_twisted.ensureDeferred
async def test_read_paginates_retained_output_without_skipping_omitted_chunks(
    tmp_path: Path,
) -> None:
    async with serving() as server:
        # Two chunks on two streams, in this order: the second is written only
        # once the first has reached this client (no sleep to hope on).
        go = tmp_path / "go"
        script = f'printf abc; while [ ! -e "{go}" ]; do sleep 0.01; done; printf def >&2'
        await server.call("process/start", exec_params(argv=["sh", "-c", script]))
        await server.wait_notification("process/output", "proc-1")
        go.touch()
        await server.wait_notification("process/exited", "proc-1")
        first = await server.call(
            "process/read", {"processId": "proc-1", "afterSeq": 0, "maxBytes": 3, "waitMs": 0}
        )
        assert [(c["seq"], c["stream"], unb64(c["chunk"])) for c in first["chunks"]] == [
            (1, "stdout", b"abc")
        ]
        assert first["nextSeq"] == 2
        second = await server.call(
            "process/read",
            {"processId": "proc-1", "afterSeq": first["nextSeq"] - 1, "maxBytes": 3, "waitMs": 0},
        )
        assert [(c["seq"], c["stream"], unb64(c["chunk"])) for c in second["chunks"]] == [
            (2, "stderr", b"def")
        ]
        assert second["nextSeq"] == 3


# --- routing tests ----------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_malformed_exec_params_return_immediate_error() -> None:
    async with serving(handshake=False) as server:
        error = await error_of(server, "process/start", {"processId": "proc-1"})
        assert error["code"] == -32602
        assert "argv" in error["message"]


@pytest_twisted.ensureDeferred
async def test_unknown_request_methods_return_invalid_request_errors() -> None:
    async with serving() as server:
        error = await error_of(server, "process/unknown", {})
        assert error == {"code": -32600, "message": "unknown method: process/unknown"}


@pytest_twisted.ensureDeferred
async def test_exec_requests_with_typed_params_and_sandbox_route() -> None:
    async with serving() as server:
        params = exec_params(
            argv=["bash", "-lc", "true"], env={}, tty=True, sandbox={"mode": "none"}
        )
        assert await server.call("process/start", params) == {"processId": "proc-1"}
        exited = await server.wait_notification("process/exited", "proc-1")
        # routing.rs serializes_typed_notifications_back_to_jsonrpc: these two
        # fields, camelCase (extension fields may follow).
        assert exited["processId"] == "proc-1"
        assert exited["exitCode"] == 0


@pytest.mark.parametrize(
    "message",
    [
        {"method": "process/output", "params": {}},
        {"id": 1, "result": {}},
        {"id": 1, "error": {"code": -32600, "message": "x"}},
    ],
)
@pytest_twisted.ensureDeferred
async def test_unexpected_client_messages_close_the_connection(message: dict[str, Any]) -> None:
    server = ServerProcess.start()
    try:
        await server.handshake()
        server.send(message)
        await with_timeout(server.exited(), 10, "server exit after protocol error")
    finally:
        await server.stop()


# --- client tests that describe the server ----------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_read_returns_retained_output_and_exit_state() -> None:
    async with serving() as server:
        await server.call("process/start", exec_params(argv=["printf", "hello"], env={}))
        read = await server.call(
            "process/read",
            {"processId": "proc-1", "afterSeq": None, "maxBytes": None, "waitMs": 1000},
        )
        assert len(read["chunks"]) == 1
        assert read["chunks"][0]["seq"] == 1
        assert read["chunks"][0]["stream"] == "stdout"
        assert unb64(read["chunks"][0]["chunk"]) == b"hello"
        assert read["nextSeq"] == 2
        if not read["exited"]:
            read = await server.call(
                "process/read",
                {"processId": "proc-1", "afterSeq": read["nextSeq"] - 1, "waitMs": 1000},
            )
        assert read["exited"] is True
        assert read["exitCode"] == 0


@pytest_twisted.ensureDeferred
async def test_start_process_output_is_notified_with_stream_metadata() -> None:
    async with serving() as server:
        await server.start_process("proc-1", ["sh", "-c", "printf error >&2"])
        output = await server.wait_notification("process/output", "proc-1")
        assert output["stream"] == "stderr"
        assert unb64(output["chunk"]) == b"error"


@pytest_twisted.ensureDeferred
async def test_rejects_invalid_exec_params_from_handler() -> None:
    async with serving() as server:
        error = await error_of(server, "process/start", exec_params(argv=[], env={}))
        assert error == {"code": -32602, "message": "argv must not be empty"}


@pytest_twisted.ensureDeferred
async def test_terminate_marks_process_exited() -> None:
    async with serving() as server:
        await server.call("process/start", exec_params(argv=["sleep", "30"]))
        assert await server.call("process/terminate", {"processId": "proc-1"}) == {"running": True}
        exited = await server.wait_notification("process/exited", "proc-1", timeout=5)
        assert exited["exitCode"] != 0
        read = await server.call("process/read", {"processId": "proc-1"})
        assert read["exited"] is True


@pytest_twisted.ensureDeferred
async def test_out_of_order_responses_match_by_request_id() -> None:
    async with serving() as server:
        await server.call("process/start", exec_params(argv=["sleep", "30"]))
        read = server.request(
            "process/read", {"processId": "proc-1", "afterSeq": 0, "waitMs": 2000}
        )
        read_d: Deferred[Any] = Deferred.fromCoroutine(read)
        terminate = await server.call("process/terminate", {"processId": "other"})
        assert terminate == {"running": False}
        assert not read_d.called, "the long-poll read must still be waiting"
        result = await read_d
        assert result["result"]["chunks"] == []
        assert result["result"]["exited"] is False


# --- process/start details the reference fixes ------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_env_is_exactly_as_given_and_cwd_and_arg0_are_honoured(tmp_path: Path) -> None:
    async with serving() as server:
        await server.call(
            "process/start", exec_params("env", argv=["/usr/bin/env"], env={"A": "1"})
        )
        await server.wait_closed("env")
        assert server.output_of("env") == b"A=1\n"
        await server.call(
            "process/start", exec_params("pwd", argv=["/bin/pwd"], cwd=str(tmp_path), env={})
        )
        await server.wait_closed("pwd")
        assert server.output_of("pwd") == str(tmp_path).encode() + b"\n"
        await server.call(
            "process/start",
            exec_params("arg0", argv=["sh", "-c", "cat /proc/$$/cmdline"], arg0="custom-zero"),
        )
        await server.wait_closed("arg0")
        assert server.output_of("arg0").split(b"\0")[0] == b"custom-zero"


@pytest_twisted.ensureDeferred
async def test_exit_codes_are_reported() -> None:
    async with serving() as server:
        await server.call("process/start", exec_params(argv=["sh", "-c", "exit 3"]))
        exited = await server.wait_notification("process/exited", "proc-1")
        assert exited["exitCode"] == 3


@pytest_twisted.ensureDeferred
async def test_relative_cwd_is_invalid_params() -> None:
    async with serving() as server:
        error = await error_of(server, "process/start", exec_params(cwd="relative"))
        assert error["code"] == -32602
        assert "absolute" in error["message"]


@pytest.mark.parametrize(
    ("case", "kind"),
    [
        ("missing-program", "spawnNotFound"),
        ("missing-cwd", "cwdNotFound"),
        ("cwd-is-a-file", "cwdNotADirectory"),
        ("not-executable", "spawnPermissionDenied"),
    ],
)
@pytest_twisted.ensureDeferred
async def test_spawn_failures_are_errors_with_data_kind(
    case: str, kind: str, tmp_path: Path
) -> None:
    plain_file = tmp_path / "plain"
    plain_file.write_text("#!/bin/sh\necho hi\n")
    plain_file.chmod(stat.S_IRUSR | stat.S_IWUSR)
    params = {
        "missing-program": exec_params(argv=["definitely-not-a-program-xyz"]),
        "missing-cwd": exec_params(argv=["true"], cwd=str(tmp_path / "nope")),
        "cwd-is-a-file": exec_params(argv=["true"], cwd=str(plain_file)),
        "not-executable": exec_params(argv=[str(plain_file)]),
    }[case]
    async with serving() as server:
        error = await error_of(server, "process/start", params)
        assert error["data"]["kind"] == kind
        assert isinstance(error["data"]["errno"], int)
        assert error["code"] in (-32600, -32602, -32603)
        # Nothing was started under that id: it is free for a retry.
        assert await server.call("process/start", exec_params(argv=["true"])) == {
            "processId": "proc-1"
        }


@pytest_twisted.ensureDeferred
async def test_reads_of_unknown_processes_are_rejected() -> None:
    async with serving() as server:
        with pytest.raises(RpcFailure) as info:
            await server.call("process/read", {"processId": "missing"})
        assert info.value.code == -32600
        assert info.value.message == "unknown process id missing"
