"""The server's file-descriptor budget and the process limit it implies.

Every process the server runs holds descriptors in the server: a pipe
process up to three (stdin, stdout, stderr pipes), a PTY process one (its
master), and a few more for a moment while it is being spawned. Connections,
listening sockets and fs operations need descriptors too. Without a limit
derived from ``RLIMIT_NOFILE``, a client that starts processes runs the
server out of descriptors first, and then every spawn, accept and fs open
fails.

So the service, when it starts, raises the soft limit to the hard limit
(:func:`raise_soft_limit`), and :func:`process_limit` derives how many
processes may be open at once, server-wide: what the soft limit leaves
after :func:`reserved_fds`, divided by :data:`FDS_PER_PROCESS`. A start
beyond it is refused with ``-32600`` (like ``--max-processes``), never left
to fail with EMFILE.
"""

from __future__ import annotations

import contextlib
import os
import resource
from typing import Final

#: Descriptors counted per process: the three pipes of a pipe process with
#: ``pipeStdin`` (measured: 2 without it, 1 for a PTY). The worst case, so
#: the limit holds whatever is started; the few a spawn holds for a moment
#: come out of the reserve.
FDS_PER_PROCESS: Final = 3

#: Descriptors kept for everything that is not a process: at least this
#: many, or a sixteenth of the limit when that is more.
MIN_RESERVED_FDS: Final = 64
RESERVED_FRACTION: Final = 16

#: What an unlimited soft limit counts as (no process limit in practice).
UNLIMITED_FDS: Final = 1 << 30


def soft_limit() -> int:
    """The current soft ``RLIMIT_NOFILE`` (:data:`UNLIMITED_FDS` if unlimited)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return UNLIMITED_FDS if soft == resource.RLIM_INFINITY else soft


def raise_soft_limit() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit; return (before, after).

    An unlimited hard limit raises the soft one to at least 2^20 (the
    kernel refuses more than ``fs.nr_open``; a refusal keeps the old value).
    """
    before = soft_limit()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return before, soft_limit()


def reserved_fds(limit: int) -> int:
    """Descriptors kept for connections, listeners, fs operations and the server itself."""
    return max(MIN_RESERVED_FDS, limit // RESERVED_FRACTION)


def process_limit(limit: int | None = None) -> int:
    """Processes that may hold descriptors at once under ``limit`` (default: the soft limit)."""
    if limit is None:
        limit = soft_limit()
    return max(0, (limit - reserved_fds(limit)) // FDS_PER_PROCESS)


def fds_in_use() -> int | None:
    """Descriptors the server has open now (None where /proc is unavailable)."""
    try:
        # listdir's own descriptor is open while it reads the directory.
        return len(os.listdir("/proc/self/fd")) - 1
    except OSError:
        return None
