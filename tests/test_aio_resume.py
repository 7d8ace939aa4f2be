"""The asyncio client rides through dropped connections as ResumingClient does.

The real server, the test-only cutting proxy (tests/support/cutting_proxy.py) on the
reactor, and the aio client in an event loop on a worker thread
(tests/support/aio_harness.py). The child writes a known pseudo-random stream; what
the handle delivers must be exactly that stream, in order, then the exit --
or, with a tiny retention, a GapEvent naming exactly the lost seqs.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted

from execserver import aio
from tests.support.aio_harness import in_asyncio, on_reactor
from tests.support.cutting_proxy import CuttingProxy
from tests.support.harness import REPO_ROOT, child_env, descendants
from tests.support.polling import until_asyncio
from tests.support.streams import (
    CHUNK,
    CHUNKS,
    EXIT_CODE,
    STREAM_SCRIPT,
    chosen_cuts,
    expected_stream,
)
from tests.support.ws_harness import WsServerProcess

CWD = str(REPO_ROOT)


class Recorder:
    """What a process handle delivers, in order."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.gaps: list[aio.GapEvent] = []
        self.seqs: list[int] = []

    def output(self, event: aio.OutputEvent) -> None:
        if isinstance(event, aio.GapEvent):
            self.gaps.append(event)
            return
        self.data += event.chunk
        if event.seq is not None:
            self.seqs.append(event.seq)


async def started(*server_args: str) -> tuple[WsServerProcess, CuttingProxy]:
    server = await WsServerProcess.start(*server_args)
    proxy = await CuttingProxy(server.host_port).start()
    return server, proxy


async def in_asyncio_then_stop(
    scenario: Callable[[], Awaitable[None]], *ends: CuttingProxy | WsServerProcess
) -> None:
    """Run ``scenario`` in the asyncio loop, then stop ``ends`` (in order) whatever happened."""
    try:
        await in_asyncio(scenario)
    finally:
        for end in ends:
            await end.stop()


def connect(proxy: CuttingProxy, **kwargs: Any) -> Any:
    return aio.connect(proxy.url, session_ttl_ms=30_000, connect_timeout=5.0, **kwargs)


async def stream_through_cuts(cuts: list[int], *server_args: str, **kwargs: Any) -> None:
    server, proxy = await started(*server_args)

    async def scenario() -> None:
        async with connect(proxy, **kwargs) as client:
            # The child waits for a line on stdin: the first cut is armed
            # before any of its output is on the way.
            proc = await client.start(
                [sys.executable, "-c", "import sys; sys.stdin.readline()\n" + STREAM_SCRIPT],
                cwd=CWD,
                env=child_env(),
                pipe_stdin=True,
            )
            recorder = Recorder()
            proc.add_output_listener(recorder.output, gaps=True)
            for index, offset in enumerate(cuts):
                before = proxy.cuts
                await on_reactor(proxy.cut_after, offset)
                if index == 0:
                    await proc.write(b"go\n")
                await until_asyncio(
                    lambda before=before: proxy.cuts > before or proc.is_closed,
                    "the cut or the end",
                    timeout=30.0,
                )
            assert await proc.wait(timeout=30) == EXIT_CODE
            await proc.closed(timeout=30)
            assert proxy.cuts >= 1
            assert 1 <= client.resumes <= proxy.cuts
            assert recorder.gaps == []
            assert bytes(recorder.data) == expected_stream(), f"cuts={cuts}"
            assert recorder.seqs == sorted(set(recorder.seqs)), "in order, never twice"
            assert client.lost is None

    await in_asyncio_then_stop(scenario, proxy, server)


@pytest_twisted.ensureDeferred
async def test_every_byte_arrives_once_in_order_through_random_cuts() -> None:
    for cuts in chosen_cuts():
        await stream_through_cuts(
            cuts, "--retained-output-bytes", str(4 * CHUNK * CHUNKS), on_detached_full="drop"
        )


@pytest_twisted.ensureDeferred
async def test_pause_with_a_tiny_retention_loses_nothing() -> None:
    for cuts in chosen_cuts()[:2]:
        await stream_through_cuts(
            cuts, "--retained-output-bytes", str(3 * CHUNK), on_detached_full="pause"
        )


@pytest_twisted.ensureDeferred
async def test_drop_reports_the_exact_gap(tmp_path: Path) -> None:
    server, proxy = await started("--retained-output-bytes", str(4 * (1024 + 96)))
    go, done = tmp_path / "go", tmp_path / "done"
    script = (
        f'printf first; while [ ! -e "{go}" ]; do sleep 0.01; done; '
        "i=0; while [ $i -lt 40 ]; do head -c 1024 /dev/zero | tr '\\0' x; "
        f'sleep 0.005; i=$((i+1)); done; touch "{done}"'
    )

    async def scenario() -> None:
        async with connect(proxy, on_detached_full="drop") as client:
            proc = await client.start(["sh", "-c", script], cwd=CWD)
            events: list[aio.OutputEvent] = []
            stream = proc.output(gaps=True)
            plain = proc.output()
            events.append(await anext(stream))
            assert events[0].chunk == b"first"
            # Nothing reaches the client now; the output piles up in the server.
            await on_reactor(proxy.stall)
            go.touch()
            await until_asyncio(done.exists, "the child to finish writing", timeout=30.0)
            await on_reactor(proxy.cut)
            await on_reactor(proxy.unstall)
            events += [event async for event in stream]
            assert await proc.wait(timeout=10) == 0
            gaps = [e for e in events if isinstance(e, aio.GapEvent)]
            seqs = [e.seq for e in events if not isinstance(e, aio.GapEvent)]
            [gap] = gaps
            assert gap.from_seq == 2 and events[1] is gap
            assert gap.delivered == (("stdout", 5), ("stderr", 0))
            # The default stream raises the gap where it falls, and goes on after it.
            # ("first" reaches it unless it came before it existed: the
            # backlog goes to the first stream only.)
            try:
                head = await anext(plain)
            except aio.OutputGap as exc:
                error = exc
            else:
                assert head.chunk == b"first"
                with pytest.raises(aio.OutputGap) as raised:
                    await anext(plain)
                error = raised.value
            assert (error.from_seq, error.to_seq) == (gap.from_seq, gap.to_seq)
            assert error.delivered == {"stdout": 5, "stderr": 0}
            assert [e.seq async for e in plain] == seqs[1:]
            assert seqs[0] == 1 and seqs[1] == gap.to_seq + 1
            assert seqs[1:] == list(range(gap.to_seq + 1, gap.to_seq + len(seqs)))

    await in_asyncio_then_stop(scenario, proxy, server)


@pytest_twisted.ensureDeferred
async def test_a_session_that_expired_fails_every_handle_naming_the_cause() -> None:
    server, proxy = await started("--max-session-ttl-ms", "200")
    assert server.pid is not None
    server_pid = server.pid

    async def scenario() -> None:
        async with connect(proxy) as client:
            proc = await client.start(["sleep", "30"], cwd=CWD)
            stream = proc.output()
            await on_reactor(proxy.stall)
            await on_reactor(proxy.cut)
            # Longer than the granted TTL: the server ends the session meanwhile.
            await until_asyncio(
                lambda: not descendants(server_pid), "the session to expire", timeout=10.0
            )
            await on_reactor(proxy.unstall)
            assert await proc.wait(timeout=20) is None
            assert isinstance(proc.lost_reason, aio.SessionLost)
            assert "unknown session id" in str(proc.lost_reason)
            with pytest.raises(aio.SessionLost) as info:
                await anext(stream)
            assert info.value is proc.lost_reason
            with pytest.raises(aio.SessionLost) as info:
                await client.list_processes()
            assert info.value is client.lost

    await in_asyncio_then_stop(scenario, proxy, server)


@pytest_twisted.ensureDeferred
async def test_calls_in_flight_at_a_drop_are_retried_or_fail_as_outcome_unknown(
    tmp_path: Path,
) -> None:
    server, proxy = await started()
    copy = tmp_path / "copy"

    async def scenario() -> None:
        async with connect(proxy) as client:
            cat = await client.start(["sh", "-c", f'tee "{copy}"'], cwd=CWD, pipe_stdin=True)
            recorder = Recorder()
            cat.add_output_listener(recorder.output, gaps=True)
            # The server gets these requests, but their answers are lost in the cut.
            await on_reactor(proxy.stall_replies)
            write = asyncio.ensure_future(cat.write(b"once\n"))
            waited = asyncio.ensure_future(client.wait(cat.process_id, timeout_ms=60_000))
            signalled = asyncio.ensure_future(cat.send_signal("SIGCONT"))
            listed = asyncio.ensure_future(client.list_processes())
            await until_asyncio(
                lambda: copy.exists() and copy.read_bytes() == b"once\n", "the write", timeout=10.0
            )
            await on_reactor(proxy.cut)
            await on_reactor(proxy.unstall)
            # Safe to repeat: answered on the resumed session (the write once).
            assert (await write).accepted
            assert [x.process_id for x in (await listed).processes] == [cat.process_id]
            with pytest.raises(aio.OutcomeUnknown) as info:
                await signalled
            assert info.value.method == "process/signal"
            await cat.close_stdin()
            assert (await waited).exited
            await cat.closed(timeout=20)
            assert copy.read_bytes() == b"once\n"
            assert bytes(recorder.data) == b"once\n"
            assert client.resumes == 1 and client.pending_request_count == 0

    await in_asyncio_then_stop(scenario, proxy, server)


@pytest_twisted.ensureDeferred
async def test_a_server_that_is_gone_fails_the_session_after_two_seconds_of_refusals() -> None:
    server = await WsServerProcess.start()

    async def scenario() -> None:
        async with aio.connect(server.url, session_ttl_ms=30_000) as client:
            proc = await client.start(["sleep", "30"], cwd=CWD)
            # The server shuts down (its sessions' processes terminated):
            # every later connection is refused.
            started = asyncio.get_running_loop().time()
            await on_reactor(server.stop)
            await until_asyncio(
                lambda: client.lost is not None, "the client to give up", timeout=20.0
            )
            waited = asyncio.get_running_loop().time() - started
            assert "the server is gone (connection refused" in str(client.lost)
            # Refusals are retried for 2 s (REFUSED_GIVE_UP_SECONDS), not the TTL.
            assert 2.0 <= waited < 20
            assert proc.signal == "SIGTERM"  # its exit arrived before the drop
            with pytest.raises(aio.SessionLost) as info:
                await client.fs_get_metadata("/")
            assert info.value is client.lost

    await in_asyncio_then_stop(scenario, server)


@pytest.mark.parametrize("server_got_it", [True, False])
@pytest_twisted.ensureDeferred
async def test_a_start_in_flight_at_a_drop_is_sent_again_and_its_output_is_whole(
    tmp_path: Path, server_got_it: bool
) -> None:
    """Issue 20's CLI flake, in the asyncio client: ``process/start`` in flight
    when the connection drops (its answer lost, or the request itself). Before
    the fix the start failed with OutcomeUnknown; now it is sent again with the
    same processId on the resumed session ("already exists": the first one
    ran) and the handle delivers the whole stream and the exit code."""
    server, proxy = await started()
    marker = tmp_path / "running"
    child = f"open({str(marker)!r}, 'a').write('ran ')\n" + STREAM_SCRIPT

    async def scenario() -> None:
        async with connect(proxy) as client:
            # Replies only (the server gets the start), or both directions.
            await on_reactor(proxy.stall_replies if server_got_it else proxy.stall)
            starting = asyncio.ensure_future(
                client.start([sys.executable, "-c", child], cwd=CWD, env=child_env())
            )
            if server_got_it:
                await until_asyncio(marker.exists, "the child to run", timeout=10.0)
            else:
                await until_asyncio(
                    lambda: client.pending_request_count == 1, "the start sent", timeout=10.0
                )
            await on_reactor(proxy.cut)
            await on_reactor(proxy.unstall)
            proc = await starting
            recorder = Recorder()
            proc.add_output_listener(recorder.output, gaps=True)
            assert await proc.wait(timeout=30) == EXIT_CODE
            await proc.closed(timeout=30)
            assert bytes(recorder.data) == expected_stream()
            assert recorder.gaps == []
            assert client.resumes == 1
            assert marker.read_text() == "ran "  # started once

    await in_asyncio_then_stop(scenario, proxy, server)


#: The request_timeout of the test below (seconds): the start and the resume fit in it.
START_TIMEOUT = 8.0


@pytest_twisted.ensureDeferred
async def test_a_resent_starts_catch_up_is_not_bounded_by_the_starts_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start answered on the resumed session ("already exists") then catches
    its handle up; that catch-up is the handle's, not the request's: one that
    runs past the start's ``request_timeout`` neither fails the start with
    TimeoutError nor terminates the process that started (the catch-up is
    slowed here by START_TIMEOUT seconds, so it must cross that bound)."""
    from execserver.aio import client as aio_client

    original = aio_client.Client._catch_up

    async def slow_catch_up(self: Any, rpc: Any, handle: Any) -> None:
        await asyncio.sleep(START_TIMEOUT)  # (a slow catch-up, not a synchronisation)
        await original(self, rpc, handle)

    monkeypatch.setattr(aio_client.Client, "_catch_up", slow_catch_up)
    server, proxy = await started()
    marker = tmp_path / "running"
    child = f"open({str(marker)!r}, 'a').write('ran ')\n" + STREAM_SCRIPT

    async def scenario() -> None:
        async with connect(proxy, request_timeout=START_TIMEOUT) as client:
            await on_reactor(proxy.stall_replies)
            starting = asyncio.ensure_future(
                client.start([sys.executable, "-c", child], cwd=CWD, env=child_env())
            )
            await until_asyncio(marker.exists, "the child to run", timeout=START_TIMEOUT)
            await on_reactor(proxy.cut)
            await on_reactor(proxy.unstall)
            proc = await starting
            recorder = Recorder()
            proc.add_output_listener(recorder.output, gaps=True)
            assert await proc.wait(timeout=30) == EXIT_CODE
            await proc.closed(timeout=30)
            assert bytes(recorder.data) == expected_stream()
            assert client.resumes == 1
            assert marker.read_text() == "ran "  # started once

    await in_asyncio_then_stop(scenario, proxy, server)
