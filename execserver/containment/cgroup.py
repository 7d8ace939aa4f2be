"""The cgroup tree: one process's cgroup v2 (and v1 directories), and the cgroupfs helpers."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Final

import attrs
from twisted.logger import Logger

from execserver import cgroups
from execserver.cgroups import Usage, mount_table
from execserver.containment.proc import (
    _CLK_TCK,
    _cgroup2_of,
    _descendants,
    _lineage,
    _signal_group,
    _signal_pid,
    _still_running,
    boot_ticks,
    proc_table,
    read_proc,
)
from execserver.containment.tree import _Owned
from execserver.limits import KINDS, Kind

if TYPE_CHECKING:
    from execserver.containment.core import Containment
    from execserver.containment.placement import LimitPlacement

log = Logger(namespace="execserver.containment")


CGROUP_PREFIX: Final = "exec-server-"


#: Signals to one tree this close together share one look for escapees.
ESCAPEE_RECHECK: Final = 0.01


class CgroupTree(_Owned):
    """The members of one cgroup v2 (and of its cgroup v1 directories)."""

    def __init__(
        self,
        owner: Containment,
        path: str,
        leader: int,
        placement: LimitPlacement | None = None,
        born: int | None = None,
    ) -> None:
        self.path = path
        self._events = os.path.join(path, "cgroup.events")
        self.leader = leader
        self.placement = placement
        #: Boot ticks just before the spawn: no member can be older
        #: (``born``: read by the spawn; None: now).
        self.born = boot_ticks() if born is None else born
        #: Descendants found outside the cgroup(s) (root can move itself),
        #: pid -> start time: attributed by lineage while their parent
        #: lives, by elimination once they are orphans adopted by the server.
        self.escapees: dict[int, int] = {}
        self.terminating = False
        self._escapees_found_at = -1.0
        self._owner = owner
        self._on_empty: Callable[[], None] | None = None
        self.released = False
        #: The last :meth:`alive` found the cgroup empty (reusable).
        self.seen_empty = False
        #: Every cgroup of the tree (v2 and v1) was found empty: nothing
        #: can enter them again (only a process inside can move a child
        #: there), so later looks need not read them.
        self._known_empty = False

    def pids(self) -> list[int]:
        found = _cgroup_pids(self.path)
        if self.placement is not None:
            # A member that moved itself out of the v2 cgroup (root can) is
            # still in the v1 ones, unless it left those too.
            files = self._owner.files
            for directory in self.placement.v1_dirs:
                found.extend(pid for pid in files.pids(directory) if pid not in found)
        return found

    def exceeded(self) -> tuple[Kind, int] | None:
        placement = self.placement
        if placement is None:
            return None
        # At the exit the tree is usually empty already: looked at before
        # the counters, that makes them final (the release reads nothing
        # more, and neither does the exit's own look at the tree). While
        # the tree runs this costs one read (``populated 1``).
        empty = placement.v1set is not None and not self.released and self._empty()
        kind = cgroups.exceeded(placement.limits, placement.counters(), placement.baseline)
        placement.final = empty
        if kind is None and placement.oom_killed:
            kind = "memory"
        if kind is None:
            return None
        field = next(f for f, k in KINDS.items() if k == kind)
        value = placement.limits.get(field)
        assert value is not None
        return kind, value

    def usage(self) -> Usage:
        if self.released:
            return Usage()
        placement = self.placement
        if placement is None:
            dirs = {c: self.path for c in self._owner.v2_controllers}
            return cgroups.usage(2, dirs, self.path)
        found = placement.usage(self.path)
        if placement.sandbox_processes and found.processes is not None:
            # The sandbox's own processes (bwrap and its init) are not the command's.
            found = attrs.evolve(
                found, processes=max(0, found.processes - placement.sandbox_processes)
            )
        return found

    def live_escapees(self) -> list[int]:
        """The escapees still running (checked one by one, no scan)."""
        return _still_running(self.escapees)

    def signal(self, signum: int) -> None:
        if self.released:
            # The cgroup may already serve another process.
            return
        # Only a terminate (or a kill) signals a whole tree. The members in
        # the cgroup first; then those that left it (root can), looked for
        # from the members down.
        self.terminating = True
        _signal_group(self.leader, signum)
        for pid in self.pids():
            _signal_pid(pid, signum)
        now = time.monotonic()
        if now - self._escapees_found_at > ESCAPEE_RECHECK:
            # A terminate's SIGTERM, SIGHUP and SIGCONT share one look.
            self._escapees_found_at = now
            self._owner._find_escapees(self)
        for pid in self.live_escapees():
            _signal_pid(pid, signum)

    def kill(self) -> None:
        if self.released:
            return
        _signal_group(self.leader, signal.SIGKILL)
        # Before Linux 5.14 there is no cgroup.kill: the members are
        # signalled one by one below (a fork racing this is caught by the
        # next check, which repeats the kill).
        with contextlib.suppress(OSError):
            _write(os.path.join(self.path, "cgroup.kill"), "1")
        self.signal(signal.SIGKILL)

    def _empty(self) -> bool:
        """No member is in the tree's cgroups (escapees aside)."""
        if self._known_empty:
            return True
        # A kept descriptor (read at offset 0: the kernel generates the
        # text afresh); v1 member lists are read by path (see ControlFiles).
        events = self._owner.files.read_bytes(self._events)
        populated = events is not None and b"populated 1" in events
        placement = self.placement
        if not populated and placement is not None:
            v1set = placement.v1set
            procs = (
                v1set.procs
                if v1set is not None
                else [os.path.join(d, "cgroup.procs") for d in placement.v1_dirs]
            )
            populated = any(_has_members(p) for p in procs)
        self._known_empty = not populated
        return not populated

    def alive(self) -> bool:
        empty = self._empty()
        self.seen_empty = empty
        return not empty or bool(self.escapees and self.live_escapees())


def _return_to(own: str, left: str) -> None:
    """Move the spawning thread back into its own cgroup (``own``: its
    ``cgroup.procs`` or v1 ``tasks``) after a spawn inside ``left``."""
    try:
        _write(own, "0")
    except OSError as exc:
        # Never raise here: the child exists and must get its transport.
        log.critical(
            "cannot leave cgroup {path} after a spawn ({error}); later children share it",
            path=left,
            error=exc,
        )


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _read_bytes(path: str, limit: int | None = None) -> bytes | None:
    """A cgroupfs file's contents in unbuffered reads (None if unreadable).

    ``limit``: stop after the first read of at most that many bytes.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        chunk = os.read(fd, limit or 65536)
        if limit is not None or not chunk:
            return chunk
        chunks = [chunk]
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def _cgroup_pids(directory: str) -> list[int]:
    """The members of one cgroup (its ``cgroup.procs``), read by path.

    Never through a kept descriptor: cgroup v1 keeps the member list it
    loaded for an open file and serves it again to later reads of that
    file while they come less than a second apart.
    """
    text = _read_bytes(os.path.join(directory, "cgroup.procs"))
    return [int(pid) for pid in text.split()] if text else []


def _has_members(procs: str) -> bool:
    """Whether one cgroup has a member: ``bool(_cgroup_pids(directory))``,
    ``procs`` being its ``cgroup.procs``."""
    text = _read_bytes(procs, 64)
    return bool(text and text.split())


def find_cgroup2_mount(mounts: str = "/proc/self/mounts") -> str | None:
    """Where the (first) cgroup v2 hierarchy is mounted, from the mount table."""
    return next((point for point, kind, _options in mount_table(mounts) if kind == "cgroup2"), None)


def _remove_cgroup_tree(path: str, wait: float) -> bool:
    """rmdir ``path`` and its sub-cgroups, waiting up to ``wait`` s for them to empty."""
    deadline = time.monotonic() + wait
    while True:
        leftovers: list[str] = []
        for dirpath, _dirs, _files in _walk_bottom_up(path):
            try:
                os.rmdir(dirpath)
            except FileNotFoundError:
                continue
            except OSError:
                leftovers.append(dirpath)
        if not leftovers:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def _in_cgroup_below(pid: int, root: str, parent: str) -> bool:
    """Whether ``pid``'s cgroup v2 (hierarchy mounted at ``root``) is ``parent`` or below it."""
    own = _cgroup2_of(pid)
    if own is None or not parent:
        return False
    path = os.path.normpath(root + "/" + own)
    return path == parent or path.startswith(parent + "/")


def _tree_pids(directory: str) -> list[int]:
    """The members of ``directory``'s cgroup and of every cgroup below it."""
    members: list[int] = []
    for dirpath, _dirs, _files in os.walk(directory):
        members.extend(_cgroup_pids(dirpath))
    return members


def _kill_descendants_of_members(directory: str) -> None:
    members = _tree_pids(directory)
    if not members:
        return
    table = proc_table()
    children: dict[int, list[int]] = {}
    for info in table.values():
        children.setdefault(info.ppid, []).append(info.pid)
    for pid in _lineage(table, children, members):
        _signal_pid(pid, signal.SIGKILL)


#: A process that started more than this (seconds) after a server's
#: directory was made is not that server: the pid is another process's now.
CREATOR_MARGIN: Final = 10.0


def started_after(start_ticks: int, made: float, real_now: float, boot_now: int) -> bool:
    """Whether a process started at ``start_ticks`` (``/proc`` clock ticks since
    boot) started more than :data:`CREATOR_MARGIN` s after the wall-clock time
    ``made``, ``real_now`` and ``boot_now`` being now in both clocks."""
    started = real_now - (boot_now - start_ticks) / _CLK_TCK
    return started > made + CREATOR_MARGIN


def server_gone(pid: int, directory: str) -> bool:
    """Whether the server that made ``directory`` (named after its ``pid``) is gone.

    Gone: no process has that pid; a zombie with no thread left; or a
    process that started more than :data:`CREATOR_MARGIN` s after the
    directory was made (a cgroupfs directory's ctime is its creation time,
    which nothing changes): the pid was reused. Anything else, the server
    may be alive and its directory is left alone.
    """
    if pid == os.getpid():
        return False
    info = read_proc(pid)
    if info is None:
        return True
    if info.zombie:
        try:
            return len(os.listdir(f"/proc/{pid}/task")) <= 1
        except OSError:
            return True
    try:
        made = os.stat(directory).st_ctime
    except OSError:
        return False
    return started_after(info.start, made, time.time(), boot_ticks())


def _dead_servers_dirs(own_dir: str, ns: int) -> list[str]:
    """The directories ``exec-server-<pid>-ns<ns>`` of gone servers (:func:`server_gone`)."""
    try:
        entries = os.listdir(own_dir)
    except OSError:
        return []
    suffix = f"-ns{ns}"
    found = []
    for name in entries:
        if not (name.startswith(CGROUP_PREFIX) and name.endswith(suffix)):
            continue
        pid_text = name[len(CGROUP_PREFIX) : -len(suffix)]
        if not pid_text.isdigit():
            continue
        path = os.path.join(own_dir, name)
        if server_gone(int(pid_text), path):
            found.append(path)
    return found


def _remove_dead_servers_dirs(own_dir: str, ns: int, kill: Callable[[str], None]) -> None:
    """Kill (``kill``) the members of gone servers' directories below ``own_dir``
    (:func:`_dead_servers_dirs`), then remove the directories."""
    for leftover in _dead_servers_dirs(own_dir, ns):
        kill(leftover)
        removed = _remove_cgroup_tree(leftover, wait=1.0)
        log.info(
            "removed {what} cgroup {path} of a server that is gone",
            what="the" if removed else "(not all of) the",
            path=leftover,
        )


def _kill_members(directory: str, rounds: int = 50) -> None:
    """SIGKILL every process in ``directory``'s cgroup tree and their descendants.

    For hierarchies without ``cgroup.kill`` (v1): repeated until no member
    is left (a fork racing a round is caught by the next).
    """
    for _ in range(rounds):
        members = _tree_pids(directory)
        if not members:
            return
        table = proc_table()
        for pid in members:
            for member in [pid, *_descendants(table, pid)]:
                _signal_pid(member, signal.SIGKILL)
        time.sleep(0.01)


def _walk_bottom_up(path: str) -> Iterable[tuple[str, list[str], list[str]]]:
    return os.walk(path, topdown=False)
