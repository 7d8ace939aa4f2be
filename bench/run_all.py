"""Run every benchmark: the source of every table in docs/performance.md.

    python bench/run_all.py [--rounds N] [--quick] [--markdown]

Throughput, spawn, round trips and memory end in one summary table of ratios
to same-run baselines; the WebSocket, filesystem, termination and client
scripts run afterwards in the same run and their output is printed as is.
The run states its date, commit and the load average before and after
every section, so the doc can quote when and under what load.

``--quick`` runs fewer rounds on smaller inputs (a smoke test of the
scripts, not figures to quote). Set ``BENCH_SERVER_ROOT`` to benchmark
another checkout of the server (e.g. a ``git worktree`` of an older commit).
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import bench_rss, bench_rtt, bench_spawn, bench_throughput
from bench._client import Ratio, Series, print_header, server_root


def _row(figure: Ratio | Series) -> tuple[str, str, str, str, str]:
    if isinstance(figure, Series):
        return (figure.name, "", f"{figure.median:,.1f} {figure.unit}", "", f"{figure.spread:.0%}")
    sign = "<=" if figure.lower_is_better else ">="
    target = "" if figure.target is None else f"{sign} {figure.target}"
    met = "" if figure.met is None else ("met" if figure.met else "MISSED")
    value = f"{figure.value.median:,.1f} / {figure.baseline.median:,.1f} {figure.value.unit}"
    paired = figure.paired_ratios
    noise = f"{min(paired):.2f}-{max(paired):.2f}"
    return (figure.name, f"{figure.ratio:.3f}", value, f"{target} {met}".strip(), noise)


def print_table(figures: list[Ratio | Series], markdown: bool) -> None:
    header = ("figure", "ratio", "median value / baseline", "target", "per-round range")
    rows = [header, *(_row(f) for f in figures)]
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows[1:]:
            print("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
        return
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    rounds = 2 if args.quick else args.rounds
    started = time.monotonic()
    commit = subprocess.run(
        ["git", "-C", server_root(), "log", "-1", "--format=%h %s"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"run of {now}; server from {server_root()} at {commit or '?'}", flush=True)
    print(f"{os.cpu_count()} CPUs, load average {_load()} at the start", flush=True)
    figures: list[Ratio | Series] = []

    print_header("throughput")
    part: list[Ratio | Series] = (
        bench_throughput.run(rounds, pipe_mib=32, pty_mib=8)
        if args.quick
        else bench_throughput.run(rounds)
    )
    bench_throughput.print_figures(part)
    figures += part

    print_header("spawn")
    part = list(bench_spawn.run(rounds, count=50 if args.quick else 500))
    bench_throughput.print_figures(part)
    figures += part

    print_header("round trips")
    part = list(bench_rtt.run(rounds, count=5000 if args.quick else 200000))
    bench_throughput.print_figures(part)
    figures += part

    print_header("memory")
    part = (
        bench_rss.run(1, stall=1.0, processes=50, stalled_gib=1)
        if args.quick
        else bench_rss.run(max(3, rounds // 2))
    )
    bench_throughput.print_figures(part)
    figures += part

    print()
    print_header(f"summary ({time.monotonic() - started:.0f} s)")
    print_table(figures, args.markdown)

    here = Path(__file__).resolve().parent
    sections: list[tuple[str, str, list[str]]] = [
        (
            "websocket",
            "bench_websocket.py",
            ["--rounds", "1", "--mib", "32", "--connections", "20"],
        ),
        ("filesystem", "bench_fs.py", ["--size-mib", "8", "--repeat", "1", "--seconds", "0.5"]),
        ("termination", "bench_terminate.py", ["--rounds", "2"]),
        ("client library", "bench_client.py", ["--rounds", "1", "--mib", "16"]),
        ("asyncio client", "bench_aio_client.py", ["--rounds", "1", "--mib", "16"]),
        ("unix:// peer check", "bench_peer_check.py", ["--rounds", "2", "--count", "2000"]),
    ]
    for title, script, quick in sections:
        print()
        print_header(title)
        subprocess.run(
            [sys.executable, str(here / script), *(quick if args.quick else [])],
            check=True,
        )
    print()
    print(f"end of run ({time.monotonic() - started:.0f} s), load average {_load()}", flush=True)


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


if __name__ == "__main__":
    main()
