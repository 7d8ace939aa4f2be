"""Process-group helpers: signal a group, and tell whether it still has live members."""

from __future__ import annotations

import os
import time
from typing import Final

from execserver.containment import read_proc


def kill_group(pid: int, sig: int) -> bool:
    """Send ``sig`` to the process group led by ``pid``; False if it is gone."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    return True


#: How long one /proc scan answers :func:`group_alive` for every group. When
#: many processes are terminated at once (a session ending) their groups are
#: checked in a burst; one scan serves them all. A stale "alive" only costs
#: a later re-check.
GROUP_SCAN_TTL: Final = 0.05
_group_scan: tuple[float, frozenset[int]] | None = None


def _live_groups() -> frozenset[int] | None:
    """Groups with a member that is not a zombie, from /proc (None: no /proc)."""
    global _group_scan
    now = time.monotonic()
    if _group_scan is not None and now - _group_scan[0] < GROUP_SCAN_TTL:
        return _group_scan[1]
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    groups = frozenset(
        info.pgrp
        for entry in entries
        if entry.isdigit() and (info := read_proc(int(entry))) is not None and not info.zombie
    )
    _group_scan = (now, groups)
    return groups


def group_alive(pgid: int) -> bool:
    """True while process group ``pgid`` has a member that is not a zombie.

    ``killpg(pgid, 0)`` alone cannot tell: it succeeds for zombies, and
    orphans killed with their group stay zombies until init reaps them
    (which some container inits never do). Only when it succeeds is /proc
    consulted.
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    groups = _live_groups()
    return groups is None or pgid in groups


def leads_own_group(pid: int) -> bool:
    """True if ``pid`` leads its own session and process group (a zombie still counts)."""
    try:
        return os.getpgid(pid) == pid and os.getsid(pid) == pid
    except OSError:
        return False


def wait_until_leader(pid: int, timeout: float) -> bool:
    """Wait (blocking, up to ``timeout`` s) until ``pid`` leads its own group.

    For children that call ``setsid`` themselves after they were created:
    until they have, signalling their group would miss them. False if the
    child ended first or the time ran out.
    """
    deadline = time.monotonic() + timeout
    while not leads_own_group(pid):
        info = read_proc(pid)
        if info is None or info.zombie or time.monotonic() > deadline:
            return False
        time.sleep(0.0002)
    return True
