"""Processes that try to escape containment, found in /proc by a marker: their
argv, the server arguments per containment mode, and the checks that they
are gone.
"""

from __future__ import annotations

import os
import secrets

import pytest

from execserver.containment import find_cgroup2_mount, own_cgroup
from tests.support.polling import until

GRACE_MS = 300


CGROUP2 = find_cgroup2_mount()


_OWN = own_cgroup()


#: The cgroup the test (and so every server it starts) runs in.
OWN_CGROUP_DIR = os.path.normpath(f"{CGROUP2}/{_OWN}") if CGROUP2 and _OWN is not None else ""


needs_cgroup = pytest.mark.skipif(
    not OWN_CGROUP_DIR or not os.access(OWN_CGROUP_DIR, os.W_OK),
    reason="no writable cgroup v2 here",
)


# The cgroup mode refuses to start where cgroup v2 is not writable (e.g. an
# unprivileged container): its half of the matrix is skipped there.
MODES = [pytest.param("cgroup", marks=needs_cgroup), "subreaper"]


def new_marker() -> str:
    # A valid sleep duration no other process on the machine uses.
    return f"1000.{secrets.randbelow(10**9):09d}"


def marked(marker: str) -> list[tuple[int, int, str]]:
    """(pid, ppid, state) of every process whose argv contains ``marker``."""
    needle = marker.encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if needle in cmdline:
            found.append((int(entry), int(fields[1]), fields[0]))
    return found


def live(marker: str) -> list[tuple[int, int, str]]:
    return [p for p in marked(marker) if p[2] not in ("Z", "X")]


async def assert_gone(markers: dict[str, str], server_pid: int | None = None) -> None:
    """Nothing marked runs; the server's own zombies of them are reaped too.

    The bound is the grace plus the time to notice (the docs promise the
    SIGKILL at the end of the grace); the wait is generous for a busy host.
    """
    for kind, marker in markers.items():
        await until(lambda m=marker: not live(m), f"every {kind} process to be gone", timeout=10.0)
        if server_pid is not None:
            await until(
                lambda m=marker: not [p for p in marked(m) if p[1] == server_pid],
                f"the server to reap its {kind} zombies",
                timeout=10.0,
            )


def server_args(mode: str) -> list[str]:
    # -v: the line naming the mode in force is informational.
    return ["-v", "--process-containment", mode, "--terminate-grace-ms", str(GRACE_MS)]
