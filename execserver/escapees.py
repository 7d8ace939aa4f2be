"""A record of escaped descendants, for a server restarted after a crash.

In cgroup containment a process started by root can write itself into
another cgroup and leave its session (docs/process-control.md,
"Containment"). While the server runs it still finds such a process: by
lineage, or, once it is an orphan, because the server (a child subreaper)
adopts it. A server killed by SIGKILL loses that knowledge, so it writes
every escapee it has attributed, as ``pid start-time`` lines, to
``<state dir>/escapees-<pid>-ns<pidns>``; the next server of the same pid
namespace kills those still running (same pid *and* start time: a reused
pid is never touched) with their descendants, and removes the file.

The state directory is ``$EXEC_SERVER_STATE_DIR``, else ``/run/exec-server``
when that can be created (root), else ``$XDG_RUNTIME_DIR/exec-server``;
without one nothing is recorded (and the server says so in its log).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from typing import Final

from twisted.logger import Logger

log = Logger()

STATE_DIR_ENV: Final = "EXEC_SERVER_STATE_DIR"
PREFIX: Final = "escapees-"


def state_dir() -> str | None:
    """The directory escapee records live in (created 0700), or None."""
    candidates = []
    if os.environ.get(STATE_DIR_ENV):
        candidates.append(os.environ[STATE_DIR_ENV])
    else:
        candidates.append("/run/exec-server")
        if os.environ.get("XDG_RUNTIME_DIR"):
            candidates.append(os.path.join(os.environ["XDG_RUNTIME_DIR"], "exec-server"))
    for directory in candidates:
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        except OSError:
            continue
        if os.access(directory, os.W_OK | os.X_OK):
            return directory
    return None


def start(ns: int, kill_recorded: Callable[[list[tuple[int, int]]], int]) -> str | None:
    """Kill what dead servers of pid namespace ``ns`` recorded; return our record's path.

    ``kill_recorded`` SIGKILLs each recorded (pid, start time) still running,
    with its descendants, and returns how many it signalled.
    """
    directory = state_dir()
    if directory is None:
        log.warn(
            "no writable state directory (${env}, /run/exec-server, $XDG_RUNTIME_DIR): "
            "escaped descendants are not recorded for a restart after a crash",
            env=STATE_DIR_ENV,
        )
        return None
    suffix = f"-ns{ns}"
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if not (name.startswith(PREFIX) and name.endswith(suffix)):
                continue
            pid_text = name[len(PREFIX) : -len(suffix)]
            if not pid_text.isdigit() or int(pid_text) == os.getpid():
                continue
            if os.path.exists(f"/proc/{pid_text}"):
                continue
            path = os.path.join(directory, name)
            killed = kill_recorded(read(path))
            with contextlib.suppress(OSError):
                os.unlink(path)
            if killed:
                log.info(
                    "killed {count} escaped descendant(s) of server {pid}, which is gone",
                    count=killed,
                    pid=pid_text,
                )
    return os.path.join(directory, f"{PREFIX}{os.getpid()}{suffix}")


def read(path: str) -> list[tuple[int, int]]:
    found = []
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split()
        if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit():
            found.append((int(fields[0]), int(fields[1])))
    return found


def record(path: str, escapees: Iterable[tuple[int, int]]) -> None:
    """Replace the record at ``path`` (atomically: a crash leaves the old or the new)."""
    entries = sorted(escapees)
    if not entries:
        forget(path)
        return
    temporary = f"{path}.tmp"
    try:
        with open(temporary, "w") as f:
            f.write("".join(f"{pid} {start}\n" for pid, start in entries))
        os.replace(temporary, path)
    except OSError as exc:
        log.warn("cannot record escaped descendants in {path}: {error}", path=path, error=exc)


def forget(path: str) -> None:
    for name in (path, f"{path}.tmp"):
        with contextlib.suppress(FileNotFoundError, OSError):
            os.unlink(name)


__all__ = ["STATE_DIR_ENV", "forget", "read", "record", "start", "state_dir"]
