"""The ``unix://`` listeners refuse the server's own confined commands.

Landlock cannot refuse ``connect()`` on a Unix socket, and bubblewrap's
mask of the socket's path does not cover another name of the same socket
(a hard link): a confined command with the network enabled (a restricted
network's seccomp filter refuses ``connect`` itself) could reach the
server's ``--listen unix://PATH`` and start an unconfined process there.
So every accepted connection of a ``unix://`` listener is checked before
anything is read from it: the kernel's record of the peer (``SO_PEERCRED``:
the pid of the process that called ``connect()``, in the server's pid
namespace; with ``SO_PEERPIDFD``, Linux 6.5+, a pidfd of that very process)
is looked up in containment (:meth:`Containment.trees_of
<execserver.containment.Containment.trees_of>`): a process whose tree was
started confined (any descendant: its cgroup, or in subreaper mode its
lineage) is refused, the connection closed at once, and one warning line
names the pid (at most one per interval, with a count); ``/metrics``
counts every refusal (``exec_server_sandbox_peer_refused_total{reason}``).

Races: the lookup reads ``/proc/PID`` after the connect. With a pidfd the
check ends by asking whether that process is still running; if it has
exited (it may have handed the socket to a child) the connection is refused
too, so a reused pid can never be read for it. Without ``SO_PEERPIDFD`` the
pid is only checked to exist: the pid space would have to wrap between the
``connect()`` and the accept for another process to be read in its place.

With ``--process-containment none`` (no tree tracked) the leaders' pids
are kept instead, beyond their records, until each leader, its session and
its group are gone: a daemon a confined command left in its session is
refused after the command's record is dropped.

Cost: nothing while no confined process lives (the registry is empty);
otherwise two ``getsockopt``, one ``/proc`` read (cgroup mode), one ``poll``
of the pidfd (``bench/bench_peer_check.py``).
"""

from __future__ import annotations

import os
import select
import socket
import struct
import weakref
from typing import TYPE_CHECKING, Any, Final

import attrs
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from execserver.containment import proc_table, read_proc
from execserver.logsink import OncePerInterval

if TYPE_CHECKING:
    from execserver.containment import Containment

log = Logger()

#: ``getsockopt`` options of a connected Unix socket (``<asm-generic/socket.h>``).
_SO_PEERCRED: Final = 17
_SO_PEERPIDFD: Final = 77
_UCRED: Final = struct.Struct("3i")
#: Why a connection is refused (the ``reason`` label of its counter).
REFUSAL_REASONS: Final = ("confined", "exited")
#: Seconds between two looks for leaders whose sessions have ended (a /proc scan).
FORGET_INTERVAL: Final = 10.0
#: Leaders held before :meth:`ConfinedPeers.add` looks for stale ones (then twice as many).
_FORGET_AT_LEAST: Final = 256


@attrs.frozen
class UnixPeer:
    """Who ``connect()``ed a Unix socket, as the kernel recorded it at that moment."""

    #: In the server's pid namespace (0: a process outside it).
    pid: int
    uid: int
    #: A pidfd of that very process (``SO_PEERPIDFD``, Linux 6.5+; None before):
    #: it cannot come to mean another process when the pid is reused. The
    #: caller closes it.
    pidfd: int | None


def unix_peer(sock: socket.socket) -> UnixPeer:
    """``SO_PEERCRED`` (and ``SO_PEERPIDFD`` where the kernel has it) of an accepted socket."""
    pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, _SO_PEERCRED, _UCRED.size))
    pidfd: int | None
    try:
        pidfd = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD)
    except OSError:
        pidfd = None  # ENOPROTOOPT: an older kernel
    return UnixPeer(pid, uid, pidfd)


class ConfinedPeers:
    """The trees of confined processes, and the check of a ``unix://`` connection's peer."""

    def __init__(
        self, clock: IReactorTime | None = None, containment: Containment | None = None
    ) -> None:
        #: The server's containment (None: nothing is checked).
        self.containment = containment
        self._trees: weakref.WeakSet[Any] = weakref.WeakSet()
        #: leader pid -> its start time: the lineage check of
        #: ``--process-containment none``, which tracks no tree. Kept after
        #: the process's record is dropped, until the leader, its session and
        #: its process group are all gone (:meth:`_forget_stale`): a daemon
        #: it left there is refused meanwhile. The kernel keeps a pid from
        #: reuse while a session or group of that id has a member, so the
        #: session ``pid`` is this leader's as long as the entry is kept.
        self._leaders: dict[int, int] = {}
        self._clock = clock
        #: When stale leaders may next be looked for (a scan of /proc).
        self._next_forget = 0.0
        #: Leaders the last look found without a session or group (forgotten
        #: if the next look finds them so again).
        self._suspects: set[int] = set()
        #: Leaders held beyond which :meth:`add` looks for stale ones.
        self._forget_at = _FORGET_AT_LEAST
        self._refusals = OncePerInterval(clock) if clock is not None else None
        #: Connections refused since the start, by reason: ``confined`` (the
        #: peer is in a confined tree), ``exited`` (it exited before it could
        #: be checked). ``/metrics``: ``exec_server_sandbox_peer_refused_total``.
        self.refused_counts: dict[str, int] = dict.fromkeys(REFUSAL_REASONS, 0)

    def add(self, tree: object, pid: int | None = None) -> None:
        """Remember the tree (led by ``pid``) of a process started confined.

        Called in the reactor turn of the spawn: no connection of the new
        process can have been accepted yet.
        """
        self._trees.add(tree)
        none = self.containment is not None and self.containment.mode == "none"
        info = read_proc(pid) if pid is not None and none else None
        if info is not None:
            self._leaders[info.pid] = info.start
            if len(self._leaders) >= self._forget_at:
                # Amortised: memory stays bounded however rarely peers connect.
                self._forget_stale(force=True)
                self._forget_at = max(_FORGET_AT_LEAST, 2 * len(self._leaders))

    @property
    def tracking(self) -> bool:
        """Whether a peer is looked up at all (a confined tree, or a leader's session, lives)."""
        return bool(self._trees) or bool(self._leaders)

    def refused(self, transport: Any) -> bool:
        """Whether the connection of ``transport`` must be closed (logs why, if so)."""
        if self.containment is None or not self.tracking:
            return False
        sock = transport.getHandle()
        peer = unix_peer(sock)
        try:
            refusal = self._refusal(peer)
        finally:
            if peer.pidfd is not None:
                os.close(peer.pidfd)
        if refusal is None:
            return False
        reason, why = refusal
        self.refused_counts[reason] += 1
        count = self._refusals.hit() if self._refusals is not None else 1
        if count is not None:
            name = transport.getHost().name
            log.warn(
                "refusing a connection on unix://{path} from pid {pid}: {why} "
                "({count} such connection(s) refused since the last such line)",
                path=name.decode(errors="replace") if isinstance(name, bytes) else name,
                pid=peer.pid,
                why=why,
                count=count,
            )
        return True

    def why_refused(self, peer: UnixPeer) -> str | None:
        """Why ``peer`` is refused, or None (it is no confined command of ours)."""
        refusal = self._refusal(peer)
        return refusal[1] if refusal is not None else None

    def _refusal(self, peer: UnixPeer) -> tuple[str, str] | None:
        """(reason, text) of ``peer``'s refusal, or None."""
        if peer.pid <= 0:
            # Outside the server's pid namespace: never one of its commands,
            # which all run in it or in namespaces below it.
            return None
        assert self.containment is not None
        trees = self.containment.trees_of(peer.pid)
        if self._leaders:
            self._forget_stale()
        if any(tree in self._trees for tree in trees) or (
            self.containment.mode == "none" and self._led_by_confined(peer.pid)
        ):
            return (
                "confined",
                "it is a sandboxed command of this server (or in its process tree); "
                "a sandboxed command cannot use the server's listeners",
            )
        # After the lookup: what was read was that process's, unless it is
        # gone (then the pid may be another's now, and the socket a child's).
        if not _running(peer):
            return "exited", "the connecting process exited before it could be checked"
        return None

    def _led_by_confined(self, pid: int) -> bool:
        """Whether ``pid`` or an ancestor is a confined leader, or in its session or group.

        Without containment (``none``) only this: a descendant that left
        the session and was orphaned (reparented to init) is not found.
        """
        leaders = self._leaders
        if not leaders:
            return False
        oldest = min(leaders.values())
        info = read_proc(pid)
        for _hop in range(1024):
            if info is None or info.start < oldest:
                return False
            if (
                leaders.get(info.pid) == info.start
                or self._holds(info.sid)
                or self._holds(info.pgrp)
            ):
                return True
            if info.ppid <= 1:
                return False
            info = read_proc(info.ppid)
        return False

    def _holds(self, leader: int) -> bool:
        """Whether the session or group ``leader`` is a confined leader's.

        Its id is the leader's pid: while the session or group has a member
        the kernel gives that pid to no other process, so a process that
        has it now with another start time means the confined leader's
        session and group had emptied, and this one is another's.
        """
        start = self._leaders.get(leader)
        if start is None:
            return False
        now = read_proc(leader)
        if now is not None and now.start != start:
            del self._leaders[leader]
            return False
        return True

    def _forget_stale(self, *, force: bool = False) -> None:
        """Forget the leaders whose process, session and group are all gone.

        A scan of /proc, at most once per :data:`FORGET_INTERVAL` seconds
        (``force``: now). A leader's pid held by another process (another
        start time) means its session and group had emptied: the kernel
        reuses no pid a session or group still holds.
        """
        now = self._clock.seconds() if self._clock is not None else None
        if not force and now is not None and now < self._next_forget:
            return
        if now is not None:
            self._next_forget = now + FORGET_INTERVAL
        table = proc_table()
        held = {info.sid for info in table.values()} | {info.pgrp for info in table.values()}
        suspects = set()
        for pid, start in list(self._leaders.items()):
            leader = table.get(pid)
            if leader is not None and leader.start == start:
                continue  # the leader itself (or its zombie) is still there
            if leader is None and pid in held:
                continue  # its session or group lives on without it
            if leader is None and pid not in self._suspects:
                # Found empty once: a member forked while /proc was listed,
                # its parent gone before it was read, would be missed; one
                # that lives on is listed by the next scan.
                suspects.add(pid)
                continue
            del self._leaders[pid]
        self._suspects = suspects


def _running(peer: UnixPeer) -> bool:
    if peer.pidfd is not None:
        poller = select.poll()
        poller.register(peer.pidfd, select.POLLIN)
        # A pidfd is readable once its process has exited.
        return not poller.poll(0)
    try:
        os.kill(peer.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
