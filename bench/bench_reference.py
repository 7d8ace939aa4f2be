"""exec-server against the Rust reference (``codex exec-server``), same client, same run.

Both servers run over stdio (``codex exec-server --listen stdio``), spoken to
by the same blocking client (:class:`bench._client.StdioClient`), in
alternating rounds (ours, then the reference's, per round), so the load of
the machine falls on both alike:

- ``fs/getMetadata`` round trips at depth 1 (one request in flight; the
  reference answers requests one at a time per connection by default, so
  depth 1 is where it is compared) of ``file:///tmp``, in ``--blocks``
  alternating blocks per round, with each server's CPU per request
  (user + system, psutil: 10 ms ticks, so use thousands of requests);
  in the same blocks, the floor of a Python server over the same pipes:
  ``bench/echo_server.py``, the bare Twisted echo-RPC of ``bench_rtt.py``
  (an inline ``os.stat``, nothing else);
- ``fs/writeFile`` of 16 MiB of random bytes (one request, a new file each
  time in the same directory), MiB/s of file from the request's first byte
  written to its answer read.

The physical limits of a write, measured in the same rounds on the same
bytes (MiB of file per second):

- ``memcpy``: copying 16 MiB in memory (``bytearray`` slice assignment);
- ``pybase64 decode``: decoding the 16 MiB file's text in one call;
- ``write+fsync``: ``os.write`` of the 16 MiB and ``fsync`` into a new file
  in the same directory as the servers write in.

The reference runs with ``CODEX_HOME`` in a private directory under the
work directory (``--work``, default a fresh one in the current directory).

    python bench/bench_reference.py [--rounds 5] [--count 5000] [--mib 16]
"""

from __future__ import annotations

import argparse
import base64
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Final

import pybase64

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._client import MiB, Ratio, Series, ServerError, StdioClient, print_header
from bench.bench_rtt import ECHO_SERVER, pipelined_rate

#: The reference's binary (the one the Codex tests run), or ``$CODEX_BIN``.
CODEX_BIN: Final = os.environ.get(
    "CODEX_BIN",
    "/root/.cache/exec-server-codex/0.171.0/package/vendor/x86_64-unknown-linux-musl/bin/codex",
)
METADATA: Final = b'{"id":%d,"method":"fs/getMetadata","params":{"path":"file:///tmp"}}\n'
#: Goals (issue 27): ratios to the reference.
GOALS: Final = {"metadata": 1.5, "write": 2.0, "write/fsync": 0.5}


def ours(tree: str | None = None) -> StdioClient:
    """This server (or, with ``tree``, the one of that source tree)."""
    saved = os.environ.get("BENCH_SERVER_ROOT")
    if tree is not None:
        os.environ["BENCH_SERVER_ROOT"] = tree
    try:
        client = StdioClient(["--max-message-bytes", str(1024 * MiB)])
    finally:
        if saved is None:
            os.environ.pop("BENCH_SERVER_ROOT", None)
        else:
            os.environ["BENCH_SERVER_ROOT"] = saved
    client.initialize()
    return client


def reference(home: Path) -> StdioClient:
    os.environ["CODEX_HOME"] = str(home)  # StdioClient passes os.environ on
    client = StdioClient(argv=[CODEX_BIN, "exec-server", "--listen", "stdio"])
    client.initialize()
    return client


#: The bare Twisted echo-RPC of bench_rtt.py takes plain paths.
ECHO_METADATA: Final = METADATA.replace(b"file://", b"")


def metadata_round(
    clients: tuple[StdioClient, ...], count: int, blocks: int
) -> list[tuple[float, float]]:
    """One round: ``count`` depth-1 round trips per server in ``blocks``
    alternating blocks; (rate, CPU µs per request) of each server.

    Alternating blocks of a few hundred requests (not one run each) spread
    the machine's changing load over the servers alike. The last client
    is the echo-RPC (plain paths).
    """
    seconds = [0.0] * len(clients)
    cpu = [0.0] * len(clients)
    per_block = max(1, count // blocks)
    for _ in range(blocks):
        for i, client in enumerate(clients):
            template = ECHO_METADATA if i == len(clients) - 1 else METADATA
            before = client.cpu_seconds()
            start = time.perf_counter()
            pipelined_rate(client, per_block, 1, template)
            seconds[i] += time.perf_counter() - start
            cpu[i] += client.cpu_seconds() - before
    total = per_block * blocks
    return [(total / seconds[i], cpu[i] / total * 1e6) for i in range(len(clients))]


def read_line(client: StdioClient) -> bytes:
    line = bytearray()
    while not line.endswith(b"\n"):
        line += client.read_raw()
    return bytes(line)


def write_rate(client: StdioClient, target: Path, text: bytes, size: int) -> float:
    request = b'{"id":%d,"method":"fs/writeFile","params":{"path":"file://%s","dataBase64":"%s"}}\n'
    line = request % (client.new_id(), str(target).encode(), text)
    start = time.perf_counter()
    client.send_bytes(line)
    reply = read_line(client)
    seconds = time.perf_counter() - start
    if b'"error"' in reply[:200]:
        raise ServerError(reply[:300].decode())
    if target.stat().st_size != size:
        raise ServerError(f"{target}: {target.stat().st_size} bytes, not {size}")
    target.unlink()
    return size / MiB / seconds


def limits(work: Path, data: bytes, text: bytes) -> tuple[float, float, float]:
    """MiB/s of memcpy, pybase64 decode and write+fsync of ``data`` (best of 3 each)."""
    mib = len(data) / MiB
    buffer = bytearray(len(data))
    copies, decodes, writes = [], [], []
    for _ in range(3):
        start = time.perf_counter()
        buffer[:] = data
        copies.append(mib / (time.perf_counter() - start))
        start = time.perf_counter()
        pybase64.b64decode(text, validate=True)
        decodes.append(mib / (time.perf_counter() - start))
        path = work / "plain.bin"
        start = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
        os.close(fd)
        writes.append(mib / (time.perf_counter() - start))
        path.unlink()
    return max(copies), max(decodes), max(writes)


def run(
    work: Path, rounds: int, count: int, size: int, blocks: int = 10, before: str | None = None
) -> list[Ratio]:
    home = work / "codex-home"
    home.mkdir(exist_ok=True)
    data = os.urandom(size)
    text = base64.b64encode(data)
    series: dict[str, list[float]] = {
        k: []
        for k in (
            "ours md",
            "ref md",
            "ours md cpu",
            "echo md",
            "echo md cpu",
            "ref md cpu",
            "ours w",
            "ref w",
            "ours w cpu",
            "before w",
            "before w cpu",
            "ref w cpu",
            "copy",
            "decode",
            "fsync",
        )
    }
    echo_argv = [sys.executable, str(ECHO_SERVER)]
    earlier = ours(before) if before is not None else None
    try:
        with ours() as mine, reference(home) as theirs, StdioClient(argv=echo_argv) as echo:
            for client in (mine, theirs):
                pipelined_rate(client, 500, 1, METADATA)  # warm up (the pool, the caches)
            pipelined_rate(echo, 500, 1, ECHO_METADATA)
            for _ in range(rounds):
                (rate, cpu), (ref_rate, ref_cpu), (echo_rate, echo_cpu) = metadata_round(
                    (mine, theirs, echo), count, blocks
                )
                series["echo md"].append(echo_rate)
                series["echo md cpu"].append(echo_cpu)
                series["ours md"].append(rate)
                series["ref md"].append(ref_rate)
                series["ours md cpu"].append(cpu)
                series["ref md cpu"].append(ref_cpu)
                writers = [("ours w", mine, "ours.bin"), ("ref w", theirs, "ref.bin")]
                if earlier is not None:
                    writers.append(("before w", earlier, "before.bin"))
                for key, client, name in writers:
                    cpu_before = client.cpu_seconds()
                    series[key].append(write_rate(client, work / name, text, size))
                    series[key + " cpu"].append((client.cpu_seconds() - cpu_before) * 1e3)
                copy, decode, fsync = limits(work, data, text)
                series["copy"].append(copy)
                series["decode"].append(decode)
                series["fsync"].append(fsync)
    finally:
        if earlier is not None:
            earlier.close()
    mib = size // MiB

    def s(key: str, name: str, unit: str) -> Series:
        return Series(name, unit, tuple(series[key]))

    ours_w = s("ours w", f"exec-server fs/writeFile {mib} MiB", "MiB/s")
    compared = []
    if earlier is not None:
        compared = [
            Ratio(
                f"fs/writeFile {mib} MiB over stdio (exec-server / exec-server --before)",
                ours_w,
                s("before w", f"exec-server --before fs/writeFile {mib} MiB", "MiB/s"),
            ),
            Ratio(
                f"fs/writeFile {mib} MiB, server CPU per write (exec-server / --before)",
                s("ours w cpu", f"exec-server CPU per {mib} MiB fs/writeFile", "ms"),
                s("before w cpu", f"exec-server --before CPU per {mib} MiB fs/writeFile", "ms"),
                lower_is_better=True,
            ),
        ]
    return [
        *compared,
        Ratio(
            "fs/getMetadata round trips, depth 1 (exec-server / reference)",
            s("ours md", "exec-server fs/getMetadata depth 1", "req/s"),
            s("ref md", "reference fs/getMetadata depth 1", "req/s"),
            target=GOALS["metadata"],
        ),
        Ratio(
            "fs/getMetadata round trips, depth 1 (reference / bare Twisted echo-RPC)",
            s("ref md", "reference fs/getMetadata depth 1", "req/s"),
            s("echo md", "echo-RPC fs/getMetadata depth 1", "req/s"),
        ),
        Ratio(
            "fs/getMetadata round trips, depth 1 (exec-server / bare Twisted echo-RPC)",
            s("ours md", "exec-server fs/getMetadata depth 1", "req/s"),
            s("echo md", "echo-RPC fs/getMetadata depth 1", "req/s"),
        ),
        Ratio(
            "fs/getMetadata depth 1, CPU per request (echo-RPC / reference)",
            s("echo md cpu", "echo-RPC CPU per fs/getMetadata", "us"),
            s("ref md cpu", "reference CPU per fs/getMetadata", "us"),
            lower_is_better=True,
        ),
        Ratio(
            "fs/getMetadata depth 1, server CPU per request (exec-server / reference)",
            s("ours md cpu", "exec-server CPU per fs/getMetadata", "us"),
            s("ref md cpu", "reference CPU per fs/getMetadata", "us"),
            lower_is_better=True,
        ),
        Ratio(
            f"fs/writeFile {mib} MiB over stdio (exec-server / reference)",
            ours_w,
            s("ref w", f"reference fs/writeFile {mib} MiB", "MiB/s"),
            target=GOALS["write"],
        ),
        Ratio(
            f"fs/writeFile {mib} MiB, server CPU per write (exec-server / reference)",
            s("ours w cpu", f"exec-server CPU per {mib} MiB fs/writeFile", "ms"),
            s("ref w cpu", f"reference CPU per {mib} MiB fs/writeFile", "ms"),
            lower_is_better=True,
        ),
        Ratio(
            f"fs/writeFile {mib} MiB (exec-server / plain write+fsync)",
            ours_w,
            s("fsync", f"write+fsync {mib} MiB", "MiB/s"),
            target=GOALS["write/fsync"],
        ),
        Ratio(
            f"fs/writeFile {mib} MiB (exec-server / pybase64 decode)",
            ours_w,
            s("decode", f"pybase64 decode of {mib} MiB", "MiB/s"),
        ),
        Ratio(
            f"fs/writeFile {mib} MiB (exec-server / memcpy)",
            ours_w,
            s("copy", f"memcpy {mib} MiB", "MiB/s"),
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--count", type=int, default=5000, help="round trips per server a round")
    parser.add_argument("--blocks", type=int, default=10, help="alternating blocks a round")
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--work", type=Path, default=None, help="directory written in")
    parser.add_argument(
        "--before",
        default=None,
        help="source tree of an earlier version (e.g. a git archive): its writes are measured "
        "in the same rounds",
    )
    args = parser.parse_args()
    print_header(f"against the reference ({os.cpu_count()} CPUs)")
    work = Path(tempfile.mkdtemp(prefix="bench-reference-", dir=args.work or Path.cwd()))
    try:
        results = run(work, args.rounds, args.count, args.mib * MiB, args.blocks, args.before)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for ratio in results:
        print(ratio.value.describe())
        print(ratio.baseline.describe())
        print(ratio.describe(), flush=True)
    paired = next(r for r in results if "getMetadata" in r.name).paired_ratios
    print(
        f"fs/getMetadata depth 1, per-round ratios: min {min(paired):.3f}, "
        f"median {statistics.median(paired):.3f}, max {max(paired):.3f}",
        flush=True,
    )
    print_header("end")


if __name__ == "__main__":
    main()
