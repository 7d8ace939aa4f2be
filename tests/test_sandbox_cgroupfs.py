"""A confined command never writes the cgroup file systems, whatever its profile.

Before the fix, a confined command running as root whose profile made the
cgroup files writable (a writable root containing ``/sys/fs/cgroup``, or
``/`` itself) moved itself out of the cgroups the server put it in
(``echo $$ > <its cgroup's parent>/cgroup.procs``, and the v1 ``tasks``):
out of its tree's tracking, its resource limits (v1 ``pids``/``memory``
directories here) and the ``unix://`` listeners' peer check. Every mount
of type ``cgroup``/``cgroup2`` is now read-only to a confined command under
both mechanisms (bubblewrap re-protects it like a carve-out, Landlock
leaves it out of its write grants), and a sandboxed ``fs/*`` write there is
refused. Through the real installed server; each case escaped before the fix.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted

from tests.support.harness import RpcTestClient
from tests.support.sandbox import MECHANISMS, Dirs, dirs, env_for, profile_for, stdio_server, uri

__all__ = ["dirs"]

#: Run inside the sandbox: for each hierarchy the server placed it in (its
#: path names an ``exec-server-`` directory), try to move itself to that
#: cgroup's parent through ``cgroup.procs`` (and v1's ``tasks``), by its path
#: and through ``/proc/self/root``; print what
#: each attempt gave and its cgroups afterwards, as one JSON line.
MOVE = r"""
import errno, json, os
v2, v1 = None, []
for line in open("/proc/self/mountinfo"):
    left, _, right = line.partition(" - ")
    fstype, _source, options = right.split()[:3]
    point = left.split()[4]
    if fstype == "cgroup2":
        v2 = point
    elif fstype == "cgroup":
        v1.append((set(options.split(",")), point))
before = open("/proc/self/cgroup").read()
tried = {}
for line in before.splitlines():
    _n, controllers, path = line.split(":", 2)
    if "exec-server-" not in path:
        continue
    if controllers:
        wanted = set(controllers.split(","))
        mount = next(point for options, point in v1 if wanted <= options)
        files = ("cgroup.procs", "tasks")
    else:
        mount, files = v2, ("cgroup.procs",)
    for name in files:
        target = mount + os.path.dirname(path) + "/" + name
        # Also by another name of the same file (/proc/self/root/...).
        for route in (target, "/proc/self/root" + target):
            try:
                with open(route, "w") as f:
                    f.write(str(os.getpid()))
                tried[route] = "moved"
            except OSError as exc:
                tried[route] = errno.errorcode.get(exc.errno, str(exc.errno))
print("MOVE", json.dumps({"tried": tried, "before": before,
                          "after": open("/proc/self/cgroup").read()}), flush=True)
"""

#: The kernel's refusal of a write under each mechanism: a read-only mount
#: (bubblewrap), no Landlock grant.
REFUSAL = {"bwrap": "EROFS", "landlock": "EACCES"}

#: v1 directories for these (this host has no v2 controllers delegated;
#: on one with them, the v2 cgroup is the only one and is tried alone).
LIMITS = {"maxProcesses": 64, "memoryBytes": 512 * 1024 * 1024}


def with_cgroupfs_writable(d: Dirs, mechanism: str) -> Any:
    """Codex's workspace-write profile plus a writable root at ``/sys/fs/cgroup``."""
    profile = profile_for(d, mechanism)
    profile["permissions"]["file_system"]["entries"].append(
        {"path": {"type": "path", "path": "/sys/fs/cgroup"}, "access": "write"}
    )
    return profile


def with_root_writable(d: Dirs) -> Any:
    """Every path writable, the network restricted (still a confined process).

    (Under Landlock a process start refuses it: the server's seccomp
    filters would be writable; bubblewrap's fresh /dev hides them.)
    """
    return {
        "permissions": {
            "type": "managed",
            "file_system": {"type": "unrestricted"},
            "network": "restricted",
        },
        "cwd": uri(d.work),
    }


def with_root_writable_but_dev_shm(d: Dirs) -> Any:
    """``/`` writable but ``/dev/shm`` (where the server keeps its filters) denied."""
    root = {"type": "special", "value": {"kind": "root"}}
    return {
        "permissions": {
            "type": "managed",
            "file_system": {
                "type": "restricted",
                "entries": [
                    {"path": root, "access": "write"},
                    {"path": {"type": "path", "path": "/dev/shm"}, "access": "deny"},
                ],
            },
            "network": "restricted",
        },
        "cwd": uri(d.work),
    }


def with_a_link_to_cgroupfs(d: Dirs, mechanism: str) -> Any:
    """A writable root that is a symlink to ``/sys/fs/cgroup``."""
    (d.work / "cg").symlink_to("/sys/fs/cgroup")
    profile = profile_for(d, mechanism)
    profile["permissions"]["file_system"]["entries"].append(
        {"path": {"type": "path", "path": str(d.work / "cg")}, "access": "write"}
    )
    return profile


def cgroup_mounts() -> dict[str, str]:
    """This host's cgroup mounts: mount point -> its super options ("" for cgroup2)."""
    found = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, _source, options = right.split()[:3]
        if fstype in ("cgroup", "cgroup2"):
            found[left.split()[4]] = options if fstype == "cgroup" else ""
    return found


def own_v1_procs() -> str:
    """``cgroup.procs`` of this process's own cgroup in a v1 hierarchy: writing 0
    there moves the writer to where it already is (the server shares it)."""
    mounts = cgroup_mounts()
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _n, controllers, path = line.split(":", 2)
        if not controllers:
            continue
        wanted = set(controllers.split(","))
        for point, options in mounts.items():
            if options and wanted <= set(options.split(",")):
                return os.path.normpath(point + path) + "/cgroup.procs"
    raise AssertionError("no cgroup v1 hierarchy is mounted here")


_started = iter(range(1_000_000))


async def attempt(client: RpcTestClient, d: Dirs, mechanism: str, sandbox: Any) -> dict[str, Any]:
    pid = f"move-{next(_started)}"
    started = await client.start_process(
        pid,
        [sys.executable, "-I", "-c", MOVE],
        cwd=uri(d.work),
        env=env_for(d, mechanism),
        sandbox=sandbox,
        limits=LIMITS,
    )
    assert started["sandboxType"] == "linuxSeccomp", started
    exited = await client.wait_notification("process/exited", pid, timeout=60)
    await client.wait_closed(pid, timeout=30)
    output = client.output_of(pid).decode(errors="replace")
    assert exited["exitCode"] == 0, output
    line = next(line for line in output.splitlines() if line.startswith("MOVE "))
    result: dict[str, Any] = json.loads(line[len("MOVE ") :])
    return result


def escapes(result: dict[str, Any], mechanism: str) -> dict[str, str]:
    """The attempts the kernel did not refuse as it must (empty: it stayed put)."""
    tried: dict[str, str] = result["tried"]
    # Its v2 cgroup and each v1 directory of its limits were tried.
    assert any(path.startswith(m) for m in cgroup_mounts() for path in tried), result
    assert len({os.path.dirname(os.path.dirname(path)) for path in tried}) >= 4, result
    wrong = {path: how for path, how in tried.items() if how != REFUSAL[mechanism]}
    if result["after"] != result["before"]:
        wrong["/proc/self/cgroup"] = result["after"]
    return wrong


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest_twisted.ensureDeferred
async def test_a_confined_command_cannot_leave_its_cgroups(dirs: Dirs, mechanism: str) -> None:
    cases = {
        "a writable root containing /sys/fs/cgroup": with_cgroupfs_writable(dirs, mechanism),
        # (bwrap binds it where it leads, /sys/fs/cgroup, writable.)
        "a writable root that is a symlink to /sys/fs/cgroup": with_a_link_to_cgroupfs(
            dirs, mechanism
        ),
    }
    if mechanism == "bwrap":
        # (Landlock refuses the hidden path.)
        cases["/ writable (but /dev/shm)"] = with_root_writable_but_dev_shm(dirs)
    async with stdio_server("--sandbox-mechanism", mechanism) as server:
        problems = {
            case: escapes(await attempt(server, dirs, mechanism, sandbox), mechanism)
            for case, sandbox in cases.items()
        }
    assert not any(problems.values()), problems


@pytest_twisted.ensureDeferred
async def test_a_sandboxed_fs_write_into_cgroupfs_is_refused(dirs: Dirs) -> None:
    # The same policy confines the fs/* calls: writing a pid into a
    # cgroup.procs through fs/writeFile would move that process.
    # (Before the fix the server wrote it: "0" moved the server to its own
    # v1 cgroup, where it already was.)
    procs = own_v1_procs()
    async with stdio_server() as server:
        for sandbox in (with_cgroupfs_writable(dirs, "bwrap"), with_root_writable(dirs)):
            reply = await server.request(
                "fs/writeFile", {"path": procs, "dataBase64": "MAo=", "sandbox": sandbox}
            )
            error = reply.get("error", {})
            assert (error.get("code"), error.get("message")) == (
                -32603,
                "Read-only file system (os error 30)",
            ), reply
