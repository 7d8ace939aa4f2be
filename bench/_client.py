"""Shared pieces of the benchmarks: a fast blocking client of the server over stdio.

The client is written to stay out of the way of what it measures:

- it reads the server's stdout in big ``os.read`` calls (and enlarges that
  pipe, which it owns, so one read can return up to :data:`CLIENT_PIPE_BYTES`);
- it decodes every line with one typed ``msgspec`` decoder
  (``Decoder.decode_lines``), base64 chunks decoded with pybase64;
- requests are pre-rendered byte templates, written in batches.

Every benchmark runs the server from this working tree
(``python -m execserver`` with ``PYTHONPATH`` at the repository root).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import msgspec
import psutil
from pybase64 import b64decode

REPO_ROOT: Final = Path(__file__).resolve().parent.parent
MiB: Final = 1024 * 1024
#: Capacity the client gives the pipe carrying the server's stdout (Linux's
#: unprivileged maximum; the client owns both ends when it creates the pipe).
CLIENT_PIPE_BYTES: Final = 1 * MiB
READ_BYTES: Final = 4 * MiB
F_SETPIPE_SZ: Final = getattr(fcntl, "F_SETPIPE_SZ", 1031)


def child_env() -> dict[str, str]:
    """The environment given to processes the server starts."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}


def server_root() -> str:
    """The tree the server runs from: this one, or ``$BENCH_SERVER_ROOT`` (to compare trees)."""
    return os.environ.get("BENCH_SERVER_ROOT") or str(REPO_ROOT)


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = server_root() + (os.pathsep + old if old else "")
    return env


class Params(msgspec.Struct, rename="camel"):
    """Union of the notification params the benchmarks look at."""

    process_id: str | None = None
    stream: str | None = None
    #: Base64 text, decoded by :attr:`data` with pybase64 (SIMD, tens of GB/s;
    #: msgspec's own base64 decode would make this client the bottleneck).
    chunk: str | None = None
    seq: int | None = None
    exit_code: int | None = None

    @property
    def data(self) -> bytes:
        return b64decode(self.chunk, validate=True) if self.chunk else b""


class Message(msgspec.Struct):
    """Any server message: a response, an error or a notification."""

    id: int | str | None = None
    method: str | None = None
    params: Params | None = None
    result: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    error: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


_decoder: Final = msgspec.json.Decoder(Message)


class LineDecoder:
    """NDJSON bytes -> typed messages, across arbitrary read boundaries."""

    __slots__ = ("_rest",)

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, data: bytes) -> list[Message]:
        end = data.rfind(b"\n")
        if end < 0:
            self._rest += data
            return []
        if self._rest:
            data = self._rest + data
            end += len(self._rest)
        self._rest = data[end + 1 :]
        if end + 1 == len(data):
            return _decoder.decode_lines(data)
        return _decoder.decode_lines(memoryview(data)[: end + 1])


def render(message: Any) -> bytes:
    return msgspec.json.encode(message) + b"\n"


class ServerError(Exception):
    pass


class StdioClient:
    """The server as a child process, spoken to over its stdin/stdout."""

    def __init__(self, args: Sequence[str] = (), argv: Sequence[str] | None = None) -> None:
        command = list(argv) if argv is not None else [sys.executable, "-m", "execserver", *args]
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=server_env(),
            cwd=server_root(),
            bufsize=0,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._w = self.proc.stdin.fileno()
        self._r = self.proc.stdout.fileno()
        with contextlib.suppress(OSError):
            fcntl.fcntl(self._r, F_SETPIPE_SZ, CLIENT_PIPE_BYTES)
        self._decoder = LineDecoder()
        self.next_id = 1
        self.bytes_received = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the server process has used so far.

        Less sensitive than wall-clock rates to other load on the machine, so
        the better signal when comparing two versions of the server.
        """
        times = psutil.Process(self.proc.pid).cpu_times()
        return float(times.user + times.system)

    # --- writing ----------------------------------------------------------------

    def send_bytes(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = os.write(self._w, view)
            view = view[written:]

    def send(self, message: Any) -> None:
        self.send_bytes(render(message))

    def new_id(self) -> int:
        request_id = self.next_id
        self.next_id += 1
        return request_id

    # --- reading ----------------------------------------------------------------

    def read_raw(self) -> bytes:
        data = os.read(self._r, READ_BYTES)
        if not data:
            raise ServerError("server closed its stdout")
        self.bytes_received += len(data)
        return data

    def read_batch(self) -> list[Message]:
        """Block for the next read and return every complete message in it."""
        return self._decoder.feed(self.read_raw())

    def messages(self) -> Iterator[Message]:
        while True:
            yield from self.read_batch()

    def request(
        self, method: str, params: Any = None, on_other: Callable[[Message], None] | None = None
    ) -> Message:
        """Send one request and wait for its answer; other messages go to ``on_other``."""
        request_id = self.new_id()
        message: dict[str, Any] = {"id": request_id, "method": method}
        if params is not None:
            message["params"] = params
        self.send(message)
        for reply in self.messages():
            if reply.id == request_id and reply.method is None:
                if isinstance(reply.error, msgspec.Raw):
                    raise ServerError(f"{method}: {bytes(reply.error).decode()}")
                return reply
            if on_other is not None:
                on_other(reply)
        raise AssertionError("unreachable")

    def initialize(self) -> None:
        self.request("initialize", {"clientName": "bench"})
        self.send({"method": "initialized"})

    def start(self, process_id: str, argv: Sequence[str], tty: bool = False) -> None:
        self.send(start_request(self.new_id(), process_id, argv, tty))

    # --- ending -----------------------------------------------------------------

    def close(self, timeout: float = 10.0) -> int | None:
        """Close stdin (the server stops its processes and exits), drain, reap."""
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        deadline = time.monotonic() + timeout
        with contextlib.suppress(OSError):
            os.set_blocking(self._r, False)
            while time.monotonic() < deadline:
                try:
                    if not os.read(self._r, READ_BYTES):
                        break
                except BlockingIOError:
                    time.sleep(0.01)
        try:
            return self.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            assert self.proc.stdout is not None
            self.proc.stdout.close()

    def __enter__(self) -> StdioClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_request(
    request_id: int, process_id: str, argv: Sequence[str], tty: bool = False, cwd: str = "/tmp"
) -> dict[str, Any]:
    return {
        "id": request_id,
        "method": "process/start",
        "params": {
            "processId": process_id,
            "argv": list(argv),
            "cwd": cwd,
            "env": child_env(),
            "tty": tty,
        },
    }


# --- measuring and reporting ---------------------------------------------------


@attrs.frozen
class Series:
    """Repeated measurements of one quantity (higher is better unless noted)."""

    name: str
    unit: str
    values: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def spread(self) -> float:
        """(max - min) / median: how noisy the repeats were."""
        med = self.median
        return (max(self.values) - min(self.values)) / med if med else 0.0

    def describe(self) -> str:
        vals = ", ".join(f"{v:,.1f}" for v in self.values)
        return (
            f"{self.name}: median {self.median:,.1f} {self.unit} "
            f"(n={len(self.values)}, spread {self.spread:.0%}; runs: {vals})"
        )


@attrs.frozen
class Ratio:
    """A figure as a ratio to a baseline measured in the same run."""

    name: str
    value: Series
    baseline: Series
    target: float | None = None
    #: True when smaller is better (RSS): the ratio is then baseline-relative
    #: the other way round and compared as "at most".
    lower_is_better: bool = False

    @property
    def ratio(self) -> float:
        return self.value.median / self.baseline.median

    @property
    def paired_ratios(self) -> tuple[float, ...]:
        """Ratios of each repeat to the baseline of the same round."""
        return tuple(v / b for v, b in zip(self.value.values, self.baseline.values, strict=False))

    @property
    def met(self) -> bool | None:
        if self.target is None:
            return None
        if self.lower_is_better:
            return self.ratio <= self.target
        return self.ratio >= self.target

    def describe(self) -> str:
        paired = ", ".join(f"{r:.3f}" for r in self.paired_ratios)
        verdict = ""
        if self.target is not None:
            sign = "<=" if self.lower_is_better else ">="
            verdict = f"; target {sign} {self.target}: {'MET' if self.met else 'MISSED'}"
        return (
            f"{self.name}: ratio {self.ratio:.3f} = {self.value.median:,.1f} / "
            f"{self.baseline.median:,.1f} {self.value.unit} (per-round ratios: {paired}{verdict})"
        )


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def raw_pipe_rate(total_bytes: int, one_core: bool = False, tries: int = 3) -> float:
    """MB/s (10**6 bytes) of ``head -c N /dev/zero | cat >/dev/null``, median of ``tries``.

    The raw pipe is bimodal here: about 4.5 GB/s when ``head`` and ``cat``
    run on different cores, about 1.8 GB/s when they share one (which is what
    earlier single-core measurements here saw). ``one_core`` pins both to CPU 0 to measure
    the second mode on purpose. One run takes ~0.1 s, hence the median.
    """
    command = f"head -c {total_bytes} /dev/zero | cat >/dev/null"
    if one_core:
        command = f"taskset -c 0 sh -c '{command}'"
    rates = []
    for _ in range(tries):
        seconds = timed(lambda: subprocess.run(command, shell=True, check=True))
        rates.append(total_bytes / seconds / 1e6)
    return statistics.median(rates)


def print_header(title: str) -> None:
    load = os.getloadavg()
    print(f"== {title}  (load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f})", flush=True)


# --- the client benchmarks (bench_client.py, bench_aio_client.py) ---------------------

#: A Twisted client run in its own interpreter: ``head -c TOTAL /dev/zero``,
#: output counted in a listener until ``process/closed``; prints payload MB/s.
#: ``argv``: TOTAL [URL] (no URL: ``spawn_local`` over stdio; a URL:
#: ``connect_websocket``).
TWISTED_END_TO_END = """
import sys, time
from twisted.internet import defer, task
from execserver.client import ExecServerClient

async def main(reactor):
    total = int(sys.argv[1])
    if len(sys.argv) > 2:
        client = await ExecServerClient.connect_websocket(reactor, sys.argv[2])
    else:
        client = await ExecServerClient.spawn_local(reactor)
    received = 0
    def count(event):
        nonlocal received
        received += len(event.chunk)
    start = time.perf_counter()
    proc = await client.start_process(["head", "-c", str(total), "/dev/zero"])
    proc.add_output_listener(count)
    await proc.closed()
    seconds = time.perf_counter() - start
    await client.close()
    assert received == total, (received, total)
    print(total / seconds / 1e6)

task.react(lambda r: defer.Deferred.fromCoroutine(main(r)))
"""


def child_rate(script: str, total_bytes: int, url: str | None = None) -> float:
    """Run ``script`` (``python -c``) with TOTAL [URL]; the rate its last line prints."""
    out = subprocess.run(
        [sys.executable, "-c", script, str(total_bytes), *([url] if url else [])],
        env=server_env(),
        cwd=str(REPO_ROOT),
        check=True,
        capture_output=True,
        text=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def twisted_end_to_end_rate(total_bytes: int, url: str | None = None) -> float:
    """Payload MB/s through the Twisted client (``spawn_local``, or ``url``) in its own
    interpreter."""
    return child_rate(TWISTED_END_TO_END, total_bytes, url)


def stream_round(
    total_bytes: int, decoders: Sequence[Callable[[list[bytes]], float]]
) -> tuple[list[float], float]:
    """One round of the client benchmarks' stream figures: (each decoder's
    payload MB/s on one captured server stream, the server's stdout MB/s).

    The stream is ``head -c TOTAL /dev/zero`` in pipe mode, the server's raw
    stdout reads. The first decoder runs once unmeasured first: whichever
    decoder runs first pays for growing the heap (glibc raises its mmap
    threshold after the first large free), which would favour the later ones.
    The server's stdout rate is what the lean blocking client gets end to end,
    so one run is the baseline of both the headroom and the end-to-end figures.
    """
    from bench.bench_throughput import capture_stream, server_run

    reads = capture_stream(total_bytes)
    decoders[0](reads)
    rates = [decode(reads) for decode in decoders]
    del reads
    return rates, server_run(total_bytes, tty=False)[0]


def client_bench_main(
    doc: str | None, title: str, run: Callable[[int, int], Sequence[Ratio | Series]]
) -> None:
    """``--rounds``, ``--mib``, ``--json``; prints a header, then each figure of ``run``."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args()
    print_header(f"{title} ({os.cpu_count()} CPUs)")
    results = run(args.rounds, args.mib)
    for result in results:
        print(result.describe(), flush=True)
    if args.json:
        print(
            json.dumps({r.name: (r.ratio if isinstance(r, Ratio) else r.median) for r in results})
        )
