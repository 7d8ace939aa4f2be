"""The process table: ``/proc`` reads, signals, the server's children and their reaping."""

from __future__ import annotations

import os
import signal
import time
from typing import Final

import attrs
from twisted.internet import process as _twisted_process

_CLK_TCK: Final = os.sysconf("SC_CLK_TCK")


@attrs.frozen
class ProcInfo:
    pid: int
    ppid: int
    pgrp: int
    sid: int
    #: Start time in clock ticks since boot (``/proc/<pid>/stat`` field 22).
    start: int
    zombie: bool


def read_proc(pid: int) -> ProcInfo | None:
    """One process's ``/proc/<pid>/stat``, or None if it is gone."""
    text = _proc_bytes(f"/proc/{pid}/stat")
    if text is None:
        return None
    # After the command: state ppid pgrp session tty tpgid flags minflt
    # cminflt majflt cmajflt utime stime cutime cstime priority nice threads
    # itrealvalue starttime
    try:
        fields = text.rsplit(b")", 1)[1].split()
        return ProcInfo(
            pid,
            int(fields[1]),
            int(fields[2]),
            int(fields[3]),
            int(fields[19]),
            fields[0] in (b"Z", b"X"),
        )
    except (IndexError, ValueError):
        return None


def proc_table() -> dict[int, ProcInfo]:
    """Every process visible in ``/proc``."""
    table: dict[int, ProcInfo] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for entry in entries:
        if entry.isdigit():
            info = read_proc(int(entry))
            if info is not None:
                table[info.pid] = info
    return table


def own_children() -> set[int]:
    """The server's children, from ``/proc/self/task/*/children`` (no scan)."""
    children: set[int] = set()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return children
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/children", "rb") as f:
                children.update(int(pid) for pid in f.read().split())
        except OSError:
            continue
    return children


def _proc_bytes(path: str) -> bytes | None:
    """One unbuffered read of a small ``/proc`` file (a third of ``open()``'s cost)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 65536)
    except OSError:
        return None
    finally:
        os.close(fd)


#: The peer check's lineage walk reads with :func:`read_proc` (one unbuffered read).
_quick_proc = read_proc


def own_cgroup(path: str = "/proc/self/cgroup") -> str | None:
    """The cgroup v2 path (relative to the hierarchy's root) in a ``/proc/*/cgroup``
    file: the server's own by default; one unbuffered read."""
    text = _proc_bytes(path)
    if text is None:
        return None
    for line in text.splitlines():
        if line.startswith(b"0::"):
            return line[3:].decode(errors="surrogateescape")
    return None


def _cgroup2_of(pid: int) -> str | None:
    """``pid``'s cgroup v2 path (:func:`own_cgroup` of its ``/proc/<pid>/cgroup``)."""
    return own_cgroup(f"/proc/{pid}/cgroup")


def boot_ticks() -> int:
    """Now, in the clock ticks since boot that ``/proc`` start times use."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * _CLK_TCK)


def _signal_pid(pid: int, signum: int) -> bool:
    # A member list shows 0 for a process outside our pid namespace (and a
    # fake or corrupt one could hold anything): kill(0) would signal our
    # own process group, kill(-1) every process we may signal.
    if pid <= 1:
        return False
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _signal_group(pgid: int, signum: int) -> bool:
    if pgid <= 1:
        return False
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def reaped_by_twisted() -> dict[int, object] | None:
    """The children Twisted waits for, by pid (None if this Twisted keeps them elsewhere).

    A private module dict of ``twisted.internet.process``; checked with the
    spawn overrides (``execserver.spawn.overrides.check_private_hooks``).
    """
    known = getattr(_twisted_process, "reapProcessHandlers", None)
    return known if isinstance(known, dict) else None


def reap_unknown_children() -> list[int]:
    """Reap zombie children the server did not spawn itself (reparented orphans).

    Returns the unknown children still running. Never ``waitpid(-1)``: that
    would steal the statuses Twisted waits for; each unknown child is waited
    for by pid (one cheap syscall; there are usually none).
    """
    known = reaped_by_twisted()
    if known is None:
        # Without Twisted's registry a wait could steal a status it waits for.
        return list(own_children())
    running = []
    for pid in own_children():
        if pid in known:
            continue
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                continue
        except ChildProcessError:
            continue
        running.append(pid)
    return running


def _still_running(started: dict[int, int]) -> list[int]:
    """The pids of ``started`` (pid -> start time) still running as that
    process; the others (gone, reused, zombies) are removed from it."""
    live = []
    for pid, start in list(started.items()):
        info = read_proc(pid)
        if info is None or info.start != start or info.zombie:
            del started[pid]
        else:
            live.append(pid)
    return live


def _descendants(table: dict[int, ProcInfo], root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for info in table.values():
        children.setdefault(info.ppid, []).append(info.pid)
    found: list[int] = []
    pending = [root]
    while pending:
        for child in children.get(pending.pop(), ()):
            found.append(child)
            pending.append(child)
    return found


def _lineage(
    table: dict[int, ProcInfo], children: dict[int, list[int]], roots: list[int]
) -> list[int]:
    """``roots`` still running and all their descendants."""
    found: list[int] = []
    seen: set[int] = set()
    pending = [pid for pid in roots if pid in table]
    while pending:
        pid = pending.pop()
        if pid in seen:
            continue
        seen.add(pid)
        if not table[pid].zombie:
            found.append(pid)
        pending.extend(children.get(pid, ()))
    return found


def _children(pid: int) -> list[int]:
    """``pid``'s children, from the kernel's per-thread children lists."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found: list[int] = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found.extend(int(child) for child in f.read().split())
        except OSError:
            continue
    return found


def _walk_children(roots: list[int]) -> list[int]:
    """``roots`` and all their descendants, walking children lists down."""
    found: list[int] = []
    seen: set[int] = set()
    pending = list(roots)
    while pending:
        pid = pending.pop()
        if pid in seen:
            continue
        seen.add(pid)
        found.append(pid)
        pending.extend(_children(pid))
    return found


def _kill_recorded(entries: list[tuple[int, int]]) -> int:
    """SIGKILL each recorded (pid, start time) still running, with its descendants."""
    table = proc_table()
    killed = 0
    for pid, start in entries:
        info = table.get(pid)
        if info is None or info.start != start or info.zombie:
            continue
        for member in [pid, *_descendants(table, pid)]:
            if _signal_pid(member, signal.SIGKILL):
                killed += 1
    return killed


def _pidns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0
