"""The ``unix://`` listeners' peer check, unit by unit (fake containment, real sockets).

The escapes it closes are reproduced through the real server in
tests/test_sandbox_listener.py; here: what the kernel records of a peer,
and each decision (a confined tree, another tree, a stranger, a peer gone
before its check, with and without a pidfd, one outside the pid namespace).
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from twisted.internet.task import Clock
from twisted.logger import ILogObserver, LogLevel, globalLogPublisher

from execserver.sandbox.peers import ConfinedPeers, UnixPeer, unix_peer
from tests.support.polling import until_blocking


class Tree:
    """Stands for a containment tree (only its identity matters)."""


class FakeContainment:
    def __init__(self, trees: dict[int, list[Any]], mode: str = "cgroup") -> None:
        self.trees = trees
        self.mode = mode
        self.asked: list[int] = []

    def trees_of(self, pid: int) -> list[Any]:
        self.asked.append(pid)
        return self.trees.get(pid, [])


class Transport:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.handles = 0

    def getHandle(self) -> socket.socket:
        self.handles += 1
        return self.sock

    def getHost(self) -> Any:
        return type("Host", (), {"name": b"/run/x.sock"})()


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def warnings() -> Iterator[list[str]]:
    said: list[str] = []

    def observe(event: dict[str, Any]) -> None:
        if event.get("log_level") == LogLevel.warn and "refusing" in event.get("log_format", ""):
            said.append(event["log_format"].format(**event))

    observer = cast(ILogObserver, observe)
    globalLogPublisher.addObserver(observer)
    yield said
    globalLogPublisher.removeObserver(observer)


def _pidfd_pid(fd: int) -> int:
    with open(f"/proc/self/fdinfo/{fd}") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Pid:"))


def test_the_kernel_records_the_connecting_process(pair: tuple[socket.socket, ...]) -> None:
    peer = unix_peer(pair[0])
    assert (peer.pid, peer.uid) == (os.getpid(), os.getuid())
    if peer.pidfd is not None:  # SO_PEERPIDFD: Linux 6.5 and later
        try:
            assert _pidfd_pid(peer.pidfd) == os.getpid()
        finally:
            os.close(peer.pidfd)


def test_nothing_is_read_while_no_confined_process_lives(
    pair: tuple[socket.socket, ...],
) -> None:
    containment = FakeContainment({os.getpid(): [Tree()]})
    peers = ConfinedPeers(Clock(), containment)  # type: ignore[arg-type]
    transport = Transport(pair[0])
    assert not peers.refused(transport)
    assert (transport.handles, containment.asked) == (0, [])


def test_a_peer_in_a_confined_tree_is_refused_and_named(
    pair: tuple[socket.socket, ...], warnings: list[str]
) -> None:
    confined, other = Tree(), Tree()
    containment = FakeContainment({os.getpid(): [other, confined]})
    clock = Clock()
    peers = ConfinedPeers(clock, containment)  # type: ignore[arg-type]
    peers.add(confined)
    fds_before = len(os.listdir("/proc/self/fd"))
    assert peers.refused(Transport(pair[0]))
    assert peers.refused(Transport(pair[0]))
    # The pidfd of each check is closed.
    assert len(os.listdir("/proc/self/fd")) == fds_before
    # One line per interval, however often it is refused.
    assert len(warnings) == 1, warnings
    assert f"on unix:///run/x.sock from pid {os.getpid()}:" in warnings[0]
    assert "sandboxed command of this server" in warnings[0]
    clock.advance(3600)
    assert peers.refused(Transport(pair[0]))
    assert len(warnings) == 2 and "(2 such connection(s)" in warnings[1], warnings


def test_a_peer_of_another_tree_or_none_is_admitted(pair: tuple[socket.socket, ...]) -> None:
    confined = Tree()
    peers = ConfinedPeers(None, FakeContainment({os.getpid(): [Tree()]}))  # type: ignore[arg-type]
    peers.add(confined)
    assert not peers.refused(Transport(pair[0]))
    peers.containment = FakeContainment({})  # type: ignore[assignment]
    assert not peers.refused(Transport(pair[0]))


def test_a_peer_outside_the_pid_namespace_is_no_command_of_ours() -> None:
    confined = Tree()
    peers = ConfinedPeers(None, FakeContainment({0: [confined]}))  # type: ignore[arg-type]
    peers.add(confined)
    assert peers.why_refused(UnixPeer(0, 0, None)) is None


@pytest.mark.parametrize("with_pidfd", [True, False])
def test_a_peer_gone_before_its_check_is_refused(with_pidfd: bool) -> None:
    # It may have handed the connected socket to a child, and its pid may
    # be another process's by now: nothing read of that pid proves anything.
    confined = Tree()
    peers = ConfinedPeers(None, FakeContainment({}))  # type: ignore[arg-type]
    peers.add(confined)
    child = subprocess.Popen(["sleep", "60"])
    pidfd = os.pidfd_open(child.pid) if with_pidfd else None
    try:
        alive = UnixPeer(child.pid, os.getuid(), pidfd)
        assert peers.why_refused(alive) is None
        child.kill()
        child.wait(timeout=30)
        why = peers.why_refused(alive)
        assert why == "the connecting process exited before it could be checked"
    finally:
        if pidfd is not None:
            os.close(pidfd)
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)


def test_without_containment_the_lineage_of_a_confined_leader_is_refused() -> None:
    # --process-containment none tracks no tree: the leader recorded at the
    # start, its session and group, and their descendants are refused.
    confined = Tree()
    peers = ConfinedPeers(None, FakeContainment({}, mode="none"))  # type: ignore[arg-type]
    leader = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        peers.add(confined, leader.pid)
        assert peers.why_refused(UnixPeer(leader.pid, os.getuid(), None)) is not None
        # The test process is older than the leader: neither it nor its
        # parents can be of the tree.
        assert peers.why_refused(UnixPeer(os.getpid(), os.getuid(), None)) is None
    finally:
        leader.kill()
        leader.wait(timeout=30)


#: A leader that leaves a daemon in its session (in a group of its own),
#: then exits: the daemon prints its pid and waits for its stdin to close.
_DAEMONISING = (
    "import os, sys\n"
    "if os.fork() == 0:\n"
    "    os.setpgid(0, 0)\n"
    "    print(os.getpid(), flush=True)\n"
    "    sys.stdin.read()\n"
    "    os._exit(0)\n"
)


def test_without_containment_a_daemon_is_refused_after_its_leaders_record_is_gone() -> None:
    # Before the fix the leader was kept only as long as the process's
    # record (the tree, weakly): once the record was dropped, a daemon the
    # confined command left in its session was admitted.
    confined = Tree()
    clock = Clock()
    peers = ConfinedPeers(clock, FakeContainment({}, mode="none"))  # type: ignore[arg-type]
    leader = subprocess.Popen(
        [sys.executable, "-I", "-c", _DAEMONISING],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert leader.stdout is not None and leader.stdin is not None
    peers.add(confined, leader.pid)
    daemon = int(leader.stdout.readline())
    try:
        assert leader.wait(timeout=30) == 0
        del confined
        gc.collect()
        with open(f"/proc/{daemon}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[3] == str(leader.pid)  # its session
        assert peers.why_refused(UnixPeer(daemon, os.getuid(), None)) is not None
        # Still after the interval at which stale leaders are forgotten: the
        # daemon keeps its session alive (its id cannot be another's).
        clock.advance(3600)
        assert peers.why_refused(UnixPeer(daemon, os.getuid(), None)) is not None
    finally:
        leader.stdin.close()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(daemon, 0)
    # Once the last member is gone the leader is forgotten (found so by two
    # looks, each past the interval), and nothing is read any more.
    until_gone(daemon)
    for _look in range(2):
        assert peers.tracking
        clock.advance(3600)
        assert peers.why_refused(UnixPeer(os.getpid(), os.getuid(), None)) is None
    assert not peers.tracking


def until_gone(pid: int) -> None:
    """Wait (bounded) for the reparented ``pid`` to be reaped by init."""
    until_blocking(lambda: not os.path.exists(f"/proc/{pid}"), f"pid {pid} gone", timeout=30)


def test_every_refusal_is_counted_by_reason(pair: tuple[socket.socket, ...]) -> None:
    # /metrics' exec_server_sandbox_peer_refused_total{reason}: each
    # refusal, not only those the once-per-interval warning names.
    confined = Tree()
    clock = Clock()
    peers = ConfinedPeers(clock, FakeContainment({os.getpid(): [confined]}))  # type: ignore[arg-type]
    assert peers.refused_counts == {"confined": 0, "exited": 0}
    assert not peers.refused(Transport(pair[0]))  # no confined tree yet: nothing read
    peers.add(confined)
    for _ in range(3):
        assert peers.refused(Transport(pair[0]))
    assert peers.refused_counts == {"confined": 3, "exited": 0}
    peers.containment = FakeContainment({os.getpid(): [Tree()]})  # type: ignore[assignment]
    assert not peers.refused(Transport(pair[0]))
    assert peers.refused_counts == {"confined": 3, "exited": 0}


def test_a_peer_gone_before_its_check_is_counted_as_exited(tmp_path: Path) -> None:
    confined = Tree()
    peers = ConfinedPeers(Clock(), FakeContainment({}))  # type: ignore[arg-type]
    peers.add(confined)
    path = str(tmp_path / "s.sock")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(path)
        server.listen(1)
        connect = "import socket, sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1])"
        subprocess.run([sys.executable, "-c", connect, path], check=True, timeout=30)
        conn, _ = server.accept()
        with conn:
            assert peers.refused(Transport(conn))
    assert peers.refused_counts == {"confined": 0, "exited": 1}


def test_without_containment_a_reused_leader_pid_is_not_a_confined_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A confined leader whose pid, once its session emptied, another
    # process got: the new session of that pid is not the confined one.
    # (Before: refused until the next look at /proc, up to 10 s later.)
    from execserver.containment.proc import ProcInfo, read_proc

    confined = subprocess.Popen(["sleep", "60"], start_new_session=True)
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        peers = ConfinedPeers(Clock(), FakeContainment({}, mode="none"))  # type: ignore[arg-type]
        peers.add(Tree(), confined.pid)
        # This check looks at /proc (the first): the next is 10 s away.
        assert peers.why_refused(UnixPeer(confined.pid, os.getuid(), None)) is not None
        now = read_proc(other.pid)
        assert now is not None and now.sid == other.pid
        # A confined leader had other's pid, and started earlier.
        earlier = ProcInfo(now.pid, now.ppid, now.pgrp, now.sid, now.start - 1, False)
        monkeypatch.setattr("execserver.sandbox.peers.read_proc", lambda pid: earlier)
        peers.add(Tree(), other.pid)
        monkeypatch.undo()
        assert peers.why_refused(UnixPeer(other.pid, os.getuid(), None)) is None
        assert peers.why_refused(UnixPeer(confined.pid, os.getuid(), None)) is not None
    finally:
        for child in (confined, other):
            child.kill()
            child.wait(timeout=30)
