"""Output throughput through the server over stdio, as ratios to raw baselines.

- pipe: a child writes N bytes of ``/dev/zero`` (``head -c``) to its stdout;
  the client decodes every ``process/output`` (base64 included) until
  ``process/closed``. Baseline: ``head -c N /dev/zero | cat >/dev/null``,
  as is (the issue's baseline) and pinned to one core (see
  ``raw_pipe_rate``: the raw pipe is bimodal on these machines).
- pty: the same child on a PTY (64 MiB). Baseline: the same child on a raw
  ``pty.openpty()`` read by plain Python ``os.read`` calls.
- client: the client's own decode rate on a captured server stream, to show
  it is not the bottleneck.

Rates are payload MB/s (10**6 bytes of child output per second). Each round
measures the baseline and the server back to back; the figure is the median.

    python bench/bench_throughput.py [--rounds 5] [--pipe-mib 256] [--pty-mib 64]
"""

from __future__ import annotations

import argparse
import os
import pty
import subprocess
import time

if __package__ in (None, ""):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._client import (
    LineDecoder,
    MiB,
    Ratio,
    Series,
    StdioClient,
    print_header,
    raw_pipe_rate,
)


def _drain_until_closed(client: StdioClient) -> int:
    """Decode every message until ``process/closed``; return payload bytes."""
    payload = 0
    while True:
        for message in client.read_batch():
            method = message.method
            if method == "process/output":
                assert message.params is not None
                payload += len(message.params.data)
            elif method == "process/closed":
                return payload


def server_rate(total_bytes: int, tty: bool) -> float:
    """Payload MB/s of ``head -c N /dev/zero`` streamed through the server."""
    return server_run(total_bytes, tty)[0]


def server_run(total_bytes: int, tty: bool) -> tuple[float, float]:
    """(payload MB/s, server CPU seconds per GiB of payload) of one run."""
    with StdioClient() as client:
        client.initialize()
        cpu_before = client.cpu_seconds()
        start = time.perf_counter()
        client.start("p", ["head", "-c", str(total_bytes), "/dev/zero"], tty=tty)
        payload = _drain_until_closed(client)
        seconds = time.perf_counter() - start
        cpu = client.cpu_seconds() - cpu_before
    if payload != total_bytes:
        raise AssertionError(f"received {payload} bytes of output, expected {total_bytes}")
    return total_bytes / seconds / 1e6, cpu / (total_bytes / 2**30)


def raw_pty_rate(total_bytes: int) -> float:
    """Payload MB/s of the same child read from a raw ``pty.openpty`` master."""
    master, slave = pty.openpty()
    start = time.perf_counter()
    child = subprocess.Popen(
        ["head", "-c", str(total_bytes), "/dev/zero"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
    )
    os.close(slave)
    received = 0
    try:
        while True:
            try:
                # 64 KiB: a PTY yields <= 4 KiB a read, and a bigger buffer only
                # costs an mmap-sized allocation per read (see spawn.PTY_READ_SIZE).
                data = os.read(master, 64 * 1024)
            except OSError:  # EIO: slave closed and drained
                break
            if not data:
                break
            received += len(data)
    finally:
        os.close(master)
        child.wait()
    seconds = time.perf_counter() - start
    if received != total_bytes:
        raise AssertionError(f"raw pty read {received} bytes, expected {total_bytes}")
    return total_bytes / seconds / 1e6


def capture_stream(total_bytes: int) -> list[bytes]:
    """The server's raw stdout reads for one pipe run, undecoded."""
    reads: list[bytes] = []
    with StdioClient() as client:
        client.initialize()
        client.start("p", ["head", "-c", str(total_bytes), "/dev/zero"])
        tail = b""
        while True:
            data = client.read_raw()
            reads.append(data)
            if b'"process/closed"' in tail + data:
                break
            tail = data[-64:]
    return reads


def client_decode_rate(reads: list[bytes]) -> float:
    """Payload MB/s the client decodes a captured stream at (no server involved)."""
    decoder = LineDecoder()
    payload = 0
    start = time.perf_counter()
    for data in reads:
        for message in decoder.feed(data):
            if message.method == "process/output":
                assert message.params is not None
                payload += len(message.params.data)
    seconds = time.perf_counter() - start
    return payload / seconds / 1e6


def run(rounds: int = 5, pipe_mib: int = 256, pty_mib: int = 64) -> list[Ratio | Series]:
    pipe_bytes = pipe_mib * MiB
    pty_bytes = pty_mib * MiB
    raw: list[float] = []
    raw_one_core: list[float] = []
    server: list[float] = []
    server_cpu: list[float] = []
    raw_pty: list[float] = []
    server_pty: list[float] = []
    server_pty_cpu: list[float] = []
    decode: list[float] = []
    for _ in range(rounds):
        raw.append(raw_pipe_rate(pipe_bytes))
        raw_one_core.append(raw_pipe_rate(pipe_bytes, one_core=True))
        rate, cpu = server_run(pipe_bytes, tty=False)
        server.append(rate)
        server_cpu.append(cpu)
        raw_pty.append(raw_pty_rate(pty_bytes))
        rate, cpu = server_run(pty_bytes, tty=True)
        server_pty.append(rate)
        server_pty_cpu.append(cpu)
    for _ in range(rounds):
        decode.append(client_decode_rate(capture_stream(64 * MiB)))
    pipe_series = Series("server stdout", "MB/s", tuple(server))
    return [
        Ratio(
            f"pipe stdout {pipe_mib} MiB (server / raw head|cat)",
            pipe_series,
            Series("raw pipe", "MB/s", tuple(raw)),
            target=0.17,
        ),
        Ratio(
            f"pipe stdout {pipe_mib} MiB (server / raw head|cat pinned to one core)",
            pipe_series,
            Series("raw pipe, one core", "MB/s", tuple(raw_one_core)),
            target=0.17,
        ),
        Ratio(
            f"pty output {pty_mib} MiB (server / raw pty.openpty)",
            Series("server pty", "MB/s", tuple(server_pty)),
            Series("raw pty", "MB/s", tuple(raw_pty)),
            target=0.6,
        ),
        Ratio(
            "client decode headroom (client decode / server stdout)",
            Series("client decode", "MB/s", tuple(decode)),
            pipe_series,
        ),
        Series("server CPU per GiB of pipe output", "CPU-s/GiB", tuple(server_cpu)),
        Series("server CPU per GiB of pty output", "CPU-s/GiB", tuple(server_pty_cpu)),
    ]


def print_figures(figures: list[Ratio | Series]) -> None:
    for figure in figures:
        if isinstance(figure, Ratio):
            print(figure.value.describe())
            print(figure.baseline.describe())
        print(figure.describe(), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pipe-mib", type=int, default=256)
    parser.add_argument("--pty-mib", type=int, default=64)
    args = parser.parse_args()
    print_header("throughput")
    print_figures(run(args.rounds, args.pipe_mib, args.pty_mib))


if __name__ == "__main__":
    main()
