"""``process/start`` -> ``process/exited`` of ``true`` with resource limits, as a ratio to without.

The same server (default containment: cgroup where writable) runs the same
loop as ``bench_spawn.py`` — one start at a time (sequential) and 32 in
flight — once with no ``limits`` and once per limit set below, interleaved
in the same rounds. Each row is a ratio of time per start (lower is better,
goal at most 1.15): limits cost the cgroup directories of the controllers
(pooled), their files written per start, the child's entry into each, and
``RLIMIT_FSIZE``/``oom_score_adj`` around the spawn.

    python bench/bench_limits.py [--rounds 5] [--count 300]
"""

from __future__ import annotations

import argparse
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
    print_header,
    render,
    start_request,
)

DEPTHS = (1, 32)
MiB = 1 << 20
LIMIT_SETS: dict[str, dict[str, int]] = {
    "all four": {
        "memoryBytes": 512 * MiB,
        "maxProcesses": 256,
        "cpuPercent": 100,
        "fileSizeBytes": 1 << 30,
    },
    "memoryBytes": {"memoryBytes": 512 * MiB},
    "maxProcesses": {"maxProcesses": 256},
    "fileSizeBytes": {"fileSizeBytes": 1 << 30},
}


def seconds_per_start(count: int, depth: int, limits: dict[str, int] | None) -> tuple[float, float]:
    """Wall seconds per start, and the server's CPU seconds per start.

    The CPU figure (user + system of the server, which includes the
    kernel's cgroup work) is far less disturbed by other load than the
    wall-clock one.
    """
    with StdioClient([]) as client:
        client.initialize()
        cpu = client.cpu_seconds()
        sent = 0
        done = 0

        def requests(n: int) -> bytes:
            nonlocal sent
            out = []
            for _ in range(n):
                request: dict[str, Any] = start_request(client.new_id(), f"p{sent}", ["true"])
                if limits is not None:
                    request["params"]["limits"] = limits
                out.append(render(request))
                sent += 1
            return b"".join(out)

        start = time.perf_counter()
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
        wall = (time.perf_counter() - start) / count
        return wall, (client.cpu_seconds() - cpu) / count


def run(rounds: int = 5, count: int = 300) -> list[Ratio]:
    times: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for depth in DEPTHS:
            for name, limits in (("none", None), *LIMIT_SETS.items()):
                wall, used = seconds_per_start(count, depth, limits)
                times.setdefault((name, depth), []).append(wall * 1e6)
                cpu.setdefault((name, depth), []).append(used * 1e6)
    ratios = []
    for name in LIMIT_SETS:
        for depth in DEPTHS:
            label = "sequential" if depth == 1 else f"{depth} in flight"
            ratios.append(
                Ratio(
                    f"start->exited of true, {label} (limits {name} / no limits)",
                    Series(f"limits {name}, {label}", "us/start", tuple(times[(name, depth)])),
                    Series(f"no limits, {label}", "us/start", tuple(times[("none", depth)])),
                    target=1.15,
                    lower_is_better=True,
                )
            )
            ratios.append(
                Ratio(
                    f"server CPU per start of true, {label} (limits {name} / no limits)",
                    Series(
                        f"server CPU, limits {name}, {label}", "us/start", tuple(cpu[(name, depth)])
                    ),
                    Series(
                        f"server CPU, no limits, {label}", "us/start", tuple(cpu[("none", depth)])
                    ),
                    target=1.15,
                    lower_is_better=True,
                )
            )
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--count", type=int, default=300)
    args = parser.parse_args()
    print_header("limits")
    for ratio in run(args.rounds, args.count):
        print(ratio.value.describe())
        print(ratio.baseline.describe())
        print(ratio.describe(), flush=True)


if __name__ == "__main__":
    main()
