"""Cgroup controllers: finding them, writing a process's limits, reading its usage.

Everything here is plain file I/O below directories given by the caller, so
it is unit-tested against a fake cgroupfs (a directory tree of ordinary
files). :mod:`execserver.containment` decides where the directories are and
when a process enters them.

Two layouts:

- cgroup v2 with delegated controllers: the process's own cgroup (the one
  containment already gives every process) holds ``memory.max`` (with
  ``memory.swap.max`` 0 and ``memory.oom.group`` 1, so an OOM kill takes the
  whole tree), ``pids.max`` and ``cpu.max``; usage is ``memory.current``,
  ``memory.peak``, ``cpu.stat`` and ``pids.current``; what happened is
  ``memory.events`` (``oom_kill``), ``pids.events`` (``max``) and
  ``cpu.stat`` (``nr_throttled``).
- cgroup v1 hierarchies (one per controller, or ``cpu,cpuacct`` together):
  a directory per process in each, ``memory.limit_in_bytes`` (and
  ``memory.memsw.limit_in_bytes`` at the same figure where swap accounting
  exists, so swap cannot extend the limit), ``pids.max``,
  ``cpu.cfs_quota_us``/``cpu.cfs_period_us``; usage is
  ``memory.usage_in_bytes``, ``memory.max_usage_in_bytes``,
  ``cpuacct.usage`` and ``pids.current``; what happened is
  ``memory.oom_control`` (``oom_kill``), ``pids.events`` (``max``) and
  ``cpu.stat`` (``nr_throttled``). v1 has no group OOM kill: containment
  watches ``oom_kill`` and kills the rest of the tree itself.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from typing import Final, Literal

import attrs

from execserver.limits import Kind, Limits

Version = Literal[1, 2]
#: The CFS period used for ``cpuPercent`` (100 ms, the kernel's default).
CPU_PERIOD_US: Final = 100_000
#: The controllers limits use (``cpuacct`` only measures, on v1).
LIMIT_CONTROLLERS: Final = ("memory", "pids", "cpu")


def write(path: str, text: str) -> None:
    # O_TRUNC means nothing to cgroupfs; it makes ordinary files (the unit
    # tests' fake hierarchy) read back exactly what was written.
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def read_text(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return None


def read_int(path: str) -> int | None:
    text = read_text(path)
    if text is None:
        return None
    try:
        return int(text.split()[0])
    except (IndexError, ValueError):
        return None


#: How a caller reads one control file (path -> text, None if unreadable)
#: and writes one (raises OSError): by default :func:`read_text` and
#: :func:`write`; containment passes its kept descriptors for the v1 files
#: of pooled directories.
Reader = Callable[[str], "str | None"]
Writer = Callable[[str, str], None]


def read_key(path: str, key: str, read: Reader | None = None) -> int | None:
    """The value of ``key`` in a flat-keyed file (``memory.events``, ``cpu.stat``)."""
    text = (read or read_text)(path)
    if text is None:
        return None
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[0] == key:
            try:
                return int(fields[1])
            except ValueError:
                return None
    return None


# --- finding the hierarchies -----------------------------------------------------


@attrs.frozen
class V1Hierarchy:
    """One mounted cgroup v1 hierarchy and the server's place in it."""

    mount: str
    controllers: frozenset[str]
    #: The server's own cgroup there (absolute path).
    own: str


def mount_table(mounts: str = "/proc/self/mounts") -> list[tuple[str, str, frozenset[str]]]:
    """The mount table (a ``/proc/*/mounts`` file): (mount point, type, options) per mount.

    Unreadable: empty. Lines with fewer than three fields are skipped (no
    options: none); a space in a mount point (``\\040`` in the table) is
    restored.
    """
    table = []
    for line in (read_text(mounts) or "").splitlines():
        fields = line.split()
        if len(fields) >= 3:
            options = frozenset(fields[3].split(",")) if len(fields) > 3 else frozenset()
            table.append((fields[1].replace("\\040", " "), fields[2], options))
    return table


def v1_hierarchies(
    mounts: str = "/proc/self/mounts", cgroup: str = "/proc/self/cgroup"
) -> dict[str, V1Hierarchy]:
    """Controller -> the v1 hierarchy that has it (for the controllers limits use)."""
    own: dict[frozenset[str], str] = {}
    for line in (read_text(cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[1]:
            own[frozenset(parts[1].split(","))] = parts[2]
    found: dict[str, V1Hierarchy] = {}
    for mount, kind, options in mount_table(mounts):
        if kind != "cgroup":
            continue
        controllers = frozenset(c for c in ("memory", "pids", "cpu", "cpuacct") if c in options)
        if not controllers:
            continue
        relative = next((path for names, path in own.items() if controllers <= names), None)
        if relative is None:
            continue
        hierarchy = V1Hierarchy(mount, controllers, os.path.normpath(mount + "/" + relative))
        for controller in controllers:
            found.setdefault(controller, hierarchy)
    return found


def v2_available(own_dir: str) -> frozenset[str]:
    """The limit controllers the server's own v2 cgroup offers its children."""
    text = read_text(os.path.join(own_dir, "cgroup.controllers")) or ""
    return frozenset(c for c in text.split() if c in LIMIT_CONTROLLERS)


def v2_enable(directory: str, controllers: frozenset[str]) -> frozenset[str]:
    """Enable ``controllers`` for ``directory``'s children; return those that are on."""
    if controllers:
        with contextlib.suppress(OSError):
            write(
                os.path.join(directory, "cgroup.subtree_control"),
                " ".join(f"+{c}" for c in sorted(controllers)),
            )
    text = read_text(os.path.join(directory, "cgroup.subtree_control")) or ""
    return frozenset(c for c in text.split() if c in controllers)


# --- one process's limits -----------------------------------------------------------


def apply(
    version: Version,
    dirs: Mapping[str, str],
    limits: Limits,
    previous: Limits | None = None,
    out: Writer | None = None,
) -> None:
    """Write ``limits`` (None: unlimited) into the controllers of ``dirs``.

    ``dirs`` maps each controller to the directory whose files it owns.
    ``previous``: what these directories already hold (a reused set), so
    only what differs is written. ``out``: how to write (default
    :func:`write`). Raises OSError if the kernel refuses one.
    """
    put = out or write
    if "memory" in dirs:
        if previous is None or previous.memory_bytes != limits.memory_bytes:
            _apply_memory(version, dirs["memory"], limits.memory_bytes, put)
        elif version == 1:
            reset_v1_memory_peak(dirs["memory"], put)
    if "pids" in dirs and (previous is None or previous.max_processes != limits.max_processes):
        value = "max" if limits.max_processes is None else str(limits.max_processes)
        put(os.path.join(dirs["pids"], "pids.max"), value)
    if "cpu" in dirs and (previous is None or previous.cpu_percent != limits.cpu_percent):
        cpu = dirs["cpu"]
        quota = None if limits.cpu_percent is None else limits.cpu_percent * CPU_PERIOD_US // 100
        if version == 2:
            text = "max" if quota is None else str(quota)
            put(os.path.join(cpu, "cpu.max"), f"{text} {CPU_PERIOD_US}")
        else:
            put(os.path.join(cpu, "cpu.cfs_period_us"), str(CPU_PERIOD_US))
            put(os.path.join(cpu, "cpu.cfs_quota_us"), "-1" if quota is None else str(quota))


def _apply_memory(version: Version, directory: str, limit: int | None, put: Writer) -> None:
    if version == 2:
        put(os.path.join(directory, "memory.max"), "max" if limit is None else str(limit))
        swap = os.path.join(directory, "memory.swap.max")
        if os.path.exists(swap):
            put(swap, "max" if limit is None else "0")
        put(os.path.join(directory, "memory.oom.group"), "0" if limit is None else "1")
        return
    memsw = os.path.join(directory, "memory.memsw.limit_in_bytes")
    has_memsw = os.path.exists(memsw)
    # memsw may never be below the memory limit: lift it first, set it last.
    if has_memsw:
        put(memsw, "-1")
    put(os.path.join(directory, "memory.limit_in_bytes"), "-1" if limit is None else str(limit))
    if has_memsw and limit is not None:
        put(memsw, str(limit))
    reset_v1_memory_peak(directory, put)


def reset_v1_memory_peak(directory: str, out: Writer | None = None) -> None:
    """A reused v1 memory cgroup's peak starts again."""
    with contextlib.suppress(OSError):
        (out or write)(os.path.join(directory, "memory.max_usage_in_bytes"), "0")


@attrs.frozen
class Counters:
    """Monotonic event counts (a reused cgroup's are compared with these)."""

    oom_kills: int = 0
    pids_refused: int = 0
    throttled: int = 0


def counters(version: Version, dirs: Mapping[str, str], read: Reader | None = None) -> Counters:
    """The event counters of ``dirs`` (``read``: how to read, default :func:`read_text`)."""
    oom = pids = throttled = None
    if "memory" in dirs:
        name = "memory.events" if version == 2 else "memory.oom_control"
        oom = read_key(os.path.join(dirs["memory"], name), "oom_kill", read)
    if "pids" in dirs:
        pids = read_key(os.path.join(dirs["pids"], "pids.events"), "max", read)
    if "cpu" in dirs:
        throttled = read_key(os.path.join(dirs["cpu"], "cpu.stat"), "nr_throttled", read)
    return Counters(oom or 0, pids or 0, throttled or 0)


def exceeded(limits: Limits, now: Counters, before: Counters) -> Kind | None:
    """Which limit ended or crippled the process (the most severe first)."""
    if limits.memory_bytes is not None and now.oom_kills > before.oom_kills:
        return "memory"
    if limits.max_processes is not None and now.pids_refused > before.pids_refused:
        return "processes"
    if limits.cpu_percent is not None and now.throttled > before.throttled:
        return "cpu"
    return None


@attrs.frozen
class Usage:
    """What a process's tree uses now (None: not measured on this host)."""

    memory_bytes: int | None = None
    memory_peak_bytes: int | None = None
    cpu_usec: int | None = None
    processes: int | None = None


def usage(version: Version, dirs: Mapping[str, str], procs_dir: str | None) -> Usage:
    """Current usage from the controllers of ``dirs``.

    ``procs_dir`` (a cgroup without the pids controller) gives the process
    count from ``cgroup.procs`` when ``pids.current`` is not there.
    """
    memory = peak = cpu = processes = None
    if "memory" in dirs:
        d = dirs["memory"]
        if version == 2:
            memory = read_int(os.path.join(d, "memory.current"))
            peak = read_int(os.path.join(d, "memory.peak"))
        else:
            memory = read_int(os.path.join(d, "memory.usage_in_bytes"))
            peak = read_int(os.path.join(d, "memory.max_usage_in_bytes"))
    if "cpuacct" in dirs:
        nanoseconds = read_int(os.path.join(dirs["cpuacct"], "cpuacct.usage"))
        cpu = None if nanoseconds is None else nanoseconds // 1000
    elif procs_dir is not None:
        # The v2 cgroup's cpu.stat usage is core v2: no controller needed,
        # also on a hybrid host whose cpu controller is on v1.
        cpu = read_key(os.path.join(procs_dir, "cpu.stat"), "usage_usec")
    if "pids" in dirs:
        processes = read_int(os.path.join(dirs["pids"], "pids.current"))
    elif procs_dir is not None:
        text = read_text(os.path.join(procs_dir, "cgroup.procs"))
        processes = None if text is None else len(text.split())
    return Usage(memory, peak, cpu, processes)


__all__ = [
    "CPU_PERIOD_US",
    "Counters",
    "Reader",
    "Usage",
    "V1Hierarchy",
    "Writer",
    "apply",
    "counters",
    "exceeded",
    "reset_v1_memory_peak",
    "usage",
    "v1_hierarchies",
    "v2_available",
    "v2_enable",
]
