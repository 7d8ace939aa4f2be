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

from execserver import cgroups, escapees, fdlimit
from execserver.cgroups import V1Hierarchy
from execserver.containment.cgroup import (
    CGROUP_PREFIX,
    CgroupTree,
    _dead_servers_dirs,
    _in_cgroup_below,
    _kill_descendants_of_members,
    _kill_members,
    _remove_cgroup_tree,
    _return_to,
    _write,
    find_cgroup2_mount,
    own_cgroup,
)
from execserver.containment.placement import (
    _CONTROLLER_OF,
    CONTROL_FILES_SHARE,
    V2_THREAD_ROOM,
    ControlFiles,
    LimitPlacement,
    Placing,
    V1Set,
    _thread_count,
    _with_oom_score,
    _with_rlimit,
    _WithLimits,
)
from execserver.containment.proc import (
    ProcInfo,
    _descendants,
    _kill_recorded,
    _signal_pid,
    _walk_children,
    boot_ticks,
    proc_table,
    read_proc,
    reap_unknown_children,
    reaped_by_twisted,
)
from execserver.containment.scan import MAX_SCAN_SHARE, MIN_SCAN_INTERVAL, ScanTree
from execserver.containment.tree import ContainmentError
from execserver.errors import RpcError
from execserver.limits import FIELDS, KINDS, NO_LIMITS, Limits
from execserver.waiters import cancel_call

log = Logger(namespace="execserver.containment")


Mode = Literal["auto", "cgroup", "subreaper", "none"]


#: ``none`` is the behaviour before containment (the process group only),
#: kept for measurement and comparison; it is not a safe setting.
MODES: Final[tuple[Mode, ...]] = ("auto", "cgroup", "subreaper", "none")


#: How often trees that outlived their leader's output (a daemon) are checked
#: for being empty, and unknown zombies reaped, while there are any.
SWEEP_INTERVAL: Final = 1.0


#: Empty per-process cgroups kept for reuse.
CGROUP_POOL: Final = 64


_PR_SET_CHILD_SUBREAPER: Final = 36


#: How often the trees with a cgroup v1 memory limit are checked for an OOM
#: kill (v1 kills one process; the rest of the tree is ours to kill).
OOM_CHECK_INTERVAL: Final = 0.1


#: The name of the server's own leaf below its cgroup v2 parent when it
#: delegates controllers to its processes (no process may sit in a cgroup
#: whose children have controllers).
SERVER_LEAF: Final = "server"


Tree = CgroupTree | ScanTree


def set_child_subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _pidns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


class Containment:
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
        #: Empty v1 directory sets kept for reuse, by the hierarchies they
        #: span, with the limits they hold.
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

    # --- limit controllers ----------------------------------------------------------

    def _start_controllers(self) -> None:
        """Find, for each limit controller, where this host lets us enforce it."""
        own_dir = os.path.dirname(self._parent)
        self._v2_cpu_stat = (
            cgroups.read_key(os.path.join(self._parent, "cpu.stat"), "usage_usec") is not None
        )
        available = cgroups.v2_available(own_dir)
        if available:
            try:
                self.v2_controllers = self._delegate_v2(own_dir, available)
            except OSError as exc:
                for controller in available:
                    self._missing[controller] = (
                        f"cgroup v2 {controller} is available in {own_dir} but cannot be "
                        f"delegated to the processes ({exc.strerror}); the server needs a "
                        "cgroup of its own (systemd Delegate=yes)"
                    )
        ns = _pidns()
        self.files = ControlFiles(fdlimit.soft_limit() // CONTROL_FILES_SHARE)
        hierarchies = cgroups.v1_hierarchies()
        for controller in cgroups.LIMIT_CONTROLLERS:
            if controller in self.v2_controllers:
                continue
            wanted = [controller]
            if controller == "cpu" and "cpuacct" not in self.v2_controllers:
                wanted.append("cpuacct")
            for name in wanted:
                hierarchy = hierarchies.get(name)
                if hierarchy is None:
                    if name == controller and controller not in self._missing:
                        self._missing[controller] = (
                            f"no cgroup v2 {controller} controller is delegated to the "
                            f"server's cgroup and no cgroup v1 {controller} hierarchy is mounted"
                        )
                    continue
                try:
                    parent = self._start_v1(hierarchy, ns)
                    self._v1[name] = (hierarchy, parent)
                    self._v1_own_tasks[parent] = os.path.join(hierarchy.own, "tasks")
                except OSError as exc:
                    if name == controller:
                        self._missing[controller] = (
                            f"the cgroup v1 {controller} hierarchy at {hierarchy.mount} is "
                            f"not writable ({exc.strerror})"
                        )
                else:
                    if name == controller:
                        self._missing.pop(controller, None)
        log.info(
            "process limits: {report}",
            report="; ".join(self.limits_report()),
        )

    def _delegate_v2(self, own_dir: str, available: frozenset[str]) -> frozenset[str]:
        """Move the server into a leaf and enable ``available`` for its processes.

        A cgroup whose children have controllers may hold no process, so the
        server leaves its own cgroup (which must then be empty: a delegated
        one) for ``<parent>/server``.
        """
        leaf = os.path.join(self._parent, SERVER_LEAF)
        with contextlib.suppress(FileExistsError):
            os.mkdir(leaf)
        _write(os.path.join(leaf, "cgroup.procs"), "0")
        self._own_procs = os.path.join(leaf, "cgroup.procs")
        enabled = cgroups.v2_enable(own_dir, available)
        if enabled != available:
            missing = ", ".join(sorted(available - enabled))
            raise OSError(16, f"cannot enable {missing} in {own_dir} (other processes in it?)")
        return cgroups.v2_enable(self._parent, enabled)

    def _leave_server_leaf(self) -> None:
        """Back from ``<parent>/server`` to the server's own cgroup, so both can go.

        Only possible once no cgroup below the server's own has controllers
        enabled (no process may sit beside children with controllers); if
        another server shares that cgroup, the leaf stays until a later
        server removes it (its pid is gone by then).
        """
        own_dir = os.path.dirname(self._parent)
        for dirpath, dirs, _files in os.walk(self._parent, topdown=False):
            for name in dirs:
                if dirpath == self._parent and name == SERVER_LEAF:
                    continue
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(dirpath, name))
        off = " ".join(f"-{c}" for c in sorted(self.v2_controllers))
        try:
            if off:
                cgroups.write(os.path.join(self._parent, "cgroup.subtree_control"), off)
                cgroups.write(os.path.join(own_dir, "cgroup.subtree_control"), off)
            _write(os.path.join(own_dir, "cgroup.procs"), "0")
        except OSError as exc:
            log.info(
                "the server stays in {leaf} ({error}); a later server removes it",
                leaf=os.path.dirname(self._own_procs),
                error=exc,
            )
            return
        self._own_procs = os.path.join(own_dir, "cgroup.procs")

    def _start_v1(self, hierarchy: V1Hierarchy, ns: int) -> str:
        """Our parent directory in one v1 hierarchy, proven usable."""
        for known, parent in self._v1.values():
            if known == hierarchy:
                return parent
        self._cleanup_v1_leftovers(hierarchy.own, ns)
        parent = os.path.join(hierarchy.own, f"{CGROUP_PREFIX}{os.getpid()}-ns{ns}")
        with contextlib.suppress(FileExistsError):
            os.mkdir(parent)
        probe = os.path.join(parent, "probe")
        own_procs = os.path.join(hierarchy.own, "cgroup.procs")
        try:
            os.mkdir(probe)
            _write(os.path.join(probe, "cgroup.procs"), "0")
            _write(own_procs, "0")
            os.rmdir(probe)
        except BaseException:
            with contextlib.suppress(OSError):
                _write(own_procs, "0")
            for path in (probe, parent):
                with contextlib.suppress(OSError):
                    os.rmdir(path)
            raise
        return parent

    def _cleanup_v1_leftovers(self, own_dir: str, ns: int) -> None:
        """Kill the members of a dead server's v1 directories and remove them."""
        for leftover in _dead_servers_dirs(own_dir, ns):
            _kill_members(leftover)
            _remove_cgroup_tree(leftover, wait=1.0)

    def limits_report(self) -> list[str]:
        """One line per limit: whether and how this server enforces it."""
        lines = []
        for field, kind in KINDS.items():
            if kind == "fileSize":
                lines.append(f"{field}: enforced (RLIMIT_FSIZE in the child)")
                continue
            controller = {"memory": "memory", "processes": "pids", "cpu": "cpu"}[kind]
            if self.mode != "cgroup" and controller not in self._missing:
                lines.append(f"{field}: not enforced (process containment is {self.mode})")
            elif controller in self.v2_controllers:
                lines.append(f"{field}: enforced (cgroup v2 {controller})")
            elif controller in self._v1:
                lines.append(
                    f"{field}: enforced (cgroup v1 {controller} at {self._v1[controller][0].mount})"
                )
            else:
                lines.append(f"{field}: not enforced ({self._missing.get(controller, 'unknown')})")
        return lines

    def check_limits(self, limits: Limits) -> None:
        """Refuse (-32600) limits this host cannot enforce, naming what is missing."""
        for controller in limits.cgroup_controllers():
            if self.mode == "cgroup" and (
                controller in self.v2_controllers or controller in self._v1
            ):
                continue
            field = next(f for f in limits.set_fields() if _CONTROLLER_OF[f] == controller)
            why = self._missing.get(controller)
            if why is None:
                why = f"process containment is `{self.mode}` (limits need cgroup containment)"
            raise RpcError.invalid_request(
                f"limits.{field} cannot be enforced on this host: {why}",
                {"kind": "limitUnsupported", "field": field},
            )

    def _cleanup_leftovers(self, own_dir: str, ns: int) -> None:
        """Kill and remove the cgroups of a server of this pid namespace that died.

        Only names with our pid namespace are considered, and only when their
        pid is not running, so another live server is never touched.
        """
        try:
            entries = os.listdir(own_dir)
        except OSError:
            return
        suffix = f"-ns{ns}"
        for name in entries:
            if not (name.startswith(CGROUP_PREFIX) and name.endswith(suffix)):
                continue
            pid_text = name[len(CGROUP_PREFIX) : -len(suffix)]
            if not pid_text.isdigit() or int(pid_text) == os.getpid():
                continue
            if os.path.exists(f"/proc/{pid_text}"):
                continue
            leftover = os.path.join(own_dir, name)
            # Descendants that left the cgroup (root can) but whose parent
            # stayed are found through it before it dies.
            _kill_descendants_of_members(leftover)
            with contextlib.suppress(OSError):
                _write(os.path.join(leftover, "cgroup.kill"), "1")
            removed = _remove_cgroup_tree(leftover, wait=1.0)
            log.info(
                "removed {what} cgroup {path} of a server that is gone",
                what="the" if removed else "(not all of) the",
                path=leftover,
            )

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
                    for index, tasks in enumerate(v1set.tasks):
                        # Exactness or nothing: a limit the child could
                        # escape before it is moved is refused.
                        # v1 moves one thread (``tasks``): only the one
                        # that creates the child, which is all it inherits.
                        try:
                            self.files.write(tasks, "0")
                        except OSError as exc:
                            raise ContainmentError(
                                f"cannot enter cgroup {v1set.dirs[index]}: {exc.strerror}",
                                exc.errno or 0,
                            ) from None
                        v1_entered.append(index)
                pid = _with_rlimit(create, limits)
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
        tree = CgroupTree(self, path, pid, placement)
        self._add(tree)
        if not exact:
            tree.kill()
        if placement is not None and "memory" in placement.v1_controllers:
            self._oom_watch.add(tree)
            self._schedule_oom_check()
        return pid, tree

    def _place(
        self, path: str, limits: Limits, controllers: list[str], sandbox_processes: int = 0
    ) -> LimitPlacement:
        """The controller directories of one limited process, limits written.

        ``pids.max`` is ``maxProcesses`` plus ``sandbox_processes`` (see
        :meth:`placing`).
        """
        v1 = [c for c in controllers if c not in self.v2_controllers]
        if v1 and not self._v2_cpu_stat and "cpuacct" in self._v1 and "cpuacct" not in v1:
            # Without the v2 cgroup's cpu.stat, CPU time is cpuacct's.
            v1.append("cpuacct")
        v1set: V1Set | None = None
        if v1:
            key = tuple(sorted(v1))
            free = self._v1_free.get(key)
            v1set = free.pop() if free else self._new_v1_set(key)
        previous = v1set.written if v1set is not None else None
        dirs = {c: path for c in controllers if c in self.v2_controllers}
        if v1set is not None:
            dirs.update(v1set.by_controller)
        placement = LimitPlacement(
            limits,
            dirs,
            frozenset(v1),
            v1set.dirs if v1set is not None else (),
            files=self.files,
            v1set=v1set,
            sandbox_processes=sandbox_processes,
        )
        written = limits
        if limits.max_processes is not None:
            # The server's own tasks count in pids.current while it creates
            # the child: room for exactly them (v1: the one thread that
            # moves; v2: all its threads, plus a few it might start in those
            # microseconds) until the exact figure is written right after.
            room = 1 if "pids" in v1 else _thread_count() + V2_THREAD_ROOM
            written = Limits(
                limits.memory_bytes,
                limits.max_processes + sandbox_processes + room,
                limits.cpu_percent,
                limits.file_size_bytes,
            )
        try:
            # Each side (v1 directories, the v2 cgroup) by its own rules.
            for version, side in placement.sides():
                # A reused v1 set holds what its last process left; the v2
                # cgroup is always fresh when it has controllers.
                if version == 1:
                    cgroups.apply(1, side, written, previous, self.files.write)
                else:
                    cgroups.apply(2, side, written)
        except OSError as exc:
            self._recycle_v1(placement)
            raise ContainmentError(
                f"cannot write the process's limits: {exc.strerror}", exc.errno or 0
            ) from None
        last = v1set.last if v1set is not None else None
        # A reused v1 set's counters have not moved since it was found empty
        # (nothing counts while it is empty): no need to read them again.
        if last is not None and not any(c in self.v2_controllers for c in controllers):
            placement.baseline = last
        else:
            placement.baseline = placement.counters()
        placement.written = written
        return placement

    def _new_v1_set(self, controllers: tuple[str, ...]) -> V1Set:
        """Fresh directories, one in each v1 hierarchy of ``controllers``."""
        self._v1_serial += 1
        made: dict[str, str] = {}
        by_controller: dict[str, str] = {}
        try:
            for controller in controllers:
                parent = self._v1[controller][1]
                if parent not in made:
                    directory = os.path.join(parent, str(self._v1_serial))
                    os.mkdir(directory)
                    made[parent] = directory
                by_controller[controller] = made[parent]
        except OSError as exc:
            for directory in made.values():
                with contextlib.suppress(OSError):
                    os.rmdir(directory)
            raise ContainmentError(
                f"cannot create a cgroup for the process's limits: {exc.strerror}",
                exc.errno or 0,
            ) from None
        return V1Set(by_controller, self._v1_own_tasks)

    def _exact_pids_max(self, placement: LimitPlacement, limit: int) -> bool:
        if placement.written is not None:
            mine = placement.limits
            placement.written = Limits(
                mine.memory_bytes, limit, mine.cpu_percent, mine.file_size_bytes
            )
        path = os.path.join(placement.dirs["pids"], "pids.max")
        try:
            if "pids" in placement.v1_controllers:
                self.files.write(path, str(limit))
            else:
                _write(path, str(limit))
        except OSError as exc:
            placement.written = None
            log.critical(
                "cannot set pids.max {limit} in {path}: {error}; the process is killed",
                limit=limit,
                path=placement.dirs["pids"],
                error=exc,
            )
            return False
        return True

    def _leave_v1(self, v1set: V1Set, entered: list[int]) -> None:
        for index in entered:
            own = v1set.own_tasks[index]
            try:
                self.files.write(own, "0")
            except OSError:
                _return_to(own, v1set.dirs[index])

    def _recycle_v1(self, placement: LimitPlacement, known_empty: bool = False) -> None:
        """Keep an empty placement's v1 directories for reuse, or remove them.

        ``known_empty``: the tree's last check found them empty.
        """
        v1set = placement.v1set
        if v1set is None:
            return
        if not known_empty and any(cgroups.read_text(p) for p in v1set.procs):
            return
        free = self._v1_free.setdefault(tuple(sorted(placement.v1_controllers)), [])
        if len(free) < CGROUP_POOL:
            # If the limits were never written (a failed write), nothing is
            # known of what the directories hold. The counters are read now,
            # empty: members that outlived the exit may have moved them.
            v1set.written = placement.written
            final = placement.final and placement.last is not None
            v1set.last = placement.last if final else v1set.counters(self.files)
            free.append(v1set)
            return
        for directory in v1set.dirs:
            self.files.forget(directory)
            with contextlib.suppress(OSError):
                os.rmdir(directory)

    def _schedule_oom_check(self) -> None:
        if self._oom_timer is None and self._clock is not None and self._oom_watch:
            self._oom_timer = self._clock.callLater(OOM_CHECK_INTERVAL, self._check_ooms)

    def _check_ooms(self) -> None:
        """cgroup v1 kills one process on OOM: kill the rest of its tree."""
        self._oom_timer = None
        for tree in list(self._oom_watch):
            placement = tree.placement
            if tree.released or placement is None:
                self._oom_watch.discard(tree)
                continue
            now = cgroups.counters(1, {"memory": placement.dirs["memory"]}, self.files.read)
            if now.oom_kills > placement.baseline.oom_kills:
                placement.oom_killed = True
                self._oom_watch.discard(tree)
                log.info(
                    "an OOM kill in cgroup {path} (memoryBytes {limit}): killing its tree",
                    path=placement.dirs["memory"],
                    limit=placement.limits.memory_bytes,
                )
                tree.kill()
        self._schedule_oom_check()

    def _leave(self, path: str) -> None:
        _return_to(self._own_procs, path)

    # --- bookkeeping ------------------------------------------------------------------

    def _add(self, tree: Tree) -> None:
        self._trees.add(tree)
        if isinstance(tree, CgroupTree):
            self._schedule()
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

    # --- escapees (cgroup mode) ----------------------------------------------------------

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

    # --- subreaper scans ----------------------------------------------------------------

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
