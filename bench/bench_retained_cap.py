"""What enforcing ``--max-total-retained-bytes`` as output arrives costs a chatty process.

One process writes ``--megabytes`` of zeros over stdio; the server's CPU
seconds until ``process/closed`` are measured with a 1 MiB server cap (every
chunk past the first megabyte makes the oldest retained output go) and,
back to back in the same round, without a server cap (the baseline: only
the 1 MiB per-process cap drops chunks). Prints the paired ratio
(cap / no cap; 1.0 is free).

    python bench/bench_retained_cap.py [--rounds 5] [--megabytes 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

if __package__ in (None, ""):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._client import StdioClient, print_header

CAP = 1 << 20


def one_run(cap: int, megabytes: int) -> tuple[float, float]:
    """(server CPU seconds, wall seconds) for one chatty process under ``cap``."""
    with StdioClient(["--max-total-retained-bytes", str(cap)]) as client:
        client.initialize()
        began_cpu, began = client.cpu_seconds(), time.monotonic()
        client.start("chatty", ["head", "-c", str(megabytes << 20), "/dev/zero"])
        for message in client.messages():
            if message.method == "process/closed":
                break
        return client.cpu_seconds() - began_cpu, time.monotonic() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--megabytes", type=int, default=256)
    args = parser.parse_args()
    print_header(f"retained cap: {args.megabytes} MiB from one process, {args.rounds} rounds")
    ratios, walls = [], []
    for _ in range(args.rounds):
        base_cpu, base_wall = one_run(0, args.megabytes)
        cap_cpu, cap_wall = one_run(CAP, args.megabytes)
        ratios.append(cap_cpu / base_cpu)
        walls.append(cap_wall / base_wall)
    print(
        f"server CPU, 1 MiB server cap / no server cap: {statistics.median(ratios):.2f} "
        f"(rounds {', '.join(f'{r:.2f}' for r in ratios)}); wall {statistics.median(walls):.2f}"
    )
    print_header("retained cap: done")


if __name__ == "__main__":
    main()
