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

from execserver import cgroups
from execserver.cgroups import Counters, Usage
from execserver.containment.cgroup import _write
from execserver.limits import Limits

if TYPE_CHECKING:
    from execserver.containment.core import Containment, Tree

log = Logger(namespace="execserver.containment")


#: Descriptors of cgroup v1 control files kept open (:class:`ControlFiles`):
#: at most this share of the soft ``RLIMIT_NOFILE`` (a quarter of the reserve
#: :mod:`execserver.fdlimit` keeps beside the processes' descriptors).
CONTROL_FILES_SHARE: Final = 64


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

    At most ``budget`` descriptors are kept; past it (and for a file that is
    not a cgroupfs one: an ordinary file with contents, as in unit tests'
    fake trees) each access opens the file as before. :meth:`forget` closes
    a directory's descriptors before it is removed.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._fds: dict[tuple[str, bool], int] = {}
        #: Paths that are not kept (ordinary files).
        self._plain: set[str] = set()

    def __len__(self) -> int:
        return len(self._fds)

    def _fd(self, path: str, writing: bool) -> int | None:
        key = (path, writing)
        fd = self._fds.get(key)
        if fd is not None or path in self._plain or len(self._fds) >= self.budget:
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

    def write(self, path: str, text: str) -> None:
        """Write ``text`` to a control file (raises OSError as the kernel refuses)."""
        fd = self._fd(path, True)
        if fd is None:
            cgroups.write(path, text)
        else:
            os.pwrite(fd, text.encode(), 0)

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
        text = cgroups.read_text(os.path.join(directory, "cgroup.procs"))
        return [int(pid) for pid in text.split()] if text else []

    def forget(self, directory: str) -> None:
        """Close the kept descriptors of ``directory``'s files."""
        prefix = directory + "/"
        for key in [k for k in self._fds if k[0].startswith(prefix)]:
            os.close(self._fds.pop(key))
        self._plain = {p for p in self._plain if not p.startswith(prefix)}

    def close(self) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        self._plain.clear()


#: v1 event counter files: controller -> (file, key), in Counters' order.
_V1_COUNTERS: Final = (
    ("memory", "memory.oom_control", "oom_kill"),
    ("pids", "pids.events", "max"),
    ("cpu", "cpu.stat", "nr_throttled"),
)


def _key_value(text: str | None, key: str) -> int:
    """``key``'s value in a flat-keyed control file's text (0 if absent)."""
    if not text:
        return 0
    at = ("\n" + text).find("\n" + key + " ")
    if at < 0:
        return 0
    end = text.find("\n", at)
    try:
        return int(text[at + len(key) : end if end >= 0 else None])
    except ValueError:
        return 0


class V1Set:
    """One limited process's cgroup v1 directories (one per hierarchy), pooled.

    Every path the spawn and the exit touch is computed once, when the set
    is made; with the kept descriptors of :class:`ControlFiles` a reused
    set costs the kernel's work and one syscall per file.
    """

    __slots__ = (
        "by_controller",
        "counter_files",
        "dirs",
        "last",
        "own_tasks",
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
        self.counter_files = [
            (by_controller[c] + "/" + name, key) if c in by_controller else None
            for c, name, key in _V1_COUNTERS
        ]
        #: What the directories hold (None: unknown, e.g. a write failed).
        self.written: Limits | None = None
        #: The counters when the set was last found empty.
        self.last: Counters | None = None

    def counters(self, files: ControlFiles) -> Counters:
        oom, pids, throttled = (
            0 if entry is None else _key_value(files.read(entry[0]), entry[1])
            for entry in self.counter_files
        )
        return Counters(oom, pids, throttled)


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
