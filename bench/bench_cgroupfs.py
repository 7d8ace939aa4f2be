"""What keeping the cgroup file systems read-only adds to resolving a sandbox, as a ratio.

Every confining policy goes through :func:`~execserver.sandbox.policy.protect_cgroupfs`
(once per ``process/start`` and per sandboxed fs call): one ``poll`` of the
kept-open ``/proc/self/mountinfo`` (re-read only after a mount or unmount),
one ``realpath`` per writable root, and the rebuilt rule set where a cgroup
mount lies in a writable root. The baseline resolves the same profile
without that step (the profile language alone); the measured one is
:func:`~execserver.sandbox.policy.resolve`. Codex's workspace-write profile,
and one whose writable roots hold ``/sys/fs/cgroup`` (the carve-outs are
added). Microseconds per resolve, medians of ``--rounds`` rounds of
``--count`` resolves each, A B B A within a round.

    python bench/bench_cgroupfs.py [--rounds 5] [--count 3000]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgspec

from execserver import protocol as p
from execserver.sandbox import policy as pol


def _sandbox(work: str, extra: list[dict[str, Any]]) -> p.SandboxConfig:
    entries = [
        {"path": {"type": "special", "value": {"kind": "root"}}, "access": "read"},
        {"path": {"type": "special", "value": {"kind": "project_roots"}}, "access": "write"},
        *extra,
    ]
    params = msgspec.json.decode(
        msgspec.json.encode(
            {"processId": "a", "argv": ["true"], "cwd": "/", "env": {}, "tty": False,
             "sandbox": {"permissions": {"type": "managed", "network": "restricted",
                                         "file_system": {"type": "restricted",
                                                         "entries": entries}},
                         "cwd": f"file://{work}", "workspaceRoots": [f"file://{work}"]}}
        ),
        type=p.ExecParams,
    )  # fmt: skip
    assert params.sandbox is not None
    return params.sandbox


def _per_call(func: Callable[[], object], count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        func()
    return (time.perf_counter() - started) / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--count", type=int, default=3000)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="bench-cgroupfs-", dir="/var/tmp")
    cases = {
        "workspace-write": _sandbox(work, []),
        "+ /sys/fs/cgroup writable": _sandbox(
            work, [{"path": {"type": "path", "path": "/sys/fs/cgroup"}, "access": "write"}]
        ),
    }
    print(f"{'profile':28} {'bare µs':>9} {'protected µs':>13} {'ratio':>6}")
    for name, sandbox in cases.items():

        def bare(s: p.SandboxConfig = sandbox) -> object:
            return pol._resolve_profile(s, "/", {})

        def protected(s: p.SandboxConfig = sandbox) -> object:
            return pol.resolve(s, cwd="/", env={})

        a: list[float] = []
        b: list[float] = []
        for _ in range(args.rounds):
            a.append(_per_call(bare, args.count))
            b.append(_per_call(protected, args.count))
            b.append(_per_call(protected, args.count))
            a.append(_per_call(bare, args.count))
        base, measured = statistics.median(a), statistics.median(b)
        print(f"{name:28} {base:9.1f} {measured:13.1f} {measured / base:6.2f}")


if __name__ == "__main__":
    main()
