"""The client library and the CLI ride through dropped connections (issue 11).

Everything runs through the real server and a test-only TCP proxy
(:mod:`tests.support.cutting_proxy`) that aborts the live connection at points in
the server-to-client byte stream chosen by hypothesis. The child writes a
known pseudo-random stream; what the process handle delivers must be that
stream exactly, in order, then the exit, then the close -- or, with
``"drop"`` and a tiny retention, a :class:`GapEvent` naming exactly the
seqs that never arrived.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest_twisted
from twisted.python.failure import Failure

from execserver.client import (
    GapEvent,
    OutcomeUnknown,
    OutputEvent,
    SessionLost,
)
from execserver.client.reconnect import ReconnectingClient
from tests.support.children import Collected
from tests.support.cutting_proxy import CuttingProxy
from tests.support.harness import (
    DEFAULT_TIMEOUT,
    REPO_ROOT,
    child_env,
    console_script,
    observe,
    reactor,
    with_timeout,
)
from tests.support.polling import until
from tests.support.streams import (
    CHUNK,
    CHUNKS,
    EXIT_CODE,
    STREAM_SCRIPT,
    chosen_cuts,
    expected_stream,
    reconnecting,
)
from tests.support.ws_harness import WsServerProcess


class Recorder:
    """What a process handle delivers, in order."""

    def __init__(self) -> None:
        self.events: list[object] = []
        self.data = bytearray()
        self.gaps: list[GapEvent] = []
        self.seqs: list[int] = []

    def output(self, event: OutputEvent) -> None:
        if isinstance(event, GapEvent):
            self.gaps.append(event)
            self.events.append(event)
            return
        self.events.append("output")
        self.data += event.chunk
        if event.seq is not None:
            self.seqs.append(event.seq)


async def stream_through_cuts(
    cuts: list[int], server_args: tuple[str, ...], **client_kwargs: Any
) -> tuple[Recorder, Any, ReconnectingClient]:
    server = await WsServerProcess.start(*server_args)
    proxy = await CuttingProxy((server.host_port[0], server.host_port[1])).start()
    client = reconnecting(proxy.url, session_ttl_ms=30_000, **client_kwargs)
    client.start()
    recorder = Recorder()
    try:
        await with_timeout(client.when_connected(), DEFAULT_TIMEOUT, "the first connection")
        proc = await client.start_process(
            [sys.executable, "-c", STREAM_SCRIPT], cwd=str(REPO_ROOT), env=child_env()
        )
        proc.add_output_listener(recorder.output, gaps=True)
        proc.exited().addCallback(lambda code: recorder.events.append(("exit", code)))
        closed = proc.closed()
        closed.addCallback(lambda _: recorder.events.append("closed"))
        for offset in cuts:
            before = proxy.cuts
            proxy.cut_after(offset)
            await until(
                lambda before=before: proxy.cuts > before or closed.called,
                "the cut or the end",
                timeout=30.0,
            )
        await with_timeout(observe(closed), 60.0, "the process to close")
        # Cuts were made and ridden through (one may hit a reconnection's
        # own handshake, which is then simply retried).
        assert proxy.cuts >= 1
        assert 1 < client.connect_count <= 1 + proxy.cuts
        print(f"cuts {cuts}: {proxy.cuts} made, {proxy.s2c_bytes} bytes forwarded")
        return recorder, proc, client
    finally:
        await client.stop()
        await proxy.stop()
        await server.stop()


def check_complete(recorder: Recorder, proc: Any) -> None:
    assert recorder.gaps == []
    assert bytes(recorder.data) == expected_stream()
    assert recorder.seqs == sorted(set(recorder.seqs)), "in order, never twice"
    assert recorder.events[-2:] == [("exit", EXIT_CODE), "closed"]
    assert proc.exit_code == EXIT_CODE


@pytest_twisted.ensureDeferred
async def test_every_byte_arrives_once_in_order_through_random_cuts() -> None:
    for cuts in chosen_cuts():
        # Retention well above the stream: "drop" never has to drop.
        recorder, proc, client = await stream_through_cuts(
            cuts, ("--retained-output-bytes", str(4 * CHUNK * CHUNKS)), on_detached_full="drop"
        )
        try:
            check_complete(recorder, proc)
            assert client.lost_sessions == []
        except AssertionError as exc:
            raise AssertionError(f"cuts={cuts}: {exc}") from exc


@pytest_twisted.ensureDeferred
async def test_pause_with_a_tiny_retention_loses_nothing() -> None:
    for cuts in chosen_cuts():
        # Three chunks of retention for a 96-chunk stream: the child is
        # paused instead of its output being dropped.
        recorder, proc, _ = await stream_through_cuts(
            cuts, ("--retained-output-bytes", str(3 * CHUNK)), on_detached_full="pause"
        )
        try:
            check_complete(recorder, proc)
        except AssertionError as exc:
            raise AssertionError(f"cuts={cuts}: {exc}") from exc


@pytest_twisted.ensureDeferred
async def test_drop_reports_the_exact_gap(tmp_path: Path) -> None:
    server = await WsServerProcess.start("--retained-output-bytes", str(4 * (1024 + 96)))
    proxy = await CuttingProxy((server.host_port[0], server.host_port[1])).start()
    client = reconnecting(proxy.url, session_ttl_ms=30_000, on_detached_full="drop")
    client.start()
    go, done = tmp_path / "go", tmp_path / "done"
    # One 1 KiB chunk per write, 40 of them once `go` exists; `done` at the end.
    script = (
        f'printf first; while [ ! -e "{go}" ]; do sleep 0.01; done; '
        "i=0; while [ $i -lt 40 ]; do head -c 1024 /dev/zero | tr '\\0' x; "
        f'sleep 0.005; i=$((i+1)); done; touch "{done}"'
    )
    recorder = Recorder()
    try:
        await with_timeout(client.when_connected(), DEFAULT_TIMEOUT, "connection")
        proc = await client.start_process(["sh", "-c", script], cwd=str(REPO_ROOT))
        proc.add_output_listener(recorder.output, gaps=True)
        proc.exited().addCallback(lambda code: recorder.events.append(("exit", code)))
        proc.closed().addCallback(lambda _: recorder.events.append("closed"))
        await until(lambda: recorder.data == b"first", "the first output", timeout=10.0)
        # Nothing reaches the client now; the output piles up in the server.
        proxy.stall()
        go.touch()
        await until(done.exists, "the child to finish writing", timeout=30.0)
        proxy.cut()
        proxy.unstall()
        await with_timeout(observe(proc.closed()), 30.0, "the process to close")
        [gap] = recorder.gaps
        delivered = recorder.seqs
        # Output 1 ("first") arrived live; the first retained chunk follows the gap.
        assert gap.from_seq == 2
        assert delivered[0] == 1 and delivered[1] == gap.to_seq + 1
        assert delivered[1:] == list(range(gap.to_seq + 1, delivered[-1] + 1))
        assert recorder.events[-2:] == [("exit", 0), "closed"]
    finally:
        await client.stop()
        await proxy.stop()
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_a_session_that_expired_fails_every_handle_naming_the_cause() -> None:
    server = await WsServerProcess.start("--max-session-ttl-ms", "200")
    proxy = await CuttingProxy((server.host_port[0], server.host_port[1])).start()
    # The resume attempt stalled in the proxy outlives the wait for the
    # expiry below: the server's answer, not the client's own 0.2 s TTL
    # (which a failed attempt would find passed), ends the session.
    client = reconnecting(proxy.url, session_ttl_ms=30_000, connect_timeout=30.0)
    client.start()
    try:
        await with_timeout(client.when_connected(), DEFAULT_TIMEOUT, "connection")
        proc = await client.start_process(["sleep", "30"], cwd=str(REPO_ROOT))
        lost: list[Failure] = []
        sub = proc.subscribe()
        sub.next().addErrback(lost.append)
        proxy.stall()
        proxy.cut()
        # Longer than the granted TTL: the server ends the session meanwhile.
        await until(lambda: not server_children(server), "the session to expire", timeout=10.0)
        proxy.unstall()
        assert await with_timeout(observe(proc.exited()), 20.0, "the handle to fail") is None
        assert isinstance(proc.lost_reason, SessionLost)
        assert "unknown session id" in str(proc.lost_reason)
        assert lost and isinstance(lost[0].value, SessionLost)
        # The client carries on with a new session.
        await with_timeout(client.when_connected(), DEFAULT_TIMEOUT, "a new session")
        assert (await client.list_processes()).processes == []
    finally:
        await client.stop()
        await proxy.stop()
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_calls_in_flight_at_a_drop_are_retried_or_fail_as_outcome_unknown(
    tmp_path: Path,
) -> None:
    server = await WsServerProcess.start()
    proxy = await CuttingProxy((server.host_port[0], server.host_port[1])).start()
    client = reconnecting(proxy.url, session_ttl_ms=30_000)
    client.start()
    try:
        await with_timeout(client.when_connected(), DEFAULT_TIMEOUT, "connection")
        copy = tmp_path / "copy"
        cat = await client.start_process(
            ["sh", "-c", f'tee "{copy}"'], cwd=str(REPO_ROOT), pipe_stdin=True
        )
        recorder = Recorder()
        cat.add_output_listener(recorder.output, gaps=True)
        # The server gets these requests, but their answers are lost in the cut.
        proxy.stall_replies()
        write = client.write(cat.process_id, b"once\n")
        waited = client.wait(cat.process_id, timeout_ms=60_000)
        signalled = client.signal(cat.process_id, "SIGCONT")
        listed = client.list_processes()
        # The write reached the child (its copy shows it); its answer did not.
        await until(
            lambda: copy.exists() and copy.read_bytes() == b"once\n", "the write", timeout=10.0
        )
        proxy.cut()
        proxy.unstall()
        # Safe to repeat: answered on the resumed session (the write once).
        assert (await with_timeout(write, 20.0, "the retried write")).accepted
        assert [p.process_id for p in (await with_timeout(listed, 20.0, "list")).processes] == [
            cat.process_id
        ]
        # Not safe to repeat: the outcome is unknown, and said so.
        try:
            await with_timeout(signalled, 20.0, "the signal")
        except OutcomeUnknown as exc:
            assert exc.method == "process/signal"
        else:
            raise AssertionError("process/signal in flight at the drop must fail")
        await cat.close_stdin()
        assert (await with_timeout(waited, 20.0, "the retried wait")).exited
        await with_timeout(observe(cat.closed()), 20.0, "cat to close")
        # Sent twice, written once (writeId).
        assert copy.read_bytes() == b"once\n"
        assert bytes(recorder.data) == b"once\n"
    finally:
        await client.stop()
        await proxy.stop()
        await server.stop()


def server_children(server: WsServerProcess) -> list[int]:
    from tests.support.harness import descendants

    assert server.pid is not None
    return descendants(server.pid)


# --- the CLI --------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_cli_run_over_websocket_survives_cuts_byte_exact() -> None:
    server = await WsServerProcess.start("--retained-output-bytes", str(4 * CHUNK * CHUNKS))
    proxy = await CuttingProxy((server.host_port[0], server.host_port[1])).start()
    proto = Collected()
    argv = [console_script("exec-server-client"), "run", "--url", proxy.url, "--"]
    argv += [sys.executable, "-c", STREAM_SCRIPT]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    reactor.spawnProcess(proto, argv[0], argv, env=env, path="/")
    try:
        for offset in (20_000, 150_000, 260_000):
            before = proxy.cuts
            proxy.cut_after(offset)
            await until(
                lambda before=before: proxy.cuts > before or proto.ended.called,
                "the cut or the end",
                timeout=30.0,
            )
        code = await with_timeout(observe(proto.ended), 60.0, "the CLI to finish")
        assert bytes(proto.out) == expected_stream(), bytes(proto.err)
        assert code == EXIT_CODE, bytes(proto.err)
    finally:
        # Shown with a failure (a timeout included): where the cuts fell and
        # what the CLI said.
        print(f"cuts {proxy.cuts}, {proxy.s2c_bytes} bytes forwarded, {proxy.accepted} accepted")
        print(f"CLI: ended {proto.ended.called}, stdout {len(proto.out)} bytes, stderr:")
        print(bytes(proto.err)[-4000:].decode(errors="replace"))
        if not proto.ended.called:
            proto.transport.signalProcess("KILL")  # type: ignore[union-attr]
        await proxy.stop()
        await server.stop()
