"""The client libraries make lost output impossible to miss by accident (issue 20).

Through the real server and the cutting proxy: every client's resuming
session asks for ``onDetachedFull: "pause"`` by default, and where a
``"drop"`` session did lose output, the default iteration raises
:class:`OutputGap` with the lost range (then goes on after it) in the
Twisted and the blocking clients (the asyncio one: tests/test_aio_resume.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import threads
from twisted.internet.defer import Deferred

from execserver import aio, sync
from execserver.client import ConnectOptions, OutputEvent, OutputGap, connect_websocket
from tests.support.aio_harness import in_asyncio, on_reactor
from tests.support.cutting_proxy import CuttingProxy
from tests.support.harness import DEFAULT_TIMEOUT, REPO_ROOT, observe, reactor, with_timeout
from tests.support.polling import until, until_asyncio
from tests.support.streams import reconnecting
from tests.support.ws_harness import WsServerProcess

CWD = str(REPO_ROOT)


def gap_script(go: Path, done: Path) -> str:
    """``first``, then (once ``go`` exists) 40 chunks of 1 KiB, then ``done``."""
    return (
        f'printf first; while [ ! -e "{go}" ]; do sleep 0.01; done; '
        "i=0; while [ $i -lt 40 ]; do head -c 1024 /dev/zero | tr '\\0' x; "
        f'sleep 0.005; i=$((i+1)); done; touch "{done}"'
    )


async def lose_output(proxy: CuttingProxy, go: Path, done: Path) -> None:
    """Keep the client away while the child writes far more than the retention."""
    proxy.stall()
    go.touch()
    await until(done.exists, "the child to finish writing", timeout=30.0)
    proxy.cut()
    proxy.unstall()


async def started() -> tuple[WsServerProcess, CuttingProxy]:
    # Four 1 KiB chunks (with their bookkeeping) of retention: most of the 40 are lost.
    server = await WsServerProcess.start("--retained-output-bytes", str(4 * (1024 + 96)))
    return server, await CuttingProxy(server.host_port).start()


@pytest_twisted.ensureDeferred
async def test_every_clients_resuming_session_asks_for_pause_by_default() -> None:
    server = await WsServerProcess.start()
    try:
        twisted_client = await with_timeout(
            connect_websocket(reactor, server.url, ConnectOptions(session_ttl_ms=30_000)),
            DEFAULT_TIMEOUT,
            "connect",
        )
        assert twisted_client.initialize_result.on_detached_full == "pause"
        await twisted_client.close()
        reconnecting_client = reconnecting(server.url, session_ttl_ms=30_000)
        reconnecting_client.start()
        connected = await with_timeout(
            reconnecting_client.when_connected(), DEFAULT_TIMEOUT, "connect"
        )
        assert connected.initialize_result.on_detached_full == "pause"
        await reconnecting_client.stop()

        async def asyncio_client() -> None:
            async with aio.connect(server.url) as client:
                assert client.initialize_result.on_detached_full == "pause"

        await in_asyncio(asyncio_client)

        def blocking_client() -> str:
            with sync.connect(server.url) as client:
                return client.aio.initialize_result.on_detached_full

        assert await threads.deferToThread(blocking_client) == "pause"
    finally:
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_a_twisted_subscription_raises_the_gap_and_goes_on_after_it(
    tmp_path: Path,
) -> None:
    server, proxy = await started()
    client = reconnecting(proxy.url, session_ttl_ms=30_000, on_detached_full="drop")
    client.start()
    go, done = tmp_path / "go", tmp_path / "done"
    try:
        await with_timeout(client.when_connected(), DEFAULT_TIMEOUT, "connection")
        proc = await client.start_process(["sh", "-c", gap_script(go, done)], cwd=CWD)
        sub = proc.subscribe()
        first = await with_timeout(sub.next(), DEFAULT_TIMEOUT, "the first output")
        assert first.chunk == b"first"
        await lose_output(proxy, go, done)
        with pytest.raises(OutputGap) as raised:
            await with_timeout(sub.next(), 30.0, "the gap")
        gap = raised.value
        assert (gap.process_id, gap.from_seq) == (proc.process_id, 2)
        assert gap.delivered == {"stdout": 5, "stderr": 0}
        rest: list[OutputEvent] = []
        while (event := await with_timeout(sub.next(), 30.0, "the rest")) is not None:
            rest.append(event)
        # After the gap: the retained chunks, in order, right after its end.
        assert [e.seq for e in rest] == list(range(gap.to_seq + 1, gap.to_seq + 1 + len(rest)))
        assert rest and all(e.chunk == b"x" * len(e.chunk) for e in rest)
        assert [(g.from_seq, g.to_seq) for g in proc.gaps] == [(2, gap.to_seq)]
        assert await with_timeout(observe(proc.exited()), 30.0, "the exit") == 0
    finally:
        await client.stop()
        await proxy.stop()
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_the_blocking_output_iterator_raises_the_gap_and_goes_on_after_it(
    tmp_path: Path,
) -> None:
    server, proxy = await started()
    go, done = tmp_path / "go", tmp_path / "done"
    state: dict[str, Any] = {}

    def begin() -> bytes:
        client = sync.connect(proxy.url, on_detached_full="drop", connect_timeout=5.0)
        state["client"] = client
        proc = state["proc"] = client.start(["sh", "-c", gap_script(go, done)], cwd=CWD)
        return next(proc.output(timeout=DEFAULT_TIMEOUT)).chunk

    def finish() -> tuple[OutputGap, list[OutputEvent], int | None]:
        proc = state["proc"]
        with pytest.raises(OutputGap) as raised:
            next(proc.output(timeout=30.0))
        rest = list(proc.output(timeout=30.0))
        return raised.value, rest, proc.wait(timeout=30.0)

    try:
        assert await threads.deferToThread(begin) == b"first"
        await lose_output(proxy, go, done)
        gap, rest, code = await threads.deferToThread(finish)
        assert gap.from_seq == 2 and gap.delivered == {"stdout": 5, "stderr": 0}
        assert [e.seq for e in rest] == list(range(gap.to_seq + 1, gap.to_seq + 1 + len(rest)))
        assert code == 0
    finally:
        if "client" in state:
            await threads.deferToThread(state["client"].close)
        await proxy.stop()
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_asyncio_run_raises_the_gap_with_what_arrived(tmp_path: Path) -> None:
    server, proxy = await started()
    go, done = tmp_path / "go", tmp_path / "done"

    async def scenario() -> None:
        async with aio.connect(proxy.url, on_detached_full="drop", connect_timeout=5.0) as c:
            argv = ["sh", "-c", gap_script(go, done)]
            running = asyncio.ensure_future(c.run(argv, cwd=CWD, process_id="gap"))

            # Its start answered (a read after it is answered after it), its
            # first output written: only then is the connection cut.
            async def first_output() -> bool:
                with contextlib.suppress(aio.ServerError):  # not started yet
                    return bool((await c.read("gap", 0, wait_ms=1000)).chunks)
                return False

            await until_asyncio(
                first_output, "its first output", timeout=DEFAULT_TIMEOUT, interval=0.01
            )
            await on_reactor(lambda: Deferred.fromCoroutine(lose_output(proxy, go, done)))
            with pytest.raises(aio.OutputGap) as raised:
                await running
            gap = raised.value
            result = gap.result
            assert isinstance(result, aio.RunResult) and result.exit_code == 0
            # "first" (unless the stall came before it), then the retained tail.
            before = gap.delivered["stdout"]
            assert result.stdout[:before] == b"first"[:before]
            tail = result.stdout[before:]
            assert 0 < len(tail) < 40 * 1024 and tail == b"x" * len(tail)

    try:
        await in_asyncio(scenario)
    finally:
        await proxy.stop()
        await server.stop()
