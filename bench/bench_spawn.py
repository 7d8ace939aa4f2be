"""``process/start`` -> ``process/exited`` of ``true``, as a ratio to bare Twisted.

- server: the client sends ``process/start`` of ``["true"]`` with ``cwd``
  ``/tmp`` and counts ``process/exited`` notifications, one at a time
  (sequential) and with 32 starts in flight (a new start is sent for each
  exit).
- baseline: a bare Twisted reactor in its own process running
  ``reactor.spawnProcess`` of ``/usr/bin/true`` with no ``path`` (Twisted's
  posix_spawn fast path), relaunching on each ``processEnded``, with the same
  depths.
- containment: the same server loop with ``--process-containment cgroup``
  and ``subreaper``, each as a ratio to ``--process-containment none`` (the
  process group only) measured in the same round. The cgroup row is skipped
  on a host without a writable cgroup v2.

    python bench/bench_spawn.py [--rounds 5] [--count 300] [--no-containment]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._client import (
    Ratio,
    Series,
    ServerError,
    StdioClient,
    child_env,
    print_header,
    render,
    server_env,
    server_root,
    start_request,
)

DEPTHS = (1, 32)


def server_spawn_rate(count: int, depth: int) -> float:
    """Starts per second (start sent -> exited received) through the server."""
    return server_spawn_measure(count, depth)[0]


def server_spawn_measure(
    count: int, depth: int, containment: str | None = None
) -> tuple[float, float]:
    """Starts per second, and server CPU microseconds per start.

    The CPU figure (user + system of the server, which includes the kernel's
    cgroup work) is far less disturbed by other load than the rate.
    """
    args = ["--process-containment", containment] if containment else []
    with StdioClient(args) as client:
        client.initialize()
        sent = 0
        done = 0
        cpu = client.cpu_seconds()
        start = time.perf_counter()

        def requests(n: int) -> bytes:
            nonlocal sent
            out = []
            for _ in range(n):
                out.append(render(start_request(client.new_id(), f"p{sent}", ["true"])))
                sent += 1
            return b"".join(out)

        client.send_bytes(requests(min(depth, count)))
        while done < count:
            finished = 0
            for message in client.read_batch():
                if message.method == "process/exited":
                    finished += 1
                elif isinstance(message.error, msgspec.Raw):
                    raise ServerError(repr(message))
            done += finished
            more = min(finished, count - sent)
            if more > 0:
                client.send_bytes(requests(more))
        seconds = time.perf_counter() - start
        cpu = client.cpu_seconds() - cpu
    return count / seconds, cpu / count * 1e6


def bare_twisted_rate(count: int, depth: int) -> float:
    """Runs :func:`_bare_main` in a fresh interpreter (a reactor runs once)."""
    out = subprocess.run(
        [sys.executable, __file__, "--bare", str(count), str(depth)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    rate: float = json.loads(out)["rate"]
    return rate


def _bare_main(count: int, depth: int) -> None:
    from twisted.internet import reactor as _reactor
    from twisted.internet.protocol import ProcessProtocol
    from twisted.python.failure import Failure

    reactor: Any = _reactor
    executable = shutil.which("true") or "/bin/true"
    env = child_env()
    state = {"sent": 0, "done": 0}
    start = 0.0
    result: dict[str, float] = {}

    class Child(ProcessProtocol):
        def processEnded(self, reason: Failure) -> None:
            state["done"] += 1
            if state["done"] == count:
                result["rate"] = count / (time.perf_counter() - start)
                reactor.stop()
            elif state["sent"] < count:
                launch()

    def launch() -> None:
        state["sent"] += 1
        reactor.spawnProcess(Child(), executable, ["true"], env=env)

    def begin() -> None:
        nonlocal start
        start = time.perf_counter()
        for _ in range(min(depth, count)):
            launch()

    reactor.callWhenRunning(begin)
    reactor.run()
    print(json.dumps(result))


def cgroup_available() -> bool:
    """Whether ``--process-containment cgroup`` can start here."""
    out = subprocess.run(
        [sys.executable, "-m", "execserver", "--process-containment", "cgroup"],
        input=b"",
        capture_output=True,
        timeout=60,
        env=server_env(),
        cwd=server_root(),
        check=False,
    )
    return out.returncode == 0


def containment_ratios(rounds: int, count: int) -> list[Ratio]:
    """Each containment mode against none, interleaved in the same rounds."""
    modes = ["subreaper", *(["cgroup"] if cgroup_available() else [])]
    rates: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for depth in DEPTHS:
            for mode in ("none", *modes):
                rate, cpu_us = server_spawn_measure(count, depth, mode)
                rates.setdefault((mode, depth), []).append(rate)
                cpu.setdefault((mode, depth), []).append(cpu_us)
    ratios = []
    for mode in modes:
        for depth in DEPTHS:
            label = "sequential" if depth == 1 else f"{depth} in flight"
            ratios.append(
                Ratio(
                    f"start->exited of true, {label} (containment {mode} / none)",
                    Series(f"server, {mode}, {label}", "starts/s", tuple(rates[(mode, depth)])),
                    Series(f"server, none, {label}", "starts/s", tuple(rates[("none", depth)])),
                    target=0.8,
                )
            )
            ratios.append(
                Ratio(
                    f"server CPU per start of true, {label} (containment {mode} / none)",
                    Series(f"server CPU, {mode}, {label}", "us/start", tuple(cpu[(mode, depth)])),
                    Series(f"server CPU, none, {label}", "us/start", tuple(cpu[("none", depth)])),
                    target=1.5,
                    lower_is_better=True,
                )
            )
    return ratios


def run(rounds: int = 5, count: int = 300) -> list[Ratio]:
    server: dict[int, list[float]] = {d: [] for d in DEPTHS}
    bare: dict[int, list[float]] = {d: [] for d in DEPTHS}
    for _ in range(rounds):
        for depth in DEPTHS:
            bare[depth].append(bare_twisted_rate(count, depth))
            server[depth].append(server_spawn_rate(count, depth))
    ratios = []
    for depth in DEPTHS:
        label = "sequential" if depth == 1 else f"{depth} in flight"
        ratios.append(
            Ratio(
                f"start->exited of true, {label} (server / bare spawnProcess)",
                Series(f"server, {label}", "starts/s", tuple(server[depth])),
                Series(f"bare Twisted, {label}", "starts/s", tuple(bare[depth])),
                target=0.5,
            )
        )
    # The baseline is the bare loop; also state the 32-in-flight
    # server figure against the sequential bare loop.
    ratios.append(
        Ratio(
            "start->exited of true, 32 in flight (server / bare spawnProcess sequential)",
            Series("server, 32 in flight", "starts/s", tuple(server[32])),
            Series("bare Twisted, sequential", "starts/s", tuple(bare[1])),
            target=0.5,
        )
    )
    return ratios


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--bare":
        _bare_main(int(sys.argv[2]), int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument(
        "--no-containment", action="store_true", help="skip the containment mode rows"
    )
    parser.add_argument(
        "--containment-only", action="store_true", help="only the containment mode rows"
    )
    args = parser.parse_args()
    print_header("spawn")
    ratios = [] if args.containment_only else run(args.rounds, args.count)
    if not args.no_containment:
        ratios += containment_ratios(args.rounds, args.count)
    for ratio in ratios:
        print(ratio.value.describe())
        print(ratio.baseline.describe())
        print(ratio.describe(), flush=True)


if __name__ == "__main__":
    main()
