"""Containment: every descendant of a supervised process stays reachable.

A process started by the server is the leader of a *tree*: itself and every
process it ever creates, including those that leave its session or process
group (``setsid``, ``setpgid``, GNU ``timeout``), double-fork or daemonise.
A :class:`ProcessTree` can signal every member, kill them all and tell
whether any is still alive. :class:`Containment` is the server-wide part: it
chooses how trees are tracked when the service starts, creates them around
each spawn, reaps orphans that become the server's children, and kills
whatever is left when the server stops.

Two mechanisms (``--process-containment``; ``docs/process-control.md``,
"Containment", states exactly what each guarantees):

- ``cgroup``: one cgroup v2 per process, below a cgroup of the server's own
  (``<own cgroup>/exec-server-<pid>-ns<pidns>``). The server enters the
  child's cgroup around ``posix_spawn`` and returns to its own right after,
  so the child is inside before it can fork: membership is exact and
  nothing can leave it (a cgroup is not something an unprivileged
  descendant can change). SIGKILL is ``cgroup.kill``; "gone" is
  ``populated 0`` in ``cgroup.events``. No controller is enabled.
- ``subreaper``: the server is a child subreaper (``PR_SET_CHILD_SUBREAPER``),
  so every orphaned descendant becomes the server's child instead of init's
  and the set of all its descendants is always visible in ``/proc``. Each
  tree is attributed from ``/proc``: the leader's session and process
  group, parent chains from members, and members remembered as
  ``(pid, start time)`` so that reparented orphans stay attributed. An
  orphan whose lineage was never seen (it escaped between two scans) is
  attributed by elimination: it can only belong to a tree that had started
  when it was born, so it is killed once every such tree is terminating or
  gone, and at the latest when the server stops.

The cgroup mode sets the subreaper too: an escapee killed through its cgroup
whose parent is gone is then the server's zombie to reap, not init's (which
in some containers never reaps).

In cgroup mode a descendant that left its cgroup (root can write itself
elsewhere) is still a member: found by lineage when its tree is signalled,
or, once orphaned and adopted by the server, by elimination as in subreaper
mode, and recorded (:mod:`execserver.escapees`) for a server restarted
after a crash.

Resource limits (:mod:`execserver.limits`): a limited process's controllers
are its v2 cgroup's where the host delegates them, else one directory per
process in each cgroup v1 hierarchy; the creating thread enters them around
the spawn as it enters the v2 cgroup, with ``RLIMIT_FSIZE`` and a higher
``oom_score_adj`` set around the spawn too. The file I/O is
:mod:`execserver.cgroups`.

Process-wide effects (prctl, cgroups) happen in :meth:`Containment.start`,
called when the service starts, never at import or construction.

The package, by part:

- :mod:`~execserver.containment.proc`: the process table (``/proc``
  reads, signals, the server's children, reaping orphans);
- :mod:`~execserver.containment.tree`: the :class:`ProcessTree` protocol;
- :mod:`~execserver.containment.cgroup`: the cgroup tree
  (:class:`CgroupTree`) and the cgroupfs helpers;
- :mod:`~execserver.containment.scan`: the subreaper's trees
  (:class:`ScanTree`) and attribution (``Attribution``, a mixin of
  :class:`Containment`): escapees by lineage and elimination, ``/proc``
  scans, orphans;
- :mod:`~execserver.containment.placement`: limits placement (the limit
  controllers, ``LimitControllers``, a mixin of :class:`Containment`; the
  v1 directory sets with their control files kept open; ``RLIMIT_FSIZE``
  and ``oom_score_adj`` around the spawn);
- :mod:`~execserver.containment.core`: :class:`Containment` (modes,
  spawning, bookkeeping, sweeps, shutdown).
"""

from __future__ import annotations

from execserver.containment.cgroup import (
    CGROUP_PREFIX,
    ESCAPEE_RECHECK,
    CgroupTree,
    find_cgroup2_mount,
)
from execserver.containment.core import (
    MODES,
    SWEEP_INTERVAL,
    Containment,
    Mode,
    Tree,
    limits_report,
    set_child_subreaper,
)
from execserver.containment.placement import (
    CGROUP_POOL,
    CHILD_OOM_SCORE_ADJ,
    CONTROL_FILES_SHARE,
    OOM_CHECK_INTERVAL,
    SERVER_LEAF,
    V2_THREAD_ROOM,
    ControlFiles,
    LimitPlacement,
    Placing,
    V1Set,
)
from execserver.containment.proc import (
    ProcInfo,
    boot_ticks,
    own_cgroup,
    own_children,
    proc_table,
    read_proc,
    reap_unknown_children,
    reaped_by_twisted,
)
from execserver.containment.scan import MAX_SCAN_SHARE, MIN_SCAN_INTERVAL, ScanTree
from execserver.containment.tree import ContainmentError, ProcessTree

__all__ = [
    "CGROUP_POOL",
    "CGROUP_PREFIX",
    "CHILD_OOM_SCORE_ADJ",
    "CONTROL_FILES_SHARE",
    "ESCAPEE_RECHECK",
    "MAX_SCAN_SHARE",
    "MIN_SCAN_INTERVAL",
    "MODES",
    "OOM_CHECK_INTERVAL",
    "SERVER_LEAF",
    "SWEEP_INTERVAL",
    "V2_THREAD_ROOM",
    "CgroupTree",
    "Containment",
    "ContainmentError",
    "ControlFiles",
    "LimitPlacement",
    "Mode",
    "Placing",
    "ProcInfo",
    "ProcessTree",
    "ScanTree",
    "Tree",
    "V1Set",
    "boot_ticks",
    "find_cgroup2_mount",
    "limits_report",
    "own_cgroup",
    "own_children",
    "proc_table",
    "read_proc",
    "reap_unknown_children",
    "reaped_by_twisted",
    "set_child_subreaper",
]
