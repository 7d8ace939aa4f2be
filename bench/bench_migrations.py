"""The kernel's floor under the limits: cgroup migrations of the spawning thread, as ratios.

What ``process/start`` with limits costs the kernel on a cgroup v1 host,
without the server: the spawning thread's moves into a process's cgroups
and back, around a bare ``posix_spawn`` of ``/bin/true`` and its
``waitpid``. Four loops per round, each start using one of ``depth``
directory sets in turn (sequential: always the same set, warm; 32 in
flight: 32 sets, 32 children spawned before they are waited for, as the
server's pool does with 32 starts outstanding):

- ``spawn``: ``posix_spawn`` + ``waitpid`` of ``/bin/true`` (the baseline);
- ``spawn + v2``: the thread enters the process's cgroup v2 first and
  leaves it after (what containment costs every process, limits or not);
- ``spawn + v2 + v1``: also into one directory of each v1 hierarchy the
  limits use here (memory, pids, cpu) and back, through ``tasks`` files
  kept open (what all four limits add on a v1 host);
- ``v1 moves``: the v1 moves alone (six writes), no spawn.

Microseconds per start in wall time, in this process's CPU time
(user + system: the kernel's migration work is system time) and in the
children's (a child in more cgroups costs more to create and to end), medians of
``--rounds``; ratios to ``spawn`` measured in the same rounds. Needs root
(or writable cgroups) and the v1 hierarchies; the directories are removed
at the end.

``--containment``: the server's own limits path instead, in this
process, no server and no reactor: ``Containment.spawn`` (cgroup mode) of
a child, the exit's ``exceeded()``, ``alive()`` and ``release()``, with all
four limits and with none, the thread's CPU per start (``time.thread_time``,
system time included); once with a ``create`` that starts nothing (returns
a pid no process can have: the placement, the moves, the limit files, the
counters and the emptiness reads alone) and once with ``posix_spawn`` of
``/bin/true`` and its ``waitpid``.

    python bench/bench_migrations.py [--rounds 5] [--count 2000]
    python bench/bench_migrations.py --containment [--rounds 5] [--count 640]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from execserver import cgroups
from execserver.containment import find_cgroup2_mount, own_cgroup

DEPTHS = (1, 32)
V1_CONTROLLERS = ("memory", "pids", "cpu")
TRUE = "/bin/true"


class Sets:
    """``depth`` directory sets: one cgroup v2 directory and one per v1 hierarchy each."""

    def __init__(self, depth: int) -> None:
        root, own = find_cgroup2_mount(), own_cgroup()
        if root is None or own is None:
            raise SystemExit("no cgroup v2 hierarchy")
        v2_own = os.path.normpath(f"{root}/{own}")
        hierarchies = cgroups.v1_hierarchies()
        missing = [c for c in V1_CONTROLLERS if c not in hierarchies]
        if missing:
            raise SystemExit(f"no cgroup v1 hierarchy for {', '.join(missing)}")
        owns = [v2_own, *sorted({hierarchies[c].own for c in V1_CONTROLLERS})]
        name = f"bench-migrations-{os.getpid()}"
        self.parents = [os.path.join(d, name) for d in owns]
        self.dirs: list[str] = []
        self.back_fds: list[int] = []
        for index, (own_dir, parent) in enumerate(zip(owns, self.parents, strict=True)):
            os.mkdir(parent)
            member = "cgroup.procs" if index == 0 else "tasks"
            self.back_fds.append(os.open(os.path.join(own_dir, member), os.O_WRONLY))
        #: Per set: the fds to enter (v2 cgroup.procs, then the v1 tasks).
        self.enter_fds: list[list[int]] = []
        for n in range(depth):
            fds = []
            for index, parent in enumerate(self.parents):
                directory = os.path.join(parent, str(n))
                os.mkdir(directory)
                self.dirs.append(directory)
                member = "cgroup.procs" if index == 0 else "tasks"
                fds.append(os.open(os.path.join(directory, member), os.O_WRONLY))
            self.enter_fds.append(fds)

    def close(self) -> None:
        for fds in self.enter_fds:
            for fd in fds:
                os.close(fd)
        for fd in self.back_fds:
            os.close(fd)
        for directory in [*self.dirs, *self.parents]:
            for _ in range(100):
                try:
                    os.rmdir(directory)
                    break
                except OSError:
                    time.sleep(0.01)


def _spawn() -> int:
    return os.posix_spawn(TRUE, [TRUE], {})


def _cpu(who: int) -> float:
    used = resource.getrusage(who)
    return used.ru_utime + used.ru_stime


def loop(
    sets: Sets, depth: int, count: int, v2: bool, v1: bool, spawn: bool
) -> tuple[float, float, float]:
    """Wall, this process's CPU and the children's CPU, microseconds per start."""
    first = 0 if v2 else 1
    last = len(sets.back_fds) if v1 else 1
    pairs = [[(fds[i], sets.back_fds[i]) for i in range(first, last)] for fds in sets.enter_fds]
    write = os.write
    zero = b"0"
    waitpid = os.waitpid
    before = _cpu(resource.RUSAGE_SELF)
    children = _cpu(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = 0
    while done < count:
        batch = min(depth, count - done)
        pids = []
        for n in range(batch):
            moves = pairs[n]
            for into, _back in moves:
                write(into, zero)
            if spawn:
                pids.append(_spawn())
            for _into, back in reversed(moves):
                write(back, zero)
        for pid in pids:
            waitpid(pid, 0)
        done += batch
    wall = time.perf_counter() - started
    cpu = _cpu(resource.RUSAGE_SELF) - before
    children = _cpu(resource.RUSAGE_CHILDREN) - children
    return wall / count * 1e6, cpu / count * 1e6, children / count * 1e6


LOOPS = {
    "spawn": (False, False, True),
    "spawn + v2": (True, False, True),
    "spawn + v2 + v1": (True, True, True),
    "v1 moves": (False, True, False),
}


#: A pid no process has (above any pid_max, 2**22).
NO_PID = 999_999_999


def containment_path(rounds: int, count: int) -> None:
    """``--containment``: the thread CPU of the limits path, all four / none."""
    from execserver.containment import Containment
    from execserver.limits import NO_LIMITS, Limits

    every = Limits(512 << 20, 256, 100, 1 << 30)
    box = Containment("cgroup")
    box.start()

    def spawn_true() -> int:
        return os.posix_spawn(TRUE, [TRUE], {}, setsid=True)

    def per_start(limits: Limits, depth: int, create: bool) -> float:
        started = time.thread_time()
        for _ in range(count // depth):
            make = spawn_true if create else lambda: NO_PID
            batch = [box.spawn(make, limits) for _ in range(depth)]
            for pid, tree in batch:
                if create:
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(pid, 0)
                assert tree is not None
                if limits:
                    tree.exceeded()
                tree.alive()
                tree.release()
        return (time.thread_time() - started) / (count // depth * depth) * 1e6

    try:
        for create in (False, True):
            for depth in DEPTHS:
                found: dict[str, list[float]] = {"none": [], "all four": []}
                for _ in range(rounds):
                    found["none"].append(per_start(NO_LIMITS, depth, create))
                    found["all four"].append(per_start(every, depth, create))
                none = statistics.median(found["none"])
                four = statistics.median(found["all four"])
                label = "sequential" if depth == 1 else f"{depth} at once"
                what = "spawn of /bin/true" if create else "no child"
                print(
                    f"containment path, {what}, {label}: all four {four:.1f} us, none {none:.1f} us"
                    f" per start: +{four - none:.1f} us, ratio {four / none:.2f}",
                    flush=True,
                )
    finally:
        box.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument(
        "--containment", action="store_true", help="the server's limits path, in this process"
    )
    args = parser.parse_args()
    if args.containment:
        print(f"# containment limits path: {os.cpu_count()} CPUs, load {os.getloadavg()}")
        containment_path(args.rounds, args.count)
        return
    print(f"# migrations floor: {os.cpu_count()} CPUs, load {os.getloadavg()}")
    for depth in DEPTHS:
        sets = Sets(depth)
        try:
            wall: dict[str, list[float]] = {name: [] for name in LOOPS}
            cpu: dict[str, list[float]] = {name: [] for name in LOOPS}
            kids: dict[str, list[float]] = {name: [] for name in LOOPS}
            for _ in range(args.rounds):
                for name, (v2, v1, spawn) in LOOPS.items():
                    w, c, k = loop(sets, depth, args.count, v2, v1, spawn)
                    wall[name].append(w)
                    cpu[name].append(c)
                    kids[name].append(k)
        finally:
            sets.close()
        label = "sequential" if depth == 1 else f"{depth} in flight"
        base_w = statistics.median(wall["spawn"])
        base_c = statistics.median(cpu["spawn"])
        for name in LOOPS:
            w = statistics.median(wall[name])
            c = statistics.median(cpu[name])
            print(
                f"{label:>13}  {name:<16} wall {w:7.1f} us ({w / base_w:4.2f} x spawn)"
                f"  CPU {c:7.1f} us ({c / base_c:4.2f} x spawn)"
                f"  children's CPU {statistics.median(kids[name]):6.1f} us"
                f"  rounds {', '.join(f'{x:.0f}' for x in cpu[name])}"
            )
        extra_w = statistics.median(wall["spawn + v2 + v1"]) - statistics.median(wall["spawn + v2"])
        extra_c = statistics.median(cpu["spawn + v2 + v1"]) - statistics.median(cpu["spawn + v2"])
        extra_k = statistics.median(kids["spawn + v2 + v1"]) - statistics.median(kids["spawn + v2"])
        print(
            f"{label:>13}  the three v1 directories add {extra_w:.1f} us wall,"
            f" {extra_c:.1f} us CPU per start (in and back: 6 migrations),"
            f" {extra_k:.1f} us to the children's CPU",
            flush=True,
        )


if __name__ == "__main__":
    main()
