"""The subreaper's trees: members found in ``/proc`` scans (subreaper mode)."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from execserver.containment.proc import ProcInfo, _signal_group, _signal_pid, _still_running
from execserver.containment.tree import _Owned

if TYPE_CHECKING:
    from execserver.containment.core import Containment


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
