"""Every override of Twisted's private process machinery, each with its reason.

This is the one module that steps off Twisted's public process API. The
fast path keeps Twisted's ``Process``/``PTYProcess`` transports (pipes,
readers, SIGCHLD reaping) but creates the child itself:

``_BaseProcess._trySpawnInsteadOfFork`` (called first by ``_fork``; a True
    return skips Twisted's own creation). Twisted uses ``posix_spawnp`` only
    without a working directory and never for PTYs; otherwise it forks and
    closes every fd from Python (~6 ms a spawn), and it scans every open fd on
    each spawn (~9 ms with 1,000 children). We always ``posix_spawn``: the
    working directory is entered around the call (the reactor thread is the
    only one that spawns), ``setsid`` gives the child its own session and
    process group, and a PTY becomes the controlling terminal by being opened
    after ``setsid``. Containment wraps the call so the child starts inside its
    own cgroup. Relies on: the hook's parameters, ``_fork``'s keyword names
    (``fdmap`` for pipes, ``masterfd``/``slavefd`` for PTYs, i.e. those of
    ``_setupChild``), and ``_getFileActions`` to turn ``fdmap`` into file
    actions.
``Process.processReaderFactory`` (a ``ProcessReader`` subclass). Twisted reads
    8 KiB per wakeup, a quarter of pipe speed; ours reads ``READ_SIZE`` and
    grows a busy pipe. Relies on ``ProcessReader.fd`` and ``dataReceived``.
``PTYProcess.doRead``: coalesces what the PTY has ready into one chunk.
``PTYProcess.connectionLost``/``processEnded``/``writeSomeData``: the slave
    side can close before the child is reaped; closing the master then hangs
    the terminal up and the child is reported killed by SIGHUP (1 in 4 for
    ``cat`` here). The master is closed once the child is reaped instead.

Not an override but checked here too: containment reads
``reapProcessHandlers`` (the children Twisted waits for) so that it never
``waitpid``s one of them while reaping orphans it adopted as subreaper.

:data:`PROBLEM` is None when every hook above exists with the signature relied
on, checked when this module is imported; otherwise it says what is missing,
and the server uses the stock path (:mod:`execserver.spawn.stock`). The
service also spawns one child at startup and checks that it leads its own
process group (:meth:`execserver.spawn.PosixSpawner.check`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import inspect
import os
import signal
from collections.abc import Callable
from typing import Any, Final

from twisted.internet import process as _twisted_process
from twisted.internet.interfaces import IProcessProtocol, IReactorProcess

from execserver.containment import ContainmentError, Placing, ProcessTree
from execserver.fdreads import (
    PIPE_CAPACITY,
    PTY_READ_SIZE,
    READ_SIZE,
    drain,
    read_coalesced,
    read_into,
)
from execserver.private_api_checks import parameters
from execserver.spawn.lookup import SpawnError, cwd_error, exec_error
from execserver.spawn.terminal import set_window_size, terminal_eof_char


def check_private_hooks(module: Any = _twisted_process) -> str | None:
    """None if every private hook we override exists as relied on, else what is wrong."""
    problems = []
    base = getattr(module, "_BaseProcess", None)
    expect_hook = ["self", "path", "uid", "gid", "executable", "args", "environment", "kwargs"]
    if parameters(getattr(base, "_trySpawnInsteadOfFork", None)) != expect_hook:
        problems.append("_BaseProcess._trySpawnInsteadOfFork(path, uid, gid, ...) is gone")
    fork = getattr(base, "_fork", None)
    try:
        fork_source = inspect.getsource(fork) if fork is not None else ""
    except (OSError, TypeError):
        fork_source = ""
    if "_trySpawnInsteadOfFork" not in fork_source:
        problems.append("_BaseProcess._fork no longer calls _trySpawnInsteadOfFork")
    process = getattr(module, "Process", None)
    pty = getattr(module, "PTYProcess", None)
    if parameters(getattr(process, "_setupChild", None)) != ["self", "fdmap"]:
        problems.append("Process._fork's keyword is no longer fdmap")
    if parameters(getattr(pty, "_setupChild", None)) != ["self", "masterfd", "slavefd"]:
        problems.append("PTYProcess._fork's keywords are no longer masterfd, slavefd")
    expect_actions = ["fdState", "childToParentFD", "doClose", "doDup2"]
    if parameters(getattr(module, "_getFileActions", None)) != expect_actions:
        problems.append("_getFileActions(fdState, childToParentFD, doClose, doDup2) is gone")
    if getattr(process, "processReaderFactory", None) is not getattr(module, "ProcessReader", 0):
        problems.append("Process.processReaderFactory is not ProcessReader")
    if not isinstance(getattr(module, "reapProcessHandlers", None), dict):
        # Read by containment to tell Twisted's children from adopted orphans.
        problems.append("reapProcessHandlers is gone")
    for name in ("doRead", "connectionLost", "processEnded", "writeSomeData"):
        if not callable(getattr(pty, name, None)):
            problems.append(f"PTYProcess.{name} is gone")
    return "; ".join(problems) or None


#: Why the fast path cannot be used with this Twisted, or None.
PROBLEM: Final = check_private_hooks()

# valid_signals() leaves out those the C library reserves (32 and 33 on glibc),
# which posix_spawn would warn about. Python ignores SIGPIPE (and a parent may
# have ignored others); children must start with default dispositions or
# `yes | head` never ends. The same list serves every spawn (asking Python
# about 62 signals each time cost ~100 us a spawn here).
_RESET_SIGNALS: Final = sorted(
    int(sig)
    for sig in signal.valid_signals()
    if sig not in (signal.SIGKILL, signal.SIGSTOP) and int(sig) < signal.NSIG
)

_devnull_fd: int | None = None


def devnull() -> int:
    """A shared read-only /dev/null descriptor for children without stdin."""
    global _devnull_fd
    if _devnull_fd is None:
        _devnull_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    return _devnull_fd


def posix_spawn_in(
    cwd: str,
    executable: str,
    args: list[str],
    env: dict[str, str],
    file_actions: list[tuple[Any, ...]],
) -> int:
    """``posix_spawn`` with ``setsid`` in ``cwd`` (entered and left around the call)."""
    try:
        here = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        here = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            os.chdir(cwd)
        except OSError as exc:
            raise cwd_error(cwd, exc.errno or errno.EIO) from None
        try:
            return os.posix_spawn(
                executable,
                args,
                env,
                file_actions=file_actions,
                setsid=True,
                setsigdef=_RESET_SIGNALS,
                setsigmask=(),
            )
        except OSError as exc:
            raise exec_error(args[0] if args else executable, exc.errno or errno.EIO) from None
    finally:
        os.fchdir(here)
        os.close(here)


class _ChunkReader(_twisted_process.ProcessReader):
    _grown = False

    def doRead(self) -> object:
        return read_into(self.fd, self.dataReceived, READ_SIZE, self._filled)

    def _filled(self) -> None:
        if not self._grown:
            self._grown = True
            # Refused (EPERM) for unprivileged users past their pipe quota.
            with contextlib.suppress(OSError):
                fcntl.fcntl(self.fd, fcntl.F_SETPIPE_SZ, PIPE_CAPACITY)

    def drain(self) -> None:
        if self.connected and not self.disconnecting:
            drain(self.fd, self.dataReceived)


class _PosixSpawned:
    """The creation step shared by both transports: ``posix_spawn`` in ``cwd``."""

    _cwd: str
    _containment: Placing | None = None
    pid: Any
    status: Any
    #: Every process this child creates (None: only its process group).
    tree: ProcessTree | None = None

    #: The posix_spawn file actions for ``_fork``'s keyword arguments.
    _file_actions: Callable[[dict[str, Any]], list[tuple[Any, ...]]]

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
            return posix_spawn_in(
                self._cwd, executable, args, environment, self._file_actions(kwargs)
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
        reactor: IReactorProcess,
        cwd: str,
        executable: str,
        args: list[str],
        env: dict[str, str],
        pipe_stdin: bool,
        proto: IProcessProtocol,
        containment: Placing | None = None,
    ) -> None:
        self._cwd = cwd
        self._containment = containment
        child_fds: dict[int, int | str] = {0: "w" if pipe_stdin else devnull(), 1: "r", 2: "r"}
        super().__init__(reactor, executable, args, env, None, proto, childFDs=child_fds)

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
        reactor: IReactorProcess,
        cwd: str,
        executable: str,
        args: list[str],
        env: dict[str, str],
        size: tuple[int, int],
        proto: IProcessProtocol,
        containment: Placing | None = None,
    ) -> None:
        self._cwd = cwd
        self._containment = containment
        master, slave = os.openpty()
        try:
            set_window_size(master, *size)
            super().__init__(
                reactor, executable, args, env, None, proto,
                usePTY=(master, slave, os.ttyname(slave)),
            )  # fmt: skip
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
        return read_coalesced(self.fd, self._deliver)

    def connectionLost(self, reason: Any) -> None:
        if self.pid is not None and not self.disconnecting:
            # The slave side closed (EIO or HUP) while the child is still
            # exiting: stop watching the master and close it once the child
            # is reaped (see the module doc).
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
            drain(self.fd, self._deliver, PTY_READ_SIZE)

    def set_window_size(self, rows: int, cols: int) -> None:
        set_window_size(self.fd, rows, cols)

    def eof_char(self) -> bytes:
        return terminal_eof_char(self.fd)
