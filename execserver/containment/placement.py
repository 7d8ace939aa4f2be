"""Limits placement: where a limited process's controllers are, and the spawn's adjustments.

A limited process's controllers are its v2 cgroup's where the host
delegates them, else one directory per process in each cgroup v1 hierarchy
(a pooled :class:`V1Set`, its control files kept open by
:class:`ControlFiles`); ``RLIMIT_FSIZE`` and a higher ``oom_score_adj`` are
set on the server around the spawn for the child to inherit.
"""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Callable
from typing import TYPE_CHECKING, Final, Protocol

import attrs
from twisted.logger import Logger

from execserver import cgroups, fdlimit
from execserver.cgroups import Counters, Usage
from execserver.containment.cgroup import (
    CGROUP_PREFIX,
    _cgroup_pids,
    _kill_members,
    _remove_dead_servers_dirs,
    _return_to,
    _write,
)
from execserver.containment.proc import _pidns
from execserver.containment.tree import ContainmentError
from execserver.errors import RpcError
from execserver.limits import KINDS, Limits

if TYPE_CHECKING:
    from twisted.internet.interfaces import IDelayedCall, IReactorTime

    from execserver.cgroups import V1Hierarchy
    from execserver.containment.cgroup import CgroupTree
    from execserver.containment.core import Containment, Tree

log = Logger(namespace="execserver.containment")


#: Descriptors of cgroup v1 control files kept open (:class:`ControlFiles`):
#: at most this share of the soft ``RLIMIT_NOFILE`` (half the reserve
#: :mod:`execserver.fdlimit` keeps beside the processes' descriptors). A
#: pooled set keeps 8 with all limits (:attr:`ControlFiles.KEPT`: 3
#: ``tasks``, ``pids.max``, the peak reset, 3 counters), a pooled v2 cgroup
#: one (``cgroup.events``); 625 at a soft limit of 20,000 covers the ~40-70
#: sets that 32 starts in flight keep (64 of each: 579; 561 measured at 62;
#: one more file per set, ``pids.current``, filled it at 62 sets; a quarter
#: of the reserve, with the limit files kept too, ran out at ~50 sets: past
#: it every access opened its file again).
CONTROL_FILES_SHARE: Final = 32

#: Empty per-process cgroups kept for reuse.
CGROUP_POOL: Final = 64

#: How often the trees with a cgroup v1 memory limit are checked for an OOM
#: kill (v1 kills one process; the rest of the tree is ours to kill).
OOM_CHECK_INTERVAL: Final = 0.1

#: The name of the server's own leaf below its cgroup v2 parent when it
#: delegates controllers to its processes (no process may sit in a cgroup
#: whose children have controllers).
SERVER_LEAF: Final = "server"


#: cgroup v2 moves every thread of the server into the child's cgroup:
#: room in ``pids.max`` for threads it might start in that window.
V2_THREAD_ROOM: Final = 8


#: Added to the server's own ``oom_score_adj`` for every child, so the
#: kernel's OOM killer takes a command before the server.
CHILD_OOM_SCORE_ADJ: Final = 500


class ControlFiles:
    """Descriptors of cgroup v1 control files, kept open while their directory is.

    A control file read or written through a kept descriptor costs one
    ``pread``/``pwrite`` (about 1 µs here) instead of an open, the I/O and
    a close (4-8 µs, most of it the path walk), and cgroupfs answers a read
    at offset 0 afresh every time. The pooled v1 directories of limited
    processes are used by every limited start (entering and leaving them,
    ``pids.max``, the peak reset) and exit (the event counters), so their
    files are opened once per directory, not per process. Member lists are
    always read by path (:meth:`pids`).

    Only the files every start or exit touches are kept (:data:`KEPT`);
    the limit files, rewritten only when a set's next user asks for other
    limits, are written by path. At most ``budget`` descriptors are kept;
    past it (and for a file that is not a cgroupfs one: an ordinary file
    with contents, as in unit tests' fake trees) each access opens the file
    as before. :meth:`forget` closes a directory's descriptors before it is
    removed.
    """

    #: The control files kept open: entering (``tasks``), the exact
    #: ``pids.max``, the peak reset, the three event counters and the v2
    #: cgroup's ``cgroup.events`` (a pooled cgroup's emptiness at each exit:
    #: generated afresh by every read at offset 0, unlike v1's member lists).
    KEPT: Final = frozenset(
        {
            "cgroup.events",
            "tasks",
            "pids.max",
            "memory.max_usage_in_bytes",
            "memory.oom_control",
            "pids.events",
            "cpu.stat",
        }
    )

    def __init__(self, budget: int) -> None:
        self.budget = budget
        #: Moves on whenever a kept descriptor is closed: descriptors handed
        #: out by :meth:`kept` are valid while it has not moved.
        self.generation = 0
        self._fds: dict[tuple[str, bool], int] = {}
        #: Paths that are not kept (ordinary files).
        self._plain: set[str] = set()

    def __len__(self) -> int:
        return len(self._fds)

    def _fd(self, path: str, writing: bool) -> int | None:
        key = (path, writing)
        fd = self._fds.get(key)
        if (
            fd is not None
            or path in self._plain
            or len(self._fds) >= self.budget
            or path[path.rfind("/") + 1 :] not in self.KEPT
        ):
            return fd
        fd = os.open(path, (os.O_WRONLY if writing else os.O_RDONLY) | os.O_CLOEXEC)
        if writing and os.fstat(fd).st_size:
            # cgroupfs files have size 0; an ordinary one would keep the
            # tail of a longer earlier value after a pwrite at 0.
            os.close(fd)
            self._plain.add(path)
            return None
        self._fds[key] = fd
        return fd

    def kept(self, paths: list[str], writing: bool = True) -> list[int] | None:
        """Kept write (``writing``, else read) descriptors of ``paths``, all or
        nothing (None: access them by path).

        Valid until :attr:`generation` moves on (:meth:`forget`, :meth:`close`).
        """
        fds = []
        for path in paths:
            try:
                fd = self._fd(path, writing)
            except OSError:
                return None
            if fd is None:
                return None
            fds.append(fd)
        return fds

    def write(self, path: str, text: str) -> None:
        """Write ``text`` to a control file (raises OSError as the kernel refuses)."""
        fd = self._fd(path, True)
        if fd is None:
            cgroups.write(path, text)
        else:
            os.pwrite(fd, text.encode(), 0)

    def read_bytes(self, path: str, limit: int = 65536) -> bytes | None:
        """The first read (at most ``limit`` bytes) of a control file, None if
        it cannot be read (through a kept descriptor where :data:`KEPT`
        allows, looked up by path at every call: see :meth:`forget`)."""
        try:
            fd = self._fd(path, False)
            if fd is None:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    return os.read(fd, limit)
                finally:
                    os.close(fd)
            return os.pread(fd, limit, 0)
        except OSError:
            return None

    def read(self, path: str) -> str | None:
        """A control file's text, None if it cannot be read."""
        try:
            fd = self._fd(path, False)
            if fd is None:
                return cgroups.read_text(path)
            return os.pread(fd, 65536, 0).decode(errors="replace")
        except OSError:
            return None

    @staticmethod
    def pids(directory: str) -> list[int]:
        """The members of one v1 directory (its ``cgroup.procs``), read afresh.

        Never through a kept descriptor: cgroup v1 keeps the member list it
        loaded for an open file and serves it again to later reads of that
        file while they come less than a second apart, so a kept
        descriptor would report members long gone.
        """
        return _cgroup_pids(directory)

    def forget(self, directory: str) -> None:
        """Close the kept descriptors of ``directory``'s files.

        :attr:`generation` moves on only if one of them may have been handed
        out by :meth:`kept` (``cgroup.events`` never is: it is looked up by
        path at every read), so removing a pooled v2 cgroup does not make
        every v1 set look its descriptors up again.
        """
        prefix = directory + "/"
        closing = [k for k in self._fds if k[0].startswith(prefix)]
        if any(not k[0].endswith(_LOOKED_UP_EACH_TIME) for k in closing):
            self.generation += 1
        for key in closing:
            os.close(self._fds.pop(key))
        self._plain = {p for p in self._plain if not p.startswith(prefix)}

    def close(self) -> None:
        self.generation += 1
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        self._plain.clear()


#: The kept file that is never handed out by :meth:`ControlFiles.kept`.
_LOOKED_UP_EACH_TIME: Final = "/cgroup.events"

#: v1 event counter files: controller -> (file, key), in Counters' order.
_V1_COUNTERS: Final = (
    ("memory", "memory.oom_control", "oom_kill"),
    ("pids", "pids.events", "max"),
    ("cpu", "cpu.stat", "nr_throttled"),
)


def _counter_value(data: bytes, head: bytes, needle: bytes) -> int:
    """:func:`_key_value` of a counter file's raw bytes (no decoding, no
    copy of the text): ``head`` is ``key + b" "``, ``needle`` ``b"\\n" + head``."""
    if data.startswith(head):
        at = len(head)
    else:
        at = data.find(needle)
        if at < 0:
            return 0
        at += len(needle)
    end = data.find(b"\n", at)
    try:
        return int(data[at : end if end >= 0 else None])
    except ValueError:
        return 0


def _key_value(text: str | None, key: str) -> int:
    """``key``'s value in a flat-keyed control file's text (0 if absent)."""
    if not text:
        return 0
    head = key.encode() + b" "
    return _counter_value(text.encode(), head, b"\n" + head)


class V1Set:
    """One limited process's cgroup v1 directories (one per hierarchy), pooled.

    Every path the spawn and the exit touch is computed once, when the set
    is made; with the kept descriptors of :class:`ControlFiles` a reused
    set costs the kernel's work and one syscall per file.
    """

    __slots__ = (
        "_counter_keys",
        "_moves",
        "_reads",
        "by_controller",
        "counter_files",
        "dirs",
        "last",
        "own_tasks",
        "pids_max",
        "procs",
        "tasks",
        "written",
    )

    def __init__(self, by_controller: dict[str, str], own_tasks: dict[str, str]) -> None:
        #: Controller -> its directory (the cgroup v1 ones only).
        self.by_controller = by_controller
        self.dirs: tuple[str, ...] = tuple(sorted(set(by_controller.values())))
        self.tasks = [d + "/tasks" for d in self.dirs]
        #: The server's own ``tasks`` file in each directory's hierarchy.
        self.own_tasks = [own_tasks[os.path.dirname(d)] for d in self.dirs]
        self.procs = [d + "/cgroup.procs" for d in self.dirs]
        pids = by_controller.get("pids")
        self.pids_max = None if pids is None else pids + "/pids.max"
        self.counter_files = [
            (by_controller[c] + "/" + name, key) if c in by_controller else None
            for c, name, key in _V1_COUNTERS
        ]
        #: What the directories hold (None: unknown, e.g. a write failed).
        self.written: Limits | None = None
        #: The counters when the set was last found empty.
        self.last: Counters | None = None
        #: (generation, kept descriptors of ``tasks``, of ``own_tasks``).
        self._moves: tuple[int, list[int], list[int]] | None = None
        #: (generation, kept read descriptors of the counter files, or None).
        self._reads: tuple[int, list[int] | None] | None = None
        #: (index in Counters' order, ``key + b" "``, ``b"\\n" + key + b" "``)
        #: of each counter file, in order.
        self._counter_keys = [
            (index, entry[1].encode() + b" ", b"\n" + entry[1].encode() + b" ")
            for index, entry in enumerate(self.counter_files)
            if entry
        ]

    def moves(self, files: ControlFiles) -> tuple[list[int], list[int]] | None:
        """The kept descriptors to enter the directories (``tasks``) and leave
        them (``own_tasks``), looked up once (None: they are not kept)."""
        kept = self._moves
        if kept is None or kept[0] != files.generation:
            fds = files.kept([*self.tasks, *self.own_tasks])
            if fds is None:
                return None
            half = len(self.tasks)
            kept = self._moves = (files.generation, fds[:half], fds[half:])
        return kept[1], kept[2]

    def _read_fds(self, files: ControlFiles) -> list[int] | None:
        """The kept read descriptors of the counter files, in ``_counter_keys``'
        order, looked up once (None: read them by path)."""
        kept = self._reads
        if kept is None or kept[0] != files.generation:
            paths = [entry[0] for entry in self.counter_files if entry is not None]
            kept = self._reads = (files.generation, files.kept(paths, writing=False))
        return kept[1]

    def oom_kills(self, files: ControlFiles) -> int | None:
        """The memory directory's ``oom_kill`` count alone (the OOM watch's
        look), None if the set has no memory directory."""
        entry = self.counter_files[0]
        if entry is None:
            return None
        fds = self._read_fds(files)
        if fds is None:
            return _key_value(files.read(entry[0]), entry[1])
        try:
            data = os.pread(fds[0], 65536, 0)
        except OSError:
            return 0
        _index, head, needle = self._counter_keys[0]
        return _counter_value(data, head, needle)

    def counters(self, files: ControlFiles) -> Counters:
        found = [0, 0, 0]
        fds = self._read_fds(files)
        if fds is None:
            for index, entry in enumerate(self.counter_files):
                if entry is not None:
                    found[index] = _key_value(files.read(entry[0]), entry[1])
        else:
            for fd, (index, head, needle) in zip(fds, self._counter_keys, strict=True):
                try:
                    data = os.pread(fd, 65536, 0)
                except OSError:
                    continue
                found[index] = _counter_value(data, head, needle)
        return Counters(found[0], found[1], found[2])


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
    #: ``last`` was read with every cgroup of the tree already empty: no
    #: counter can move any more, so they are the next user's baseline.
    final: bool = False
    #: How the v1 files are read and written (kept descriptors).
    files: ControlFiles | None = None
    #: The pooled v1 directories (None: a placement made without a pool).
    v1set: V1Set | None = None
    #: Processes of the sandbox's own in the tree (room in ``pids.max``
    #: beyond ``limits.max_processes``, left out of the process count).
    sandbox_processes: int = 0
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
        if self.v1set is not None and self.files is not None and len(self._sides) == 1:
            self.last = self.v1set.counters(self.files)
            return self.last
        oom = pids = throttled = 0
        read = self.files.read if self.files is not None else None
        for version, side in self._sides:
            found = cgroups.counters(version, side, read if version == 1 else None)
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
    sandbox_processes: int = 0

    def spawn(self, create: Callable[[], int]) -> tuple[int, Tree | None]:
        return self.owner.spawn(create, self.limits, self.sandbox_processes)


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


class LimitControllers:
    """The limit controllers of :class:`~execserver.containment.core.Containment`.

    Finding where this host lets the server enforce each limit (delegated
    cgroup v2, else a cgroup v1 hierarchy), refusing what it cannot, and
    placing one limited process: its pooled v1 directory set, the limit
    files, ``pids.max`` made exact after the spawn, the set's reuse, and
    the v1 OOM watch. A mixin: the state is the containment's.
    """

    mode: str
    _clock: IReactorTime | None
    _own_procs: str
    _parent: str
    v2_controllers: frozenset[str]
    _v1: dict[str, tuple[V1Hierarchy, str]]
    _missing: dict[str, str]
    _v1_free: dict[tuple[str, ...], list[V1Set]]
    _v2_cpu_stat: bool
    _v1_serial: int
    _oom_watch: set[CgroupTree]
    _oom_timer: IDelayedCall | None
    files: ControlFiles
    _v1_own_tasks: dict[str, str]

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

    def _cleanup_all_v1_leftovers(self) -> None:
        """Clean up after dead servers in every v1 hierarchy the limits could use."""
        ns = _pidns()
        for hierarchy in {*cgroups.v1_hierarchies().values()}:
            self._cleanup_v1_leftovers(hierarchy.own, ns)

    def _cleanup_v1_leftovers(self, own_dir: str, ns: int) -> None:
        """Kill the members of a dead server's v1 directories and remove them.

        The members are escapees of a server that is gone (as in its v2
        cgroup): killed, with their descendants, before the directories go.
        """
        _remove_dead_servers_dirs(own_dir, ns, _kill_members)

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
        v1set = placement.v1set
        path = (
            v1set.pids_max
            if v1set is not None and v1set.pids_max is not None
            else os.path.join(placement.dirs["pids"], "pids.max")
        )
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

    def _enter_v1(self, v1set: V1Set, entered: list[int]) -> None:
        """Move the spawning thread into each of ``v1set``'s directories
        (``entered`` gets the index of each it entered; raises
        :class:`ContainmentError` at the first refusal)."""
        moves = v1set.moves(self.files)
        for index, tasks in enumerate(v1set.tasks):
            # Exactness or nothing: a limit the child could escape before
            # it is moved is refused. v1 moves one thread (``tasks``): only
            # the one that creates the child, which is all it inherits.
            try:
                if moves is None:
                    self.files.write(tasks, "0")
                else:
                    os.pwrite(moves[0][index], b"0", 0)
            except OSError as exc:
                raise ContainmentError(
                    f"cannot enter cgroup {v1set.dirs[index]}: {exc.strerror}",
                    exc.errno or 0,
                ) from None
            entered.append(index)

    def _leave_v1(self, v1set: V1Set, entered: list[int]) -> None:
        moves = v1set.moves(self.files)
        for index in entered:
            own = v1set.own_tasks[index]
            try:
                if moves is None:
                    self.files.write(own, "0")
                else:
                    os.pwrite(moves[1][index], b"0", 0)
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
            v1set = placement.v1set
            found = v1set.oom_kills(self.files) if v1set is not None else None
            if found is not None:
                kills = found
            else:
                dirs = {"memory": placement.dirs["memory"]}
                kills = cgroups.counters(1, dirs, self.files.read).oom_kills
            if kills > placement.baseline.oom_kills:
                placement.oom_killed = True
                self._oom_watch.discard(tree)
                log.info(
                    "an OOM kill in cgroup {path} (memoryBytes {limit}): killing its tree",
                    path=placement.dirs["memory"],
                    limit=placement.limits.memory_bytes,
                )
                tree.kill()
        self._schedule_oom_check()
