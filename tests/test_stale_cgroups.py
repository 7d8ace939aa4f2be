"""A restarted server removes the cgroup directories a SIGKILLed one left, and only those.

A server that is SIGKILLed leaves its ``exec-server-<pid>-ns<ns>``
directories behind: its v2 cgroup and, for the limited processes, one in
each cgroup v1 hierarchy the limits use (``pids``, ``memory`` on this
hybrid host), with its processes still inside. The next server kills those
members (escapees of a dead server) and removes the directories; those of a
server that still runs (another test's, or this test's own) are never
touched. Before the fix a server whose pid still existed (a zombie nobody
had reaped yet, or a pid reused by another process) was taken for alive:
its directories and processes stayed for good. Through real installed
servers.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import pytest_twisted

from execserver import cgroups
from execserver.containment import cgroup as containment_cgroup
from execserver.containment import find_cgroup2_mount, own_cgroup
from execserver.containment.cgroup import server_gone, started_after
from execserver.containment.proc import ProcInfo, read_proc
from tests.support.escapees import live, new_marker
from tests.support.harness import console_script, server_env
from tests.support.polling import until
from tests.support.stdio_server import ServerProcess

NS = os.stat("/proc/self/ns/pid").st_ino
LIMITS = {"maxProcesses": 16, "memoryBytes": 256 * 1024 * 1024}


def server_dirs(pid: int) -> list[str]:
    """Where a server of this test's cgroups with ``pid`` keeps its directories."""
    name = f"exec-server-{pid}-ns{NS}"
    found = [os.path.join(h.own, name) for h in {*cgroups.v1_hierarchies().values()}]
    root, own = find_cgroup2_mount(), own_cgroup()
    assert root is not None and own is not None
    return sorted([*found, os.path.normpath(f"{root}/{own}/{name}")])


def members(directory: str) -> set[int]:
    found: set[int] = set()
    for dirpath, _dirs, _files in os.walk(directory):
        try:
            found |= {int(p) for p in Path(dirpath, "cgroup.procs").read_text().split()}
        except OSError:
            continue
    return found


async def start_limited(server: ServerProcess, process_id: str, marker: str) -> int:
    await server.handshake()
    started = await server.call(
        "process/start",
        {"processId": process_id, "argv": ["sleep", marker], "cwd": "/", "env": {},
         "tty": False, "arg0": None, "limits": LIMITS},
    )  # fmt: skip
    assert started["limits"]["maxProcesses"] == LIMITS["maxProcesses"], started
    await until(lambda: bool(live(marker)), "the limited sleep to run", timeout=10.0)
    ((pid, _ppid, _state),) = live(marker)
    return pid


def unreaped_server() -> ServerProcess:
    """A server whose parent never reaps it: SIGKILLed, it stays a zombie.

    (``sleep`` becomes its parent; a supervisor that is slow to reap, or an
    init that never does, leaves the same.) Its stdio is the harness's.
    """
    script = console_script("exec-server")
    return ServerProcess().launch(
        ["/bin/sh", "-c", 'exec 3<&0; "$0" <&3 3<&- & exec sleep 3600', script],
        env=server_env(None),
        description="exec-server (stdio, under a parent that never reaps it)",
    )


def child_of(pid: int) -> int:
    (child,) = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return int(child)


@pytest_twisted.ensureDeferred
async def test_a_restarted_server_removes_what_a_sigkilled_one_left() -> None:
    crashed_marker, live_marker = new_marker(), new_marker()
    wrapper = unreaped_server()
    survivor = ServerProcess.start()
    restarted: ServerProcess | None = None
    try:
        orphan = await start_limited(wrapper, "left", crashed_marker)
        kept = await start_limited(survivor, "kept", live_marker)
        assert wrapper.pid is not None and survivor.pid is not None
        crashed = child_of(wrapper.pid)
        left, alive = server_dirs(crashed), server_dirs(survivor.pid)
        # The premise: it is in the v2 cgroup and the v1 pids and memory
        # directories (the other v1 hierarchies' parents are made at start).
        assert all(os.path.isdir(d) for d in left + alive), (left, alive)
        assert len([d for d in left if orphan in members(d)]) >= 3, left
        os.kill(crashed, signal.SIGKILL)
        await until(lambda: (read_proc(crashed) or ProcInfo(0, 0, 0, 0, 0, True)).zombie,
                    "the SIGKILLed server to be a zombie", timeout=10.0)  # fmt: skip
        assert live(crashed_marker) and all(os.path.isdir(d) for d in left)

        restarted = ServerProcess.start("--verbose")
        await restarted.handshake()
        await until(lambda: not live(crashed_marker), "the dead server's process to be killed",
                    timeout=10.0)  # fmt: skip
        await until(lambda: not any(os.path.exists(d) for d in left),
                    "the dead server's directories to be removed", timeout=10.0)  # fmt: skip
        # The live server's directories and process were not touched.
        assert all(os.path.isdir(d) for d in alive), alive
        assert len([d for d in alive if kept in members(d)]) >= 3, alive
        assert [p for p, _pp, _s in live(live_marker)] == [kept]
        await survivor.call("process/terminate", {"processId": "kept"})
    finally:
        wrapper.kill("KILL")
        for server in (wrapper, survivor, restarted):
            if server is not None:
                await server.stop()


# --- which directories are a dead server's (units) ------------------------------------


def test_a_process_younger_than_the_directory_is_not_its_server() -> None:
    tick = os.sysconf("SC_CLK_TCK")
    # Now: wall clock 10_000 s, 1_000 s since boot. The directory was made at
    # 9_500 s (500 s after boot).
    made, real_now, boot_now = 9_500.0, 10_000.0, 1_000 * tick
    assert not started_after(400 * tick, made, real_now, boot_now)  # its maker
    assert not started_after(505 * tick, made, real_now, boot_now)  # within the margin
    assert started_after(600 * tick, made, real_now, boot_now)  # a reused pid


def test_server_gone_judges_the_pid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    child = subprocess.Popen(["sleep", "60"])
    try:
        directory = tmp_path / f"exec-server-{child.pid}-ns{NS}"
        directory.mkdir()
        assert not server_gone(child.pid, str(directory))  # older than its directory
        assert not server_gone(os.getpid(), str(directory))
        # The same process, had the directory been made long before it started.
        monkeypatch.setattr(containment_cgroup, "CREATOR_MARGIN", -3600.0)
        assert server_gone(child.pid, str(directory))
        monkeypatch.undo()
        child.kill()
        child.wait(timeout=30)
        assert server_gone(child.pid, str(directory))
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
