"""Resumable sessions through the real server over real WebSockets (issue 11).

A session created with ``sessionTtlMs`` outlives its connection: processes
keep running, output is retained, and ``initialize`` with
``resumeSessionId`` takes it over. The error texts are the contract's,
exactly. Seqs follow the reference: one counter per process for output,
exit and close.
"""

from __future__ import annotations

import os
from typing import Any

import pytest_twisted

from tests.support.harness import b64, pid_alive, unb64
from tests.support.polling import until
from tests.support.resume_handshake import initialize
from tests.support.ws_harness import WsClientProtocol, WsServerProcess, connect


async def session(server: WsServerProcess, **params: Any) -> tuple[WsClientProtocol, str]:
    client = await connect(server.url)
    response = await initialize(client, **params)
    return client, response["result"]["sessionId"]


async def resume(
    server: WsServerProcess, session_id: str
) -> tuple[WsClientProtocol, dict[str, Any]]:
    """Connect anew and ask to take over ``session_id``; the raw response."""
    client = await connect(server.url)
    return client, await initialize(client, resumeSessionId=session_id)


async def start_tree(client: WsClientProtocol) -> int:
    """Start process "p" with a background grandchild; return the grandchild's pid."""
    await client.start_process("p", ["sh", "-c", "sleep 1000 & echo $!; wait"])
    return int((await client.wait_output_contains("p", b"\n")).split()[0])


async def dropped(client: WsClientProtocol) -> None:
    """Cut TCP under the client (no close frame), and wait for it to notice."""
    client.abort()
    await client.closed


@pytest_twisted.ensureDeferred
async def test_resume_error_texts_are_exact() -> None:
    server = await WsServerProcess.start()
    try:
        client = await connect(server.url)
        response = await initialize(client, resumeSessionId="no-such-session")
        assert response["error"] == {
            "code": -32600,
            "message": "unknown session id no-such-session",
        }
        # A refused resume leaves the connection usable for a fresh session.
        fresh = await initialize(client, sessionTtlMs=5000)
        session_id = fresh["result"]["sessionId"]
        assert fresh["result"]["sessionTtlMs"] == 5000

        other = await connect(server.url)
        taken = await initialize(other, resumeSessionId=session_id)
        assert taken["error"] == {
            "code": -32010,
            "message": f"session {session_id} is already attached to another connection",
        }
        await other.close()
        await client.close()
    finally:
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_resume_within_ttl_keeps_processes_and_replays_missed_output(tmp_path: Any) -> None:
    server = await WsServerProcess.start()
    try:
        client, session_id = await session(server, sessionTtlMs=20_000)
        go = tmp_path / "go"
        script = (
            f'echo before; while [ ! -e "{go}" ]; do sleep 0.01; done; '
            'echo after; read x; echo "got $x"'
        )
        await client.start_process("p", ["sh", "-c", script], pipeStdin=True)
        await client.wait_output_contains("p", b"before\n")
        await dropped(client)
        go.touch()  # the child writes while nobody is connected

        again, resumed = await resume(server, session_id)
        assert resumed["result"]["sessionId"] == session_id
        assert resumed["result"]["sessionTtlMs"] == 20_000
        read = await again.call("process/read", {"processId": "p", "afterSeq": 1, "waitMs": 5000})
        assert [unb64(c["chunk"]) for c in read["chunks"]] == [b"after\n"], read
        assert read["chunks"][0]["seq"] == 2
        assert "gap" not in read
        # Live notifications flow on the new connection.
        write = await again.call(
            "process/write", {"processId": "p", "chunk": b64(b"x\n"), "writeId": "w1"}
        )
        assert write == {"accepted": True, "status": "accepted"}
        await again.wait_output_contains("p", b"got x\n")
        last = max(
            m["params"]["seq"] for m in again.notifications if m["method"] == "process/output"
        )
        exited = await again.wait_notification("process/exited", "p")
        closed = await again.wait_notification("process/closed", "p")
        assert exited["seq"] == last + 1
        assert closed["seq"] == exited["seq"] + 1
        await again.close()
    finally:
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_expiry_terminates_the_whole_tree_and_forgets_the_id() -> None:
    server = await WsServerProcess.start("--terminate-grace-ms", "200")
    try:
        client, session_id = await session(server, sessionTtlMs=300)
        # A grandchild in the background, reporting its pid.
        grandchild = await start_tree(client)
        assert pid_alive(grandchild)
        await dropped(client)
        await until(lambda: not pid_alive(grandchild), "the tree to be terminated", timeout=10.0)

        again, response = await resume(server, session_id)
        assert response["error"] == {"code": -32600, "message": f"unknown session id {session_id}"}
        await again.close()
    finally:
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_without_a_ttl_a_disconnect_ends_the_session_as_before() -> None:
    server = await WsServerProcess.start("--terminate-grace-ms", "200")
    try:
        client, session_id = await session(server)
        grandchild = await start_tree(client)
        await dropped(client)
        await until(lambda: not pid_alive(grandchild), "the tree to be terminated", timeout=10.0)
        again, response = await resume(server, session_id)
        assert response["error"]["message"] == f"unknown session id {session_id}"
        await again.close()
    finally:
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_ttl_is_capped_and_zero_max_disables_resumption() -> None:
    server = await WsServerProcess.start("--max-session-ttl-ms", "1000")
    try:
        client, _ = await session(server, sessionTtlMs=50_000)
        assert client.messages[0]["result"]["sessionTtlMs"] == 1000
        await client.close()
    finally:
        await server.stop()
    server = await WsServerProcess.start("--max-session-ttl-ms", "0")
    try:
        client, session_id = await session(server, sessionTtlMs=50_000)
        assert client.messages[0]["result"]["sessionTtlMs"] == 0
        await dropped(client)
        again, response = await resume(server, session_id)
        assert response["error"]["message"] == f"unknown session id {session_id}"
        await again.close()
    finally:
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_default_ttl_applies_to_clients_that_do_not_ask() -> None:
    server = await WsServerProcess.start("--default-session-ttl-ms", "4000")
    try:
        client, session_id = await session(server)
        assert client.messages[0]["result"]["sessionTtlMs"] == 4000
        await dropped(client)
        again, response = await resume(server, session_id)
        assert response["result"]["sessionId"] == session_id
        await again.close()
    finally:
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_server_shutdown_terminates_detached_sessions() -> None:
    server = await WsServerProcess.start("--terminate-grace-ms", "200")
    stopped = False
    try:
        client, _ = await session(server, sessionTtlMs=60_000)
        grandchild = await start_tree(client)
        await dropped(client)
        assert pid_alive(grandchild)
        assert await server.stop() == 0
        stopped = True
        await until(lambda: not pid_alive(grandchild), "the detached tree to be ended", timeout=5.0)
    finally:
        if not stopped:
            await server.stop()


@pytest_twisted.ensureDeferred
async def test_write_id_is_written_once() -> None:
    server = await WsServerProcess.start()
    try:
        client, _ = await session(server)
        await client.start_process("p", ["cat"], pipeStdin=True)
        for _ in range(3):
            result = await client.call(
                "process/write", {"processId": "p", "chunk": b64(b"once\n"), "writeId": "same"}
            )
            assert result == {"accepted": True, "status": "accepted"}
        await client.call(
            "process/write", {"processId": "p", "chunk": b64(b"twice\n"), "writeId": "other"}
        )
        await client.call("process/closeStdin", {"processId": "p"})
        await client.wait_closed("p")
        assert client.output_of("p") == b"once\ntwice\n"
        # Without a writeId the answer is the baseline's, unchanged.
        await client.start_process("q", ["cat"], pipeStdin=True)
        assert await client.call("process/write", {"processId": "q", "chunk": b64(b"")}) == {
            "accepted": True
        }
        empty = await client.request(
            "process/write", {"processId": "q", "chunk": b64(b"x"), "writeId": ""}
        )
        assert empty["error"] == {"code": -32602, "message": "writeId must not be empty"}
        await client.close()
    finally:
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_exit_and_close_seqs_follow_the_output_as_the_reference_numbers_them() -> None:
    server = await WsServerProcess.start()
    try:
        client, _ = await session(server)
        await client.start_process("p", ["sh", "-c", "printf a; sleep 0.05; printf b >&2"])
        await client.wait_closed("p")
        outputs = [
            m["params"]["seq"] for m in client.notifications if m["method"] == "process/output"
        ]
        exited = await client.wait_notification("process/exited", "p")
        closed = await client.wait_notification("process/closed", "p")
        assert outputs == [1, 2]
        assert (exited["seq"], closed["seq"]) == (3, 4)
        read = await client.call("process/read", {"processId": "p", "afterSeq": 0})
        assert (read["exitedSeq"], read["closedSeq"]) == (3, 4)
        await client.close()
    finally:
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_an_attached_slow_reader_is_told_the_exact_gap() -> None:
    # 1 KiB chunks against a cap of four chunks: most are dropped.
    server = await WsServerProcess.start("--retained-output-bytes", "4480")
    try:
        client, _ = await session(server)
        script = "i=0; while [ $i -lt 20 ]; do head -c 1024 /dev/zero; sleep 0.01; i=$((i+1)); done"
        await client.start_process("p", ["sh", "-c", script])
        await client.wait_closed("p")
        seqs = [m["params"]["seq"] for m in client.notifications if m["method"] == "process/output"]
        read = await client.call("process/read", {"processId": "p", "afterSeq": 0})
        first = read["chunks"][0]["seq"]
        assert first > 1
        assert read["gap"] == {"fromSeq": 1, "toSeq": first - 1}
        assert [c["seq"] for c in read["chunks"]] == [s for s in seqs if s >= first]
        assert "gap" not in await client.call(
            "process/read", {"processId": "p", "afterSeq": first - 1}
        )
        await client.close()
    finally:
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_pause_keeps_unacknowledged_output_while_detached() -> None:
    # A cap of about 2 KiB: "drop" would lose most of the 64 KiB below.
    server = await WsServerProcess.start("--retained-output-bytes", "2048")
    try:
        client, session_id = await session(server, sessionTtlMs=20_000, onDetachedFull="pause")
        assert client.messages[0]["result"]["onDetachedFull"] == "pause"
        script = "head -c 65536 /dev/urandom | od -An -v -tx1"
        await client.start_process("p", ["sh", "-c", script])
        await dropped(client)
        again, _ = await resume(server, session_id)
        data = b""
        after = 0
        while True:
            read = await again.call(
                "process/read", {"processId": "p", "afterSeq": after, "waitMs": 5000}
            )
            assert "gap" not in read
            for chunk in read["chunks"]:
                assert chunk["seq"] > after
                data += unb64(chunk["chunk"])
            after = read["nextSeq"] - 1
            if read.get("closed") and not read["chunks"]:
                break
        assert len(data) == 65536 * 3 + 65536 // 16  # " xx" per byte, a newline per 16
        await again.close()
    finally:
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_stdio_grants_no_ttl() -> None:
    from tests.support.stdio_server import ServerProcess

    server = ServerProcess.start()
    try:
        result = await server.call("initialize", {"clientName": "t", "sessionTtlMs": 5000})
        assert result["sessionTtlMs"] == 0
    finally:
        await server.stop()


def test_pid_helper_sees_this_process() -> None:
    assert pid_alive(os.getpid())
