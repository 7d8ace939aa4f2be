"""The client against the real server: in-process (dispatcher) and spawned over stdio."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
from typing import Any

import pytest
import pytest_twisted

from execserver import protocol as p
from execserver.client import (
    ConnectionClosed,
    ConnectOptions,
    ExecServerClient,
    InitializeTimeout,
    OutputEvent,
    ServerError,
    SpawnFailed,
)
from execserver.session import session_of
from tests.support.client_fakes import make_dispatcher, wait
from tests.support.harness import REPO_ROOT, pid_alive, reactor, server_env

OPTIONS = ConnectOptions("test-client", initialize_timeout=5.0)
CWD = str(REPO_ROOT)


async def _in_process(dispatcher: Any = None) -> ExecServerClient:
    client: ExecServerClient = await wait(
        ExecServerClient.connect_in_process(reactor, OPTIONS, dispatcher=dispatcher),
        "in-process connect",
    )
    return client


async def _spawned(**kwargs: Any) -> ExecServerClient:
    client: ExecServerClient = await wait(
        ExecServerClient.spawn_local(reactor, OPTIONS, env=server_env(), **kwargs),
        "local server handshake",
    )
    return client


# --- in-process (the reference's connect_in_process tests) --------------------------------


@pytest_twisted.ensureDeferred
async def test_in_process_starts_processes_without_jsonrpc_transport() -> None:
    client = await _in_process()
    try:
        process = await client.start_process(["printf", "hello"], process_id="proc-1", cwd=CWD)
        output = await wait(process.subscribe().next(), "output")
        assert output == OutputEvent("proc-1", "stdout", b"hello", 1)
        assert await wait(process.exited(), "exit") == 0
    finally:
        await wait(client.close(), "close")


@pytest_twisted.ensureDeferred
async def test_in_process_read_returns_retained_output_and_exit_state() -> None:
    client = await _in_process()
    try:
        response = await client.exec(
            p.ExecParams("proc-1", ["printf", "hello"], CWD, {}, tty=False)
        )
        read = await wait(client.read(response.process_id, wait_ms=1000), "read")
        assert len(read.chunks) == 1
        assert (read.chunks[0].seq, read.chunks[0].stream) == (1, "stdout")
        assert read.chunks[0].chunk == b"hello"
        assert read.next_seq == 2
        if not read.exited:
            read = await wait(
                client.read(response.process_id, after_seq=read.next_seq - 1, wait_ms=1000),
                "read until exit",
            )
        assert read.exited
        assert read.exit_code == 0
    finally:
        await wait(client.close(), "close")


@pytest_twisted.ensureDeferred
async def test_in_process_rejects_invalid_exec_params_from_handler() -> None:
    client = await _in_process()
    try:
        with pytest.raises(ServerError) as info:
            await client.start_process([], process_id="proc-1", cwd=CWD)
        assert (info.value.code, info.value.message) == (-32602, "argv must not be empty")
        assert client.tracked_process_count == 0
    finally:
        await wait(client.close(), "close")


@pytest_twisted.ensureDeferred
async def test_in_process_rejects_writes_to_unknown_processes() -> None:
    client = await _in_process()
    try:
        with pytest.raises(ServerError) as info:
            await client.write("missing", b"input")
        assert (info.value.code, info.value.message) == (-32600, "unknown process id missing")
    finally:
        await wait(client.close(), "close")


@pytest_twisted.ensureDeferred
async def test_in_process_terminate_marks_process_exited() -> None:
    client = await _in_process()
    try:
        process = await client.start_process(["sleep", "30"], process_id="proc-1", cwd=CWD)
        assert (await client.terminate(process.process_id)).running
        code = await wait(process.exited(), "exit after terminate")
        assert process.has_exited
        assert code == 128 + 15
        assert process.signal == "SIGTERM"
    finally:
        await wait(client.close(), "close")


@pytest_twisted.ensureDeferred
async def test_dropping_in_process_client_terminates_running_processes() -> None:
    dispatcher = make_dispatcher()
    client = await _in_process(dispatcher)
    await client.start_process(["sleep", "30"], process_id="proc-1", cwd=CWD)
    await client.list_processes()
    (connection,) = dispatcher.connections
    managed = session_of(connection).processes["proc-1"]
    pid = managed.pid
    assert pid is not None and pid_alive(pid)
    del client
    gc.collect()
    await wait(managed.when_closed(), "the dropped client's process to be terminated")
    assert not pid_alive(pid)


@pytest_twisted.ensureDeferred
async def test_closing_in_process_client_terminates_processes_and_fails_calls() -> None:
    dispatcher = make_dispatcher()
    client = await _in_process(dispatcher)
    process = await client.start_process(["sleep", "30"], process_id="proc-1", cwd=CWD)
    (connection,) = dispatcher.connections
    pid = session_of(connection).processes["proc-1"].pid
    pending = client.read("proc-1", wait_ms=30_000)
    await wait(client.close(), "close")
    assert pid is not None and not pid_alive(pid)
    with pytest.raises(ConnectionClosed):
        await pending
    # close() terminated it and waited for its exit before disconnecting.
    assert process.has_exited and process.signal == "SIGTERM"
    assert not dispatcher.connections


@pytest_twisted.ensureDeferred
async def test_in_process_pty_write_and_extensions() -> None:
    client = await _in_process()
    try:
        process = await client.start_process(
            ["cat"], process_id="pty", cwd=CWD, tty=True, size=(30, 100)
        )
        assert client.supports(p.PROCESS_RESIZE)
        await process.resize(40, 120)
        seen = bytearray()
        sub = process.subscribe()
        await process.write(b"ping\n")
        while b"ping" not in seen:
            event = await wait(sub.next(), "pty echo")
            assert event is not None and event.stream == "pty"
            seen += event.chunk
        listed = await client.list_processes()
        assert [proc.process_id for proc in listed.processes] == ["pty"]
        await process.close_stdin()
        waited = await wait(process.wait(timeout_ms=5000), "process/wait")
        assert waited.exited and waited.exit_code == 0, waited
    finally:
        await wait(client.close(), "close")


# --- a local server over stdio ------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_spawned_server_handshake_process_and_close_reaps_everything() -> None:
    client = await _spawned()
    server_pid = client.local_server.pid
    assert client.session_id
    assert client.initialize_result is not None
    assert client.initialize_result.server_info is not None
    process = await client.start_process(
        ["sh", "-c", "echo out; echo err >&2; exit 3"], cwd=CWD, env={"PATH": os.defpath}
    )
    chunks: list[tuple[str, bytes]] = []
    process.add_output_listener(lambda e: chunks.append((e.stream, e.chunk)))
    assert await wait(process.exited(), "exit") == 3
    await wait(process.closed(), "closed")
    assert sorted(chunks) == [("stderr", b"err\n"), ("stdout", b"out\n")]
    sleeper = await client.start_process(["sleep", "30"], cwd=CWD)
    listed = await client.list_processes()
    (running,) = [proc for proc in listed.processes if proc.process_id == sleeper.process_id]
    await wait(client.close(), "close")
    assert not pid_alive(server_pid)
    assert running.pid is not None and not pid_alive(running.pid)
    # The server reports the exit of what it terminated before it goes.
    assert sleeper.has_exited and sleeper.exit_code in (None, 143)


@pytest_twisted.ensureDeferred
async def test_spawned_server_is_stopped_when_the_client_is_garbage_collected() -> None:
    client = await _spawned()
    server = client.local_server
    await client.start_process(["sleep", "30"], cwd=CWD)
    # (A coroutine keeps the Deferred it last awaited, here holding the
    # handle, which refers to its client: await something else first.)
    await client.list_processes()
    del client
    gc.collect()
    await wait(server.when_ended(), "the dropped client's server to exit")
    assert server.exit_code == 0


@pytest_twisted.ensureDeferred
async def test_spawn_failure_is_reported_with_the_server_stderr() -> None:
    command = [sys.executable, "-c", "import sys; sys.stderr.write('boom\\n'); sys.exit(3)"]
    with pytest.raises(SpawnFailed) as info:
        await _spawned(command=command)
    assert "exit code 3" in str(info.value)
    assert "boom" in str(info.value)


@pytest_twisted.ensureDeferred
async def test_spawn_of_missing_program_is_a_clear_error() -> None:
    with pytest.raises(SpawnFailed):
        await _spawned(command=["/nonexistent/exec-server"])


@pytest_twisted.ensureDeferred
async def test_spawned_server_that_never_answers_times_out_and_is_killed(
    tmp_path: Any,
) -> None:
    pid_file = tmp_path / "pid"
    # sh records its pid at once (well within the 0.3 s), then becomes the sleep.
    command = ["/bin/sh", "-c", 'echo $$ > "$1"; exec sleep 60', "sh", str(pid_file)]
    started = reactor.seconds()
    with pytest.raises(InitializeTimeout):
        await wait(
            ExecServerClient.spawn_local(
                reactor,
                ConnectOptions("t", initialize_timeout=0.3),
                command=command,
                shutdown_grace=0.2,
            ),
            "initialize timeout",
        )
    assert reactor.seconds() - started < 5
    # spawn_local waits for the kill and the reap before failing.
    assert not pid_alive(int(pid_file.read_text()))


@pytest_twisted.ensureDeferred
async def test_server_exit_fails_pending_calls_promptly() -> None:
    client = await _spawned()
    server = client.local_server
    sleeper = await client.start_process(["sleep", "30"], cwd=CWD)
    (listed,) = (await client.list_processes()).processes
    pending = client.read(sleeper.process_id, after_seq=0, wait_ms=30_000)
    try:
        server.kill()  # a crash: nothing pending can be answered
        with pytest.raises(ConnectionClosed) as info:
            await wait(pending, "pending call to fail")
        assert "exec-server" in str(info.value)
        assert await wait(sleeper.exited(), "handle marked exited") is None
        assert not client.is_connected
        assert client.pending_request_count == 0
        await wait(client.close(), "close")
    finally:
        # The killed server could not stop its child.
        if listed.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(listed.pid, signal.SIGKILL)


@pytest_twisted.ensureDeferred
async def test_in_process_fs_methods(tmp_path: Any) -> None:
    client = await _in_process()
    root = str(tmp_path)
    try:
        await client.fs_create_directory(f"{root}/a/b", recursive=True)
        payload = bytes(range(256)) * 10
        await client.fs_write_file(f"{root}/a/b/data.bin", payload)
        assert (await client.fs_read_file(f"{root}/a/b/data.bin")).data_base64 == payload
        meta = await client.fs_get_metadata(f"{root}/a/b/data.bin")
        assert meta.is_file and not meta.is_directory
        await client.fs_copy(f"{root}/a", f"{root}/copy", recursive=True)
        listing = await client.fs_read_directory(f"{root}/copy/b")
        assert [e.file_name for e in listing.entries] == ["data.bin"]
        await client.fs_remove(f"{root}/a", recursive=True, force=True)
        with pytest.raises(ServerError) as info:
            await client.fs_read_file(f"{root}/a/b/data.bin")
        assert info.value.method == "fs/readFile"
        assert info.value.code in (p.INVALID_REQUEST, p.INTERNAL_ERROR)
    finally:
        await wait(client.close(), "close")
