"""Time from ``process/terminate`` to ``process/exited`` (and ``process/closed``) for a tree.

The tree is 20 processes in one group: a shell leader and 19 background
``sleep`` children that all hold its output pipe. Three variants:

- cooperative: every member dies of SIGTERM;
- stubborn member: one child ignores SIGTERM (so only the SIGKILL after the
  grace ends it, and with it the output pipe: ``process/closed`` waits);
- stubborn leader: the leader (and so every child, which inherits the
  ignored disposition) ignores SIGTERM: ``process/exited`` waits too.

Each round measures, back to back, a baseline without the server: the same
tree started by ``subprocess`` in its own session and ended with
``os.killpg(SIGTERM)``, timed until the leader is reaped and the pipe is at
EOF. The cooperative figure is reported as a ratio to that baseline; the
stubborn ones against the grace (``--grace-ms``), which they cannot beat.

    python bench/bench_terminate.py [--rounds 10] [--grace-ms 500]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import time

if __package__ in (None, ""):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec
import psutil

from bench._client import Ratio, Series, StdioClient, child_env, print_header

TREE_SIZE = 20
_SLEEPERS = "for i in $(seq {n}); do sleep 1000 & done"
VARIANTS: dict[str, str] = {
    "cooperative": f"{_SLEEPERS.format(n=TREE_SIZE - 1)}; echo ready; wait",
    # The member itself says "ready", once its SIGTERM is ignored.
    "stubborn member": (
        f"{_SLEEPERS.format(n=TREE_SIZE - 2)}; (trap '' TERM; echo ready; exec sleep 1000) & wait"
    ),
    "stubborn leader": f"trap '' TERM; {_SLEEPERS.format(n=TREE_SIZE - 1)}; echo ready; wait",
}


def group_size(pgid: int) -> int:
    count = 0
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                count += 1
        except (ProcessLookupError, psutil.Error):
            continue
    return count


def server_round(
    client: StdioClient, process_id: str, script: str, grace_ms: int
) -> tuple[float, float]:
    """Seconds from terminate to exited and to closed, through the server."""
    client.start(process_id, ["sh", "-c", script])
    output = b""
    pid: int | None = None
    for message in client.messages():
        params = message.params
        if message.method == "process/output" and params and params.process_id == process_id:
            output += params.data
            if b"ready" in output:
                break
        elif message.method is None and isinstance(message.error, msgspec.Raw):
            raise RuntimeError(f"process/start failed: {bytes(message.error).decode()}")
    listed = client.request("process/list", {})
    assert isinstance(listed.result, msgspec.Raw)
    for entry in msgspec.json.decode(listed.result)["processes"]:
        if entry["processId"] == process_id:
            pid = entry["pid"]
    assert pid is not None
    size = group_size(pid)
    if size != TREE_SIZE:
        raise RuntimeError(f"expected a tree of {TREE_SIZE} processes, found {size}")
    exited = closed = 0.0
    started = time.perf_counter()
    client.send(
        {
            "id": client.new_id(),
            "method": "process/terminate",
            "params": {"processId": process_id, "graceMs": grace_ms},
        }
    )
    for message in client.messages():
        params = message.params
        if params is None or params.process_id != process_id:
            continue
        if message.method == "process/exited":
            exited = time.perf_counter() - started
        elif message.method == "process/closed":
            closed = time.perf_counter() - started
            break
    return exited, closed


def baseline_round(script: str) -> float:
    """Seconds from killpg(SIGTERM) to the leader reaped and its pipe at EOF, no server."""
    proc = subprocess.Popen(
        ["sh", "-c", script],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=child_env(),
        start_new_session=True,
    )
    assert proc.stdout is not None
    try:
        proc.stdout.readline()
        started = time.perf_counter()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
        proc.stdout.read()
        return time.perf_counter() - started
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--grace-ms", type=int, default=500)
    args = parser.parse_args()
    grace_ms: int = args.grace_ms

    print_header(f"terminate a {TREE_SIZE}-process tree, graceMs {grace_ms}")
    baseline: list[float] = []
    results: dict[str, tuple[list[float], list[float]]] = {v: ([], []) for v in VARIANTS}
    with StdioClient() as client:
        client.initialize()
        for n in range(args.rounds):
            baseline.append(baseline_round(VARIANTS["cooperative"]) * 1000)
            for variant, script in VARIANTS.items():
                exited, closed = server_round(
                    client, f"{variant.replace(' ', '-')}-{n}", script, grace_ms
                )
                results[variant][0].append(exited * 1000)
                results[variant][1].append(closed * 1000)

    base = Series("killpg(SIGTERM) without the server, to reap + EOF", "ms", tuple(baseline))
    grace = Series("graceMs", "ms", (float(grace_ms),) * args.rounds)
    print(base.describe())
    for variant, (exited_ms, closed_ms) in results.items():
        exited_s = Series(f"{variant}: terminate -> exited", "ms", tuple(exited_ms))
        closed_s = Series(f"{variant}: terminate -> closed", "ms", tuple(closed_ms))
        print(exited_s.describe())
        print(closed_s.describe())
        if variant == "cooperative":
            print("  " + Ratio(f"{variant}: closed vs baseline", closed_s, base).describe())
        else:
            print("  " + Ratio(f"{variant}: exited vs grace", exited_s, grace).describe())
            print("  " + Ratio(f"{variant}: closed vs grace", closed_s, grace).describe())


if __name__ == "__main__":
    main()
