"""The subreaper's trees: members found in ``/proc`` scans (subreaper mode)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from twisted.logger import Logger

from execserver import escapees
from execserver.containment.cgroup import CgroupTree, _in_cgroup_below
from execserver.containment.proc import (
    ProcInfo,
    _descendants,
    _signal_group,
    _signal_pid,
    _still_running,
    _walk_children,
    proc_table,
    read_proc,
    reap_unknown_children,
    reaped_by_twisted,
)
from execserver.containment.tree import _Owned

if TYPE_CHECKING:
    from execserver.containment.core import Containment, Tree

log = Logger(namespace="execserver.containment")


#: Least interval between two periodic /proc scans (subreaper mode).
MIN_SCAN_INTERVAL: Final = 1.0


#: A periodic scan may take at most this share of one core; on a host with
#: many processes scans become rarer rather than costlier.
MAX_SCAN_SHARE: Final = 0.02


class ScanTree(_Owned):
    """One tree found in ``/proc`` (subreaper mode)."""

    def __init__(self, owner: Containment, leader: int, born: int) -> None:
        self.leader = leader
        #: Boot ticks just before the spawn: no member can be older.
        self.born = born
        #: pid -> start time of every member seen (remembered after their
        #: parent dies, when only this tells who they belong to).
        self.members: dict[int, int] = {}
        #: Whether the leader's session (and group) still exist. Once empty a
        #: session can never be entered again, and only then can its id be
        #: reused by a stranger's new session: from then on it proves nothing.
        self.by_session = True
        self.terminating = False
        self.released = False
        self._owner = owner
        self._on_empty: Callable[[], None] | None = None

    def learn(self, table: dict[int, ProcInfo], children: dict[int, list[int]]) -> None:
        """Recompute the members from a ``/proc`` table."""
        found: dict[int, int] = {}
        in_session = False
        for info in table.values():
            if info.start < self.born:
                continue
            if self.by_session and self.leader in (info.sid, info.pgrp):
                in_session = True
                if not info.zombie:
                    found[info.pid] = info.start
            elif self.members.get(info.pid) == info.start and not info.zombie:
                found[info.pid] = info.start
        if not in_session:
            self.by_session = False
        pending = list(found)
        while pending:
            for child in children.get(pending.pop(), ()):
                info = table[child]
                if child not in found and not info.zombie:
                    found[child] = info.start
                    pending.append(child)
        self.members = found

    def signal(self, signum: int) -> None:
        # Only a terminate signals a whole tree.
        self.terminating = True
        self._owner._rescan()
        _signal_group(self.leader, signum)
        for pid in self._checked_members():
            _signal_pid(pid, signum)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    def pids(self) -> list[int]:
        """The members still running (for process/list; i23)."""
        return self._checked_members()

    def alive(self) -> bool:
        if self._checked_members():
            return True
        # Orphans the server has not attributed yet (they were created and
        # orphaned since the last scan) may be ours: look before answering.
        if self._owner._unattributed_children():
            self._owner._rescan()
            return bool(self._checked_members())
        return False

    def _checked_members(self) -> list[int]:
        """Members still running, checked one by one (no scan)."""
        return _still_running(self.members)


class Attribution:
    """Who a stray process belongs to, for :class:`~execserver.containment.core.Containment`.

    Escapees (cgroup mode): descendants that left their cgroup, found by
    lineage from the members or, once orphaned and adopted by the server,
    by elimination, and recorded for a restarted server. Subreaper scans:
    every descendant attributed to its tree from ``/proc``. A mixin: the
    state is the containment's.
    """

    mode: str
    _trees: set[Tree]
    _cgroup_root: str
    _parent: str
    _escapee_file: str | None
    _recorded: frozenset[tuple[int, int]]
    _orphans_seen: bool
    _scanned_at: float
    _scan_cost: float

    def _adopted_outside(self) -> list[int]:
        """Running children of the server that it did not spawn and no cgroup of ours holds."""
        running = reap_unknown_children()
        if not running:
            return []
        return [
            pid for pid in running if not _in_cgroup_below(pid, self._cgroup_root, self._parent)
        ]

    def _find_escapees(self, tree: CgroupTree | None = None) -> None:
        """Attribute descendants that left their cgroup to their tree.

        By lineage (``tree``, right before it is signalled): a descendant
        of a member (the kernel's children lists, from the members down; no
        scan of ``/proc``), or of a known escapee, is a member wherever its
        cgroup is. By elimination: an orphan the server adopted, outside
        every cgroup of ours, belongs to a tree that existed when it was
        born; with none left it is killed; while several could own it, it
        shares their fate once all are terminating.
        """
        trees = [t for t in self._trees if isinstance(t, CgroupTree) and not t.released]
        if tree is not None and not tree.released:
            inside = set(tree.pids())
            roots = [tree.leader, *inside, *tree.live_escapees()]
            for pid in _walk_children(roots):
                if pid in inside or pid == tree.leader or pid in tree.escapees:
                    continue
                info = read_proc(pid)
                if info is not None and not info.zombie and info.start >= tree.born:
                    tree.escapees[pid] = info.start
        attributed = {pid for t in trees for pid in t.escapees}
        for pid in self._adopted_outside():
            if pid in attributed:
                continue
            adopted = read_proc(pid)
            if adopted is None or adopted.zombie:
                continue
            candidates = [t for t in trees if t.born <= adopted.start]
            if not candidates:
                log.info("killing pid {pid}: it left its cgroup and its tree is gone", pid=pid)
                for member in _walk_children([pid]):
                    _signal_pid(member, signal.SIGKILL)
                continue
            if len(candidates) == 1 or all(t.terminating for t in candidates):
                for member in _walk_children([pid]):
                    info = read_proc(member)
                    if info is None or info.zombie:
                        continue
                    for owner in candidates:
                        owner.escapees[member] = info.start
        self._record_escapees(trees)

    def _record_escapees(self, trees: list[CgroupTree]) -> None:
        if self._escapee_file is None:
            return
        current = frozenset((pid, start) for t in trees for pid, start in t.escapees.items())
        if current != self._recorded:
            self._recorded = current
            escapees.record(self._escapee_file, current)

    def _unattributed_children(self) -> list[int]:
        """Reap unknown zombie children; return the running ones no tree claims."""
        running = reap_unknown_children()
        self._orphans_seen = False
        if not running or self.mode != "subreaper":
            return []
        attributed = {pid for t in self._trees if isinstance(t, ScanTree) for pid in t.members}
        found = [pid for pid in running if pid not in attributed]
        self._orphans_seen = bool(found)
        return found

    def _rescan(self, force: bool = False) -> None:
        """Attribute every descendant of the server to its tree from ``/proc``.

        A burst of terminates (a session ending) shares one scan unless
        ``force``. Orphans no live tree can own are killed.
        """
        trees = [t for t in self._trees if isinstance(t, ScanTree)]
        if not trees and not self._unattributed_children():
            return
        now = time.monotonic()
        if not force and now - self._scanned_at < 0.05:
            return
        began = time.perf_counter()
        table = proc_table()
        children: dict[int, list[int]] = {}
        for info in table.values():
            children.setdefault(info.ppid, []).append(info.pid)
        for tree in trees:
            tree.learn(table, children)
        self._attribute_orphans(table, children, trees)
        self._scanned_at = time.monotonic()
        self._scan_cost = time.perf_counter() - began

    def _attribute_orphans(
        self,
        table: dict[int, ProcInfo],
        children: dict[int, list[int]],
        trees: list[ScanTree],
    ) -> None:
        known = reaped_by_twisted()
        if known is None:
            return
        attributed = {pid for t in trees for pid in t.members}
        for pid in children.get(os.getpid(), ()):
            info = table[pid]
            if pid in known or pid in attributed or info.zombie:
                continue
            # Reparented to us with a lineage never seen: only a tree that
            # existed when it was born can own it.
            candidates = [t for t in trees if t.born <= info.start and not t.released]
            if len(candidates) == 1:
                owner = candidates[0]
                owner.members[pid] = info.start
                owner.learn(table, children)
            elif not candidates:
                # Every tree it could belong to is gone.
                for member in [pid, *_descendants(table, pid)]:
                    _signal_pid(member, signal.SIGKILL)
            elif all(t.terminating for t in candidates):
                # Whichever it belongs to is being terminated: it shares
                # their fate (and their signals).
                for owner in candidates:
                    owner.members[pid] = info.start
                    owner.learn(table, children)
