"""Files moved in ranges, and cheap calls that never block the event loop
(issue 13, items 1 and 3), through real servers:

- ``upload``/``download`` of the client library through a spawned server
  (hashes equal, progress reported, a file larger than one range);
- ``exec-server-client fs put/get`` in ranges, with a progress bar on a
  terminal and none on a pipe;
- a path whose ``stat`` is slow (on what the server's mount table says is
  an NFS mount) keeps one pool thread busy while another client's
  getMetadata, readDirectory and readFile calls are all answered: the inline
  rule never runs it on the reactor thread.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_twisted
from twisted.internet.defer import Deferred

from execserver.app import build_dispatcher, file_system
from execserver.client import ConnectOptions, ExecServerClient
from execserver.client.cli.fs import ProgressBar
from execserver.client.errors import RangesNotSupported
from execserver.config import ServerConfig
from execserver.dispatcher import Dispatcher
from execserver.fs import local, paths
from execserver.fs.local import Locality
from tests.support.cli import Cli, run
from tests.support.client_fakes import wait
from tests.support.fakes import FakeSpawner
from tests.support.harness import reactor, server_env, with_timeout

OPTIONS = ConnectOptions("test-transfer", initialize_timeout=5.0)
MiB = 1024 * 1024


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- the client library ---------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_upload_and_download_round_trip_through_a_real_server(tmp_path: Path) -> None:
    source = tmp_path / "source.bin"
    source.write_bytes(os.urandom(300_001))
    remote = tmp_path / "remote.bin"
    remote.write_bytes(b"an older, longer file " * 20_000)  # cut to the new length
    back = tmp_path / "back.bin"
    client: ExecServerClient = await wait(
        ExecServerClient.spawn_local(reactor, OPTIONS, env=server_env()), "server handshake"
    )
    try:
        seen: list[tuple[int, int | None]] = []
        sent = await wait(
            client.upload(
                str(remote),
                source,
                chunk_bytes=64 * 1024,
                progress=lambda d, t: seen.append((d, t)),
            ),
            "upload",
        )
        assert sent == 300_001
        assert _digest(remote) == _digest(source)
        assert seen[-1] == (300_001, 300_001) and len(seen) == 5
        assert [done for done, _ in seen] == sorted(done for done, _ in seen)
        seen.clear()
        got = await wait(
            client.download(
                str(remote), back, chunk_bytes=64 * 1024, progress=lambda d, t: seen.append((d, t))
            ),
            "download",
        )
        assert got == 300_001
        assert _digest(back) == _digest(source)
        assert seen[-1] == (300_001, 300_001) and len(seen) == 5
        # One range: a plain atomic writeFile; an empty file round trips too.
        empty = tmp_path / "empty"
        empty.write_bytes(b"")
        assert await wait(client.upload(str(remote), empty), "empty upload") == 0
        assert remote.read_bytes() == b""
        assert await wait(client.download(str(remote), back), "empty download") == 0
        assert back.read_bytes() == b""
    finally:
        await wait(client.close(), "close")


@pytest_twisted.ensureDeferred
async def test_no_ranged_upload_to_a_server_without_ranges(tmp_path: Path) -> None:
    """A server that does not list the range capabilities (a baseline one would
    ignore ``offset`` and replace the file with each range) gets no ranged call."""
    dispatcher = build_dispatcher(ServerConfig(), reactor, FakeSpawner())
    dispatcher.capabilities[:] = [c for c in dispatcher.capabilities if ":range" not in c]
    client: ExecServerClient = await wait(
        ExecServerClient.connect_in_process(reactor, OPTIONS, dispatcher=dispatcher), "connect"
    )
    source = tmp_path / "source.bin"
    source.write_bytes(b"x" * 300)
    remote = tmp_path / "remote.bin"
    remote.write_bytes(b"old")
    try:
        with pytest.raises(RangesNotSupported, match="fs/writeFile:range not in its capabilities"):
            await client.upload(str(remote), source, chunk_bytes=100)
        assert remote.read_bytes() == b"old"
        with pytest.raises(RangesNotSupported, match="fs/readFile:range"):
            await client.download(str(remote), tmp_path / "back.bin")
        # One chunk needs no range: a plain writeFile.
        assert await client.upload(str(remote), source) == 300
        assert remote.read_bytes() == b"x" * 300
    finally:
        await wait(client.close(), "close")
        pool = file_system(dispatcher).pool
        assert pool is not None
        pool.stop()


# --- the CLI ----------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_cli_put_and_get_in_ranges(tmp_path: Path) -> None:
    local_file = tmp_path / "local.bin"
    local_file.write_bytes(os.urandom(9 * MiB + 7))  # two 8 MiB ranges
    remote = tmp_path / "remote.bin"
    cli = await run("fs", "--stdio", "put", str(local_file), str(remote))
    assert (cli.exit_code, cli.err) == (0, b"")  # no progress bar on a pipe
    assert _digest(remote) == _digest(local_file)
    back = tmp_path / "back.bin"
    cli = await run("fs", "--stdio", "get", str(remote), str(back))
    assert (cli.exit_code, cli.err) == (0, b"")
    assert _digest(back) == _digest(local_file)
    cli = await run("fs", "--stdio", "get", str(remote), "-")
    assert cli.exit_code == 0
    assert hashlib.sha256(cli.out).hexdigest() == _digest(local_file)
    cli = await run("fs", "--stdio", "get", str(tmp_path / "missing"), str(back))
    assert cli.exit_code == 1
    assert cli.err.startswith(f"exec-server-client: fs get {tmp_path}/missing: ".encode())
    cli = await run("fs", "--stdio", "put", str(tmp_path / "nope"), str(remote))
    assert cli.exit_code == 2
    assert b"cannot read" in cli.err and b"No such file or directory" in cli.err


#: A server that advertises no ranged fs calls (as a baseline one would not).
_NO_RANGES_SERVER = """
import sys
from execserver import app, service
built = app.build_dispatcher
def without_ranges(*args, **kwargs):
    dispatcher = built(*args, **kwargs)
    dispatcher.capabilities[:] = [c for c in dispatcher.capabilities if ":range" not in c]
    return dispatcher
service.build_dispatcher = without_ranges
from execserver.cli import main
main(sys.argv[1:])
"""


@pytest_twisted.ensureDeferred
async def test_cli_put_and_get_without_server_ranges_is_a_clear_remote_error(
    tmp_path: Path,
) -> None:
    script = tmp_path / "no_ranges_server.py"
    script.write_text(_NO_RANGES_SERVER)
    server = f"{sys.executable} {script}"
    local_file = tmp_path / "local.bin"
    local_file.write_bytes(b"x" * (8 * MiB + 1))  # two ranges
    remote = tmp_path / "remote.bin"
    cli = await run("fs", "--stdio", "--server-command", server, "get", str(remote), "-")
    assert cli.exit_code == 1
    assert (
        cli.err
        == (
            f"exec-server-client: fs get {remote}: the server does not support ranged reads "
            "(fs/readFile:range); `fs cat` reads a file in one call\n"
        ).encode()
    )
    cli = await run(
        "fs", "--stdio", "--server-command", server, "put", str(local_file), str(remote)
    )
    assert cli.exit_code == 1
    assert (
        cli.err
        == (
            f"exec-server-client: fs put {remote}: the server does not support ranged writes "
            "(fs/writeFile:range), so only a file of at most one 8 MiB range can be put\n"
        ).encode()
    )
    assert not remote.exists()


@pytest_twisted.ensureDeferred
async def test_cli_get_shows_progress_on_a_terminal(tmp_path: Path) -> None:
    remote = tmp_path / "remote.bin"
    remote.write_bytes(os.urandom(9 * MiB))
    back = tmp_path / "back.bin"
    cli = Cli.start("fs", "--stdio", "get", str(remote), str(back), pty=True, show_terminal=False)
    assert await cli.finish() == 0
    assert f"get {remote}: 9.0 / 9.0 MiB (100%)".encode() in cli.out
    assert _digest(back) == _digest(remote)
    cli = Cli.start("fs", "--stdio", "put", str(back), str(remote), pty=True, show_terminal=False)
    assert await cli.finish() == 0
    # The average rate since the transfer began follows the share.
    assert re.search(rb"put \S+: 9\.0 / 9\.0 MiB \(100%\), [0-9]+\.[0-9] MiB/s", cli.out), cli.out
    assert _digest(back) == _digest(remote)


def test_the_progress_line_shows_the_average_rate() -> None:
    """Unit: the rate is the bytes so far over the time since the bar was made."""
    now = [100.0]
    out = io.StringIO()
    bar = ProgressBar("put /x", out, clock=lambda: now[0])
    now[0] = 102.0
    bar(64 * MiB, 128 * MiB)
    now[0] = 104.0
    bar(128 * MiB, 128 * MiB)
    bar.finish()
    assert out.getvalue() == (
        "\rput /x: 64.0 / 128.0 MiB (50%), 32.0 MiB/s\x1b[K"
        "\rput /x: 128.0 / 128.0 MiB (100%), 32.0 MiB/s\x1b[K\n"
    )


# --- a slow file system never blocks the event loop -----------------------------------------


class _Outbound:
    """A connection's responses, by id, as Deferreds."""

    def __init__(self) -> None:
        self.answers: dict[Any, Deferred[dict[str, Any]]] = {}

    def answer(self, request_id: int) -> Deferred[dict[str, Any]]:
        return self.answers.setdefault(request_id, Deferred())

    def write_message(self, data: bytes) -> None:
        message = msgspec.json.decode(data)
        if "id" in message:
            self.answer(message["id"]).callback(message)

    def write_message_parts(self, parts: Any) -> None:
        self.write_message(b"".join(bytes(part) for part in parts))

    def close_connection(self) -> None:
        pass

    def unsent_bytes(self) -> int:
        return 0

    def discard_unsent(self) -> None:
        pass


def _connect(dispatcher: Dispatcher) -> tuple[Any, _Outbound]:
    outbound = _Outbound()
    conn = dispatcher.connect(outbound, "test")
    conn.message_received(b'{"id":0,"method":"initialize","params":{"clientName":"t"}}')
    conn.message_received(b'{"method":"initialized","params":{}}')
    return conn, outbound


def _slowed(original: Callable[..., Any], slow: str, release: threading.Event) -> Any:
    def call(path: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(path, str | bytes | os.PathLike) and os.fsdecode(path).startswith(slow):
            # Called on the reactor thread this would stall every client:
            # the test then times out waiting for the other client's answers.
            assert release.wait(30), "never released"
        return original(path, *args, **kwargs)

    return call


@pytest_twisted.ensureDeferred
async def test_a_slow_stat_holds_one_pool_thread_and_no_one_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = tmp_path / "nfs"
    slow.mkdir()
    (slow / "file").write_bytes(b"remote")
    fast = tmp_path / "local"
    fast.mkdir()
    (fast / "file").write_bytes(b"local")
    (fast / "sub").mkdir()
    fifo = fast / "fifo"
    os.mkfifo(fifo)
    # The server's mount table says the slow directory is an NFS mount.
    mountinfo = tmp_path / "mountinfo"
    with open("/proc/self/mountinfo") as real:
        text = real.read()
    mountinfo.write_text(text + f"999 1 0:99 / {slow} rw - nfs server:/export rw\n")
    release = threading.Event()
    for name in ("stat", "lstat"):
        monkeypatch.setattr(os, name, _slowed(getattr(os, name), str(slow), release))
    monkeypatch.setattr(local, "lstatx", _slowed(paths.lstatx, str(slow), release))
    dispatcher = build_dispatcher(ServerConfig(), reactor, FakeSpawner())
    file_system(dispatcher).locality = Locality(mountinfo=str(mountinfo))
    try:
        a, a_out = _connect(dispatcher)
        b, b_out = _connect(dispatcher)
        # Both paths were looked at before, while fast: the local directory
        # is now trusted for inline calls, the NFS one must never be.
        release.set()
        for request_id, path in enumerate((fast / "file", slow / "file", slow), start=1):
            b.message_received(
                msgspec.json.encode(
                    {"id": request_id, "method": "fs/getMetadata", "params": {"path": str(path)}}
                )
            )
            await with_timeout(b_out.answer(request_id), 10, "the first looks")
        release.clear()
        # One client asks about the slow path, and the slow mount point itself.
        a.message_received(
            b'{"id":1,"method":"fs/getMetadata","params":{"path":"%s"}}'
            % (str(slow / "file").encode())
        )
        a.message_received(
            b'{"id":2,"method":"fs/readDirectory","params":{"path":"%s"}}' % (str(slow).encode())
        )
        requests = [
            ("fs/getMetadata", fast / "file"),
            ("fs/getMetadata", fast / "sub"),
            ("fs/readDirectory", fast),
            ("fs/readFile", fast / "file"),
            ("fs/readFile", fifo),
            ("fs/getMetadata", tmp_path / "missing"),
        ] * 5
        for request_id, (method, path) in enumerate(requests, start=10):
            b.message_received(
                msgspec.json.encode(
                    {"id": request_id, "method": method, "params": {"path": str(path)}}
                )
            )
        answers = [
            await with_timeout(b_out.answer(i), 10, f"the other client's {i}")
            for i in range(10, 10 + len(requests))
        ]
        assert answers[0]["result"]["isFile"] is True
        assert answers[4]["error"]["data"] == {"kind": "notRegularFile"}
        assert answers[5]["error"]["data"]["kind"] == "notFound"
        # The slow calls are still running, on pool threads.
        assert not a_out.answer(1).called and not a_out.answer(2).called
        assert file_system(dispatcher).running == 2
        release.set()
        got = await with_timeout(a_out.answer(1), 10, "the slow getMetadata")
        assert got["result"]["size"] == 6
        got = await with_timeout(a_out.answer(2), 10, "the slow readDirectory")
        assert [e["fileName"] for e in got["result"]["entries"]] == ["file"]
    finally:
        release.set()
        pool = file_system(dispatcher).pool
        assert pool is not None
        pool.stop()


# --- memory of ranged transfers --------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_ranged_transfers_keep_the_server_within_64_mib_above_idle(tmp_path: Path) -> None:
    """docs/filesystem.md: a file moved in 8 MiB ranges costs the server one
    range, whatever its size (measured 22 MiB); the promise is 64 MiB."""
    from tests.support.harness import status_bytes
    from tests.support.ws_harness import WsServerProcess, connect

    size = 96 * MiB
    source = tmp_path / "source.bin"
    with open(source, "wb") as f:
        for _ in range(size // (8 * MiB)):
            f.write(os.urandom(8 * MiB))
    target = tmp_path / "target.bin"
    server = await WsServerProcess.start()
    assert server.pid is not None
    try:
        client = await connect(server.url)
        await client.handshake()
        await client.call("fs/readFile", {"path": str(source), "offset": 0, "length": 1000})
        idle = status_bytes(server.pid)
        digest = hashlib.sha256()
        for offset in range(0, size, 8 * MiB):
            got = await client.call(
                "fs/readFile", {"path": str(source), "offset": offset, "length": 8 * MiB}
            )
            assert got["size"] == size
            chunk = base64.b64decode(got["dataBase64"])
            digest.update(chunk)
            params = {"path": str(target), "dataBase64": got["dataBase64"], "offset": offset}
            assert await client.call("fs/writeFile", params) == {}
            del got, chunk, params
        peak = status_bytes(server.pid, "VmHWM") - idle
        print(f"\nserver peak RSS above idle: {peak / MiB:.0f} MiB for {size // MiB} MiB each way")
        assert peak <= 64 * MiB
        assert digest.hexdigest() == _digest(source) == _digest(target)
    finally:
        await server.stop()
