"""Integration tests of the real server over stdio: process trees, shutdown paths,
flow control with a stalled client, binary fidelity and hostile input.

Bounds stated here:
- a terminated process tree is gone from /proc within TREE_GONE_BOUND seconds
  (the server's default grace is 2 s; ``sleep`` dies at the SIGTERM);
- while the client reads nothing, the server's peak RSS stays below its idle
  RSS plus ``tests.support.bounds.STALL_RSS_GROWTH`` (the documented figure).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import psutil
import pytest
import pytest_twisted
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from twisted.internet import task
from twisted.internet.defer import Deferred
from twisted.internet.stdio import StandardIO

from execserver.app import build_dispatcher
from execserver.config import ServerConfig
from execserver.transports.stdio import LineProtocol
from tests.support.bounds import STALL_RSS_GROWTH
from tests.support.fakes import FakeSpawner
from tests.support.harness import (
    REPO_ROOT,
    b64,
    child_env,
    descendants,
    peak_rss_bytes,
    pid_alive,
    reactor,
    reset_peak_rss,
    with_timeout,
)
from tests.support.polling import until, until_blocking
from tests.support.raw_server import RawServer
from tests.support.stdio_server import ServerProcess

TREE_GONE_BOUND = 5.0
MiB = 1024 * 1024
GIB = 1 << 30


@asynccontextmanager
async def serving(*args: str) -> AsyncIterator[ServerProcess]:
    server = ServerProcess.start(*args)
    try:
        await server.handshake()
        yield server
    finally:
        await server.stop()


def sleeps_under(pid: int) -> list[int]:
    found = []
    for child in descendants(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except FileNotFoundError:
            continue
        if argv[:2] == [b"sleep", b"300"] and pid_alive(child):
            found.append(child)
    return found


async def start_tree(server: ServerProcess, process_id: str = "tree") -> list[int]:
    """Start ``sh -c 'sleep 300 & sleep 300'``; return the pids of its two sleeps."""
    assert server.pid is not None
    server_pid = server.pid
    known = set(sleeps_under(server_pid))
    await server.start_process(process_id, ["sh", "-c", "sleep 300 & sleep 300"])

    def new_sleeps() -> list[int]:
        return [pid for pid in sleeps_under(server_pid) if pid not in known]

    await until(lambda: len(new_sleeps()) == 2, "both sleeps to start", timeout=10)
    pids = new_sleeps()
    assert len(pids) == 2
    return pids


# --- process trees ----------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_terminate_kills_the_whole_process_tree() -> None:
    async with serving() as server:
        pids = await start_tree(server)
        result = await server.call("process/terminate", {"processId": "tree"})
        assert result == {"running": True}
        took = await until(
            lambda: not any(pid_alive(pid) for pid in pids),
            "the tree to die",
            timeout=TREE_GONE_BOUND,
        )
        assert took < TREE_GONE_BOUND
        await server.wait_notification("process/exited", "tree")


@pytest_twisted.ensureDeferred
async def test_stdin_eof_answers_terminates_every_tree_and_exits_zero() -> None:
    server = ServerProcess.start()
    try:
        await server.handshake()
        pids = await start_tree(server, "t1")
        pids += await start_tree(server, "t2")
        assert len(pids) == 4
        # Requests in flight when input ends are still answered: a long poll
        # (woken by the exit the shutdown causes) and a last line that has no
        # newline.
        server.send(
            {"id": "poll", "method": "process/read", "params": {"processId": "t1", "waitMs": 60000}}
        )
        server.send_raw(b'{"id":"last","method":"process/read","params":{"processId":"t2"}}')
        server.transport.closeStdin()  # type: ignore[union-attr]
        code = await with_timeout(server.exited(), TREE_GONE_BOUND + 5, "server exit")
        assert code == 0
        answers = {m["id"]: m for m in server.messages if m.get("id") in ("poll", "last")}
        assert set(answers) == {"poll", "last"}
        assert answers["poll"]["result"]["exited"] is True
        assert not any(pid_alive(pid) for pid in pids)
        assert server.pid is not None
        assert descendants(server.pid) == []
    finally:
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_sigterm_to_the_server_leaves_no_process_behind() -> None:
    server = ServerProcess.start()
    try:
        await server.handshake()
        pids = await start_tree(server)
        server.kill("TERM")
        code = await with_timeout(server.exited(), TREE_GONE_BOUND + 5, "server exit")
        assert code == 0
        assert not any(pid_alive(pid) for pid in pids)
    finally:
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_sigterm_flushes_exit_notifications_and_pending_answers() -> None:
    """Stopped by SIGTERM, the server ends the session as on stdin EOF: the client
    still learns that its processes exited and gets answers to what it asked."""
    server = ServerProcess.start()
    try:
        await server.handshake()
        await server.start_process("sleeper", ["sleep", "300"])
        server.send(
            {
                "id": "poll",
                "method": "process/read",
                "params": {"processId": "sleeper", "waitMs": 60000},
            }
        )
        # The read is in the server's hands before the signal.
        await server.call("process/terminate", {"processId": "nobody"})
        server.kill("TERM")
        code = await with_timeout(server.exited(), TREE_GONE_BOUND + 5, "server exit")
        assert code == 0
        exited = [
            m
            for m in server.notifications
            if m["method"] == "process/exited" and m["params"]["processId"] == "sleeper"
        ]
        assert len(exited) == 1
        poll = [m for m in server.messages if m.get("id") == "poll"]
        assert len(poll) == 1
        assert poll[0]["result"]["exited"] is True
    finally:
        await server.stop()


# --- flow control -----------------------------------------------------------------------------


class _Envelope(msgspec.Struct):
    method: str | None = None
    id: int | str | None = None
    params: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    result: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    error: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


class _Output(msgspec.Struct, rename="camel"):
    process_id: str
    stream: str
    chunk: bytes
    seq: int


def zeros_digest(size: int) -> str:
    digest = hashlib.sha256()
    block = bytes(MiB)
    for _ in range(size // MiB):
        digest.update(block)
    digest.update(bytes(size % MiB))
    return digest.hexdigest()


def rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


def test_stalled_client_bounds_server_memory_then_gets_every_byte_in_order() -> None:
    server = RawServer()
    try:
        server.handshake()
        idle = rss(server.pid)
        reset_peak_rss(server.pid)
        server.call(
            "process/start",
            {
                "processId": "gib",
                "argv": ["head", "-c", str(GIB), "/dev/zero"],
                "cwd": str(REPO_ROOT),
                "env": child_env(),
                "tty": False,
                "arg0": None,
            },
        )
        # The raw line loop below must see every output notification; `head`
        # cannot exit before its spawn returns, so none was queued by call().
        assert not server._backlog
        # Read nothing for three seconds while the child tries to write 1 GiB.
        stall_peak = idle
        stall_end = time.monotonic() + 3.0
        while time.monotonic() < stall_end:
            stall_peak = max(stall_peak, rss(server.pid))
            time.sleep(0.05)
        head = [
            p
            for p in descendants(server.pid)
            if pid_alive(p) and psutil.Process(p).name() == "head"
        ]
        assert head, "the child must be blocked on its pipe, not finished"
        # VmHWM also catches peaks between the samples above.
        stall_peak = max(stall_peak, peak_rss_bytes(server.pid))
        assert stall_peak <= idle + STALL_RSS_GROWTH, (
            f"RSS grew from {idle / MiB:.1f} MiB to {stall_peak / MiB:.1f} MiB while stalled"
        )

        envelope = msgspec.json.Decoder(_Envelope).decode
        output = msgspec.json.Decoder(_Output).decode
        digest = hashlib.sha256()
        received = 0
        next_seq = 1
        exit_code = None
        drain_peak = 0
        lines = 0
        closed = False
        deadline = time.monotonic() + 120
        while not closed:
            assert time.monotonic() < deadline, "draining 1 GiB took over 120 s"
            line = server.read_line(timeout=30)
            message = envelope(line)
            if message.method == "process/output":
                assert isinstance(message.params, msgspec.Raw)
                note = output(message.params)
                assert note.seq == next_seq, "chunks must arrive in seq order, none missing"
                next_seq += 1
                digest.update(note.chunk)
                received += len(note.chunk)
            elif message.method == "process/exited":
                assert isinstance(message.params, msgspec.Raw)
                exit_code = json.loads(bytes(message.params))["exitCode"]
            elif message.method == "process/closed":
                closed = True
            lines += 1
            if lines % 256 == 0:
                drain_peak = max(drain_peak, rss(server.pid))
        assert exit_code == 0
        assert received == GIB
        assert digest.hexdigest() == zeros_digest(GIB)
        print(
            f"\nflow control: idle RSS {idle / MiB:.1f} MiB, stalled peak "
            f"{stall_peak / MiB:.1f} MiB, draining peak {drain_peak / MiB:.1f} MiB, "
            f"{next_seq - 1} chunks"
        )
    finally:
        assert server.stop() == 0


# --- binary fidelity --------------------------------------------------------------------------

EVERY_BYTE = bytes(range(256))

PIPE_WRITER = (
    "import sys; b = bytes(range(256)); "
    "sys.stdout.buffer.write(b * 4); sys.stdout.flush(); "
    "sys.stderr.buffer.write(b[::-1]); sys.stderr.flush()"
)

PTY_ECHO = """
import os, sys, tty
tty.setraw(0)
os.write(1, b"ready\\n")
data = b""
while len(data) < 256:
    data += os.read(0, 256 - len(data))
os.write(1, b"hex:" + data.hex().encode() + b"\\n")
os.write(1, data)
os.write(1, b"\\ndone\\n")
"""


@pytest_twisted.ensureDeferred
async def test_every_byte_value_survives_pipe_output() -> None:
    async with serving() as server:
        await server.start_process("bytes", [sys.executable, "-c", PIPE_WRITER])
        await server.wait_closed("bytes")
        assert server.output_of("bytes", "stdout") == EVERY_BYTE * 4
        assert server.output_of("bytes", "stderr") == EVERY_BYTE[::-1]


@pytest_twisted.ensureDeferred
async def test_every_byte_value_survives_a_raw_pty_both_ways() -> None:
    async with serving() as server:
        await server.start_process("pty", [sys.executable, "-c", PTY_ECHO], tty=True)
        await server.wait_for(
            lambda _: b"ready\n" in server.output_of("pty"), what="the pty child in raw mode"
        )
        result = await server.call("process/write", {"processId": "pty", "chunk": b64(EVERY_BYTE)})
        assert result == {"accepted": True}
        await server.wait_closed("pty")
        out = server.output_of("pty")
        assert b"hex:" + EVERY_BYTE.hex().encode() + b"\n" in out
        assert out.endswith(b"hex:" + EVERY_BYTE.hex().encode() + b"\n" + EVERY_BYTE + b"\ndone\n")


# --- hostile input ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def garbage_server() -> Iterator[RawServer]:
    server = RawServer("--max-message-bytes", "65536")
    try:
        server.handshake()
        yield server
    finally:
        assert server.stop() == 0


def _is_a_message(line: bytes) -> bool:
    """A line the server may legitimately treat as a message (not garbage)."""
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):
        return False
    return isinstance(value, dict) and bool({"id", "method", "result", "error"} & set(value))


garbage_lines = st.one_of(
    st.binary(min_size=1, max_size=300),
    st.text(min_size=1, max_size=100).map(str.encode),
    st.recursive(
        st.none() | st.booleans() | st.floats(allow_nan=False) | st.integers() | st.text(),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
        max_leaves=8,
    ).map(lambda v: json.dumps(v).encode()),
    st.sampled_from(
        [
            b'{"id":1,"method":"initialize"',
            b'{"method":',
            b'[{"id":1,"method":"x"}]',
            b"\x00",
            b"\xef\xbb\xbf{}",
            b"\x0c",
            b'"\\ud800"',
            # Invalid UTF-8 inside strings and deep nesting used to end the connection.
            b'{"id":1,"method":"\xff"}',
            b'{"method":"\xc3\x28"}',
            b"[" * 50_000,
            b'{"id":2,"method":"initialize","params":' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        ]
    ),
)


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=garbage_lines)
@example(garbage=b"\x0c")
@example(garbage=b"[")
@example(garbage=b'{"id":1,"method":"\xff"}')
@example(garbage=b"[" * 50_000)
def test_garbage_lines_get_exactly_one_error_with_null_id(
    garbage_server: RawServer, garbage: bytes
) -> None:
    line = garbage.replace(b"\n", b"")
    assume(line.rstrip(b"\r").strip(b" \t\r"))
    assume(not _is_a_message(line.rstrip(b"\r")))
    server = garbage_server
    sentinel = f"sentinel-{time.monotonic_ns()}"
    server.send_raw(
        line + b"\n" + json.dumps({"id": sentinel, "method": "no/such"}).encode() + b"\n"
    )
    replies = []
    while True:
        message = server.read_message(timeout=10)
        if message.get("id") == sentinel:
            assert message["error"] == {"code": -32600, "message": "unknown method: no/such"}
            break
        replies.append(message)
    assert len(replies) == 1, replies
    [reply] = replies
    assert reply["id"] is None
    assert reply["error"]["code"] in (-32700, -32600)
    assert server.proc.poll() is None


@pytest_twisted.ensureDeferred
async def test_an_oversized_line_gets_one_error_and_the_connection_stays_usable() -> None:
    async with serving("--max-message-bytes", "1024") as server:
        before = len(server.messages)
        # One line of 3 MiB, written in pieces.
        for _ in range(3):
            server.send_raw(b"x" * MiB)
        server.send_raw(b"\n")
        result = await server.call("process/terminate", {"processId": "nobody"})
        assert result == {"running": False}
        errors = [m for m in server.messages[before:] if "error" in m]
        assert len(errors) == 1
        assert errors[0]["id"] is None
        assert errors[0]["error"]["code"] == -32600
        assert "1024" in errors[0]["error"]["message"]
        # A line of exactly the limit is still accepted.
        line = b'{"id":"fits","method":"process/terminate","params":{"processId":"x"}}'
        padded = line[:-1] + b" " * (1024 - len(line)) + b"}"
        assert len(padded) == 1024
        server.send_raw(padded + b"\n")
        fits = await server.wait_for(lambda m: m.get("id") == "fits", what="the at-limit line")
        assert fits["result"] == {"running": False}


@pytest_twisted.ensureDeferred
async def test_a_two_second_long_poll_does_not_delay_the_next_request() -> None:
    async with serving() as server:
        await server.start_process("quiet", ["sleep", "30"])
        read: Deferred[Any] = Deferred.fromCoroutine(
            server.request("process/read", {"processId": "quiet", "afterSeq": 0, "waitMs": 2000})
        )
        started = time.monotonic()
        assert await server.call("process/read", {"processId": "quiet"})
        assert not read.called
        response = await read
        assert time.monotonic() - started >= 1.0
        assert response["result"]["chunks"] == []
        order = [m.get("id") for m in server.messages if "id" in m]
        assert order.index(response["id"]) == len(order) - 1


def test_a_client_that_stops_reading_for_good_ends_the_session() -> None:
    """The read end of the server's stdout closes (the client went away) while its
    stdin stays open: the server must kill its processes and exit, not linger."""
    server = RawServer()
    try:
        server.handshake()
        server.call(
            "process/start",
            {
                "processId": "tree",
                "argv": ["sh", "-c", "sleep 300 & sleep 300"],
                "cwd": str(REPO_ROOT),
                "env": child_env(),
                "tty": False,
                "arg0": None,
            },
        )
        until_blocking(lambda: len(sleeps_under(server.pid)) >= 2, "the sleeps", timeout=10)
        pids = sleeps_under(server.pid)
        assert server.proc.stdout is not None
        server.proc.stdout.close()
        server.eof = True
        # The next message the server writes fails with EPIPE.
        server.send({"id": 1, "method": "process/terminate", "params": {"processId": "nobody"}})
        assert server.proc.wait(TREE_GONE_BOUND + 5) == 0
        assert not any(pid_alive(pid) for pid in pids)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
        for pid in pids if "pids" in locals() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest_twisted.ensureDeferred
async def test_exit_is_notified_after_every_byte_the_child_wrote() -> None:
    async with serving() as server:
        await server.start_process("burst", ["sh", "-c", "head -c 5000000 /dev/zero; exit 3"])
        exited = await server.wait_notification("process/exited", "burst")
        assert exited["exitCode"] == 3
        assert len(server.output_of("burst")) == 5_000_000
        await server.wait_closed("burst")
        seqs = [
            m["params"]["seq"]
            for m in server.notifications
            if m["method"] == "process/output" and m["params"]["processId"] == "burst"
        ]
        assert seqs == list(range(1, len(seqs) + 1))


def test_sigterm_with_a_stalled_client_still_exits_and_kills_everything() -> None:
    """The flush on SIGTERM gives up on a client that reads nothing."""
    server = RawServer("--terminate-grace-ms", "200")
    pids: list[int] = []
    try:
        server.handshake()
        server.call(
            "process/start",
            {
                "processId": "chatty",
                "argv": ["sh", "-c", "trap '' TERM; exec yes"],
                "cwd": str(REPO_ROOT),
                "env": child_env(),
                "tty": False,
                "arg0": None,
            },
        )

        def started() -> bool:
            pids[:] = [p for p in descendants(server.pid) if pid_alive(p)]
            return bool(pids)

        until_blocking(started, "the child to start", timeout=10)
        # Not reading: the server's output pipe fills and stays full.
        server.proc.send_signal(signal.SIGTERM)
        # 0.2 s grace + 2 s flush slack + the force-close second, with margin.
        assert server.proc.wait(15) == 0
        assert not any(pid_alive(pid) for pid in pids)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# --- the write path ---------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_the_answers_to_one_read_reach_an_idle_pipe_before_the_reactor_turns() -> None:
    # A LineProtocol on real pipes, driven by hand: the answers gathered while
    # one read is handled are written as that read ends, not on a later
    # writable event (the reactor does not run between feeding and reading).
    dispatcher = build_dispatcher(ServerConfig(), task.Clock(), FakeSpawner())
    proto = LineProtocol(dispatcher)
    stdin_r, stdin_w = os.pipe()
    stdout_r, stdout_w = os.pipe()
    os.set_blocking(stdout_r, False)
    StandardIO(proto, stdin=stdin_r, stdout=stdout_w, reactor=reactor)  # type: ignore[call-arg]
    try:
        proto.dataReceived(
            b'{"id":1,"method":"initialize","params":{"clientName":"t"}}\n'
            b'{"id":2,"method":"no/such"}\n'
        )
        try:
            written = os.read(stdout_r, 65536)
        except BlockingIOError:
            written = b""
        answers = [json.loads(line) for line in written.splitlines()]
        assert [answer["id"] for answer in answers] == [1, 2]
        assert answers[1]["error"] == {"code": -32600, "message": "unknown method: no/such"}
    finally:
        # End of input: the connection closes as the server's stdio does.
        os.close(stdin_w)
        await with_timeout(proto.when_closed(), 10, "the line protocol to close")
        for fd in (stdin_r, stdout_r, stdout_w):
            with contextlib.suppress(OSError):
                os.close(fd)
