"""What the ``unix://`` listeners' peer check adds to an accept, as a ratio in one run.

An ordinary client (not a confined command) connects to a Unix socket and
the listener accepts it and closes both ends: the baseline is that loop
bare, the measured one adds :meth:`ConfinedPeers.refused
<execserver.sandbox.peers.ConfinedPeers.refused>` on the accepted socket,
with a confined tree registered (so the check runs: with none, it returns
at once), in each containment mode:

- ``cgroup``: ``SO_PEERCRED``, ``SO_PEERPIDFD``, one read of
  ``/proc/PID/stat`` (the client is older than the one live confined
  tree: neither it nor its parents can be members, the walk stops), a
  ``poll`` of the pidfd;
- ``subreaper``: the same, against one live tree (a ``sleep`` child in a
  session of its own);
- ``none``: the same, against that child remembered as a confined leader
  (its record alive, then dropped: its session is still refused), plus
  the time of the look for ended sessions (a /proc scan, at most one per
  10 s on an accept).

A client younger than the oldest confined tree (an ``exec-server-client``
started after it) costs one read of ``/proc/PID/cgroup`` (cgroup mode) and
one more ``stat`` per ancestor up to the first one older than that tree.

Containment is not started (no cgroup is created, no prctl): its mode and
cgroup paths are set as a started one has them, which is all the query
reads. Microseconds per accept, medians of ``--rounds`` rounds of
``--count`` accepts each, A B B A within a round.

    python bench/bench_peer_check.py [--rounds 5] [--count 20000]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from execserver.containment import (
    CgroupTree,
    Containment,
    ScanTree,
    boot_ticks,
    find_cgroup2_mount,
    own_cgroup,
)
from execserver.sandbox.peers import ConfinedPeers


class _Transport:
    """What the check uses of a Twisted Unix transport."""

    def __init__(self, sock: socket.socket, path: str) -> None:
        self._sock = sock
        self._path = path

    def getHandle(self) -> socket.socket:
        return self._sock

    def getHost(self) -> Any:
        return type("Host", (), {"name": self._path})()


def _loop(listener: socket.socket, path: str, count: int, peers: ConfinedPeers | None) -> float:
    start = time.perf_counter()
    for _ in range(count):
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(path)
        accepted, _ = listener.accept()
        if peers is not None and peers.refused(_Transport(accepted, path)):
            raise SystemExit("an ordinary client was refused")
        accepted.close()
        client.close()
    return (time.perf_counter() - start) / count * 1e6


class _Record:
    """Stands for a process's record (its tree): only its life matters."""


class _Monotonic:
    """The clock the server's peer check gets (seconds, never stepped back)."""

    def seconds(self) -> float:
        return time.monotonic()


def _peers(mode: str, child: subprocess.Popen[bytes]) -> ConfinedPeers:
    if mode.startswith("none"):
        # No tree: the leader (a sleep in a session of its own) is remembered.
        none = Containment("none")
        peers = ConfinedPeers(_Monotonic(), none)  # type: ignore[arg-type]
        record = _Record()
        peers.add(record, child.pid)
        if mode == "none":
            peers._keep = record  # type: ignore[attr-defined]
        # "none, record gone": its record dropped, its session still lives.
        return peers
    containment = Containment(mode)
    containment.mode = mode
    confined: Any
    if mode == "cgroup":
        root, own = find_cgroup2_mount(), own_cgroup()
        if root is None or own is None:
            raise SystemExit("no cgroup v2 hierarchy")
        containment._cgroup_root = root
        containment._parent = os.path.normpath(f"{root}/{own}/exec-server-{os.getpid()}-bench")
        confined = CgroupTree(containment, f"{containment._parent}/1", child.pid)
    else:
        confined = ScanTree(containment, child.pid, boot_ticks())
    containment._trees.add(confined)
    peers = ConfinedPeers(None, containment)
    peers.add(confined)
    peers._keep = confined  # type: ignore[attr-defined]
    return peers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--count", type=int, default=20000)
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="bench-peer-")
    path = os.path.join(directory, "s.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    child = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        rows: dict[str, list[tuple[float, float]]] = {}
        for mode in ("cgroup", "subreaper", "none", "none, record gone"):
            peers = _peers(mode, child)
            _loop(listener, path, args.count // 10, peers)  # warm-up
            for _ in range(args.rounds):
                a1 = _loop(listener, path, args.count, None)
                b1 = _loop(listener, path, args.count, peers)
                b2 = _loop(listener, path, args.count, peers)
                a2 = _loop(listener, path, args.count, None)
                rows.setdefault(mode, []).append(((a1 + a2) / 2, (b1 + b2) / 2))
        print(f"accepts of an ordinary Unix-socket client, {args.rounds} rounds x {args.count}")
        print("| mode | accept alone µs | with the peer check µs | added µs | ratio |")
        print("|---|---|---|---|---|")
        for mode, pairs in rows.items():
            base = statistics.median(a for a, _ in pairs)
            checked = statistics.median(b for _, b in pairs)
            ratios = ", ".join(f"{b / a:.2f}" for a, b in pairs)
            print(
                f"| {mode} | {base:.1f} | {checked:.1f} | {checked - base:.1f} | "
                f"{checked / base:.2f} (rounds: {ratios}) |"
            )
        # none mode: the look for ended sessions (a /proc scan), at most one per 10 s.
        peers = _peers("none, record gone", child)
        scans = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            peers._forget_stale(force=True)
            scans.append((time.perf_counter() - start) * 1e6)
        print(
            f"none mode's look for ended sessions: {statistics.median(scans):.0f} µs "
            f"({len(os.listdir('/proc'))} /proc entries), at most once per 10 s"
        )
    finally:
        child.kill()
        child.wait()
        listener.close()
        os.unlink(path)
        os.rmdir(directory)


if __name__ == "__main__":
    main()
