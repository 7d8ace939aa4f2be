"""Benchmarks of the fs/* methods against the real server over stdio.

Prints figures and ratios to baselines measured in the same run, never asserts:

- ``fs/getMetadata`` round trips at 1 and 64 requests in flight, against
  ``bench/echo_server.py`` (a bare Twisted LineOnlyReceiver echo-RPC that
  answers ``fs/getMetadata`` with an inline ``os.stat``, so the replies are
  the same size); target at least 0.5 of the echo at depth 64;
- ``fs/readFile`` / ``fs/writeFile`` of 16 and 256 MiB, MB/s against
  ``cat FILE | base64 -w0 >/dev/null`` and ``base64 -d <TEXT | cat >FILE``;
- the server's peak RSS above idle as a multiple of the file (target at most
  1.5x), and for the same file moved in 8 MiB ranges (target at most 64 MiB);
  whole-file transfers over WebSocket too (``websockets``' blocking client);
- with ``--library-gib N``: an N GiB download and upload through the client
  library (``ExecServerClient.download``/``upload``, 8 MiB ranges): MB/s,
  the client's and the server's peak RSS. Not part of the test suite.

- with ``--put-get MIB``: ``exec-server-client fs put`` against ``fs get`` of
  the same file (``--stdio``), alternating;
- with ``--write-paths MIB``: ``fs/writeFile`` of a file with one link (the
  atomic replacement) and of a hard-linked one (the journaled copy-back)
  against a plain ``write`` + ``fsync`` of the same bytes; ``--before TREE``
  adds the same rows for the server of an older checkout, in the same run;
- with ``--reference MIB``: ``fs/writeFile`` of MIB MiB and ``fs/getMetadata``
  round trips at depth 1 against the Rust reference (``codex exec-server
  --listen stdio``, the cached Codex CLI), alternating, and against a plain
  ``write`` + ``fsync`` of the same bytes (targets 2x and 0.5, 1.5x);
- with ``--write-steps MIB``: each step of one MIB MiB ``fs/writeFile`` timed
  alone beside its physical limit.

Usage: ``python -m bench.bench_fs [--sizes-mib 16,256] [--rounds 3] [--library-gib 1] [--ws]``
(``--rss-only``: the peak RSS figures alone.)
(``--size-mib N --repeat R --seconds S``: one size, R rounds, short runs.)
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._client import Ratio, Series, StdioClient, print_header
from bench.bench_rtt import echo_rate, server_rate

MiB = 1024 * 1024
RANGE_BYTES = 8 * MiB


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


# --- round trips ----------------------------------------------------------------------------


def metadata_ratios(rounds: int, count: int) -> list[Ratio]:
    ratios = []
    for depth in (1, 64):
        n = count if depth > 1 else count // 10
        server: list[float] = []
        echo: list[float] = []
        for _ in range(rounds):
            echo.append(echo_rate(n, depth, "fs/getMetadata"))
            server.append(server_rate(n, depth, "fs/getMetadata"))
        ratios.append(
            Ratio(
                f"fs/getMetadata round trips, depth {depth} (server / echo-RPC)",
                Series(f"server, depth {depth}", "req/s", tuple(server)),
                Series(f"echo-RPC, depth {depth}", "req/s", tuple(echo)),
                target=0.5 if depth == 64 else None,
            )
        )
    return ratios


# --- whole-file transfers -----------------------------------------------------------------


def read_line(client: StdioClient) -> bytearray:
    """One whole reply line (a large one without re-joining its pieces)."""
    line = bytearray()
    while not line.endswith(b"\n"):
        line += client.read_raw()
    return line


def read_request(request_id: int, path: Path, **extra: Any) -> bytes:
    params = json.dumps({"path": str(path), **extra})
    return b'{"id":%d,"method":"fs/readFile","params":%s}\n' % (request_id, params.encode())


def write_request(request_id: int, path: Path, text: bytes, **extra: Any) -> bytes:
    more = "".join(f',"{k}":{json.dumps(v)}' for k, v in extra.items())
    return b'{"id":%d,"method":"fs/writeFile","params":{"path":"%s","dataBase64":"%s"%s}}\n' % (
        request_id,
        str(path).encode(),
        text,
        more.encode(),
    )


def started_server(*args: str) -> StdioClient:
    client = StdioClient(["--max-message-bytes", str(1024 * MiB), *args])
    client.initialize()
    client.request("fs/getMetadata", {"path": "/tmp"})  # the pool, the code paths
    return client


def check_ok(line: bytes | bytearray) -> None:
    if b'"error"' in line[:200]:
        raise RuntimeError(bytes(line[:300]).decode())


def transfer_rates(work: Path, size: int, rounds: int) -> list[Ratio]:
    source = work / f"source-{size}.bin"
    text_file = work / f"source-{size}.b64"
    with open(source, "wb") as f:
        f.write(os.urandom(size))
    text = base64.b64encode(source.read_bytes())
    text_file.write_bytes(text)
    mib = size / MiB
    reads: list[float] = []
    cats: list[float] = []
    writes: list[float] = []
    decodes: list[float] = []
    with started_server() as client:
        for _ in range(rounds):
            start = time.perf_counter()
            subprocess.run(f"cat '{source}' | base64 -w0 >/dev/null", shell=True, check=True)
            cats.append(mib / (time.perf_counter() - start))
            start = time.perf_counter()
            client.send_bytes(read_request(client.new_id(), source))
            line = read_line(client)
            reads.append(mib / (time.perf_counter() - start))
            check_ok(line)
            del line
            out = work / "decoded.bin"
            start = time.perf_counter()
            subprocess.run(f"base64 -d <'{text_file}' | cat >'{out}'", shell=True, check=True)
            decodes.append(mib / (time.perf_counter() - start))
            request = write_request(client.new_id(), work / "written.bin", text)
            start = time.perf_counter()
            client.send_bytes(request)
            line = read_line(client)
            writes.append(mib / (time.perf_counter() - start))
            check_ok(line)
            del request
    assert (work / "written.bin").read_bytes() == source.read_bytes()
    return [
        Ratio(
            f"fs/readFile {mib:.0f} MiB (server / cat | base64 >/dev/null)",
            Series("fs/readFile", "MiB/s", tuple(reads)),
            Series("cat | base64", "MiB/s", tuple(cats)),
        ),
        Ratio(
            f"fs/writeFile {mib:.0f} MiB (server / base64 -d | cat >FILE)",
            Series("fs/writeFile", "MiB/s", tuple(writes)),
            Series("base64 -d | cat", "MiB/s", tuple(decodes)),
        ),
    ]


def peak_over_idle(work: Path, size: int, ranged: bool) -> dict[str, float]:
    """Server peak RSS above idle (MiB) for one read and one write of ``size`` bytes."""
    source = work / f"source-{size}.bin"
    figures: dict[str, float] = {}
    for method in ("fs/readFile", "fs/writeFile"):
        with started_server() as client:
            idle = rss_kib(client.pid)
            if method == "fs/readFile":
                if ranged:
                    for offset in range(0, size, RANGE_BYTES):
                        client.send_bytes(
                            read_request(client.new_id(), source, offset=offset, length=RANGE_BYTES)
                        )
                        check_ok(read_line(client))
                else:
                    client.send_bytes(read_request(client.new_id(), source))
                    check_ok(read_line(client))
            else:
                target = work / "rss-written.bin"
                with open(source, "rb") as f:
                    if ranged:
                        offset = 0
                        while chunk := f.read(RANGE_BYTES):
                            extra = {"offset": offset, "truncate": True}
                            request = write_request(
                                client.new_id(), target, base64.b64encode(chunk), **extra
                            )
                            client.send_bytes(request)
                            check_ok(read_line(client))
                            offset += len(chunk)
                    else:
                        request = write_request(client.new_id(), target, base64.b64encode(f.read()))
                        client.send_bytes(request)
                        del request
                        check_ok(read_line(client))
            figures[method] = (rss_kib(client.pid, "VmHWM") - idle) / 1024
    return figures


def peak_over_idle_ws(work: Path, size: int) -> dict[str, tuple[float, float]]:
    """The same as :func:`peak_over_idle` (whole file) over a WebSocket, with its MB/s.

    The rate is the file's size over the time from the request's first byte
    sent to the answer received (one transfer, ``websockets``' client).
    """
    from websockets.sync.client import connect

    from bench.bench_websocket import Server

    source = work / f"source-{size}.bin"
    figures: dict[str, tuple[float, float]] = {}
    limit = str(1024 * MiB)
    for method in ("fs/readFile", "fs/writeFile"):
        server = Server(
            *("--listen", "ws://127.0.0.1:0"),
            *("--max-message-bytes", limit, "--max-partial-message-bytes", limit),
        )
        pid = server.proc.pid
        try:
            host, port = server.ws_address()
            with connect(f"ws://{host}:{port}", max_size=None) as ws:
                ws.send(b'{"id":0,"method":"initialize","params":{"clientName":"bench"}}')
                ws.recv()
                ws.send(b'{"method":"initialized"}')
                ws.send(read_request(1, source, offset=0, length=1000).rstrip(b"\n"))
                ws.recv()  # the pool, the code paths
                idle = rss_kib(pid)
                if method == "fs/readFile":
                    request = read_request(2, source)
                else:
                    text = base64.b64encode(source.read_bytes())
                    request = write_request(2, work / "rss-written.bin", text)
                    del text
                started = time.perf_counter()
                ws.send(request.rstrip(b"\n"))
                del request
                reply = ws.recv(decode=False)
                seconds = time.perf_counter() - started
                check_ok(reply)
                del reply
                peak = (rss_kib(pid, "VmHWM") - idle) / 1024
                figures[method] = (peak, size / MiB / seconds)
        finally:
            server.stop()
    return figures


# --- the client library, N GiB -------------------------------------------------------------


def _server_command(tree: str | None) -> list[str]:
    """The server to run: this one, or the tree ``tree`` (a checkout) put first on the path."""
    if tree is None:
        return [sys.executable, "-m", "execserver"]
    return ["env", f"PYTHONPATH={tree}", sys.executable, "-m", "execserver"]


def _cli_seconds(*args: str) -> float:
    client = str(Path(sys.executable).with_name("exec-server-client"))
    start = time.perf_counter()
    subprocess.run([client, "fs", "--stdio", *args], check=True, cwd=tempfile.gettempdir())
    return time.perf_counter() - start


def put_get_rates(work: Path, size: int, rounds: int, before: str | None) -> list[Ratio]:
    """``exec-server-client fs put`` and ``fs get`` of ``size`` bytes (stdio), alternating.

    ``put / get`` with this server; with ``before`` (a checkout of an older
    version) also this server's put over the older one's, in the same rounds.
    """
    source = work / f"put-{size}.bin"
    with open(source, "wb") as f:
        f.write(os.urandom(size))
    remote = work / "put-remote.bin"
    back = work / "put-back.bin"
    mib = size / MiB
    puts: list[float] = []
    gets: list[float] = []
    old_puts: list[float] = []
    for _ in range(rounds):
        for tree, rates in ((None, puts), *(((before, old_puts),) if before else ())):
            command = " ".join(_server_command(tree))
            rates.append(
                mib / _cli_seconds("--server-command", command, "put", str(source), str(remote))
            )
        command = " ".join(_server_command(None))
        gets.append(mib / _cli_seconds("--server-command", command, "get", str(remote), str(back)))
    assert back.read_bytes() == source.read_bytes()
    ratios = [
        Ratio(
            f"fs put {mib:.0f} MiB (put / get, exec-server-client --stdio)",
            Series("fs put", "MiB/s", tuple(puts)),
            Series("fs get", "MiB/s", tuple(gets)),
        )
    ]
    if before:
        ratios.append(
            Ratio(
                f"fs put {mib:.0f} MiB (this server / the server at {before})",
                Series("fs put", "MiB/s", tuple(puts)),
                Series("fs put before", "MiB/s", tuple(old_puts)),
            )
        )
    return ratios


def _plain_write_seconds(path: Path, data: bytes) -> float:
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def write_path_costs(work: Path, size: int, rounds: int, before: str | None) -> list[Ratio]:
    """What each ``fs/writeFile`` path costs: atomic, hard-linked (journaled copy-back).

    Ratios to a plain ``write`` + ``fsync`` of the same bytes in the same
    round (the physical limit of a durable write here), and the hard-linked
    write over the atomic one. With ``before`` (a checkout), the same two
    writes by that server too (its hard-linked write truncated in place).
    """
    data = os.urandom(size)
    text = base64.b64encode(data)
    mib = size / MiB
    figures: dict[str, list[float]] = {}
    servers = [("", None)] + ([(" before", before)] if before else [])
    plain = work / "plain.bin"
    for _ in range(rounds):
        figures.setdefault("plain", []).append(mib / _plain_write_seconds(plain, data))
        for label, tree in servers:
            with started_server_at(tree) as client:
                for kind in ("atomic", "hard-linked"):
                    target = work / f"paths-{kind}.bin"
                    target.write_bytes(b"old")
                    if kind == "hard-linked":
                        link = work / "paths-link.bin"
                        link.unlink(missing_ok=True)
                        os.link(target, link)
                    request = write_request(client.new_id(), target, text)
                    start = time.perf_counter()
                    client.send_bytes(request)
                    line = read_line(client)
                    figures.setdefault(kind + label, []).append(mib / (time.perf_counter() - start))
                    check_ok(line)
                    assert target.read_bytes() == data
    plain_series = Series("write+fsync", "MiB/s", tuple(figures["plain"]))
    ratios = []
    for label, _tree in servers:
        atomic = Series(f"atomic{label}", "MiB/s", tuple(figures["atomic" + label]))
        linked = Series(f"hard-linked{label}", "MiB/s", tuple(figures["hard-linked" + label]))
        ratios.append(
            Ratio(f"fs/writeFile {mib:.0f} MiB atomic{label} / write+fsync", atomic, plain_series)
        )
        ratios.append(
            Ratio(
                f"fs/writeFile {mib:.0f} MiB hard-linked{label} / write+fsync", linked, plain_series
            )
        )
        ratios.append(
            Ratio(f"fs/writeFile {mib:.0f} MiB hard-linked{label} / atomic{label}", linked, atomic)
        )
    return ratios


#: The Rust reference (the Codex CLI's ``codex exec-server``), if cached here.
REFERENCE_BINARY = Path.home() / (
    ".cache/exec-server-codex/0.171.0/package/vendor/x86_64-unknown-linux-musl/bin/codex"
)


def _started_reference(home: Path) -> StdioClient:
    env_home = home / "codex-home"
    env_home.mkdir(exist_ok=True)
    os.environ.setdefault("CODEX_HOME", str(env_home))
    client = StdioClient(argv=[str(REFERENCE_BINARY), "exec-server", "--listen", "stdio"])
    client.initialize()
    client.request("fs/getMetadata", {"path": "file:///tmp"})
    return client


def _timed_write(client: StdioClient, target: Path, text: bytes) -> float:
    # Paths as file:// URIs: the reference's current dialect takes nothing else.
    request = (
        b'{"id":%d,"method":"fs/writeFile","params":{"path":"file://%s","dataBase64":"%s"}}\n'
        % (
            client.new_id(),
            str(target).encode(),
            text,
        )
    )
    start = time.perf_counter()
    client.send_bytes(request)
    line = read_line(client)
    seconds = time.perf_counter() - start
    check_ok(line)
    return seconds


def _metadata_rate(client: StdioClient, count: int) -> float:
    request = b'{"id":%d,"method":"fs/getMetadata","params":{"path":"file:///tmp"}}\n'
    start = time.perf_counter()
    for _ in range(count):
        client.send_bytes(request % client.new_id())
        check_ok(read_line(client))
    return count / (time.perf_counter() - start)


def reference_rates(work: Path, size: int, rounds: int, count: int) -> list[Ratio]:
    """This server against the Rust reference over stdio, alternating, and the physical limit.

    ``fs/writeFile`` of ``size`` bytes (whole file) by each, and a plain
    ``write`` + ``fsync`` of the same bytes; ``fs/getMetadata`` round trips
    at depth 1 (one request in flight), ``count`` per round.
    """
    data = os.urandom(size)
    text = base64.b64encode(data)
    mib = size / MiB
    ours: list[float] = []
    theirs: list[float] = []
    plain: list[float] = []
    ours_meta: list[float] = []
    theirs_meta: list[float] = []
    home = Path(tempfile.mkdtemp(prefix="bench-codex-", dir=Path.home()))
    try:
        with started_server() as mine, _started_reference(home) as reference:
            for _ in range(rounds):
                plain.append(mib / _plain_write_seconds(work / "plain.bin", data))
                ours.append(mib / _timed_write(mine, work / "ours.bin", text))
                theirs.append(mib / _timed_write(reference, work / "theirs.bin", text))
                ours_meta.append(_metadata_rate(mine, count))
                theirs_meta.append(_metadata_rate(reference, count))
        assert (work / "ours.bin").read_bytes() == (work / "theirs.bin").read_bytes() == data
    finally:
        shutil.rmtree(home, ignore_errors=True)
    ours_series = Series("fs/writeFile", "MiB/s", tuple(ours))
    return [
        Ratio(
            f"fs/writeFile {mib:.0f} MiB stdio (server / reference)",
            ours_series,
            Series("reference", "MiB/s", tuple(theirs)),
            target=2.0,
        ),
        Ratio(
            f"fs/writeFile {mib:.0f} MiB stdio (server / write+fsync)",
            ours_series,
            Series("write+fsync", "MiB/s", tuple(plain)),
            target=0.5,
        ),
        Ratio(
            "fs/getMetadata round trips, depth 1 (server / reference)",
            Series("server", "req/s", tuple(ours_meta)),
            Series("reference", "req/s", tuple(theirs_meta)),
            target=1.5,
        ),
    ]


def write_steps(work: Path, size: int) -> None:
    """Where an ``fs/writeFile`` of ``size`` bytes goes: each step of the server, timed alone.

    The server's own functions on one request line, median of 7, each
    printed beside its physical limit (a copy of the line, ``pybase64``'s
    decode, a plain ``write`` and ``write`` + ``fsync``, a pipe transfer).
    """
    import threading

    import pybase64

    from execserver import codec
    from execserver.dispatcher import _has_uri_value
    from execserver.fs import ops
    from execserver.fs.handlers import WriteFileWire

    data = os.urandom(size)
    text = base64.b64encode(data)
    target = work / "steps.bin"
    line = write_request(1, target, text).rstrip(b"\n")

    def timed(func: Any, repeat: int = 7) -> float:
        values = []
        for _ in range(repeat):
            start = time.perf_counter()
            func()
            values.append(time.perf_counter() - start)
        return sorted(values)[len(values) // 2] * 1000

    request: Any = codec.decode_message(line)
    params: Any = codec.decode_params(request.params, WriteFileWire)
    fd = os.open(work / "steps-plain.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def write_and_sync() -> None:
        os.pwrite(fd, data, 0)
        os.fsync(fd)

    def pipe_transfer() -> None:
        r, w = os.pipe()

        def reader() -> None:
            got = 0
            while got < len(line):
                got += len(os.read(r, 256 * 1024))

        thread = threading.Thread(target=reader)
        thread.start()
        view = memoryview(line)
        while view:
            view = view[os.write(w, view[: 1 << 20]) :]
        thread.join()
        os.close(r)
        os.close(w)

    rows = [
        ("limit: copy of the line", timed(lambda: bytearray(line))),
        ("limit: the line through a pipe, 256 KiB reads", timed(pipe_transfer, 3)),
        ("envelope parse (params kept as Raw)", timed(lambda: codec.decode_message(line))),
        (
            "dialect check (a file:// value in params)",
            timed(lambda: _has_uri_value(request.params)),
        ),
        (
            "params parse (WriteFileWire)",
            timed(lambda: codec.decode_params(request.params, WriteFileWire)),
        ),
        (
            "limit: pybase64 decode of the whole text",
            timed(lambda: pybase64.b64decode(text, validate=True)),
        ),
        (
            "fs work: decode into a temporary file, attributes, rename",
            timed(lambda: ops.write_file(str(target), params.data_base64)),
        ),
        ("limit: plain write of the bytes", timed(lambda: os.pwrite(fd, data, 0))),
        ("limit: plain write + fsync", timed(write_and_sync, 3)),
    ]
    os.close(fd)
    for name, ms in rows:
        print(f"{ms:8.2f} ms  {len(line) / MiB / (ms / 1000):7.0f} MiB/s of text  {name}")


def started_server_at(tree: str | None) -> StdioClient:
    argv = [*_server_command(tree), "--max-message-bytes", str(1024 * MiB)]
    client = StdioClient(argv=argv)
    client.initialize()
    client.request("fs/getMetadata", {"path": "/tmp"})
    return client


def library_child(direction: str, remote: str, local: str) -> None:
    """Run in a child process: one transfer, then print its figures as JSON."""
    import psutil
    from twisted.internet import defer, task

    from execserver.client import ConnectOptions, ExecServerClient

    async def main(reactor: Any) -> None:
        client = await ExecServerClient.spawn_local(reactor, ConnectOptions("bench"))
        try:
            children = psutil.Process().children(recursive=True)
            start = time.perf_counter()
            if direction == "down":
                moved = await client.download(remote, local)
            else:
                moved = await client.upload(remote, local)
            seconds = time.perf_counter() - start
            server_peak = max(rss_kib(child.pid, "VmHWM") for child in children)
        finally:
            await client.close()
        print(
            json.dumps(
                {
                    "bytes": moved,
                    "seconds": seconds,
                    "client_peak_kib": rss_kib(os.getpid(), "VmHWM"),
                    "server_peak_kib": server_peak,
                }
            )
        )

    task.react(lambda reactor: defer.Deferred.fromCoroutine(main(reactor)))


def library_transfers(work: Path, gib: int) -> None:
    size = gib * 1024 * MiB
    source = work / "library-source.bin"
    with open(source, "wb") as f:
        for _ in range(size // (64 * MiB)):
            f.write(os.urandom(64 * MiB))
    remote = work / "library-remote.bin"
    back = work / "library-back.bin"
    for direction, args in (("up", (remote, source)), ("down", (remote, back))):
        out = subprocess.run(
            [sys.executable, "-m", "bench.bench_fs", "--library-child", direction, *map(str, args)],
            check=True,
            capture_output=True,
            cwd=str(Path(__file__).resolve().parent.parent),
        ).stdout
        figures = json.loads(out.decode().strip().splitlines()[-1])
        print(
            f"client library {'upload' if direction == 'up' else 'download'} {gib} GiB "
            f"in 8 MiB ranges: {figures['bytes'] / MiB / figures['seconds']:.0f} MiB/s; "
            f"peak RSS client {figures['client_peak_kib'] / 1024:.0f} MiB, "
            f"server {figures['server_peak_kib'] / 1024:.0f} MiB"
        )
    same = subprocess.run(["cmp", str(source), str(back)], check=False).returncode == 0
    print(f"round trip identical: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes-mib", default="16,256")
    parser.add_argument("--size-mib", help="one size only (what bench/run_all.py asks for)")
    parser.add_argument("--rounds", "--repeat", type=int, default=3)
    parser.add_argument("--count", type=int, default=40000, help="getMetadata calls at depth 64")
    parser.add_argument(
        "--seconds", type=float, help="instead of --count: about this long per getMetadata run"
    )
    parser.add_argument("--library-gib", type=int, default=0)
    parser.add_argument(
        "--ws", action="store_true", help="peak RSS of whole-file transfers over WebSocket too"
    )
    parser.add_argument(
        "--rss-only", action="store_true", help="only the peak RSS figures (no rates)"
    )
    parser.add_argument("--library-child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument(
        "--put-get", type=int, metavar="MIB", help="only: fs put vs fs get of MIB MiB (the CLI)"
    )
    parser.add_argument(
        "--write-paths", type=int, metavar="MIB", help="only: the fs/writeFile paths' costs"
    )
    parser.add_argument("--before", metavar="TREE", help="with those two: also a checkout's server")
    parser.add_argument(
        "--reference",
        type=int,
        metavar="MIB",
        help="only: fs/writeFile of MIB MiB and getMetadata depth 1 against the Rust reference",
    )
    parser.add_argument(
        "--write-steps", type=int, metavar="MIB", help="only: where a MIB MiB write's time goes"
    )
    args = parser.parse_args()
    if args.library_child:
        library_child(*args.library_child)
        return
    if args.write_steps:
        print_header("filesystem: the steps of one fs/writeFile")
        work = Path(tempfile.mkdtemp(prefix="bench-fs-"))
        try:
            write_steps(work, args.write_steps * MiB)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    if args.put_get or args.write_paths or args.reference:
        print_header("filesystem write paths")
        work = Path(tempfile.mkdtemp(prefix="bench-fs-"))
        try:
            found = []
            if args.put_get:
                found += put_get_rates(work, args.put_get * MiB, args.rounds, args.before)
            if args.write_paths:
                found += write_path_costs(work, args.write_paths * MiB, args.rounds, args.before)
            if args.reference:
                count = max(1000, args.count // 10)
                found += reference_rates(work, args.reference * MiB, args.rounds, count)
            for ratio in found:
                print(ratio.value.describe())
                print(ratio.baseline.describe())
                print(ratio.describe(), flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    if args.size_mib:
        args.sizes_mib = args.size_mib
    if args.seconds is not None:
        args.count = max(1000, int(args.seconds * 100_000))
    print_header("filesystem")
    if not args.rss_only:
        for ratio in metadata_ratios(args.rounds, args.count):
            print(ratio.value.describe())
            print(ratio.baseline.describe())
            print(ratio.describe(), flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-fs-"))
    try:
        for size in (int(s) * MiB for s in args.sizes_mib.split(",")):
            if args.rss_only:
                with open(work / f"source-{size}.bin", "wb") as f:
                    f.write(os.urandom(size))
            else:
                for ratio in transfer_rates(work, size, args.rounds):
                    print(ratio.value.describe())
                    print(ratio.baseline.describe())
                    print(ratio.describe(), flush=True)
            whole = peak_over_idle(work, size, ranged=False)
            ranged = peak_over_idle(work, size, ranged=True)
            ws = peak_over_idle_ws(work, size) if args.ws else {}
            for method in whole:
                print(
                    f"{method} {size / MiB:.0f} MiB: server peak RSS above idle "
                    f"{whole[method]:.1f} MiB = {whole[method] * MiB / size:.2f}x the file "
                    f"(target <= 1.5x); in 8 MiB ranges {ranged[method]:.0f} MiB "
                    f"(target <= 64 MiB)",
                    flush=True,
                )
                if method in ws:
                    peak, rate = ws[method]
                    print(
                        f"{method} {size / MiB:.0f} MiB over WebSocket: server peak RSS above "
                        f"idle {peak:.1f} MiB = {peak * MiB / size:.2f}x the file; "
                        f"{rate:.0f} MiB/s",
                        flush=True,
                    )
        if args.library_gib:
            library_transfers(work, args.library_gib)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
