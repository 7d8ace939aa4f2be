"""Starting child processes: fast, in their own session, with big reads.

Twisted's ``reactor.spawnProcess`` machinery is kept (its ``Process`` and
``PTYProcess`` transports, pipes, readers and SIGCHLD reaping) but the
moment of creation is ours, because the stock paths cost too much here:

- Twisted uses ``posix_spawnp`` only without a working directory and never
  for PTYs; otherwise it forks and closes every fd from Python (~6 ms a
  spawn). We always ``posix_spawn``: the working directory is entered around
  the call (the reactor thread is the only one that spawns, and no code in
  this server resolves relative paths), ``setsid`` gives every child its own
  session and process group (so one ``killpg`` reaches the members that stay
  in it), and a PTY becomes the child's controlling terminal by being opened
  after ``setsid``. The server's :class:`~execserver.containment.Containment`
  wraps the call, so that the child starts inside its own cgroup (or is
  tracked as a subreaper's descendant): its ``tree`` reaches every
  descendant.
- Twisted scans every open fd on each spawn (~9 ms with 1,000 children). All
  our descriptors are close-on-exec (Python's default; :func:`seal_inherited_fds`
  marks the ones the server inherited), so the child gets exactly fds 0-2.
- Twisted reads child output 8 KiB at a time, a quarter of pipe speed; our
  readers read :data:`READ_SIZE` bytes per wakeup.

The executable is looked up in the *child's* ``PATH`` (or ``/bin:/usr/bin``
when it has none), relative to its working directory, as the reference's
Rust ``Command`` does; failures are reported as :class:`SpawnError` before
any process exists.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import stat
import struct
import termios
import time
from typing import Any, Final, Protocol

import attrs
from twisted.internet import process as _twisted_process
from twisted.internet.interfaces import IProcessProtocol, IReactorCore
from twisted.internet.main import CONNECTION_DONE, CONNECTION_LOST

from execserver.containment import Containment, ContainmentError, ProcessTree
from execserver.errors import RpcError

READ_SIZE: Final = 256 * 1024
# Capacity given to a child's stdout/stderr pipe once it fills the default
# 64 KiB (which caps every read at 64 KiB whatever READ_SIZE says); a pipe as
# large as one read lets each wakeup take a full READ_SIZE. Growing only busy
# pipes keeps unprivileged servers inside the kernel's per-user pipe quota
# (pipe-user-pages-soft) with hundreds of mostly quiet children.
PIPE_CAPACITY: Final = READ_SIZE
DEFAULT_PIPE_CAPACITY: Final = 64 * 1024
# A PTY master yields at most 4 KiB per read (the line discipline's buffer).
# Asking for READ_SIZE anyway costs an mmap-sized allocation per read (above
# malloc's 128 KiB threshold) that is shrunk to 4 KiB: ~45% more CPU per byte.
PTY_READ_SIZE: Final = 64 * 1024
# What is immediately available on a PTY is gathered, up to this much, into
# one chunk: one notification per 4 KiB would cost most of the PTY's speed.
PTY_COALESCE_BYTES: Final = 64 * 1024
# Glibc's default search path when PATH is unset, as execvp uses.
DEFAULT_PATH: Final = "/bin:/usr/bin"
# Bytes read synchronously from a stream when its process exits, so that all
# output written before the exit precedes the exit notification. Bounded so a
# grandchild that keeps writing cannot stall the reactor.
EXIT_DRAIN_LIMIT: Final = 8 * 1024 * 1024


@attrs.frozen
class ProcessSpec:
    """A fully validated request to start one process."""

    argv: tuple[str, ...]
    cwd: str
    env: dict[str, str]
    tty: bool
    arg0: str | None = None
    pipe_stdin: bool = False
    rows: int = 24
    cols: int = 80

    @property
    def child_args(self) -> list[str]:
        """The argv the child sees: ``arg0`` (when given) replaces ``argv[0]``."""
        return [self.arg0 if self.arg0 is not None else self.argv[0], *self.argv[1:]]


class SpawnError(RpcError):
    """The process could not be started. ``-32603`` with ``data.kind``/``data.errno``."""

    def __init__(self, kind: str, err: int, message: str) -> None:
        super().__init__(-32603, message, {"kind": kind, "errno": err})
        self.kind = kind
        self.errno = err


def _os_message(err: int) -> str:
    return f"{os.strerror(err)} (os error {err})"


_EXEC_KINDS: Final = {
    errno.ENOENT: "spawnNotFound",
    errno.EACCES: "spawnPermissionDenied",
    errno.EPERM: "spawnPermissionDenied",
    errno.ENOEXEC: "spawnExecFormatError",
    errno.E2BIG: "spawnArgumentListTooLong",
    errno.ENOTDIR: "spawnNotFound",
    errno.ELOOP: "spawnNotFound",
    errno.EISDIR: "spawnPermissionDenied",
}
_CWD_KINDS: Final = {
    errno.ENOENT: "cwdNotFound",
    errno.ENOTDIR: "cwdNotADirectory",
    errno.EACCES: "cwdPermissionDenied",
    errno.EPERM: "cwdPermissionDenied",
    errno.ELOOP: "cwdNotFound",
}


def _exec_error(program: str, err: int) -> SpawnError:
    return SpawnError(
        _EXEC_KINDS.get(err, "spawnFailed"),
        err,
        f"failed to start `{program}`: {_os_message(err)}",
    )


def resolve_executable(program: str, env: dict[str, str], cwd: str) -> str:
    """Find what ``execvp(program)`` would run with ``env``'s PATH from ``cwd``."""
    if "/" in program:
        candidate = os.path.join(cwd, program)
        err = _unusable(candidate)
        if err:
            raise _exec_error(program, err)
        return candidate
    denied = 0
    for entry in env.get("PATH", DEFAULT_PATH).split(":"):
        candidate = os.path.join(cwd, entry, program)
        err = _unusable(candidate)
        if not err:
            return candidate
        if err in (errno.EACCES, errno.EISDIR):
            denied = err
    raise _exec_error(program, denied or errno.ENOENT)


def _unusable(path: str) -> int:
    """0 if ``path`` is an executable file, else the errno exec would report.

    Cheap on a miss: a lookup along PATH misses once per entry before the hit.
    """
    try:
        st = os.stat(path)
    except OSError as exc:
        return exc.errno or errno.ENOENT
    if stat.S_ISDIR(st.st_mode):
        return errno.EISDIR
    if not os.access(path, os.X_OK):
        return errno.EACCES
    return 0


def seal_inherited_fds() -> None:
    """Mark every fd above 2 close-on-exec, so no child inherits the server's.

    Descriptors Python opens are close-on-exec already; this catches those the
    server was started with. Called once at startup.
    """
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        if fd > 2:
            with contextlib.suppress(OSError):
                os.set_inheritable(fd, False)


_devnull_fd: int | None = None


def _devnull() -> int:
    global _devnull_fd
    if _devnull_fd is None:
        _devnull_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    return _devnull_fd


def _ignored_signals() -> list[int]:
    # Python ignores SIGPIPE (and a parent may have ignored others); children
    # must start with default dispositions or `yes | head` never ends. Reset
    # every signal the server does not handle itself: the same list for
    # each spawn, without asking Python about 62 signals each time (that
    # cost ~100 us a spawn here).
    return _RESET_SIGNALS


# valid_signals() leaves out those the C library reserves (32 and 33 on glibc),
# which posix_spawn would warn about.
_RESET_SIGNALS: Final = sorted(
    int(sig)
    for sig in signal.valid_signals()
    if sig not in (signal.SIGKILL, signal.SIGSTOP) and int(sig) < signal.NSIG
)


def _posix_spawn_in(
    cwd: str,
    executable: str,
    args: list[str],
    env: dict[str, str],
    file_actions: list[tuple[Any, ...]],
) -> int:
    try:
        here = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        here = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            os.chdir(cwd)
        except OSError as exc:
            err = exc.errno or errno.EIO
            raise SpawnError(
                _CWD_KINDS.get(err, "cwdUnusable"),
                err,
                f"cannot use cwd `{cwd}`: {_os_message(err)}",
            ) from None
        try:
            return os.posix_spawn(
                executable,
                args,
                env,
                file_actions=file_actions,
                setsid=True,
                setsigdef=_ignored_signals(),
                setsigmask=(),
            )
        except OSError as exc:
            raise _exec_error(args[0] if args else executable, exc.errno or errno.EIO) from None
    finally:
        os.fchdir(here)
        os.close(here)


def _read_into(fd: int, deliver: Any, size: int = READ_SIZE, filled: Any = None) -> object:
    """One read for a reactor reader: None to go on, a reason when the stream ended.

    ``filled`` is called when a read took a whole default-size pipe's worth.
    """
    try:
        data = os.read(fd, size)
    except BlockingIOError:
        return None
    except OSError:
        # EIO: the PTY's slave side is closed and drained.
        return CONNECTION_LOST
    if not data:
        return CONNECTION_DONE
    if filled is not None and len(data) >= DEFAULT_PIPE_CAPACITY:
        filled()
    deliver(data)
    return None


def _read_coalesced(fd: int, deliver: Any) -> object:
    """Read what a PTY has ready (up to PTY_COALESCE_BYTES) as one chunk."""
    pieces: list[bytes] = []
    total = 0
    ended: object = None
    while total < PTY_COALESCE_BYTES:
        try:
            data = os.read(fd, PTY_READ_SIZE)
        except BlockingIOError:
            break
        except OSError:
            ended = CONNECTION_LOST
            break
        if not data:
            ended = CONNECTION_DONE
            break
        pieces.append(data)
        total += len(data)
    if pieces:
        deliver(pieces[0] if len(pieces) == 1 else b"".join(pieces))
    return ended


def _drain(fd: int, deliver: Any, size: int = READ_SIZE) -> None:
    budget = EXIT_DRAIN_LIMIT
    while budget > 0:
        try:
            data = os.read(fd, size)
        except OSError:
            return
        if not data:
            return
        budget -= len(data)
        deliver(data)


class _ChunkReader(_twisted_process.ProcessReader):
    _grown = False

    def doRead(self) -> object:
        return _read_into(self.fd, self.dataReceived, READ_SIZE, self._filled)

    def _filled(self) -> None:
        if not self._grown:
            self._grown = True
            # Refused (EPERM) for unprivileged users past their pipe quota.
            with contextlib.suppress(OSError):
                fcntl.fcntl(self.fd, fcntl.F_SETPIPE_SZ, PIPE_CAPACITY)

    def drain(self) -> None:
        if self.connected and not self.disconnecting:
            _drain(self.fd, self.dataReceived)


class _PosixSpawned:
    """The creation step shared by both transports: ``posix_spawn`` in ``cwd``.

    Twisted's ``_fork`` calls this hook first and skips its fork when it
    returns True.
    """

    _spec: ProcessSpec
    _containment: Containment | None = None
    pid: Any
    status: Any
    #: Every process this child creates (None: only its process group).
    tree: ProcessTree | None = None

    @staticmethod
    def _file_actions(kwargs: dict[str, Any]) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def _trySpawnInsteadOfFork(
        self,
        path: object,
        uid: object,
        gid: object,
        executable: str,
        args: list[str],
        environment: dict[str, str],
        kwargs: dict[str, Any],
    ) -> bool:
        def create() -> int:
            return _posix_spawn_in(
                self._spec.cwd, executable, args, environment, self._file_actions(kwargs)
            )

        if self._containment is None:
            self.pid = create()
        else:
            try:
                self.pid, self.tree = self._containment.spawn(create)
            except ContainmentError as exc:
                raise SpawnError("spawnFailed", exc.errno, str(exc)) from None
        self.status = -1
        return True


class PipeProcess(_PosixSpawned, _twisted_process.Process):
    """Twisted's pipe ``Process``, created by ``posix_spawn`` in its own session."""

    processReaderFactory = _ChunkReader

    def __init__(
        self,
        reactor: IReactorCore,
        spec: ProcessSpec,
        executable: str,
        proto: IProcessProtocol,
        containment: Containment | None = None,
    ) -> None:
        self._spec = spec
        self._containment = containment
        child_fds: dict[int, int | str] = {
            0: "w" if spec.pipe_stdin else _devnull(),
            1: "r",
            2: "r",
        }
        super().__init__(
            reactor,
            executable,
            spec.child_args,
            spec.env,
            None,
            proto,
            childFDs=child_fds,
        )

    @staticmethod
    def _file_actions(kwargs: dict[str, Any]) -> list[tuple[Any, ...]]:
        # Every fd of ours is close-on-exec, so the child gets exactly fdmap.
        fdmap: dict[int, int] = kwargs["fdmap"]
        return _twisted_process._getFileActions(
            [(fd, True) for fd in set(fdmap.values())],
            fdmap,
            doClose=os.POSIX_SPAWN_CLOSE,
            doDup2=os.POSIX_SPAWN_DUP2,
        )

    def drain_output(self) -> None:
        for pipe in list(self.pipes.values()):
            if isinstance(pipe, _ChunkReader):
                pipe.drain()


class PtyProcess(_PosixSpawned, _twisted_process.PTYProcess):
    """Twisted's ``PTYProcess``, created by ``posix_spawn``; the PTY is its controlling tty."""

    def __init__(
        self,
        reactor: IReactorCore,
        spec: ProcessSpec,
        executable: str,
        proto: IProcessProtocol,
        containment: Containment | None = None,
    ) -> None:
        self._spec = spec
        self._containment = containment
        master, slave = os.openpty()
        try:
            set_window_size(master, spec.rows, spec.cols)
            super().__init__(
                reactor,
                executable,
                spec.child_args,
                spec.env,
                None,
                proto,
                usePTY=(master, slave, os.ttyname(slave)),
            )
        except BaseException:
            for fd in (master, slave):
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise

    @staticmethod
    def _file_actions(kwargs: dict[str, Any]) -> list[tuple[Any, ...]]:
        # Opened after setsid, the slave becomes the controlling terminal.
        return [
            (os.POSIX_SPAWN_OPEN, 0, os.ttyname(kwargs["slavefd"]), os.O_RDWR, 0),
            (os.POSIX_SPAWN_DUP2, 0, 1),
            (os.POSIX_SPAWN_DUP2, 0, 2),
        ]

    #: Why output ended, when it ended before the child was reaped.
    _early_eof: Any = None

    def doRead(self) -> object:
        return _read_coalesced(self.fd, self._deliver)

    def connectionLost(self, reason: Any) -> None:
        if self.pid is not None and not self.disconnecting:
            # The slave side closed (EIO or HUP) while the child is still
            # exiting. Closing the master now would hang the terminal up, and
            # the kernel then reports the exiting child as killed by SIGHUP
            # (1 in 4 for `cat` ending on EOF, measured here). Stop watching
            # the master and close it once the child is reaped.
            self._early_eof = reason
            self.stopReading()
            self.stopWriting()
            return
        super().connectionLost(reason)

    def processEnded(self, status: int) -> None:
        super().processEnded(status)
        reason, self._early_eof = self._early_eof, None
        if reason is not None and self.connected:
            self.connectionLost(reason)

    def writeSomeData(self, data: bytes) -> int | BaseException:
        if self._early_eof is not None:
            # Nobody can read it any more.
            return len(data)
        result: int | BaseException = super().writeSomeData(data)
        return result

    def _deliver(self, data: bytes) -> None:
        proto = self.proto
        assert proto is not None
        proto.childDataReceived(1, data)

    def drain_output(self) -> None:
        if self.connected and not self.disconnecting:
            _drain(self.fd, self._deliver, PTY_READ_SIZE)

    def set_window_size(self, rows: int, cols: int) -> None:
        """Resize the terminal; the kernel sends SIGWINCH to its foreground group."""
        set_window_size(self.fd, rows, cols)

    def eof_char(self) -> bytes:
        return terminal_eof_char(self.fd)


def set_window_size(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def terminal_eof_char(fd: int) -> bytes:
    """The EOF character (VEOF) of the terminal behind a PTY master.

    On Linux the master reports the line discipline settings the child set on
    its side (e.g. ``stty eof ^B``). Falls back to ^D, the default.
    """
    try:
        char = termios.tcgetattr(fd)[6][termios.VEOF]
    except (OSError, termios.error):
        return b"\x04"
    if isinstance(char, int):  # pragma: no cover - only in non-canonical layouts
        return bytes([char])
    # NUL is _POSIX_VDISABLE: the terminal has no EOF character; ^D is the
    # best guess of what the program reading it expects.
    return bytes(char) if char and char != b"\x00" else b"\x04"


class Spawner(Protocol):
    """What the supervisor needs to start a process (faked in unit tests)."""

    def spawn(self, proto: IProcessProtocol, spec: ProcessSpec) -> Any:
        """Start ``spec`` connected to ``proto``; return its transport or raise SpawnError."""


@attrs.define
class PosixSpawner:
    """The production :class:`Spawner`."""

    reactor: IReactorCore
    #: Started by the service; None (the local client) contains nothing
    #: beyond the process group.
    containment: Containment | None = None

    def spawn(self, proto: IProcessProtocol, spec: ProcessSpec) -> Any:
        executable = resolve_executable(spec.argv[0], spec.env, spec.cwd)
        factory = PtyProcess if spec.tty else PipeProcess
        try:
            return factory(self.reactor, spec, executable, proto, self.containment)
        except ValueError as exc:
            # posix_spawn's own validation (e.g. an environment name containing "=").
            raise RpcError.invalid_params(str(exc)) from None


def kill_group(pid: int, sig: int) -> bool:
    """Send ``sig`` to the process group led by ``pid``; False if it is gone."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    return True


#: How long one /proc scan answers :func:`group_alive` for every group. When
#: many processes are terminated at once (a session ending) their groups are
#: checked in a burst; one scan serves them all. A stale "alive" only costs
#: a later re-check.
GROUP_SCAN_TTL: Final = 0.05
_group_scan: tuple[float, frozenset[int]] | None = None


def _live_groups() -> frozenset[int] | None:
    """Groups with a member that is not a zombie, from /proc (None: no /proc)."""
    global _group_scan
    now = time.monotonic()
    if _group_scan is not None and now - _group_scan[0] < GROUP_SCAN_TTL:
        return _group_scan[1]
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    live = set()
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # Fields after the command: state, ppid, pgrp, ...
        if len(fields) > 2 and fields[0] not in (b"Z", b"X"):
            live.add(int(fields[2]))
    groups = frozenset(live)
    _group_scan = (now, groups)
    return groups


def group_alive(pgid: int) -> bool:
    """True while process group ``pgid`` has a member that is not a zombie.

    ``killpg(pgid, 0)`` alone cannot tell: it succeeds for zombies, and
    orphans killed with their group stay zombies until init reaps them
    (which some container inits never do). Only when it succeeds is /proc
    consulted.
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    groups = _live_groups()
    return groups is None or pgid in groups


__all__ = [
    "READ_SIZE",
    "PipeProcess",
    "PosixSpawner",
    "ProcessSpec",
    "PtyProcess",
    "SpawnError",
    "Spawner",
    "group_alive",
    "kill_group",
    "resolve_executable",
    "seal_inherited_fds",
    "set_window_size",
    "terminal_eof_char",
]
