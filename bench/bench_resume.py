"""Resumable sessions: resume latency and replay rate, as ratios to baselines.

Against a real server (``python -m execserver --listen ws://127.0.0.1:0``),
with the client library, all in one run:

- resume latency: a session with 10 (then 100) live processes, each having
  written one chunk and now quiet; the client's TCP connection is aborted
  and the clock runs from the cut until a new connection has resumed the
  session and every handle is caught up (``initialize`` with
  ``resumeSessionId`` + one ``process/read`` per process). Baseline: a fresh
  connect + ``initialize`` in the same run.
- replay rate: a process writes ``--mib`` MiB while its session is detached
  (retention large enough to keep it all); after the resume the client
  catches up through ``process/read``. Baseline: the same amount streamed
  live (``process/output`` notifications) to an attached client.

    python bench/bench_resume.py [--rounds 5] [--mib 32]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from twisted.internet import defer, task

from bench._client import Ratio, Series, print_header
from execserver.client import ConnectOptions, ExecServerClient

REPO = Path(__file__).resolve().parent.parent
TTL_MS = 60_000
QUIET = "printf x; exec sleep 600"


class Server:
    def __init__(self, *args: str) -> None:
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "execserver", "--listen", "ws://127.0.0.1:0", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            cwd=str(REPO),
        )

    def url(self, timeout: float = 10.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.log.seek(0)
            found = re.search(rb"listening on (ws://[\d.]+:\d+)", self.log.read())
            if found:
                return found.group(1).decode()
            time.sleep(0.01)
        raise RuntimeError("no listening banner")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


async def connect(reactor: Any, url: str, **options: Any) -> ExecServerClient:
    return await ExecServerClient.connect_websocket(
        reactor, url, ConnectOptions("bench-resume", **options)
    )


def cut(client: ExecServerClient) -> None:
    """Abort the WebSocket's TCP connection, as a network failure would."""
    channel: Any = client.rpc._sink
    channel.transport.abortConnection()


async def fresh_connect_seconds(reactor: Any, url: str) -> float:
    start = time.perf_counter()
    client = await connect(reactor, url)
    elapsed = time.perf_counter() - start
    await client.close()
    return elapsed


async def resume_seconds(reactor: Any, url: str, processes: int) -> float:
    old = await connect(reactor, url, session_ttl_ms=TTL_MS)
    handles = [
        await old.start_process(["sh", "-c", QUIET], process_id=f"p{i}", cwd="/")
        for i in range(processes)
    ]
    while any(h.last_seq < 1 for h in handles):
        await task.deferLater(reactor, 0.005, lambda: None)
    lost = old.when_disconnected()
    start = time.perf_counter()
    cut(old)
    await lost
    new = await connect(reactor, url, resume_session_id=old.session_id)
    await new.adopt(old)
    elapsed = time.perf_counter() - start
    for h in handles:
        h.terminate(grace_ms=0)
    await new.close()
    return elapsed


async def replay_rate(reactor: Any, url: str, mib: int) -> float:
    """MB/s of catching up ``mib`` MiB retained while detached."""
    old = await connect(reactor, url, session_ttl_ms=TTL_MS)
    folder = tempfile.mkdtemp()
    go, done = f"{folder}/go", f"{folder}/done"
    script = (
        f"while [ ! -e {go} ]; do sleep 0.01; done; head -c {mib << 20} /dev/zero; touch {done}"
    )
    handle = await old.start_process(["sh", "-c", script], cwd="/")
    lost = old.when_disconnected()
    cut(old)
    await lost
    Path(go).touch()
    # The child writes everything into the retained buffer meanwhile.
    while not os.path.exists(done):
        await task.deferLater(reactor, 0.02, lambda: None)
    received = 0

    def count(event: Any) -> None:
        nonlocal received
        received += len(event.chunk)

    handle.add_output_listener(count)
    start = time.perf_counter()
    new = await connect(reactor, url, resume_session_id=old.session_id)
    await new.adopt(old)
    elapsed = time.perf_counter() - start
    for name in (go, done):
        os.unlink(name)
    os.rmdir(folder)
    await new.close()
    assert received == mib << 20, received
    return (mib << 20) / elapsed / 1e6


async def live_rate(reactor: Any, url: str, mib: int) -> float:
    client = await connect(reactor, url)
    received = 0

    def count(event: Any) -> None:
        nonlocal received
        received += len(event.chunk)

    start = time.perf_counter()
    handle = await client.start_process(["head", "-c", str(mib << 20), "/dev/zero"], cwd="/")
    handle.add_output_listener(count)
    await handle.closed()
    elapsed = time.perf_counter() - start
    await client.close()
    assert received == mib << 20, received
    return (mib << 20) / elapsed / 1e6


async def main(reactor: Any, rounds: int, mib: int) -> None:
    print_header(f"bench_resume: {rounds} rounds, {mib} MiB replayed")
    server = Server("--retained-output-bytes", str((mib + 8) << 20))
    try:
        url = server.url()
        fresh: list[float] = []
        resume10: list[float] = []
        resume100: list[float] = []
        replay: list[float] = []
        live: list[float] = []
        for _ in range(rounds):
            fresh.append(await fresh_connect_seconds(reactor, url) * 1000)
            resume10.append(await resume_seconds(reactor, url, 10) * 1000)
            resume100.append(await resume_seconds(reactor, url, 100) * 1000)
            live.append(await live_rate(reactor, url, mib))
            replay.append(await replay_rate(reactor, url, mib))
        base = Series("fresh connect + initialize", "ms", tuple(fresh))
        for series in (
            base,
            Series("resume, 10 processes", "ms", tuple(resume10)),
            Series("resume, 100 processes", "ms", tuple(resume100)),
            Series("live streaming", "MB/s", tuple(live)),
            Series("replay after resume", "MB/s", tuple(replay)),
        ):
            print(series.describe())
        print(
            Ratio(
                "resume latency, 10 processes", Series("", "ms", tuple(resume10)), base
            ).describe()
        )
        print(
            Ratio(
                "resume latency, 100 processes", Series("", "ms", tuple(resume100)), base
            ).describe()
        )
        print(
            Ratio(
                "replay rate",
                Series("", "MB/s", tuple(replay)),
                Series("", "MB/s", tuple(live)),
            ).describe()
        )
    finally:
        server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mib", type=int, default=32)
    opts = parser.parse_args()
    task.react(lambda reactor: defer.Deferred.fromCoroutine(main(reactor, opts.rounds, opts.mib)))
