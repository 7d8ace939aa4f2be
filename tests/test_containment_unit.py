"""Unit tests of the containment bookkeeping over fake ``/proc`` tables.

The subreaper mode's attribution (who belongs to which tree) is pure logic
over a snapshot of ``/proc``: these tests hand it tables, never touch real
processes, and record the signals it would send.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any, cast

import pytest
from twisted.internet import error, task
from twisted.python.failure import Failure

from execserver import containment as c
from execserver.containment import Containment, ProcInfo, ScanTree, cgroup, core, proc, scan
from execserver.processes import KILL_WAIT_LIMIT, ManagedProcess

ME = os.getpid()
BORN = 1000


def info(
    pid: int, ppid: int, sid: int, start: int = BORN, pgrp: int | None = None, zombie: bool = False
) -> ProcInfo:
    return ProcInfo(pid, ppid, pgrp if pgrp is not None else sid, sid, start, zombie)


def index(*rows: ProcInfo) -> tuple[dict[int, ProcInfo], dict[int, list[int]]]:
    table = {row.pid: row for row in rows}
    children: dict[int, list[int]] = {}
    for row in rows:
        children.setdefault(row.ppid, []).append(row.pid)
    return table, children


@pytest.fixture
def killed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    sent: list[tuple[int, int]] = []

    def record(pid: int, signum: int) -> bool:
        sent.append((pid, signum))
        return True

    # Every part of the package that signals a pid.
    for module in (core, cgroup, scan, proc):
        monkeypatch.setattr(module, "_signal_pid", record)
    return sent


def owner() -> Containment:
    # Never started: no process-wide side effects, no clock.
    return Containment("subreaper")


def test_members_are_the_session_its_descendants_and_remembered_orphans() -> None:
    tree = ScanTree(owner(), 100, BORN)
    table, children = index(
        info(100, ME, 100),  # the leader
        info(101, 100, 100),  # same session
        info(102, 101, 102),  # left the session (setsid): found by its parent
        info(103, 102, 103),  # and its child
        info(200, 1, 200),  # a stranger
        info(104, 100, 100, zombie=True),  # zombies are not members
    )
    tree.learn(table, children)
    assert set(tree.members) == {100, 101, 102, 103}
    # 102's parent dies; 102 is reparented to the server and keeps its
    # membership through (pid, start time).
    table, children = index(info(100, ME, 100), info(102, ME, 102), info(103, 102, 103))
    tree.learn(table, children)
    assert set(tree.members) == {100, 102, 103}
    # The same pid with another start time is someone else.
    table, children = index(info(100, ME, 100), info(102, ME, 102, start=BORN + 50))
    tree.learn(table, children)
    assert set(tree.members) == {100}


def test_processes_older_than_the_tree_never_belong_to_it() -> None:
    tree = ScanTree(owner(), 100, BORN)
    table, children = index(info(100, ME, 100), info(150, 1, 100, start=BORN - 1))
    tree.learn(table, children)
    assert set(tree.members) == {100}


def test_a_reused_session_id_proves_nothing_once_the_session_was_empty() -> None:
    tree = ScanTree(owner(), 100, BORN)
    table, children = index(info(101, ME, 101))  # only an escapee is left
    tree.members = {101: BORN}
    tree.learn(table, children)
    assert tree.by_session is False
    # Later a stranger reuses pid 100 and leads a new session 100.
    table, children = index(info(101, ME, 101), info(100, 1, 100, start=BORN + 900))
    tree.learn(table, children)
    assert set(tree.members) == {101}


def test_an_orphan_only_one_running_tree_can_own_is_attributed_to_it(
    killed: list[tuple[int, int]],
) -> None:
    containment = owner()
    older = ScanTree(containment, 100, BORN)
    newer = ScanTree(containment, 300, BORN + 500)
    # A daemon born before `newer` started, with no visible lineage.
    table, children = index(
        info(100, ME, 100),
        info(300, ME, 300, start=BORN + 500),
        info(150, ME, 150, start=BORN + 10),
    )
    containment._attribute_orphans(table, children, [older, newer])
    assert 150 in older.members
    assert 150 not in newer.members
    assert killed == []


def test_an_ambiguous_orphan_waits_until_all_its_possible_owners_terminate(
    killed: list[tuple[int, int]],
) -> None:
    containment = owner()
    a = ScanTree(containment, 100, BORN)
    b = ScanTree(containment, 300, BORN)
    table, children = index(
        info(100, ME, 100), info(300, ME, 300), info(150, ME, 150, start=BORN + 10)
    )
    containment._attribute_orphans(table, children, [a, b])
    assert 150 not in a.members and 150 not in b.members
    a.terminating = True
    containment._attribute_orphans(table, children, [a, b])
    assert 150 not in a.members, "b may own it and is not being terminated"
    b.terminating = True
    containment._attribute_orphans(table, children, [a, b])
    assert 150 in a.members and 150 in b.members
    assert killed == []


def test_an_orphan_whose_possible_owners_all_ended_is_killed_with_its_children(
    killed: list[tuple[int, int]],
) -> None:
    containment = owner()
    later = ScanTree(containment, 300, BORN + 500)
    table, children = index(
        info(300, ME, 300, start=BORN + 500),
        info(150, ME, 150, start=BORN + 10),
        info(151, 150, 150, start=BORN + 11),
    )
    containment._attribute_orphans(table, children, [later])
    assert sorted(killed) == [(150, signal.SIGKILL), (151, signal.SIGKILL)]
    assert 150 not in later.members


def test_children_the_reactor_spawned_are_never_orphans(
    killed: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from twisted.internet import process

    monkeypatch.setitem(process.reapProcessHandlers, 150, object())
    containment = owner()
    table, children = index(info(150, ME, 150, start=BORN + 10))
    containment._attribute_orphans(table, children, [])
    assert killed == []


def test_mount_and_cgroup_parsing(tmp_path: object) -> None:
    from pathlib import Path

    base = Path(str(tmp_path))
    mounts = base / "mounts"
    mounts.write_text(
        "cgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\n"
        "cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n"
    )
    assert c.find_cgroup2_mount(str(mounts)) == "/sys/fs/cgroup/unified"
    mounts.write_text("proc /proc proc rw 0 0\n")
    assert c.find_cgroup2_mount(str(mounts)) is None
    groups = base / "cgroup"
    groups.write_text("4:memory:/x\n0::/user.slice/app.service\n")
    assert c.own_cgroup(str(groups)) == "/user.slice/app.service"
    groups.write_text("4:memory:/x\n")
    assert c.own_cgroup(str(groups)) is None


def test_one_mount_table_reader_and_one_cgroup_file_reader(tmp_path: object) -> None:
    """The v2 mount and the v1 hierarchies come from one mount-table reader;
    the server's cgroup and another process's from one ``/proc/*/cgroup`` reader."""
    from pathlib import Path

    from execserver import cgroups

    mounts = Path(str(tmp_path)) / "mounts"
    mounts.write_text(
        "cgroup2 /mnt/with\\040space cgroup2 rw,nsdelegate 0 0\n"
        "cgroup /sys/fs/cgroup/pids cgroup rw,pids 0 0\n"
        "short /x\n"
        "cgroup2 /three cgroup2\n"
    )
    assert cgroups.mount_table(str(mounts)) == [
        ("/mnt/with space", "cgroup2", frozenset({"rw", "nsdelegate"})),
        ("/sys/fs/cgroup/pids", "cgroup", frozenset({"rw", "pids"})),
        ("/three", "cgroup2", frozenset()),
    ]
    assert c.find_cgroup2_mount(str(mounts)) == "/mnt/with space"
    mounts.write_text("cgroup2 /three cgroup2\n")
    assert c.find_cgroup2_mount(str(mounts)) == "/three"
    assert cgroups.mount_table(str(mounts) + ".missing") == []
    assert proc._cgroup2_of(os.getpid()) == c.own_cgroup() is not None
    assert proc._cgroup2_of(2**22 + 7) is None


def test_read_proc_of_this_process() -> None:
    me = c.read_proc(ME)
    assert me is not None
    assert me.pid == ME
    assert me.ppid == os.getppid()
    assert me.sid == os.getsid(0)
    assert me.pgrp == os.getpgrp()
    assert 0 < me.start <= c.boot_ticks()
    assert not me.zombie
    assert c.read_proc(2**22 + 7) is None


# --- ManagedProcess over a fake tree ---------------------------------------------------------


class FakeTree:
    """A tree whose members die only when told to."""

    def __init__(self) -> None:
        self.signals: list[int] = []
        self.kills = 0
        self.members = 1
        self.released = False
        self.on_empty: Callable[[], None] | None = None

    def signal(self, signum: int) -> None:
        self.signals.append(signum)

    def kill(self) -> None:
        self.kills += 1

    def alive(self) -> bool:
        return self.members > 0

    def when_empty(self, callback: Callable[[], None]) -> None:
        self.on_empty = callback

    def release(self) -> None:
        self.released = True


class Transport:
    pid = 4242

    def __init__(self, tree: FakeTree) -> None:
        self.tree = tree

    def loseConnection(self) -> None:
        pass


class Quiet:
    def process_output(self, proc: ManagedProcess, stream: Any, data: bytes, seq: int) -> None:
        pass

    def process_exited(self, proc: ManagedProcess) -> None:
        pass

    def process_closed(self, proc: ManagedProcess) -> None:
        pass


def contained() -> tuple[ManagedProcess, FakeTree, task.Clock]:
    clock = task.Clock()
    tree = FakeTree()
    proc = ManagedProcess("p", False, 1 << 20, Quiet(), clock)
    proc.makeConnection(Transport(tree))
    return proc, tree, clock


def close(proc: ManagedProcess, reason: Failure) -> None:
    proc.processExited(reason)
    proc.processEnded(reason)


def test_terminate_signals_the_tree_not_only_the_group() -> None:
    proc, tree, clock = contained()
    proc.terminate(1.0)
    assert tree.signals == [signal.SIGTERM, signal.SIGCONT]
    clock.advance(1.0)
    assert tree.kills == 1


def test_finished_only_once_the_tree_is_empty_after_the_sigkill() -> None:
    proc, tree, clock = contained()
    proc.terminate(0)
    close(proc, Failure(error.ProcessTerminated(None, signal.SIGKILL, None)))
    assert proc.closed
    assert not proc.finished  # a member (say, mid-fork) is still there
    kills = tree.kills
    clock.advance(0.01)
    assert tree.kills > kills, "the kill is repeated while members remain"
    tree.members = 0
    clock.advance(0.02)
    assert proc.finished
    assert tree.released
    assert clock.getDelayedCalls() == []


def test_a_member_that_cannot_die_is_given_up_on_after_the_limit() -> None:
    proc, _, clock = contained()
    proc.terminate(0)
    close(proc, Failure(error.ProcessTerminated(None, signal.SIGKILL, None)))
    finished = proc.when_finished()
    clock.pump([0.5] * int(KILL_WAIT_LIMIT / 0.5 - 1))
    assert not finished.called
    clock.pump([0.5, 0.5])
    assert finished.called
    assert clock.getDelayedCalls() == []


def test_a_tree_that_empties_on_its_own_finishes_a_lingering_process() -> None:
    proc, tree, _ = contained()
    close(proc, Failure(error.ProcessDone(0)))
    assert not proc.finished
    assert tree.on_empty is not None
    tree.members = 0
    tree.on_empty()
    assert proc.finished
    assert tree.released
    proc.terminate(1.0)
    assert tree.signals == []


def test_containment_sweep_reports_emptied_trees(monkeypatch: pytest.MonkeyPatch) -> None:
    # The sweep must not reap this test process's own children.
    for module in (core, scan):
        monkeypatch.setattr(module, "reap_unknown_children", list)
    clock = task.Clock()
    containment = Containment("subreaper", clock)
    tree = FakeTree()
    emptied: list[bool] = []
    tree.emptied = lambda: emptied.append(True)  # type: ignore[attr-defined]
    containment._linger(tree)  # type: ignore[arg-type]
    clock.advance(c.SWEEP_INTERVAL)
    assert emptied == []
    tree.members = 0
    clock.advance(c.SWEEP_INTERVAL)
    assert emptied == [True]
    assert clock.getDelayedCalls() == []


# --- leftovers of a crashed server (real cgroups) ----------------------------------------------

CGROUP2 = c.find_cgroup2_mount()
OWN_DIR = os.path.normpath(f"{CGROUP2}/{c.own_cgroup()}") if CGROUP2 else ""


@pytest.mark.skipif(
    not OWN_DIR or not os.access(OWN_DIR, os.W_OK), reason="no writable cgroup v2 here"
)
def test_leftover_cgroups_of_a_dead_server_are_emptied_and_removed() -> None:
    import subprocess

    from twisted.logger import ILogObserver, globalLogPublisher

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that is no longer running
    # A pid namespace id no real server has: only this call considers it.
    fake_ns = 1
    leftover = os.path.join(OWN_DIR, f"{c.CGROUP_PREFIX}{gone.pid}-ns{fake_ns}")
    alive_server = os.path.join(OWN_DIR, f"{c.CGROUP_PREFIX}{os.getpid()}-ns{fake_ns}")
    os.makedirs(os.path.join(leftover, "7"))
    os.mkdir(alive_server)
    member = subprocess.Popen(["sleep", "300"])
    events: list[dict[str, Any]] = []
    observer = cast(ILogObserver, events.append)
    globalLogPublisher.addObserver(observer)
    try:
        with open(os.path.join(leftover, "7", "cgroup.procs"), "w") as f:
            f.write(str(member.pid))
        Containment()._cleanup_leftovers(OWN_DIR, fake_ns)
        assert member.wait(10) == -signal.SIGKILL
        assert not os.path.exists(leftover)
        # The cgroup of a server that still runs (this process) is kept.
        assert os.path.isdir(alive_server)
        assert any(
            e.get("log_format", "").startswith("removed {what} cgroup") and e["path"] == leftover
            for e in events
        )
    finally:
        globalLogPublisher.removeObserver(observer)
        if member.poll() is None:
            member.kill()
            member.wait()
        for path in (os.path.join(leftover, "7"), leftover, alive_server):
            if os.path.isdir(path):
                os.rmdir(path)


def test_a_burst_of_signals_shares_one_scan_but_a_new_tree_forces_a_fresh_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scans: list[int] = []

    def table() -> dict[int, ProcInfo]:
        scans.append(1)
        return {}

    for module in (core, scan):
        monkeypatch.setattr(module, "proc_table", table)
        monkeypatch.setattr(module, "reap_unknown_children", list)
    containment = owner()
    containment._add(ScanTree(containment, 100, BORN))
    containment._rescan()
    containment._rescan()
    assert len(scans) == 1
    containment._add(ScanTree(containment, 300, BORN + 5))
    containment._rescan()
    assert len(scans) == 2


@pytest.mark.parametrize("target", [-1, 0, 1])
def test_a_member_list_entry_of_0_or_1_is_never_signalled(target: int) -> None:
    # cgroup.procs shows 0 for a process outside the reader's pid namespace;
    # kill(0) would hit the server's own process group and kill(-1) every
    # process it may signal. Run in a child so a regression cannot take the
    # test run's own group with it.
    import subprocess
    import sys

    code = (
        "import os, signal, sys\n"
        "from execserver.containment import proc\n"
        "os.setpgid(0, 0)\n"
        f"a = proc._signal_pid({target}, signal.SIGTERM)\n"
        f"b = proc._signal_group({target}, signal.SIGTERM)\n"
        "print(a, b)\n"
    )
    done = subprocess.run(
        [sys.executable, "-P", "-c", code], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]
