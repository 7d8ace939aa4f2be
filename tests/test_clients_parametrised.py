"""The same behaviour through the three clients: Twisted, asyncio, blocking.

Each test runs once per client (``kind``), through :mod:`tests.support.client_adapters`,
against the real server over real stdio, WebSocket on 127.0.0.1 and Unix
sockets; resumption through :mod:`tests.support.cutting_proxy`. What only one or two
clients offer (``run``, ``KeyboardInterrupt``, threads) is tested for those.
Every wait is bounded; every process is checked gone (``/proc``).
"""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.threads import deferToThread

from execserver.clientcore.errors import (
    AuthRefused,
    ConnectFailed,
    ServerError,
)
from execserver.clientcore.types import GapEvent, OutputEvent
from tests.support.client_adapters import KINDS, ClientAdapter, Target, connect, python
from tests.support.cutting_proxy import CuttingProxy
from tests.support.harness import (
    DEFAULT_TIMEOUT,
    REPO_ROOT,
    child_env,
    pid_alive,
    refused_port,
    server_env,
)
from tests.support.polling import until, until_blocking
from tests.support.ws_harness import WsServerProcess

TOKEN = "adapter-test-token-0123456789"

kinds = pytest.mark.parametrize("kind", KINDS)
#: ``run`` (and cancelling it) exists in the asyncio and blocking clients.
run_kinds = pytest.mark.parametrize("kind", ["aio", "sync"])


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="exec-server-clients-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@asynccontextmanager
async def served(
    transport: str, *args: str, socket_dir: Path | None = None
) -> AsyncIterator[Target]:
    """A target of ``transport``: stdio (the client spawns it), ws or unix (a server here)."""
    if transport == "stdio":
        yield Target()
        return
    if transport == "unix":
        assert socket_dir is not None
        args = ("--listen", f"unix://{socket_dir / 'exec.sock'}", *args)
    server = await WsServerProcess.start(*args)
    try:
        yield Target(server.url)
    finally:
        await server.stop()


@asynccontextmanager
async def client_of(kind: str, target: Target) -> AsyncIterator[ClientAdapter]:
    client = await connect(kind, target)
    try:
        yield client
    finally:
        await client.close()


def stdout_of(events: list[OutputEvent], stream: str = "stdout") -> bytes:
    return b"".join(e.chunk for e in events if e.stream == stream)


def start_kwargs(**extra: Any) -> dict[str, Any]:
    return {"cwd": str(REPO_ROOT), "env": child_env(), **extra}


async def wait_gone(pid: int, what: str) -> None:
    await until(lambda: not pid_alive(pid), what, timeout=DEFAULT_TIMEOUT)


async def pid_from(path: Path) -> int:
    await until(
        lambda: path.exists() and path.read_text().endswith("\n"),
        "the pid file",
        timeout=DEFAULT_TIMEOUT,
    )
    return int(path.read_text())


def pid_writer(path: Path) -> list[str]:
    """A process that writes its pid to ``path`` and sleeps (long)."""
    return ["sh", "-c", f'echo $$ > "{path}.tmp" && mv "{path}.tmp" "{path}" && exec sleep 1000']


# --- connect, run, output ----------------------------------------------------------------


@kinds
@pytest.mark.parametrize("transport", ["stdio", "ws", "unix"])
@pytest_twisted.ensureDeferred
async def test_connect_start_output_exit(kind: str, transport: str, socket_dir: Path) -> None:
    async with (
        served(transport, socket_dir=socket_dir) as target,
        client_of(kind, target) as client,
    ):
        assert client.session_id
        proc = await client.start(
            ["sh", "-c", "printf out; printf err >&2; exit 3"], **start_kwargs()
        )
        events = await proc.events()
        assert stdout_of(events) == b"out"
        assert stdout_of(events, "stderr") == b"err"
        assert await proc.wait() == 3
        assert client.pending_request_count == 0


@pytest.mark.parametrize(
    ("kind", "transport"),
    [
        *[(kind, "stdio") for kind in KINDS],
        *[(kind, "ws-resumable") for kind in KINDS],
    ],
)
@pytest_twisted.ensureDeferred
async def test_close_ends_every_process_of_the_client(
    kind: str, transport: str, tmp_path: Path
) -> None:
    # A resumable session outlives its connection (30 s here): only the
    # client's close, not the disconnect, can end its processes at once.
    async with served("stdio" if transport == "stdio" else "ws") as served_target:
        target = (
            served_target
            if transport == "stdio"
            else Target(served_target.url, resume=True, session_ttl_ms=30_000)
        )
        client = await connect(kind, target)
        try:
            await client.start(pid_writer(tmp_path / "pid"), **start_kwargs())
            pid = await pid_from(tmp_path / "pid")
        finally:
            await client.close()
        await wait_gone(pid, "the process after close")


#: A child writing SIZE pseudo-random bytes in uneven writes, and a line on stderr.
SIZE = 6 * 1024 * 1024 + 12345
SEED = 1414
BIG_SCRIPT = (
    "import random, sys\n"
    f"r = random.Random({SEED})\n"
    f"data = r.randbytes({SIZE})\n"
    "out = sys.stdout.buffer\n"
    "i = 0\n"
    "while i < len(data):\n"
    "    n = r.randrange(1, 300000)\n"
    "    out.write(data[i:i + n]); out.flush(); i += n\n"
    "sys.stderr.write('done\\n')\n"
)


def big_expected() -> bytes:
    return random.Random(SEED).randbytes(SIZE)


@kinds
@pytest_twisted.ensureDeferred
async def test_multi_mib_output_is_byte_exact_and_ordered(kind: str) -> None:
    async with client_of(kind, Target()) as client:
        proc = await client.start(python(BIG_SCRIPT), **start_kwargs())
        events = await proc.events(timeout=60.0)
        assert stdout_of(events) == big_expected()
        assert stdout_of(events, "stderr") == b"done\n"
        seqs = [e.seq for e in events]
        assert all(s is not None for s in seqs)
        assert seqs == sorted(set(seqs)), "in order, never twice"  # type: ignore[type-var]
        assert not any(isinstance(e, GapEvent) for e in events)
        assert await proc.wait() == 0


@kinds
@pytest_twisted.ensureDeferred
async def test_stdin_writes_then_close(kind: str) -> None:
    async with client_of(kind, Target()) as client:
        proc = await client.start(["cat"], **start_kwargs(pipe_stdin=True))
        await proc.write(b"first\n")
        assert await proc.output_until(b"first\n") == b"first\n"
        await proc.write(bytes(range(256)))
        await proc.close_stdin()
        rest = await proc.events()
        assert stdout_of(rest) == bytes(range(256))
        assert await proc.wait() == 0


@kinds
@pytest_twisted.ensureDeferred
async def test_pty_echo_and_resize(kind: str) -> None:
    script = 'stty size; read line; echo "got:$line"; stty size'
    async with client_of(kind, Target()) as client:
        proc = await client.start(["sh", "-c", script], **start_kwargs(tty=True, size=(24, 80)))
        first = await proc.output_until(b"24 80")
        assert all(e in (b"", b"\r") for e in first.split(b"24 80")[0].split(b"\n"))
        await proc.resize(30, 100)
        await proc.write(b"hello\n")
        rest = b"".join(e.chunk for e in await proc.events())
        assert b"got:hello" in rest
        assert b"30 100" in rest
        assert await proc.wait() == 0


@kinds
@pytest_twisted.ensureDeferred
async def test_signal_and_terminate(kind: str) -> None:
    trap = 'trap "echo got-int; exit 7" INT; echo ready; while :; do sleep 0.05; done'
    async with client_of(kind, Target()) as client:
        proc = await client.start(["sh", "-c", trap], **start_kwargs())
        await proc.output_until(b"ready\n")
        await proc.signal("SIGINT")
        assert b"got-int" in stdout_of(await proc.events())
        assert await proc.wait() == 7

        sleeper = await client.start(["sleep", "1000"], **start_kwargs())
        await sleeper.terminate()
        assert await sleeper.wait() == 128 + signal.SIGTERM
        assert sleeper.exit_signal == "SIGTERM"


@kinds
@pytest_twisted.ensureDeferred
async def test_server_enforced_timeout(kind: str) -> None:
    async with client_of(kind, Target()) as client:
        proc = await client.start(["sleep", "1000"], **start_kwargs(timeout_ms=300))
        code = await proc.wait()
        assert code == 128 + signal.SIGTERM
        assert proc.timed_out is not None


# --- fs --------------------------------------------------------------------------------


@kinds
@pytest_twisted.ensureDeferred
async def test_fs_methods_and_ranged_transfers(kind: str, tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    async with client_of(kind, Target()) as client:
        await client.call("fs_create_directory", str(remote / "a" / "b"), True)
        await client.call("fs_write_file", str(remote / "a" / "f.bin"), b"\x00\xffdata")
        read = await client.call("fs_read_file", str(remote / "a" / "f.bin"))
        assert read.data_base64 == b"\x00\xffdata"
        meta = await client.call("fs_get_metadata", str(remote / "a" / "f.bin"))
        assert meta.is_file and not meta.is_directory
        await client.call("fs_copy", str(remote / "a"), str(remote / "c"), True)
        listed = await client.call("fs_read_directory", str(remote / "c"))
        assert sorted(e.file_name for e in listed.entries) == ["b", "f.bin"]
        await client.call("fs_remove", str(remote / "c"), True, False)
        assert not (remote / "c").exists()

        # Larger than one 8 MiB range: several ranged calls each way.
        local = tmp_path / "local.bin"
        data = random.Random(7).randbytes(17 * 1024 * 1024 + 3)
        local.write_bytes(data)
        sent_progress: list[tuple[int, int | None]] = []
        sent = await client.upload(
            str(remote / "up.bin"), str(local), lambda d, t: sent_progress.append((d, t))
        )
        assert sent == len(data)
        assert (remote / "up.bin").read_bytes() == data
        assert len(sent_progress) >= 3 and sent_progress[-1] == (len(data), len(data))
        got_progress: list[tuple[int, int | None]] = []
        back = tmp_path / "back.bin"
        got = await client.download(
            str(remote / "up.bin"), str(back), lambda d, t: got_progress.append((d, t))
        )
        assert got == len(data)
        assert back.read_bytes() == data
        assert len(got_progress) >= 3 and got_progress[-1][0] == len(data)


# --- errors ----------------------------------------------------------------------------


@kinds
@pytest_twisted.ensureDeferred
async def test_server_errors_are_typed_with_code_message_and_data(kind: str) -> None:
    async with client_of(kind, Target()) as client:
        with pytest.raises(ServerError) as started:
            await client.start(["/nonexistent/cmd"], **start_kwargs())
        assert started.value.code == -32603
        assert started.value.message == (
            "failed to start `/nonexistent/cmd`: No such file or directory (os error 2)"
        )
        assert started.value.kind == "spawnNotFound"
        with pytest.raises(ServerError) as missing:
            await client.call("fs_read_file", "/nonexistent/file")
        assert (missing.value.code, missing.value.kind) == (-32603, "notFound")
        assert missing.value.message == "No such file or directory (os error 2)"
        with pytest.raises(ServerError) as unknown:
            await client.call("signal", "nope", "SIGINT")
        assert (unknown.value.code, unknown.value.message) == (-32600, "unknown process id nope")
        # The connection is still fine.
        listed = await client.call("list_processes")
        assert listed.processes == []
        assert client.pending_request_count == 0


@kinds
@pytest_twisted.ensureDeferred
async def test_refused_connection_is_connect_failed(kind: str) -> None:
    with refused_port() as port, pytest.raises(ConnectFailed) as failed:
        await connect(kind, Target(f"ws://127.0.0.1:{port}"))
    assert not isinstance(failed.value, AuthRefused)
    assert "connection refused" in str(failed.value)


@kinds
@pytest_twisted.ensureDeferred
async def test_wrong_token_is_auth_refused(kind: str, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    tokens.chmod(0o600)
    async with served("ws", "--auth-token-file", str(tokens)) as target:
        with pytest.raises(AuthRefused) as refused:
            await connect(kind, Target(target.url, token="wrong-" + TOKEN))
        assert refused.value.status == 401
        async with client_of(kind, Target(target.url, token=TOKEN)) as client:
            assert (await client.call("list_processes")).processes == []


@kinds
@pytest_twisted.ensureDeferred
async def test_a_call_without_an_answer_times_out_and_is_forgotten(kind: str) -> None:
    server = await WsServerProcess.start()
    proxy = await CuttingProxy(server.host_port).start()
    try:
        # asyncio and blocking: the client's own per-call bound; Twisted: the
        # caller's timeout on the Deferred (addTimeout cancels the call).
        async with client_of(kind, Target(proxy.url, call_timeout=1.0)) as client:
            proxy.stall_replies()
            with pytest.raises(TimeoutError):
                await client.call("list_processes", timeout=1.0 if kind == "twisted" else 5.0)
            assert client.pending_request_count == 0
            proxy.unstall()
            # The late answer is ignored; the connection serves the next call.
            assert (await client.call("list_processes")).processes == []
            assert client.pending_request_count == 0
    finally:
        await proxy.stop()
        await server.stop()


# --- resumption through a connection-cutting proxy ------------------------------------------

CHUNK = 4096
CHUNKS = 48  # per half
STREAM_SEED = 1107
#: Two halves of a known stream, each after a line on stdin, then exit 3.
STREAM_SCRIPT = (
    "import random, sys\n"
    f"r = random.Random({STREAM_SEED})\n"
    "out = sys.stdout.buffer\n"
    "for _ in range(2):\n"
    "    sys.stdin.readline()\n"
    f"    for _ in range({CHUNKS}):\n"
    f"        out.write(r.randbytes({CHUNK})); out.flush()\n"
    "sys.exit(3)\n"
)


def random_stream() -> bytes:
    r = random.Random(STREAM_SEED)
    return b"".join(r.randbytes(CHUNK) for _ in range(2 * CHUNKS))


@kinds
@pytest_twisted.ensureDeferred
async def test_output_survives_cut_connections_exactly_once_in_order(kind: str) -> None:
    server = await WsServerProcess.start("--retained-output-bytes", str(4 * CHUNK * CHUNKS))
    proxy = await CuttingProxy(server.host_port).start()
    try:
        target = Target(proxy.url, resume=True, session_ttl_ms=30_000)
        async with client_of(kind, target) as client:
            proc = await client.start(python(STREAM_SCRIPT), **start_kwargs(pipe_stdin=True))
            events: list[OutputEvent] = []
            # Each half of the output is cut into by the proxy (a base64
            # half is ~260 kB on the wire); the write that releases it is
            # itself sent again if a cut loses its answer.
            for half, offset in enumerate((30_000, 100_000), start=1):
                proxy.cut_after(offset)
                await proc.write(b"go\n")
                while stdout_len(events) < half * CHUNK * CHUNKS:
                    event = await proc.next_event(30.0)
                    assert event is not None, f"the output ended in half {half}"
                    events.append(event)
                assert proxy.cuts == half
            events += await proc.events(30.0)
            assert await proc.wait() == 3
            assert not any(isinstance(e, GapEvent) for e in events)
            assert stdout_of(events) == random_stream()
            seqs = [e.seq for e in events]
            assert seqs == sorted(set(seqs)), "in order, never twice"  # type: ignore[type-var]
            # A "pause" session's acknowledging read (the clients' default
            # since losing output became an error) may still be on its way
            # when the close arrives: answered at once, never left pending.
            await until(
                lambda: client.pending_request_count == 0, "the last acknowledgement", timeout=5.0
            )
    finally:
        await proxy.stop()
        await server.stop()


def stdout_len(events: list[OutputEvent]) -> int:
    return sum(len(e.chunk) for e in events if e.stream == "stdout")


# --- cancellation and timeouts -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["twisted", "aio"])
@pytest_twisted.ensureDeferred
async def test_cancelled_call_leaves_no_pending_request(kind: str, tmp_path: Path) -> None:
    async with client_of(kind, Target()) as client:
        proc = await client.start(pid_writer(tmp_path / "pid"), **start_kwargs())
        pid = await pid_from(tmp_path / "pid")
        waiting = Deferred.fromCoroutine(
            client.call("wait", proc.process_id, 600_000, timeout=60.0)
        )
        await until(lambda: client.pending_request_count == 1, "the wait", timeout=DEFAULT_TIMEOUT)
        waiting.cancel()
        with pytest.raises(CancelledError):
            await waiting
        await until(lambda: client.pending_request_count == 0, "forgotten", timeout=DEFAULT_TIMEOUT)
        # The process is still under control; closing the client ends it.
        assert pid_alive(pid)
    await wait_gone(pid, "the process after close")


@run_kinds
@pytest_twisted.ensureDeferred
async def test_run_collects_output_and_input(kind: str) -> None:
    async with client_of(kind, Target()) as client:
        result = await client.run(
            ["sh", "-c", "cat; echo err >&2; exit 5"], input=b"in\x00put", **start_kwargs()
        )
        assert (result.stdout, result.stderr, result.exit_code) == (b"in\x00put", b"err\n", 5)


@run_kinds
@pytest_twisted.ensureDeferred
async def test_run_timeout_terminates_the_process(kind: str, tmp_path: Path) -> None:
    async with client_of(kind, Target()) as client:
        running = Deferred.fromCoroutine(
            client.run(pid_writer(tmp_path / "pid"), timeout=1.0, bound=30.0, **start_kwargs())
        )
        pid = await pid_from(tmp_path / "pid")
        with pytest.raises(TimeoutError):
            await running
        await wait_gone(pid, "the timed-out process")
        assert client.pending_request_count == 0


@pytest_twisted.ensureDeferred
async def test_cancelled_aio_run_leaves_no_orphan(tmp_path: Path) -> None:
    async with client_of("aio", Target()) as client:
        running = Deferred.fromCoroutine(
            client.run(pid_writer(tmp_path / "pid"), bound=30.0, **start_kwargs())
        )
        pid = await pid_from(tmp_path / "pid")
        running.cancel()
        with pytest.raises(CancelledError):
            await running
        await wait_gone(pid, "the cancelled run's process")
        await until(
            lambda: client.pending_request_count == 0, "no pending", timeout=DEFAULT_TIMEOUT
        )
        listed = await client.call("list_processes")
        assert all(not p.running for p in listed.processes)


# --- the blocking client only ----------------------------------------------------------------

INTERRUPTED_SCRIPT = """
import sys
from execserver import sync

with sync.connect(server_command=sys.argv[2:]) as client:
    try:
        client.run(["sh", "-c", 'echo $$ > "%s.tmp" && mv "%s.tmp" "%s" && exec sleep 1000'
                    % ((sys.argv[1],) * 3)])
    except KeyboardInterrupt:
        running = [p for p in client.list_processes().processes if p.running]
        print("interrupted", len(running), client.aio.pending_request_count, flush=True)
"""


def test_sync_keyboard_interrupt_cancels_run_and_leaves_no_orphan(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    from tests.support.client_adapters import stdio_command

    script = subprocess.Popen(
        [sys.executable, "-c", INTERRUPTED_SCRIPT, str(pid_file), *stdio_command()],
        env=server_env(),
        cwd=tempfile.gettempdir(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:

        def started() -> bool:
            assert script.poll() is None, script.communicate()
            return pid_file.exists() and pid_file.read_text().endswith("\n")

        until_blocking(started, "the remote process to start", timeout=DEFAULT_TIMEOUT)
        pid = int(pid_file.read_text())
        script.send_signal(signal.SIGINT)
        out, err = script.communicate(timeout=30)
        assert script.returncode == 0, err.decode()
        assert out == b"interrupted 0 0\n", err.decode()
        assert not pid_alive(pid)
    finally:
        if script.poll() is None:
            script.kill()
            script.wait(10)


def test_sync_threads_share_one_client_and_the_loop_thread_stops() -> None:
    from execserver import sync
    from execserver.sync._loop import LOOP
    from tests.support.client_adapters import stdio_command

    errors: list[BaseException] = []
    with sync.connect(server_command=stdio_command(), call_timeout=30.0) as client:
        results: dict[int, list[bytes]] = {}

        def work(n: int) -> None:
            try:
                for i in range(5):
                    result = client.run(["sh", "-c", f"echo {n}-{i}; sleep 0.0{i}"], timeout=30)
                    results.setdefault(n, []).append(result.stdout)
                proc = client.start(["cat"], pipe_stdin=True)
                proc.write(f"stream-{n}".encode())
                proc.close_stdin()
                streamed = b"".join(e.chunk for e in proc.output(timeout=30))
                results[n].append(streamed)
                assert proc.wait(30) == 0
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        for n in range(8):
            assert results[n] == [f"{n}-{i}\n".encode() for i in range(5)] + [
                f"stream-{n}".encode()
            ]
        loop_thread = LOOP.thread
        assert loop_thread is not None and loop_thread.is_alive()
    assert LOOP.thread is None and not loop_thread.is_alive()


def test_sync_timeouts_bound_every_wait() -> None:
    from execserver import sync
    from tests.support.client_adapters import stdio_command

    with sync.connect(server_command=stdio_command(), call_timeout=10.0) as client:
        proc = client.start(["sleep", "1000"])
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            proc.wait(0.2)
        with pytest.raises(TimeoutError):
            list(proc.output(timeout=0.2))
        assert time.monotonic() - started < 10
        # The handle is unharmed by the abandoned waits.
        proc.terminate()
        assert proc.wait(10) == 128 + signal.SIGTERM
        assert client.aio.pending_request_count == 0


def test_sync_refuses_a_call_from_its_loop_thread() -> None:
    from execserver import sync
    from tests.support.client_adapters import stdio_command

    with sync.connect(server_command=stdio_command()) as client:
        seen: list[BaseException] = []

        def inside() -> None:
            try:
                client.list_processes()
            except RuntimeError as exc:
                seen.append(exc)

        done = threading.Event()

        def on_loop() -> None:
            inside()
            done.set()

        client.loop.call_soon_threadsafe(on_loop)
        assert done.wait(10)
        assert "own event-loop thread" in str(seen[0])


def test_sync_and_aio_import_no_twisted() -> None:
    code = (
        "import sys, execserver.sync, execserver.aio\n"
        "bad = [m for m in sys.modules if m == 'twisted' or m.startswith('twisted.')]\n"
        "assert not bad, bad\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=server_env(),
        capture_output=True,
        timeout=60,
        check=False,
        cwd=str(REPO_ROOT),
    )
    assert done.returncode == 0, done.stderr.decode()


UNCLOSED_SCRIPT = """
import os, sys, time
from execserver import sync

client = sync.connect(sys.argv[2])
client.start(["sh", "-c", 'echo $$ > "%s.tmp" && mv "%s.tmp" "%s" && exec sleep 1000'
              % ((sys.argv[1],) * 3)])
deadline = time.monotonic() + 10
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.02)
print("started", flush=True)
"""


@pytest_twisted.ensureDeferred
async def test_sync_client_left_open_at_exit_is_closed_and_its_process_ended(
    tmp_path: Path,
) -> None:
    # Over WebSocket the session outlives a dropped connection (60 s by
    # default): only the exit-time close ends the process at once.
    pid_file = tmp_path / "pid"
    async with served("ws") as target:
        assert target.url is not None
        done = await deferToThread(
            subprocess.run,
            [sys.executable, "-c", UNCLOSED_SCRIPT, str(pid_file), target.url],
            env=server_env(),
            cwd=tempfile.gettempdir(),
            capture_output=True,
            timeout=60,
            check=False,
        )
        assert (done.returncode, done.stdout) == (0, b"started\n"), done.stderr.decode()
        await wait_gone(int(pid_file.read_text()), "the process of the unclosed client")


def test_sync_transfer_progress_runs_in_the_calling_thread(tmp_path: Path) -> None:
    from execserver import sync
    from tests.support.client_adapters import stdio_command

    data = random.Random(3).randbytes(9 * 1024 * 1024)
    (tmp_path / "in.bin").write_bytes(data)
    calls: list[tuple[int, int | None, threading.Thread]] = []

    def progress(done: int, total: int | None) -> None:
        calls.append((done, total, threading.current_thread()))

    with sync.connect(server_command=stdio_command(), env=server_env()) as client:
        sent = client.upload(
            str(tmp_path / "remote.bin"), str(tmp_path / "in.bin"), progress=progress
        )
        got = client.download(str(tmp_path / "remote.bin"), str(tmp_path / "out.bin"))
    assert sent == got == len(data)
    assert (tmp_path / "out.bin").read_bytes() == data
    assert [(d, t) for d, t, _ in calls] == [(8 * 1024 * 1024, len(data)), (len(data), len(data))]
    assert {thread for _, _, thread in calls} == {threading.current_thread()}


def test_sync_call_caught_by_a_stopping_loop_fails_instead_of_hanging() -> None:
    # A call handed to the loop just as the last client closed it: its
    # coroutine starts after the loop's tasks were cancelled.
    import asyncio

    from execserver.clientcore.errors import ConnectionClosed
    from execserver.sync._loop import Call, _drain

    loop = asyncio.new_event_loop()

    async def forever() -> None:
        await asyncio.Event().wait()

    call: Call[None] = Call(loop, forever, "forever")
    call.start()
    _drain(loop)
    with pytest.raises(ConnectionClosed, match="event loop has stopped"):
        call.wait(DEFAULT_TIMEOUT)


def test_sync_output_continues_after_a_timeout_without_losing_events() -> None:
    from execserver import sync
    from tests.support.client_adapters import stdio_command

    with sync.connect(server_command=stdio_command(), env=server_env()) as client:
        proc = client.start(["sh", "-c", "echo a; read x; echo b"], pipe_stdin=True)
        first = proc.output(timeout=DEFAULT_TIMEOUT)
        assert next(first).chunk == b"a\n"
        with pytest.raises(TimeoutError):
            next(proc.output(timeout=0.2))  # the child waits for its line
        proc.write(b"go\n")
        rest = b"".join(e.chunk for e in proc.output(timeout=DEFAULT_TIMEOUT))
        assert rest == b"b\n"
        assert list(first) == []  # the same stream, at its end
        assert proc.wait(DEFAULT_TIMEOUT) == 0


def test_sync_long_polls_are_bounded_by_their_own_wait_not_the_call_timeout() -> None:
    from execserver import sync
    from tests.support.client_adapters import stdio_command

    with sync.connect(server_command=stdio_command(), env=server_env(), call_timeout=1.0) as c:
        proc = c.start(["sh", "-c", "sleep 2; echo late"])
        read = c.read(proc.process_id, after_seq=0, wait_ms=8000)
        assert b"".join(chunk.chunk for chunk in read.chunks) == b"late\n"
        waited = c.wait(proc.process_id, timeout_ms=8000)
        assert (waited.exited, waited.exit_code) == (True, 0)
