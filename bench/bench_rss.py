"""Server memory: idle, with 500 live processes, and peak under a stalled client.

- idle: RSS of a server that has answered ``initialize`` (median of samples
  over one second). Baseline: the RSS of a bare Twisted reactor serving
  stdio (``bench/echo_server.py``) measured the same way in the same run.
- 500 live processes: RSS once 500 ``sleep`` children have been started.
- per session: RSS growth per WebSocket session (connected and
  initialized; ``--sessions`` of them) over the same server idle.
- per retained MiB: RSS growth per MiB of output retained for
  ``process/read`` (``--retained`` processes each write 1 MiB, the default
  ``--retained-output-bytes``, and exit; the figure is taken while they are
  still readable). These three are docs/deployment.md's sizing figures.
- stalled client: a child writes 1 GiB of ``/dev/zero``; the client reads
  nothing for ``--stall`` seconds, then drains and decodes everything (every
  byte is counted). RSS is sampled every 10 ms throughout; the figure is the
  peak. Target: peak <= idle + 32 MiB (flow control stops reading the child's
  pipe above the high-water mark instead of buffering).

    python bench/bench_rss.py [--rounds 3] [--stall 5] [--processes 500]
        [--sessions 200] [--retained 64]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._client import MiB, Ratio, Series, StdioClient, print_header, server_env
from bench.bench_rtt import ECHO_SERVER, pipelined_rate
from bench.bench_throughput import print_figures

GiB = 1024 * MiB


def rss_mib(pid: int) -> float:
    return float(psutil.Process(pid).memory_info().rss) / MiB


def settled_rss_mib(pid: int, seconds: float = 1.0) -> float:
    samples = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        samples.append(rss_mib(pid))
        time.sleep(0.05)
    return statistics.median(samples)


def bare_twisted_idle_mib() -> float:
    with StdioClient(argv=[sys.executable, str(ECHO_SERVER)]) as client:
        pipelined_rate(client, 10, 1)
        return settled_rss_mib(client.pid)


def idle_and_loaded_mib(processes: int) -> tuple[float, float]:
    """(idle RSS, RSS with ``processes`` live ``sleep`` children), MiB."""
    with StdioClient(["--max-processes", str(processes + 10)]) as client:
        client.initialize()
        idle = settled_rss_mib(client.pid)
        for i in range(processes):
            client.start(f"s{i}", ["sleep", "600"])
        answered = 0
        while answered < processes:
            for message in client.read_batch():
                if message.id is not None and message.method is None:
                    answered += 1
        loaded = settled_rss_mib(client.pid)
    return idle, loaded


def retained_growth_mib(processes: int) -> tuple[float, float]:
    """(idle RSS, RSS with ``processes`` x 1 MiB of output retained), MiB."""
    with StdioClient(["--max-processes", str(processes + 10)]) as client:
        client.initialize()
        idle = settled_rss_mib(client.pid)
        for i in range(processes):
            client.start(f"r{i}", ["head", "-c", str(MiB), "/dev/zero"])
        closed = 0
        while closed < processes:
            for message in client.read_batch():
                if message.method == "process/closed":
                    closed += 1
        # Exited processes stay readable for --exit-retention-ms (30 s).
        retained = settled_rss_mib(client.pid)
    return idle, retained


def sessions_growth_mib(sessions: int) -> tuple[float, float]:
    """(idle RSS, RSS with ``sessions`` initialized WebSocket sessions), MiB."""
    from websockets.sync.client import connect

    argv = [sys.executable, "-m", "execserver", "--listen", "ws://127.0.0.1:0"]
    argv += ["--max-connections", str(sessions + 10)]
    server = subprocess.Popen(argv, env=server_env(), stderr=subprocess.PIPE, text=True)
    try:
        assert server.stderr is not None
        url = None
        while url is None:
            line = server.stderr.readline()
            if not line:
                raise RuntimeError("the server exited before listening")
            found = re.search(r"listening on (ws://\S+)", line)
            url = found.group(1) if found else None
        idle = settled_rss_mib(server.pid)
        hello = json.dumps({"id": 1, "method": "initialize", "params": {"clientName": "b"}})
        with contextlib.ExitStack() as opened:
            for _ in range(sessions):
                ws = opened.enter_context(connect(url, max_size=None, open_timeout=30))
                ws.send(hello)
                json.loads(ws.recv(timeout=30))
                ws.send(json.dumps({"method": "initialized", "params": {}}))
            loaded = settled_rss_mib(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=30)
    return idle, loaded


class _Sampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self._process = psutil.Process(pid)
        self._stop_event = threading.Event()
        self.peak = 0

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self.peak = max(self.peak, self._process.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.01)

    def stop(self) -> float:
        self._stop_event.set()
        self.join()
        return self.peak / MiB


def stalled_peak_mib(total_bytes: int, stall_seconds: float) -> tuple[float, float]:
    """(idle RSS, peak RSS) of a server streaming to a client that stalls, MiB."""
    with StdioClient() as client:
        client.initialize()
        idle = settled_rss_mib(client.pid)
        sampler = _Sampler(client.pid)
        sampler.start()
        client.start("big", ["head", "-c", str(total_bytes), "/dev/zero"])
        time.sleep(stall_seconds)
        payload = 0
        closed = False
        while not closed:
            for message in client.read_batch():
                if message.method == "process/output":
                    assert message.params is not None
                    payload += len(message.params.data)
                elif message.method == "process/closed":
                    closed = True
        peak = sampler.stop()
    if payload != total_bytes:
        raise AssertionError(f"received {payload} bytes, expected {total_bytes}")
    return idle, peak


def run(
    rounds: int = 3,
    stall: float = 5.0,
    processes: int = 500,
    stalled_gib: int = 1,
    sessions: int = 200,
    retained: int = 64,
) -> list[Ratio | Series]:
    bare: list[float] = []
    idle: list[float] = []
    loaded: list[float] = []
    stalled_idle: list[float] = []
    peak: list[float] = []
    per_session: list[float] = []
    per_retained: list[float] = []
    for _ in range(rounds):
        i, loaded_mib = sessions_growth_mib(sessions)
        per_session.append((loaded_mib - i) * 1024 / sessions)
        i, loaded_mib = retained_growth_mib(retained)
        per_retained.append((loaded_mib - i) / retained)
        bare.append(bare_twisted_idle_mib())
        i, loaded_mib = idle_and_loaded_mib(processes)
        idle.append(i)
        loaded.append(loaded_mib)
        i, p = stalled_peak_mib(stalled_gib * GiB, stall)
        stalled_idle.append(i)
        peak.append(p)
    growth = tuple(p - i for p, i in zip(peak, stalled_idle, strict=True))
    per_process = tuple((m - i) * 1024 / processes for m, i in zip(loaded, idle, strict=True))
    idle_series = Series("server idle RSS", "MiB", tuple(idle))
    return [
        Ratio(
            "idle RSS (server / bare Twisted stdio echo)",
            idle_series,
            Series("bare Twisted idle RSS", "MiB", tuple(bare)),
            lower_is_better=True,
        ),
        Ratio(
            f"RSS with {processes} live processes (server loaded / server idle)",
            Series(f"server RSS, {processes} processes", "MiB", tuple(loaded)),
            idle_series,
            lower_is_better=True,
        ),
        Series(f"RSS per live process ({processes} sleeps)", "KiB", per_process),
        Series(f"RSS per WebSocket session ({sessions} initialized)", "KiB", tuple(per_session)),
        Series(
            f"RSS per MiB of retained output ({retained} processes x 1 MiB)",
            "MiB",
            tuple(per_retained),
        ),
        Ratio(
            f"peak RSS, {stalled_gib} GiB with the client stalled {stall:g} s "
            "(peak / idle of the same server)",
            Series("server peak RSS", "MiB", tuple(peak)),
            Series("same server idle RSS", "MiB", tuple(stalled_idle)),
            lower_is_better=True,
        ),
        Series("peak growth over idle (target <= 32 MiB)", "MiB", growth),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stall", type=float, default=5.0)
    parser.add_argument("--processes", type=int, default=500)
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--retained", type=int, default=64)
    args = parser.parse_args()
    print_header("memory")
    figures = run(
        args.rounds, args.stall, args.processes, sessions=args.sessions, retained=args.retained
    )
    print_figures(figures)


if __name__ == "__main__":
    main()
