"""The server-wide part: :class:`Containment` picks the mode, creates trees around each
spawn, attributes escapees and orphans, and kills what is left when the server stops."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import time
from collections.abc import Callable
from typing import Final, Literal

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from execserver import cgroups, escapees
from execserver.cgroups import V1Hierarchy
from execserver.containment.cgroup import (
    CGROUP_PREFIX,
    CgroupTree,
    _kill_descendants_of_members,
    _kill_members,
    _remove_cgroup_tree,
    _remove_dead_servers_dirs,
    _return_to,
    _write,
    find_cgroup2_mount,
)
from execserver.containment.placement import (
    CGROUP_POOL,
    ControlFiles,
    LimitControllers,
    LimitPlacement,
    Placing,
    V1Set,
    _with_oom_score,
    _with_rlimit,
    _WithLimits,
)
from execserver.containment.proc import (
    _cgroup2_of,
    _descendants,
    _kill_recorded,
    _pidns,
    _quick_proc,
    _signal_pid,
    boot_ticks,
    own_cgroup,
    proc_table,
    reap_unknown_children,
)
from execserver.containment.scan import MAX_SCAN_SHARE, MIN_SCAN_INTERVAL, Attribution, ScanTree
from execserver.containment.tree import ContainmentError
from execserver.limits import FIELDS, NO_LIMITS, Limits
from execserver.waiters import cancel_call

log = Logger(namespace="execserver.containment")


Mode = Literal["auto", "cgroup", "subreaper", "none"]


#: ``none`` is the behaviour before containment (the process group only),
#: kept for measurement and comparison; it is not a safe setting.
MODES: Final[tuple[Mode, ...]] = ("auto", "cgroup", "subreaper", "none")


#: How often trees that outlived their leader's output (a daemon) are checked
#: for being empty, and unknown zombies reaped, while there are any.
SWEEP_INTERVAL: Final = 1.0


_PR_SET_CHILD_SUBREAPER: Final = 36


Tree = CgroupTree | ScanTree


def _kill_v2_leftover(leftover: str) -> None:
    # Descendants that left the cgroup (root can) but whose parent stayed
    # are found through it before it dies.
    _kill_descendants_of_members(leftover)
    with contextlib.suppress(OSError):
        _write(os.path.join(leftover, "cgroup.kill"), "1")


def set_child_subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


class Containment(LimitControllers, Attribution):
    """Chooses, creates and cleans up process trees for one server.

    Until :meth:`start` runs (and in the local client, which never starts
    it), spawns are not contained: :meth:`spawn` returns no tree and the
    process group is all a terminate reaches.
    """

    def __init__(self, requested: str = "auto", clock: IReactorTime | None = None) -> None:
        self.requested = requested
        #: "none" until started, then "cgroup" or "subreaper".
        self.mode = "none"
        self._clock = clock
        self._cgroup_root = ""
        self._own_procs = ""
        self._parent = ""
        self._serial = 0
        self._trees: set[Tree] = set()
        self._lingering: set[Tree] = set()
        #: Empty cgroups kept for reuse (at most CGROUP_POOL).
        self._free: list[str] = []
        #: The last look at the server's children found orphans no tree claims.
        self._orphans_seen = False
        self._timer: IDelayedCall | None = None
        self._scan_cost = 0.0
        self._scanned_at = -1.0
        self._last_scan = 0.0
        #: Limit controllers the per-process v2 cgroups have (delegated).
        self.v2_controllers: frozenset[str] = frozenset()
        #: Controller -> (hierarchy, our parent directory in it), cgroup v1.
        self._v1: dict[str, tuple[V1Hierarchy, str]] = {}
        #: Controller -> why no limit of it can be enforced here.
        self._missing: dict[str, str] = {}
        #: Empty v1 directory sets kept for reuse, by the v1 controllers they
        #: have (each set knows the limits it holds and its last counters).
        self._v1_free: dict[tuple[str, ...], list[V1Set]] = {}
        #: The per-process v2 cgroups have cpu.stat (CPU time without cpuacct).
        self._v2_cpu_stat = False
        self._v1_serial = 0
        #: Where escapees are recorded for a restarted server (None: nowhere).
        self._escapee_file: str | None = None
        self._recorded: frozenset[tuple[int, int]] = frozenset()
        #: Trees whose v1 memory limit is watched for OOM kills.
        self._oom_watch: set[CgroupTree] = set()
        self._oom_timer: IDelayedCall | None = None
        #: Kept descriptors of the v1 directories' control files.
        self.files = ControlFiles(0)
        #: v1 parent directory -> the ``tasks`` file of the server's own
        #: cgroup in that hierarchy (where the spawning thread returns).
        self._v1_own_tasks: dict[str, str] = {}

    # --- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Pick the mode (``requested``), set the process-wide state, log it.

        Raises :class:`ContainmentError` if ``cgroup`` was requested and is
        unusable.
        """
        if self.requested == "none":
            log.warn(
                "process containment: none; a descendant that leaves its "
                "process group survives its process (not for production)"
            )
            return
        reason = ""
        if self.requested in ("auto", "cgroup"):
            try:
                self._start_cgroup()
            except (OSError, ContainmentError) as exc:
                reason = str(exc)
                if self.requested == "cgroup":
                    raise ContainmentError(f"cgroup containment is unavailable: {reason}") from None
            else:
                self.mode = "cgroup"
        # In either mode: a server that died (SIGKILL) may have used v1
        # hierarchies this one does not (another mode, v2 delegated now).
        self._cleanup_all_v1_leftovers()
        if self.mode == "cgroup":
            self._start_controllers()
        else:
            why = f"--process-containment {self.requested}" if self.requested != "auto" else ""
            for controller in cgroups.LIMIT_CONTROLLERS:
                self._missing[controller] = (
                    f"process containment is `subreaper` ({why or reason}), and the "
                    "limits need cgroup containment"
                )
        subreaper = set_child_subreaper()
        if self.mode != "cgroup":
            if not subreaper:
                raise ContainmentError("cannot become a child subreaper (prctl failed)")
            self.mode = "subreaper"
        if self.mode == "cgroup":
            log.info(
                "process containment: cgroup ({parent}); every descendant of a "
                "process is killed with it",
                parent=self._parent,
            )
        elif reason:
            # Asked for "auto" and got the weaker guarantee: say so even when
            # only warnings are logged.
            log.warn(
                "process containment: subreaper (no usable cgroup v2: {reason}); "
                "descendants are tracked from /proc, see docs/process-control.md",
                reason=reason,
            )
        else:
            log.info("process containment: subreaper; descendants are tracked from /proc")

    def _start_cgroup(self) -> None:
        root = find_cgroup2_mount()
        own = own_cgroup()
        if root is None or own is None:
            raise ContainmentError("no cgroup v2 hierarchy is mounted")
        own_dir = os.path.normpath(root + "/" + own)
        self._cgroup_root = root
        self._own_procs = os.path.join(own_dir, "cgroup.procs")
        ns = _pidns()
        self._cleanup_leftovers(own_dir, ns)
        self._escapee_file = escapees.start(ns, _kill_recorded)
        parent = os.path.join(own_dir, f"{CGROUP_PREFIX}{os.getpid()}-ns{ns}")
        with contextlib.suppress(FileExistsError):
            os.mkdir(parent)
        self._parent = parent
        # Prove the whole cycle once, so a host that refuses any step falls
        # back now rather than failing a spawn later.
        probe = os.path.join(parent, "probe")
        try:
            os.mkdir(probe)
            _write(os.path.join(probe, "cgroup.procs"), "0")
            _write(self._own_procs, "0")
            os.rmdir(probe)
            if not os.path.exists(os.path.join(parent, "cgroup.kill")):
                raise ContainmentError("cgroup.kill is missing (Linux < 5.14)")
        except BaseException:
            with contextlib.suppress(OSError):
                _write(self._own_procs, "0")
            for path in (probe, parent):
                with contextlib.suppress(OSError):
                    os.rmdir(path)
            self._parent = ""
            raise

    def _cleanup_leftovers(self, own_dir: str, ns: int) -> None:
        """Kill and remove the cgroups of a server of this pid namespace that died.

        Only names with our pid namespace are considered, and only when their
        server is gone (``server_gone``: its pid not running, or running a
        process younger than the directory), so another live server is
        never touched.
        """
        _remove_dead_servers_dirs(own_dir, ns, _kill_v2_leftover)

    def stop(self) -> Deferred[None]:
        """Kill every remaining descendant, reap them, remove the cgroups."""
        if self.mode == "none":
            return succeed(None)
        cancel_call(self._timer)
        self._timer = None
        for tree in list(self._trees):
            tree.kill()
        # Whatever descends from the server now is an escapee nobody owns.
        table = proc_table()
        me = os.getpid()
        for pid in _descendants(table, me):
            _signal_pid(pid, signal.SIGKILL)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            if not reap_unknown_children() and not any(t.alive() for t in self._trees):
                break
            time.sleep(0.01)
        reap_unknown_children()
        if self._parent and self._own_procs.startswith(self._parent + "/"):
            self._leave_server_leaf()
        if self._parent:
            # Sub-cgroups (in use or pooled) go with their parent.
            _remove_cgroup_tree(self._parent, wait=0.5)
            self._free.clear()
        cancel_call(self._oom_timer)
        self._oom_timer = None
        self.files.close()
        for parent in sorted({parent for _hierarchy, parent in self._v1.values()}):
            _kill_members(parent, rounds=5)
            _remove_cgroup_tree(parent, wait=0.5)
        self._v1_free.clear()
        self._oom_watch.clear()
        if self._escapee_file is not None:
            escapees.forget(self._escapee_file)
        self._trees.clear()
        self._lingering.clear()
        return succeed(None)

    # --- spawning -------------------------------------------------------------------

    def trees_of(self, pid: int) -> list[Tree]:
        """The live trees ``pid`` may belong to (the ``unix://`` listeners' peer check).

        Up ``pid``'s parent chain, the first process that is a tree's: in
        cgroup mode the one in a tree's cgroup (``pid`` itself unless it left
        its cgroup: root given the cgroup files can); in subreaper mode a
        member, the leader, or in the session or group of a tree. An orphan
        the server adopted that no tree claims: every tree born before it
        (it can only be one of theirs). The walk stops at a process older
        than every tree. ``none`` mode, a stranger, a process gone: none.
        """
        cgroup_mode = self.mode == "cgroup"
        trees: list[Tree]
        if cgroup_mode:
            trees = [
                t
                for t in (*self._trees, *self._lingering)
                if isinstance(t, CgroupTree) and not t.released
            ]
        elif self.mode == "subreaper":
            trees = [t for t in self._trees if isinstance(t, ScanTree)]
        else:
            return []
        if not trees:
            return []
        by_path = {t.path: t for t in trees if isinstance(t, CgroupTree)}
        oldest = min(t.born for t in trees)
        server = os.getpid()
        current = pid
        for _hop in range(1024):
            info = _quick_proc(current)
            if info is None or info.start < oldest:
                # Older than every tree: neither it nor its ancestors are members.
                return []
            if cgroup_mode:
                relative = _cgroup2_of(current)
                if relative is not None:
                    tree = by_path.get(os.path.normpath(self._cgroup_root + "/" + relative))
                    if tree is not None:
                        return [tree]
            for scan in trees:
                if isinstance(scan, ScanTree) and (
                    scan.members.get(info.pid) == info.start
                    or (
                        info.start >= scan.born
                        and (
                            info.pid == scan.leader
                            or (scan.by_session and scan.leader in (info.sid, info.pgrp))
                        )
                    )
                ):
                    return [scan]
            if info.ppid == server:
                return [t for t in trees if t.born <= info.start]
            if info.ppid <= 1:
                return []
            current = info.ppid
        return []

    def placing(self, limits: Limits, sandbox_processes: int = 0) -> Placing:
        """This containment, spawning with ``limits`` (checked: -32600 if unenforceable).

        ``sandbox_processes``: how many processes of the sandbox's own the
        tree holds around the command (bwrap and its init); they are not
        the command's, so ``pids.max`` has room for them beyond
        ``maxProcesses`` and the process count leaves them out.
        """
        self.check_limits(limits)
        return _WithLimits(self, limits, sandbox_processes)

    def spawn(
        self, create: Callable[[], int], limits: Limits = NO_LIMITS, sandbox_processes: int = 0
    ) -> tuple[int, Tree | None]:
        """Run ``create`` (which starts one child and returns its pid) contained.

        The child inherits what the creating thread has at that moment, so
        everything it must start with is set on the server around ``create``
        and restored right after: its cgroups, a higher ``oom_score_adj``
        and ``RLIMIT_FSIZE``.
        """
        if self.mode == "none":
            return _with_rlimit(create, limits), None
        create_adjusted = functools.partial(_with_oom_score, create, limits)
        if self.mode == "cgroup":
            return self._spawn_in_cgroup(create_adjusted, limits, sandbox_processes)
        if self.mode == "subreaper":
            born = boot_ticks()
            pid = create_adjusted()
            # The leader is found through its session at the first scan (it
            # leads a new one); nothing is read now, when /proc of a process
            # still in exec is slow to answer.
            tree = ScanTree(self, pid, born)
            self._add(tree)
            return pid, tree
        return create(), None

    def _spawn_in_cgroup(
        self, create: Callable[[], int], limits: Limits = NO_LIMITS, sandbox_processes: int = 0
    ) -> tuple[int, Tree | None]:
        controllers = limits.cgroup_controllers()
        # With controllers, a reused v2 cgroup would report its previous
        # user's peak and events: those are made afresh.
        path = self._free.pop() if self._free and not self.v2_controllers else ""
        if not path:
            self._serial += 1
            path = os.path.join(self._parent, str(self._serial))
            try:
                os.mkdir(path)
            except OSError as exc:
                # E.g. cgroup.max.descendants reached: refuse the process
                # rather than start it uncontained.
                raise ContainmentError(
                    f"cannot create a cgroup for the process: {exc.strerror}",
                    exc.errno or 0,
                ) from None
        procs = os.path.join(path, "cgroup.procs")
        entered = False
        placement: LimitPlacement | None = None
        exact = True
        try:
            if controllers:
                placement = self._place(path, limits, controllers, sandbox_processes)
            # The child inherits the cgroup of the thread that creates it,
            # so it is inside before its first instruction; the server
            # returns to its own cgroup right after (all its threads move).
            with contextlib.suppress(OSError):
                _write(procs, "0")
                entered = True
            v1_entered: list[int] = []
            try:
                v1set = placement.v1set if placement is not None else None
                if v1set is not None:
                    self._enter_v1(v1set, v1_entered)
                born = boot_ticks()
                pid = create()  # (spawn wrapped it: oom_score_adj, RLIMIT_FSIZE)
                if placement is not None and limits.max_processes is not None:
                    # Lowered while the server's thread still counts, so the
                    # tree is never above the limit, not even between the
                    # two writes (pids.max may be below pids.current).
                    exact = self._exact_pids_max(
                        placement, limits.max_processes + sandbox_processes
                    )
            finally:
                if v1_entered and placement is not None and placement.v1set is not None:
                    self._leave_v1(placement.v1set, v1_entered)
                if entered:
                    self._leave(path)
        except BaseException:
            self._free.append(path)
            if placement is not None:
                self._recycle_v1(placement)
            raise
        if not entered:
            # Moving the child after the fact leaves a window of a few
            # microseconds in which it could fork outside its cgroup.
            try:
                _write(procs, str(pid))
            except OSError as exc:
                log.warn(
                    "cannot put pid {pid} into its cgroup ({error}); only its "
                    "process group is contained",
                    pid=pid,
                    error=exc,
                )
        # ``born`` was read before the spawn: the leader's start time (taken
        # at its fork) is never before it, which the lineage checks rely on.
        tree = CgroupTree(self, path, pid, placement, born)
        self._add(tree)
        if not exact:
            tree.kill()
        if placement is not None and "memory" in placement.v1_controllers:
            self._oom_watch.add(tree)
            self._schedule_oom_check()
        return pid, tree

    def _leave(self, path: str) -> None:
        _return_to(self._own_procs, path)

    # --- bookkeeping ------------------------------------------------------------------

    def _add(self, tree: Tree) -> None:
        self._trees.add(tree)
        if isinstance(tree, ScanTree):
            # A scan from before this tree existed knows none of its members.
            self._scanned_at = -1.0
        self._schedule()

    def _linger(self, tree: Tree) -> None:
        self._lingering.add(tree)
        self._schedule()

    def _release(self, tree: Tree) -> None:
        if tree.released:
            return
        tree.released = True
        self._trees.discard(tree)
        self._lingering.discard(tree)
        if isinstance(tree, CgroupTree):
            self._oom_watch.discard(tree)
            if tree.placement is not None and tree.seen_empty:
                self._recycle_v1(tree.placement, known_empty=True)
            if tree.seen_empty and len(self._free) < CGROUP_POOL and not self.v2_controllers:
                # Entering a cgroup for the first time costs the kernel
                # several times a later entry (and mkdir/rmdir on top):
                # empty ones are kept for the next spawns.
                self._free.append(tree.path)
            else:
                self.files.forget(tree.path)
                try:
                    os.rmdir(tree.path)
                except FileNotFoundError:
                    pass
                except OSError:
                    # Still populated (a fork raced the kill, or a member
                    # would not die): kill again and keep watching it;
                    # stop() removes it at the latest.
                    tree.kill()
                    tree.released = False
                    self._trees.add(tree)
                    self._lingering.add(tree)
                    self._schedule()
                    return
            # Escapees whose parent died are our zombies now; those still
            # running whose last possible tree this was are killed.
            if self._adopted_outside() or tree.escapees:
                for pid in tree.live_escapees():
                    _signal_pid(pid, signal.SIGKILL)
                self._find_escapees()
        elif self._orphans_seen and self._unattributed_children():
            # Orphans nobody could attribute may have had this tree as their
            # last possible owner.
            self._rescan(force=True)

    def _schedule(self) -> None:
        if self._timer is not None or self._clock is None:
            return
        delay = SWEEP_INTERVAL
        if any(isinstance(t, ScanTree) for t in self._trees):
            delay = max(MIN_SCAN_INTERVAL, self._scan_cost / MAX_SCAN_SHARE)
        self._timer = self._clock.callLater(delay, self._tick)

    def _tick(self) -> None:
        self._timer = None
        if any(isinstance(t, ScanTree) for t in self._trees):
            self._rescan(force=True)
        if self.mode == "cgroup":
            # Orphans adopted by the server outside every cgroup of ours
            # are escapees: attributed (and recorded) now, not only at the
            # next terminate, so a restarted server can find them.
            if self._adopted_outside():
                self._find_escapees()
        else:
            reap_unknown_children()
        for tree in list(self._lingering):
            if not tree.alive():
                self._lingering.discard(tree)
                tree.emptied()
        if (
            self._lingering
            or any(isinstance(t, ScanTree) for t in self._trees)
            or (self.mode == "cgroup" and self._trees)
        ):
            self._schedule()


def limits_report(requested: str = "auto") -> list[str]:
    """Which resource limits this host lets a server enforce, one line per limit.

    For ``exec-server --check-sandbox``: starts a containment of mode
    ``requested`` as a server would (creating and proving its cgroups),
    reports, and removes them again. Meant for a short-lived check process
    (it makes the process a child subreaper).
    """
    containment = Containment(requested)
    try:
        containment.start()
    except ContainmentError as exc:
        return [
            f"{field}: not enforced ({exc})" for field in FIELDS if field != "fileSizeBytes"
        ] + ["fileSizeBytes: enforced (RLIMIT_FSIZE in the child)"]
    try:
        return containment.limits_report()
    finally:
        containment.stop()
