"""Benchmarks of the fs/* methods against the real server over stdio.

Prints ratios to baselines measured in the same run, never asserts:

- ``fs/readFile`` of a 64 MiB file, MB/s, vs ``cat FILE > /dev/null``;
- ``fs/writeFile`` of 64 MiB, MB/s, vs ``cp SRC DST``;
- ``fs/getMetadata`` round trips per second with 1 and 64 requests in flight,
  vs ``os.stat`` calls per second in this process (a ceiling, not a peer).

Usage: ``python -m bench.bench_fs [--size-mib 64] [--repeat 5] [--seconds 3]``
"""

from __future__ import annotations

import argparse
import base64
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

REPO_ROOT = Path(__file__).resolve().parent.parent


class StdioClient:
    """A blocking JSON-RPC client for ``python -m execserver`` over pipes."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "execserver", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=str(REPO_ROOT),
            bufsize=1 << 20,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin = self.proc.stdin
        self.stdout = self.proc.stdout
        self.next_id = 1
        self.encoder = msgspec.json.Encoder()

    def send(self, method: str, params: Any) -> int:
        request_id = self.next_id
        self.next_id += 1
        self.stdin.write(
            self.encoder.encode({"id": request_id, "method": method, "params": params})
        )
        self.stdin.write(b"\n")
        return request_id

    def flush(self) -> None:
        self.stdin.flush()

    def receive(self) -> dict[str, Any]:
        while True:
            line = self.stdout.readline()
            if not line:
                raise ConnectionError("server closed its output")
            message: dict[str, Any] = msgspec.json.decode(line)
            if "id" in message:
                if "error" in message:
                    raise RuntimeError(message["error"])
                return message

    def call(self, method: str, params: Any) -> Any:
        self.send(method, params)
        self.flush()
        return self.receive()["result"]

    def handshake(self) -> None:
        self.call("initialize", {"clientName": "bench"})
        self.stdin.write(b'{"method":"initialized","params":{}}\n')
        self.flush()

    def close(self) -> None:
        self.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def timed(func: Any, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        func()
        samples.append(time.perf_counter() - start)
    return min(samples)  # best of N: medians are noisy on 2 cores


def bench_read_write(client: StdioClient, work: Path, size: int, repeat: int) -> None:
    source = work / "source.bin"
    with open(source, "wb") as f:
        f.write(os.urandom(size))
    mib = size / 2**20

    def cat() -> None:
        subprocess.run(f"cat '{source}' > /dev/null", shell=True, check=True)

    def read() -> None:
        result = client.call("fs/readFile", {"path": str(source)})
        assert len(result["dataBase64"]) == (size + 2) // 3 * 4

    def base64_pipe() -> None:
        # Context, not the brief's baseline: the same base64 text produced by
        # coreutils and read from a pipe by Python, i.e. the transfer alone.
        with subprocess.Popen(["base64", "-w0", str(source)], stdout=subprocess.PIPE) as proc:
            assert proc.stdout is not None
            text = proc.stdout.readline()
        assert len(text) == (size + 2) // 3 * 4

    cat()  # warm the page cache
    cat_s = timed(cat, repeat)
    pipe_s = timed(base64_pipe, repeat)
    read_s = timed(read, repeat)
    print(
        f"fs/readFile {mib:.0f} MiB: {mib / read_s:8.1f} MiB/s   "
        f"cat > /dev/null: {mib / cat_s:8.1f} MiB/s   ratio {cat_s / read_s:.3f}   "
        f"(base64 | pipe into Python: {mib / pipe_s:.1f} MiB/s, ratio {pipe_s / read_s:.3f})"
    )

    payload = base64.b64encode(source.read_bytes()).decode()
    target = work / "target.bin"

    def cp() -> None:
        subprocess.run(["cp", str(source), str(work / "cp.bin")], check=True)

    def write() -> None:
        client.call("fs/writeFile", {"path": str(target), "dataBase64": payload})

    cp_s = timed(cp, repeat)
    write_s = timed(write, repeat)
    assert target.stat().st_size == size
    print(
        f"fs/writeFile {mib:.0f} MiB: {mib / write_s:8.1f} MiB/s   "
        f"cp: {mib / cp_s:8.1f} MiB/s   ratio {cp_s / write_s:.3f}"
    )


def rss_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def bench_memory(work: Path, size: int) -> None:
    """Peak server RSS above its idle RSS, in multiples of the payload size.

    A fresh server per operation, so each peak belongs to one operation. It
    counts every copy in the process: the fs code's (file + base64 text for
    a read; request line + decoded data for a write) and the dispatcher's and
    transport's (encoding the response line, buffering it for the pipe).
    """
    source = work / "source.bin"
    payload = base64.b64encode(source.read_bytes()).decode()
    for name, method, params in (
        ("fs/readFile", "fs/readFile", {"path": str(source)}),
        ("fs/writeFile", "fs/writeFile", {"path": str(work / "m.bin"), "dataBase64": payload}),
    ):
        client = StdioClient()
        try:
            client.handshake()
            client.call("fs/getMetadata", {"path": str(source)})  # start the pool
            idle = rss_kib(client.proc.pid, "VmRSS")
            client.call(method, params)
            peak = rss_kib(client.proc.pid, "VmHWM")
        finally:
            client.close()
        extra = (peak - idle) * 1024
        print(
            f"{name} {size / 2**20:.0f} MiB: server peak RSS {extra / 2**20:7.1f} MiB above idle "
            f"= {extra / size:.2f}x the data"
        )


def bench_metadata(client: StdioClient, work: Path, seconds: float) -> None:
    target = str(work / "source.bin")

    def stat_rate() -> float:
        count = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            for _ in range(1000):
                os.stat(target)
            count += 1000
        return count / (time.perf_counter() - start)

    baseline = stat_rate()
    for depth in (1, 64):
        in_flight = 0
        done = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            while in_flight < depth:
                client.send("fs/getMetadata", {"path": target})
                in_flight += 1
            client.flush()
            client.receive()
            in_flight -= 1
            done += 1
        for _ in range(in_flight):
            client.receive()
        rate = done / (time.perf_counter() - start)
        print(
            f"fs/getMetadata depth {depth:2d}: {rate:9.0f} req/s   "
            f"os.stat in-process: {baseline:9.0f}/s   ratio {rate / baseline:.4f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-fs-"))
    client = StdioClient()
    try:
        client.handshake()
        bench_read_write(client, work, args.size_mib * 2**20, args.repeat)
        bench_metadata(client, work, args.seconds)
        bench_memory(work, args.size_mib * 2**20)
    finally:
        client.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
