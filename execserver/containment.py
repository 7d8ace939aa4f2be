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
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import resource
import signal
import time
from collections.abc import Callable, Iterable
from typing import Final, Literal, Protocol, cast

import attrs
from twisted.internet import process as _twisted_process
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from execserver import cgroups, escapees
from execserver.cgroups import Counters, Usage, V1Hierarchy
from execserver.errors import RpcError
from execserver.limits import FIELDS, KINDS, NO_LIMITS, Kind, Limits
from execserver.waiters import cancel_call

log = Logger()

Mode = Literal["auto", "cgroup", "subreaper", "none"]
#: ``none`` is the behaviour before containment (the process group only),
#: kept for measurement and comparison; it is not a safe setting.
MODES: Final[tuple[Mode, ...]] = ("auto", "cgroup", "subreaper", "none")
CGROUP_PREFIX: Final = "exec-server-"
#: Least interval between two periodic /proc scans (subreaper mode).
MIN_SCAN_INTERVAL: Final = 1.0
#: A periodic scan may take at most this share of one core; on a host with
#: many processes scans become rarer rather than costlier.
MAX_SCAN_SHARE: Final = 0.02
#: How often trees that outlived their leader's output (a daemon) are checked
#: for being empty, and unknown zombies reaped, while there are any.
SWEEP_INTERVAL: Final = 1.0
#: Empty per-process cgroups kept for reuse.
CGROUP_POOL: Final = 64
_PR_SET_CHILD_SUBREAPER: Final = 36
_CLK_TCK: Final = os.sysconf("SC_CLK_TCK")
#: How often the trees with a cgroup v1 memory limit are checked for an OOM
#: kill (v1 kills one process; the rest of the tree is ours to kill).
OOM_CHECK_INTERVAL: Final = 0.1
#: cgroup v2 moves every thread of the server into the child's cgroup:
#: room in ``pids.max`` for threads it might start in that window.
V2_THREAD_ROOM: Final = 8
#: Signals to one tree this close together share one look for escapees.
ESCAPEE_RECHECK: Final = 0.01
#: Added to the server's own ``oom_score_adj`` for every child, so the
#: kernel's OOM killer takes a command before the server.
CHILD_OOM_SCORE_ADJ: Final = 500
#: The name of the server's own leaf below its cgroup v2 parent when it
#: delegates controllers to its processes (no process may sit in a cgroup
#: whose children have controllers).
SERVER_LEAF: Final = "server"


class ContainmentError(Exception):
    """The requested containment mode cannot be used, or a process cannot be contained."""

    def __init__(self, message: str, errno: int = 0) -> None:
        super().__init__(message)
        self.errno = errno


# --- /proc ------------------------------------------------------------------------


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
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # After the command: state ppid pgrp session tty tpgid flags minflt
    # cminflt majflt cmajflt utime stime cutime cstime priority nice threads
    # itrealvalue starttime
    try:
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


def boot_ticks() -> int:
    """Now, in the clock ticks since boot that ``/proc`` start times use."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * _CLK_TCK)


def _signal_pid(pid: int, signum: int) -> bool:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _signal_group(pgid: int, signum: int) -> bool:
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


# --- trees ------------------------------------------------------------------------


class ProcessTree(Protocol):
    """Every process of one supervised child (faked in unit tests)."""

    def signal(self, signum: int) -> None:
        """Send ``signum`` to every member (and to the leader's process group)."""

    def kill(self) -> None:
        """SIGKILL every member."""

    def alive(self) -> bool:
        """True while a member is running (zombies do not count)."""

    def when_empty(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, when a periodic check finds no member left.

        Used for trees that outlive their leader's output (a daemon).
        """

    def release(self) -> None:
        """The tree is empty and no longer needed: free what tracks it."""

    def exceeded(self) -> tuple[Kind, int] | None:
        """The cgroup limit that ended or crippled the tree (and its figure), if any."""

    def usage(self) -> Usage:
        """What the tree uses now (fields it cannot measure are None)."""


class _Owned:
    """What both kinds of tree share: their owner's bookkeeping."""

    _owner: Containment
    _on_empty: Callable[[], None] | None

    def when_empty(self, callback: Callable[[], None]) -> None:
        self._on_empty = callback
        self._owner._linger(cast("Tree", self))

    def emptied(self) -> None:
        callback, self._on_empty = self._on_empty, None
        if callback is not None:
            callback()

    def release(self) -> None:
        self._owner._release(cast("Tree", self))

    def exceeded(self) -> tuple[Kind, int] | None:
        return None

    def usage(self) -> Usage:
        return Usage()


@attrs.define
class LimitPlacement:
    """Where one limited process's controllers are, and what they said before it."""

    limits: Limits
    #: Controller -> the directory that holds its files.
    dirs: dict[str, str]
    #: The controllers of ``dirs`` that are cgroup v1 ones (the rest: v2).
    v1_controllers: frozenset[str]
    #: The cgroup v1 directories the process entered (none on v2).
    v1_dirs: tuple[str, ...]
    baseline: Counters = attrs.field(factory=Counters)
    #: What the directories hold now (None: unknown, e.g. a write failed).
    written: Limits | None = None
    #: The counters at the last look (the exit): a reused set's next baseline,
    #: since nothing counts while it is empty.
    last: Counters | None = None
    #: v1: the OOM kill of one member was seen; the tree was killed.
    oom_killed: bool = False
    _sides: list[tuple[cgroups.Version, dict[str, str]]] = attrs.field(init=False, factory=list)

    def __attrs_post_init__(self) -> None:
        v1 = {c: d for c, d in self.dirs.items() if c in self.v1_controllers}
        v2 = {c: d for c, d in self.dirs.items() if c not in self.v1_controllers}
        if v1:
            self._sides.append((1, v1))
        if v2:
            self._sides.append((2, v2))

    def sides(self) -> list[tuple[cgroups.Version, dict[str, str]]]:
        return self._sides

    def counters(self) -> Counters:
        # Each controller is on one side only: the others count 0 there.
        oom = pids = throttled = 0
        for version, side in self._sides:
            found = cgroups.counters(version, side)
            oom += found.oom_kills
            pids += found.pids_refused
            throttled += found.throttled
        self.last = Counters(oom, pids, throttled)
        return self.last

    def usage(self, procs_dir: str) -> Usage:
        found: dict[str, int | None] = {}
        for version, side in self.sides():
            for name, value in attrs.asdict(cgroups.usage(version, side, procs_dir)).items():
                if found.get(name) is None:
                    found[name] = value
        return Usage(**found)


class CgroupTree(_Owned):
    """The members of one cgroup v2 (and of its cgroup v1 directories)."""

    def __init__(
        self,
        owner: Containment,
        path: str,
        leader: int,
        placement: LimitPlacement | None = None,
    ) -> None:
        self.path = path
        self.leader = leader
        self.placement = placement
        #: Boot ticks just before the spawn: no member can be older.
        self.born = boot_ticks()
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

    def pids(self) -> list[int]:
        found = _cgroup_pids(self.path)
        if self.placement is not None:
            # A member that moved itself out of the v2 cgroup (root can) is
            # still in the v1 ones, unless it left those too.
            for directory in self.placement.v1_dirs:
                found.extend(pid for pid in _cgroup_pids(directory) if pid not in found)
        return found

    def exceeded(self) -> tuple[Kind, int] | None:
        placement = self.placement
        if placement is None:
            return None
        kind = cgroups.exceeded(placement.limits, placement.counters(), placement.baseline)
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
        return placement.usage(self.path)

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
        try:
            _write(os.path.join(self.path, "cgroup.kill"), "1")
        except OSError:
            # Before Linux 5.14: signal each member (a fork racing this is
            # caught by the next check, which repeats the kill).
            self.signal(signal.SIGKILL)
        else:
            self.signal(signal.SIGKILL)

    def alive(self) -> bool:
        try:
            with open(os.path.join(self.path, "cgroup.events"), "rb") as f:
                populated = b"populated 1" in f.read()
        except OSError:
            populated = False
        if not populated and self.placement is not None:
            populated = any(_cgroup_pids(d) for d in self.placement.v1_dirs)
        self.seen_empty = not populated
        return populated or bool(self.escapees and self.live_escapees())


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


Tree = CgroupTree | ScanTree


# --- the server-wide part -----------------------------------------------------------


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _cgroup_pids(directory: str) -> list[int]:
    try:
        with open(os.path.join(directory, "cgroup.procs"), "rb") as f:
            return [int(pid) for pid in f.read().split()]
    except OSError:
        return []


def find_cgroup2_mount(mounts: str = "/proc/self/mounts") -> str | None:
    try:
        with open(mounts) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) > 2 and fields[2] == "cgroup2":
            return fields[1].replace("\\040", " ")
    return None


def own_cgroup(path: str = "/proc/self/cgroup") -> str | None:
    """The server's cgroup v2 path (relative to the hierarchy's root)."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            return line[3:]
    return None


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


def _quick_proc(pid: int) -> ProcInfo | None:
    """:func:`read_proc` in one unbuffered read (the peer check's lineage walk)."""
    text = _proc_bytes(f"/proc/{pid}/stat")
    try:
        fields = text.rsplit(b")", 1)[1].split() if text is not None else []
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


def _cgroup2_of(pid: int) -> str | None:
    """``pid``'s cgroup v2 path (as :func:`own_cgroup`, in one unbuffered read)."""
    text = _proc_bytes(f"/proc/{pid}/cgroup")
    if text is None:
        return None
    for line in text.splitlines():
        if line.startswith(b"0::"):
            return line[3:].decode(errors="surrogateescape")
    return None


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
        self._v1_free: dict[
            tuple[str, ...], list[tuple[tuple[str, ...], Limits | None, Counters | None]]
        ] = {}
        #: The per-process v2 cgroups have cpu.stat (CPU time without cpuacct).
        self._v2_cpu_stat = False
        self._v1_serial = 0
        #: Where escapees are recorded for a restarted server (None: nowhere).
        self._escapee_file: str | None = None
        self._recorded: frozenset[tuple[int, int]] = frozenset()
        #: Trees whose v1 memory limit is watched for OOM kills.
        self._oom_watch: set[CgroupTree] = set()
        self._oom_timer: IDelayedCall | None = None

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
                    self._v1[name] = (hierarchy, self._start_v1(hierarchy, ns))
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

    def placing(self, limits: Limits) -> Placing:
        """This containment, spawning with ``limits`` (checked: -32600 if unenforceable)."""
        self.check_limits(limits)
        return _WithLimits(self, limits)

    def spawn(
        self, create: Callable[[], int], limits: Limits = NO_LIMITS
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
            return self._spawn_in_cgroup(create_adjusted, limits)
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
        self, create: Callable[[], int], limits: Limits = NO_LIMITS
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
                placement = self._place(path, limits, controllers)
            # The child inherits the cgroup of the thread that creates it,
            # so it is inside before its first instruction; the server
            # returns to its own cgroup right after (all its threads move).
            with contextlib.suppress(OSError):
                _write(procs, "0")
                entered = True
            v1_entered: list[str] = []
            try:
                if placement is not None:
                    for directory in placement.v1_dirs:
                        # Exactness or nothing: a limit the child could
                        # escape before it is moved is refused.
                        # v1 moves one thread (``tasks``): only the one
                        # that creates the child, which is all it inherits.
                        try:
                            _write(os.path.join(directory, "tasks"), "0")
                        except OSError as exc:
                            raise ContainmentError(
                                f"cannot enter cgroup {directory}: {exc.strerror}",
                                exc.errno or 0,
                            ) from None
                        v1_entered.append(directory)
                born = boot_ticks()
                pid = _with_rlimit(create, limits)
                if placement is not None and limits.max_processes is not None:
                    # Lowered while the server's thread still counts, so the
                    # tree is never above the limit, not even between the
                    # two writes (pids.max may be below pids.current).
                    exact = self._exact_pids_max(placement, limits.max_processes)
            finally:
                self._leave_v1(v1_entered)
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
        # Read before the spawn: the leader's start time (taken at its fork)
        # is never before it, which the lineage checks rely on.
        tree.born = born
        self._add(tree)
        if not exact:
            tree.kill()
        if placement is not None and "memory" in placement.v1_controllers:
            self._oom_watch.add(tree)
            self._schedule_oom_check()
        return pid, tree

    def _place(self, path: str, limits: Limits, controllers: list[str]) -> LimitPlacement:
        """The controller directories of one limited process, limits written."""
        v1 = [c for c in controllers if c not in self.v2_controllers]
        if v1 and not self._v2_cpu_stat and "cpuacct" in self._v1 and "cpuacct" not in v1:
            # Without the v2 cgroup's cpu.stat, CPU time is cpuacct's.
            v1.append("cpuacct")
        parents = sorted({self._v1[c][1] for c in v1})
        key = tuple(parents)
        free = self._v1_free.get(key)
        previous: Limits | None = None
        last: Counters | None = None
        if free:
            v1_dirs, previous, last = free.pop()
        else:
            self._v1_serial += 1
            made: list[str] = []
            try:
                for parent in parents:
                    directory = os.path.join(parent, str(self._v1_serial))
                    os.mkdir(directory)
                    made.append(directory)
            except OSError as exc:
                for directory in made:
                    with contextlib.suppress(OSError):
                        os.rmdir(directory)
                raise ContainmentError(
                    f"cannot create a cgroup for the process's limits: {exc.strerror}",
                    exc.errno or 0,
                ) from None
            v1_dirs = tuple(made)
        by_parent = dict(zip(parents, v1_dirs, strict=True))
        dirs = {c: path for c in controllers if c in self.v2_controllers}
        for controller in v1:
            dirs[controller] = by_parent[self._v1[controller][1]]
        placement = LimitPlacement(limits, dirs, frozenset(v1), v1_dirs)
        written = limits
        if limits.max_processes is not None:
            # The server's own tasks count in pids.current while it creates
            # the child: room for exactly them (v1: the one thread that
            # moves; v2: all its threads, plus a few it might start in those
            # microseconds) until the exact figure is written right after.
            room = 1 if "pids" in v1 else _thread_count() + V2_THREAD_ROOM
            written = attrs.evolve(limits, max_processes=limits.max_processes + room)
        try:
            # Each side (v1 directories, the v2 cgroup) by its own rules.
            for version, side in placement.sides():
                # A reused v1 set holds what its last process left; the v2
                # cgroup is always fresh when it has controllers.
                cgroups.apply(version, side, written, previous if version == 1 else None)
        except OSError as exc:
            self._recycle_v1(placement)
            raise ContainmentError(
                f"cannot write the process's limits: {exc.strerror}", exc.errno or 0
            ) from None
        only_v1 = all(version == 1 for version, _side in placement.sides())
        # A reused v1 set's counters have not moved since its last process's
        # exit (nothing counts while it is empty): no need to read them again.
        placement.baseline = last if last is not None and only_v1 else placement.counters()
        placement.written = written
        return placement

    def _exact_pids_max(self, placement: LimitPlacement, limit: int) -> bool:
        if placement.written is not None:
            placement.written = attrs.evolve(placement.written, max_processes=limit)
        try:
            _write(os.path.join(placement.dirs["pids"], "pids.max"), str(limit))
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

    def _leave_v1(self, entered: list[str]) -> None:
        for directory in entered:
            _return_to(os.path.join(self._v1_own_of(directory), "tasks"), directory)

    def _v1_own_of(self, directory: str) -> str:
        parent = os.path.dirname(directory)
        for hierarchy, known in self._v1.values():
            if known == parent:
                return hierarchy.own
        raise ContainmentError(f"{directory} is in no known cgroup v1 hierarchy")

    def _recycle_v1(self, placement: LimitPlacement, known_empty: bool = False) -> None:
        """Keep an empty placement's v1 directories for reuse, or remove them.

        ``known_empty``: the tree's last check found them empty.
        """
        if not placement.v1_dirs:
            return
        if not known_empty and any(_cgroup_pids(d) for d in placement.v1_dirs):
            return
        key = tuple(sorted(os.path.dirname(d) for d in placement.v1_dirs))
        free = self._v1_free.setdefault(key, [])
        if len(free) < CGROUP_POOL:
            # If the limits were never written (a failed write), nothing is
            # known of what the directories hold. The counters are read now,
            # empty: members that outlived the exit may have moved them.
            free.append((placement.v1_dirs, placement.written, placement.counters()))
            return
        for directory in placement.v1_dirs:
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
            now = cgroups.counters(1, {"memory": placement.dirs["memory"]})
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


_CONTROLLER_OF: Final = {
    "memoryBytes": "memory",
    "maxProcesses": "pids",
    "cpuPercent": "cpu",
    "fileSizeBytes": "",
}


class Placing(Protocol):
    """What a spawn path needs of containment: ``spawn`` (faked in unit tests)."""

    def spawn(self, create: Callable[[], int]) -> tuple[int, Tree | None]:
        """Run ``create`` contained; see :meth:`Containment.spawn`."""


@attrs.frozen
class _WithLimits:
    owner: Containment
    limits: Limits

    def spawn(self, create: Callable[[], int]) -> tuple[int, Tree | None]:
        return self.owner.spawn(create, self.limits)


def _with_rlimit(create: Callable[[], int], limits: Limits) -> int:
    """``create()`` with the server's ``RLIMIT_FSIZE`` lowered for the child to inherit.

    The limit is process-wide: for the microseconds of the spawn a file
    write by another server thread past the limit fails with EFBIG (Python
    ignores SIGXFSZ, so the server is never killed by it).
    """
    size = limits.file_size_bytes
    if size is None:
        return create()
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    hard = old[1]
    soft = size if hard == resource.RLIM_INFINITY else min(size, hard)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    try:
        return create()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 64


_OOM_SCORE_ADJ: Final = "/proc/self/oom_score_adj"


def _with_oom_score(create: Callable[[], int], limits: Limits) -> int:
    """``create()`` with a higher ``oom_score_adj``, so the OOM killer prefers the child.

    Raising it is always allowed; going back to the server's own value is
    too (unprivileged processes may return down to the value they had).
    """
    try:
        with open(_OOM_SCORE_ADJ, "rb") as f:
            own = int(f.read())
        _write(_OOM_SCORE_ADJ, str(min(1000, own + CHILD_OOM_SCORE_ADJ)))
    except (OSError, ValueError):
        return _with_rlimit(create, limits)
    try:
        return _with_rlimit(create, limits)
    finally:
        try:
            _write(_OOM_SCORE_ADJ, str(own))
        except OSError as exc:
            log.critical(
                "cannot restore the server's oom_score_adj {own}: {error}", own=own, error=exc
            )


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


def _in_cgroup_below(pid: int, root: str, parent: str) -> bool:
    """Whether ``pid``'s cgroup v2 (hierarchy mounted at ``root``) is ``parent`` or below it."""
    own = own_cgroup(f"/proc/{pid}/cgroup")
    if own is None or not parent:
        return False
    path = os.path.normpath(root + "/" + own)
    return path == parent or path.startswith(parent + "/")


def _kill_descendants_of_members(directory: str) -> None:
    members: list[int] = []
    for dirpath, _dirs, _files in os.walk(directory):
        members.extend(_cgroup_pids(dirpath))
    if not members:
        return
    table = proc_table()
    children: dict[int, list[int]] = {}
    for info in table.values():
        children.setdefault(info.ppid, []).append(info.pid)
    for pid in _lineage(table, children, members):
        _signal_pid(pid, signal.SIGKILL)


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


def _dead_servers_dirs(own_dir: str, ns: int) -> list[str]:
    """The directories ``exec-server-<pid>-ns<ns>`` of servers that are not running."""
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
        if not pid_text.isdigit() or int(pid_text) == os.getpid():
            continue
        if os.path.exists(f"/proc/{pid_text}"):
            continue
        found.append(os.path.join(own_dir, name))
    return found


def _kill_members(directory: str, rounds: int = 50) -> None:
    """SIGKILL every process in ``directory``'s cgroup tree and their descendants.

    For hierarchies without ``cgroup.kill`` (v1): repeated until no member
    is left (a fork racing a round is caught by the next).
    """
    for _ in range(rounds):
        members: list[int] = []
        for dirpath, _dirs, _files in os.walk(directory):
            members.extend(_cgroup_pids(dirpath))
        if not members:
            return
        table = proc_table()
        for pid in members:
            for member in [pid, *_descendants(table, pid)]:
                _signal_pid(member, signal.SIGKILL)
        time.sleep(0.01)


def _walk_bottom_up(path: str) -> Iterable[tuple[str, list[str], list[str]]]:
    return os.walk(path, topdown=False)


__all__ = [
    "MODES",
    "CgroupTree",
    "Containment",
    "ContainmentError",
    "LimitPlacement",
    "Mode",
    "Placing",
    "ProcInfo",
    "ProcessTree",
    "ScanTree",
    "boot_ticks",
    "limits_report",
    "proc_table",
    "reap_unknown_children",
]
