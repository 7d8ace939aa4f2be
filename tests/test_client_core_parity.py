"""What the Twisted client told its user and the asyncio and blocking clients
did not (issue 25, point 1): the resource limit that ended a process, in
every client's exit report, and the "use wss://" hint for a ``ws://`` URL
that points at a TLS port. Each is written once, in ``execserver.clientcore``
(``SeqOrdering.accept_exit_report``/``note_limit``, ``clientcore.tlsprobe``).

Real installed servers on 127.0.0.1; the asyncio client in a loop on a worker
thread, the blocking client in a thread of its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import pytest_twisted
from twisted.internet import threads

from execserver import aio, sync
from execserver import protocol as p
from execserver.clientcore.errors import ConnectFailed, OutputGap
from execserver.clientcore.process import EventQueue, ProcessCore
from tests.support.aio_harness import in_asyncio
from tests.support.harness import child_env
from tests.support.tls import Pki, start_wss
from tests.support.ws_harness import WsServerProcess

#: The server's default file size limit; the child writes five times as much.
LIMIT = 1000


def writer(tmp_path: Path) -> list[str]:
    return ["sh", "-c", f"exec head -c {5 * LIMIT} /dev/zero > {tmp_path / 'f'}"]


@pytest_twisted.ensureDeferred
async def test_the_asyncio_client_reports_the_limit_that_ended_the_process(
    tmp_path: Path,
) -> None:
    server = await WsServerProcess.start("--default-limits", f"fileSizeBytes={LIMIT}")

    async def scenario() -> None:
        async with aio.connect(server.url) as client:
            result = await client.run(writer(tmp_path), cwd="/", env=child_env())
            assert result.exit_code == 128 + 25  # SIGXFSZ
            assert result.limit_exceeded == ("fileSize", LIMIT)
            # The one names of every client (start_process, exited()).
            proc = await client.start_process(writer(tmp_path), cwd="/", env=child_env())
            assert await proc.exited(timeout=30) == 128 + 25
            assert proc.limit_exceeded == ("fileSize", LIMIT)

    try:
        await in_asyncio(scenario)
    finally:
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_the_blocking_client_reports_the_limit_that_ended_the_process(
    tmp_path: Path,
) -> None:
    server = await WsServerProcess.start("--default-limits", f"fileSizeBytes={LIMIT}")

    def scenario() -> None:
        with sync.connect(server.url) as client:
            result = client.run(writer(tmp_path), cwd="/", env=child_env())
            assert result.limit_exceeded == ("fileSize", LIMIT)
            proc = client.start(writer(tmp_path), cwd="/", env=child_env())
            assert proc.wait(timeout=30) == 128 + 25
            assert proc.limit_exceeded == ("fileSize", LIMIT)

    try:
        await threads.deferToThread(scenario)
    finally:
        await server.stop()


class _Handle(ProcessCore[EventQueue]):
    def __init__(self) -> None:
        self._init_process("p1", 1 << 20)

    def _fire_exited(self, exit_code: int | None) -> None:
        pass

    def _fire_closed(self) -> None:
        pass

    def _backlog_overflow(self) -> None:
        pass

    def _listener_failed(self) -> None:
        raise AssertionError("no listeners here")

    def _gap_unheard(self, error: OutputGap) -> None:
        raise AssertionError(f"no gap here: {error}")


def test_a_catch_up_read_carries_the_limit_as_the_exit_notification_does() -> None:
    """A handle that learns of its exit from a catch-up read (after a
    resume) keeps the limit too, in every client (the shared ordering)."""
    handle = _Handle()
    handle.begin_catch_up()
    read = p.ReadResponse(
        chunks=[],
        next_seq=3,
        exited=True,
        exit_code=153,
        exited_seq=1,
        closed=True,
        closed_seq=2,
        limit_exceeded="fileSize",
        limit_value=LIMIT,
    )
    handle.catch_up(read)
    assert (handle.exit_code, handle.limit_exceeded) == (153, ("fileSize", LIMIT))


@pytest.mark.parametrize("client", ["aio", "sync"])
@pytest_twisted.ensureDeferred
async def test_ws_to_a_wss_port_says_use_wss(tmp_path: Path, client: str) -> None:
    """As the Twisted client and the CLI say (tests/test_edge_frictions.py)."""
    server = await start_wss(Pki(tmp_path))
    plain = server.url.replace("wss://", "ws://")
    want = f"cannot connect to {plain}: the server speaks TLS here: use wss://{plain[5:]}"

    async def with_aio() -> None:
        with pytest.raises(ConnectFailed) as failed:
            await aio.connect(plain, connect_timeout=10.0)
        assert str(failed.value) == want

    def with_sync() -> None:
        with pytest.raises(ConnectFailed) as failed:
            sync.connect(plain, connect_timeout=10.0)
        assert str(failed.value) == want

    try:
        if client == "aio":
            await in_asyncio(with_aio)
        else:
            await threads.deferToThread(with_sync)
    finally:
        assert await server.stop() == 0


def test_one_name_per_concept_in_every_client_the_old_ones_aliases() -> None:
    """docs/client.md "One name per concept": ``start_process``, a handle's
    ``output()`` and ``exited()`` in all three clients; ``start``, ``wait()``
    and ``subscribe()`` stay as aliases of the same methods."""
    from execserver.client import ExecServerClient, ReconnectingClient, RemoteProcess
    from execserver.client.reconnect import ResumingClient

    for client_class in (aio.Client, sync.Client):
        assert client_class.start_process is client_class.start
    for twisted_class in (ExecServerClient, ReconnectingClient, ResumingClient):
        assert callable(twisted_class.start_process)
    for handle_class in (aio.Process, sync.Process):
        assert handle_class.exited is handle_class.wait
        assert callable(handle_class.output)
    assert RemoteProcess.output is RemoteProcess.subscribe
    assert callable(RemoteProcess.exited)
