"""``process/start`` -> ``process/exited`` of ``true`` with resource limits, as a ratio to without.

The same server (default containment: cgroup where writable) runs the same
loop as ``bench_spawn.py`` — one start at a time (sequential) and 32 in
flight — once with no ``limits`` and once per limit set below, interleaved
in the same rounds. Each row is a ratio of time per start (lower is better,
goal at most 1.15): limits cost the cgroup directories of the controllers
(pooled), their files written per start, the child's entry into each, and
``RLIMIT_FSIZE``/``oom_score_adj`` around the spawn.

    python bench/bench_limits.py [--rounds 5] [--count 300]

Two modes break the server's CPU down instead (one depth, ``--depth``,
default 32; ``none`` and ``all four`` in each round):

- ``--split``: the server's user and system CPU per start separately
  (system time holds the kernel's cgroup work: migrations, control-file
  I/O, the child's creation and reaping), as ratios to no limits;
- ``--profile DIR``: the server runs under ``cProfile`` with the thread's
  CPU clock (``time.thread_time``: system time included, sleeping not) and
  writes ``DIR/none.pstats`` and ``DIR/all_four.pstats``; the functions
  whose CPU per start grows most with the limits are printed (cProfile's
  own overhead inflates Python functions two- to threefold; compare
  within the run).

``--warmup N`` runs N starts first in each server, unmeasured: the
figures are then those of a server whose cgroup pools are full (every
start reuses a pooled directory set, as on a server that has run for a
while) rather than including the sets' creation (three v1 ``mkdir`` and the
first entry into each, once per set, up to 64 sets).

    python bench/bench_limits.py --split [--depth 32] [--rounds 3] [--count 1000]
    python bench/bench_limits.py --profile /tmp/prof [--depth 32] [--count 2000]
"""

from __future__ import annotations

import argparse
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import psutil

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


#: The server under cProfile with the thread's CPU clock (``--profile``).
PROFILED = (
    "import cProfile, runpy, sys, time\n"
    "out = sys.argv.pop(1)\n"
    "profile = cProfile.Profile(time.thread_time)\n"
    "profile.enable()\n"
    "try:\n"
    "    runpy.run_module('execserver', run_name='__main__', alter_sys=True)\n"
    "except SystemExit:\n"
    "    pass\n"
    "finally:\n"
    "    profile.disable()\n"
    "    profile.dump_stats(out)\n"
)


def seconds_per_start(
    count: int,
    depth: int,
    limits: dict[str, int] | None,
    argv: list[str] | None = None,
    split: list[float] | None = None,
    warmup: int = 0,
) -> tuple[float, float]:
    """Wall seconds per start, and the server's CPU seconds per start.

    The CPU figure (user + system of the server, which includes the
    kernel's cgroup work) is far less disturbed by other load than the
    wall-clock one. ``argv``: how to run the server (default: as is);
    ``split``: gets the user and the system seconds per start.
    ``warmup``: starts run first, unmeasured, in the same loop (the
    server's pools of cgroups filled: the steady state of a server that has
    run for a while, where every start reuses a pooled set).
    """
    with StdioClient([], argv) as client:
        client.initialize()
        sent = 0

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

        def loop(count: int) -> None:
            done = 0
            first = sent
            client.send_bytes(requests(min(depth, count)))
            while done < count:
                finished = 0
                for message in client.read_batch():
                    if message.method == "process/exited":
                        finished += 1
                    elif isinstance(message.error, msgspec.Raw):
                        raise ServerError(repr(message))
                done += finished
                more = min(finished, first + count - sent)
                if more > 0:
                    client.send_bytes(requests(more))

        if warmup:
            loop(warmup)
        cpu = client.cpu_seconds()
        times = psutil.Process(client.pid).cpu_times()
        start = time.perf_counter()
        loop(count)
        wall = (time.perf_counter() - start) / count
        if split is not None:
            after = psutil.Process(client.pid).cpu_times()
            split[:] = [(after.user - times.user) / count, (after.system - times.system) / count]
        return wall, (client.cpu_seconds() - cpu) / count


def split_cpu(rounds: int, count: int, depth: int, warmup: int = 0) -> None:
    """``--split``: the server's user and system CPU per start, limits / none."""
    found: dict[str, list[list[float]]] = {"none": [], "all four": []}
    for _ in range(rounds):
        for name, splits in found.items():
            split: list[float] = []
            seconds_per_start(count, depth, LIMIT_SETS.get(name), split=split, warmup=warmup)
            splits.append(split)
    label = "sequential" if depth == 1 else f"{depth} in flight"
    base = [statistics.median(r[i] for r in found["none"]) for i in (0, 1)]
    limited = [statistics.median(r[i] for r in found["all four"]) for i in (0, 1)]
    for i, what in enumerate(("user", "system")):
        print(
            f"server {what} CPU per start, {label}: all four {limited[i] * 1e6:.0f} us,"
            f" none {base[i] * 1e6:.0f} us, +{(limited[i] - base[i]) * 1e6:.0f} us"
            f" (rounds: {', '.join(f'{r[i] * 1e6:.0f}' for r in found['all four'])} /"
            f" {', '.join(f'{r[i] * 1e6:.0f}' for r in found['none'])})"
        )
    total = sum(limited) / sum(base)
    print(f"server CPU per start, {label}: all four / none = {total:.2f}", flush=True)


def profile(directory: str, count: int, depth: int, warmup: int = 0) -> None:
    """``--profile``: the server under cProfile (thread CPU clock), none and all four."""
    os.makedirs(directory, exist_ok=True)
    stats = {}
    for name in ("none", "all four"):
        out = os.path.join(directory, name.replace(" ", "_") + ".pstats")
        argv = [sys.executable, "-c", PROFILED, out]
        seconds_per_start(count, depth, LIMIT_SETS.get(name), argv=argv, warmup=warmup)
        stats[name] = pstats.Stats(out).stats  # type: ignore[attr-defined]
    rows = []
    for key in set(stats["none"]) | set(stats["all four"]):
        before = stats["none"].get(key, (0, 0, 0.0, 0.0))[2]
        after = stats["all four"].get(key, (0, 0, 0.0, 0.0))[2]
        rows.append((after - before, before, after, f"{Path(key[0]).name}:{key[1]}({key[2]})"))
    rows.sort(reverse=True)
    per = 1e6 / count
    total = [sum(v[2] for v in stats[n].values()) * per for n in ("none", "all four")]
    print(f"profiled server CPU per start: none {total[0]:.0f} us, all four {total[1]:.0f} us")
    print("own CPU per start that grows most with all four limits (us: none -> all four):")
    for grown, before, after, where in rows[:30]:
        print(f"  +{grown * per:6.1f}  {before * per:6.1f} -> {after * per:6.1f}  {where}")


def run(rounds: int = 5, count: int = 300, warmup: int = 0) -> list[Ratio]:
    times: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for depth in DEPTHS:
            for name, limits in (("none", None), *LIMIT_SETS.items()):
                wall, used = seconds_per_start(count, depth, limits, warmup=warmup)
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
    parser.add_argument("--depth", type=int, default=32, help="--split/--profile: starts in flight")
    parser.add_argument("--split", action="store_true", help="user and system CPU per start")
    parser.add_argument("--profile", metavar="DIR", help="cProfile the server into DIR")
    parser.add_argument(
        "--warmup", type=int, default=0, help="unmeasured starts first, in the same loop"
    )
    args = parser.parse_args()
    if args.split:
        print_header("limits: the server's CPU split")
        split_cpu(args.rounds, args.count, args.depth, args.warmup)
        return
    if args.profile:
        print_header("limits: the server profiled")
        profile(args.profile, args.count, args.depth, args.warmup)
        return
    print_header("limits")
    for ratio in run(args.rounds, args.count, args.warmup):
        print(ratio.value.describe())
        print(ratio.baseline.describe())
        print(ratio.describe(), flush=True)


if __name__ == "__main__":
    main()
