"""Closing a client ends its processes, however their start or run ended.

Against the real server: a resumable WebSocket session (which would keep
its processes for its TTL after a plain disconnect) or a local server over
stdio. Processes are looked up in the server's process tree (psutil) or by
pid (``/proc``); every wait is bounded.

- asyncio: ``close()`` (and ``async with``) right after a ``start``/``run``
  cancelled while ``process/start`` was in flight waits for the termination
  of that process instead of cancelling it;
- blocking: a ``start`` that timed out returns only once the process the
  server started anyway has ended (as ``run`` does);
- asyncio: long polls (``wait``/``read``) are bounded by the server-side wait
  plus ``request_timeout``, not by ``request_timeout`` alone;
- Twisted: ``close()``, ``ReconnectingClient.stop()`` and
  ``ResumingClient.close()`` terminate every process but detached ones.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import psutil
import pytest
import pytest_twisted
from twisted.internet.defer import Deferred

from execserver import aio
from execserver.client import ConnectOptions, ExecServerClient
from execserver.client.reconnect import ReconnectingClient, ResumingClient
from tests.support.aio_harness import Stderr, in_asyncio
from tests.support.client_adapters import stdio_command
from tests.support.harness import (
    DEFAULT_TIMEOUT,
    REPO_ROOT,
    pid_alive,
    reactor,
    server_env,
    with_timeout,
)
from tests.support.polling import until, until_blocking
from tests.support.ws_harness import WsServerProcess

CWD = str(REPO_ROOT)
#: Longer than any test; the session outlives its connection this long.
TTL_MS = 60_000


@asynccontextmanager
async def ws_server() -> AsyncIterator[WsServerProcess]:
    server = await WsServerProcess.start()
    try:
        yield server
    finally:
        await server.stop()


def stubborn(seconds: int) -> list[str]:
    """A process ignoring SIGTERM: the server kills it only after its
    terminate grace (2 s), so a termination not waited for is seen."""
    return ["sh", "-c", f"trap '' TERM; exec sleep {seconds}"]


def running_children(server_pid: int, argv: list[str]) -> list[psutil.Process]:
    """The live (not zombie) processes of the server's tree running ``argv``
    (or what it execs: ``sleep N``)."""
    found = []
    names = [argv, ["sleep", argv[-1].rsplit(" ", 1)[-1]]]
    for child in psutil.Process(server_pid).children(recursive=True):
        try:
            if child.cmdline() in names and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


async def until_sent(client: aio.Client) -> None:
    """Until the call just scheduled has sent its request (its first step:
    not an event later, or its answer may already be in)."""
    while client.pending_request_count == 0:
        await asyncio.sleep(0)


def until_running(server_pid: int, argv: list[str]) -> None:
    """Blocks the event loop (on purpose: the start's answer stays unread)
    until the server runs ``argv`` past its trap."""
    # cmdline() is empty for a process caught between fork and exec, or
    # already a zombie: not yet (or no longer) the sleep.
    until_blocking(
        lambda: any(c.cmdline()[:1] == ["sleep"] for c in running_children(server_pid, argv)),
        f"{argv} to start",
        timeout=DEFAULT_TIMEOUT,
        interval=0.01,
    )


# --- asyncio: close after a cancelled start / run -----------------------------------------


@pytest.mark.parametrize("how", ["start-then-close", "run-then-async-with-exit"])
@pytest_twisted.ensureDeferred
async def test_aio_close_right_after_a_cancelled_start_ends_its_process(how: str) -> None:
    argv = stubborn(987)
    async with ws_server() as server:
        server_pid = server.pid
        assert server_pid is not None

        async def scenario() -> None:
            client = await aio.connect(server.url, session_ttl_ms=TTL_MS)
            async with client:
                call: asyncio.Future[Any]
                if how == "start-then-close":
                    call = asyncio.ensure_future(client.start(argv, cwd=CWD))
                else:
                    call = asyncio.ensure_future(client.run(argv, cwd=CWD))
                # Cancelled with the process running, its start's answer unread.
                await until_sent(client)
                until_running(server_pid, argv)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
                if how == "start-then-close":
                    await client.close()
            # Any process/start sent is carried out before the close (one
            # connection, in order): the process existed; it must be gone.

        try:
            await in_asyncio(scenario)
            assert running_children(server_pid, argv) == []
        finally:
            for child in running_children(server_pid, argv):
                child.kill()


# --- blocking: a start that timed out -------------------------------------------------------

STUBBORN = stubborn(986)


def test_sync_start_that_timed_out_returns_once_its_process_ended() -> None:
    from execserver import sync

    with sync.connect(server_command=stdio_command(), env=server_env(), call_timeout=1.0) as c:
        assert c.aio.server_pid is not None
        server = psutil.Process(c.aio.server_pid)
        outcome: list[BaseException | None] = []

        def start() -> None:
            try:
                c.start(STUBBORN, cwd=CWD)
            except BaseException as exc:
                outcome.append(exc)
            else:
                outcome.append(None)

        # A stopped server answers nothing: the start times out for sure,
        # with its request sent (the server carries it out once continued).
        server.suspend()
        thread = threading.Thread(target=start)
        try:
            thread.start()
            until_blocking(
                lambda: not thread.is_alive() or c.aio.terminating_count > 0,
                "the start to time out",
                timeout=DEFAULT_TIMEOUT,
                interval=0.01,
            )
        finally:
            server.resume()
        thread.join(DEFAULT_TIMEOUT + 5)
        assert not thread.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], TimeoutError), outcome
        # Right as the start raised: nothing it started runs any more.
        assert [x.process_id for x in c.list_processes().processes if x.running] == []
        assert c.aio.terminating_count == 0


# --- asyncio: long polls -----------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_aio_long_polls_are_bounded_by_their_own_wait_not_the_request_timeout() -> None:
    stderr = Stderr()

    async def scenario() -> None:
        async with aio.connect(
            server_command=stdio_command(), env=server_env(), stderr=stderr, request_timeout=1.0
        ) as client:
            proc = await client.start(["sh", "-c", "sleep 2; echo late"], cwd=CWD)
            read = await proc.read(after_seq=0, wait_ms=8000)
            assert b"".join(chunk.chunk for chunk in read.chunks) == b"late\n"
            waited = await client.wait(proc.process_id, timeout_ms=8000)
            assert (waited.exited, waited.exit_code) == (True, 0)

    await in_asyncio(scenario)
    stderr.check()


# --- Twisted: close ends the processes of a resumable session -------------------------------


async def twisted_connect(how: str, url: str) -> tuple[Any, Any]:
    """(the object to start processes on, a function closing it) for ``how``."""
    options = ConnectOptions("close-test", session_ttl_ms=TTL_MS)
    if how == "reconnecting":
        recon = ReconnectingClient(
            reactor, url, ConnectOptions("close-test"), session_ttl_ms=TTL_MS
        )
        recon.start()
        await with_timeout(recon.when_connected(), DEFAULT_TIMEOUT, "first connection")
        return recon, recon.stop
    client = await with_timeout(
        ExecServerClient.connect_websocket(reactor, url, options), DEFAULT_TIMEOUT, "connect"
    )
    if how == "plain":
        return client, client.close

    def dial(session_id: str) -> Deferred[ExecServerClient]:
        again = ConnectOptions("close-test", session_ttl_ms=TTL_MS, resume_session_id=session_id)
        return ExecServerClient.connect_websocket(reactor, url, again)

    resuming = ResumingClient(reactor, client, dial)
    return resuming, resuming.close


@pytest.mark.parametrize("how", ["plain", "reconnecting", "resuming"])
@pytest_twisted.ensureDeferred
async def test_twisted_close_terminates_all_but_detached_processes(how: str) -> None:
    async with ws_server() as server:
        api, close = await twisted_connect(how, server.url)
        kept_pid = 0
        try:
            ended = await with_timeout(
                api.start_process(["sleep", "985"], cwd=CWD), DEFAULT_TIMEOUT, "start"
            )
            kept = await with_timeout(
                api.start_process(["sleep", "984"], cwd=CWD, detach=True), DEFAULT_TIMEOUT, "start"
            )
            listed = await with_timeout(api.list_processes(), DEFAULT_TIMEOUT, "list")
            pids = {x.process_id: x.pid for x in listed.processes}
            ended_pid, kept_pid = pids[ended.process_id], pids[kept.process_id]
            assert ended_pid and kept_pid
        finally:
            await with_timeout(close(), 30.0, "close")
        try:
            # Ended by the close itself, not by the session's TTL later.
            assert not pid_alive(ended_pid)
            assert ended.signal == "SIGTERM"
            assert pid_alive(kept_pid)
        finally:
            if kept_pid and pid_alive(kept_pid):
                os.kill(kept_pid, signal.SIGKILL)
            await until(lambda: not pid_alive(kept_pid), "the kill", timeout=DEFAULT_TIMEOUT)
