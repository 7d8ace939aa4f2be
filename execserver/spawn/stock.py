"""The stock spawn path: public ``reactor.spawnProcess``, every child in its own session.

Used when the fast path's private hooks are missing or misbehave
(:mod:`execserver.spawn.overrides`), or when asked for with
``--spawn-path stock``. Nothing here reaches into Twisted:

- Pipes: the child is ``setsid env -C CWD -- PROGRAM ARGS...`` with no
  ``path`` argument, so Twisted keeps its ``posix_spawnp`` path; ``setsid(1)``
  makes the child lead a new session and process group (it is not a group
  leader when created, so ``setsid`` does not fork and the pid is the
  program's), and ``env`` enters the working directory and looks ``PROGRAM``
  up in the child's ``PATH`` as the fast path does.
- PTYs: ``usePTY=(master, slave, ttyname)`` (public); Twisted forks, calls
  ``setsid`` and makes the slave the controlling terminal. The server keeps a
  duplicate of the master until the child is reaped, so the slave closing
  first cannot hang the terminal up under an exiting child.
- ``arg0`` different from the program: one more exec through
  ``python -I -S`` (``os.execv`` can set ``argv[0]``; ``env`` cannot).
- The tree (containment), the exit drain and the PTY helpers the session
  uses are attached to the transport before the protocol sees it: the
  protocol is connected once ``spawnProcess`` has returned.

Costs, against the fast path: two extra ``exec`` calls per start (more with
``arg0``), Twisted's scan of open descriptors, and 8 KiB reads of output.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import shutil
import sys
from collections.abc import Callable
from typing import Any, Final

from twisted.internet.interfaces import IProcessProtocol, IReactorProcess
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

from execserver.containment import ContainmentError, Placing, ProcessTree
from execserver.fdreads import PTY_READ_SIZE, READ_SIZE, drain
from execserver.spawn.groups import wait_until_leader
from execserver.spawn.lookup import DEFAULT_PATH, SpawnError, check_cwd, exec_error
from execserver.spawn.terminal import set_window_size, terminal_eof_char
from execserver.spawn.transport import ChildTransport

#: Re-exec with another argv[0]; restores the dispositions Python ignores.
_ARGV0_HELPER: Final = (
    "import os,signal,sys;"
    "signal.signal(signal.SIGPIPE,signal.SIG_DFL);"
    "signal.signal(signal.SIGXFSZ,signal.SIG_DFL);"
    "os.execv(sys.argv[1],sys.argv[2:])"
)


#: Longest a start waits for its child to become a group leader.
LEADER_TIMEOUT: Final = 2.0


#: What the kernel executes directly: ELF binaries and ``#!`` scripts.
_EXECUTABLE_MAGIC: Final = (b"\x7fELF", b"#!")


def check_format(program: str, executable: str) -> None:
    """Refuse what ``execve`` would refuse with ENOEXEC, as the fast path reports it.

    ``env(1)`` execs through ``execvp``, which runs a file the kernel refuses
    with ``/bin/sh`` instead. A file we cannot read is left to the kernel.
    """
    try:
        with open(executable, "rb") as f:
            head = f.read(4)
    except OSError:
        return
    if not head.startswith(_EXECUTABLE_MAGIC):
        raise exec_error(program, errno.ENOEXEC)


def find_tools() -> tuple[str, str] | str:
    """The ``setsid`` and ``env`` programs the stock path runs, or why it cannot run."""
    search = os.environ.get("PATH", DEFAULT_PATH) + ":/usr/bin:/bin"
    setsid = shutil.which("setsid", path=search)
    env = shutil.which("env", path=search)
    if setsid is None or env is None:
        return "the stock spawn path needs setsid(1) and env(1) (with -C) on PATH"
    return setsid, env


class _ConnectLater(ProcessProtocol):
    """Holds a protocol's events until its transport is fully set up.

    ``spawnProcess`` connects the protocol before it returns, i.e. before the
    containment tree is known; Twisted may even report an early exit then.
    """

    def __init__(self, target: IProcessProtocol) -> None:
        self._target = target
        self._held: list[tuple[str, tuple[Any, ...]]] = []
        self._live = False
        #: Called when the process has ended, before the protocol hears of it.
        self.on_end: Callable[[], None] | None = None

    def makeConnection(self, transport: Any) -> None:
        self.transport = transport
        # Twisted reaps a child that already exited before spawnProcess
        # returns, and then forgets its pid.
        self.pid: int = transport.pid

    def release(self, transport: Any) -> None:
        if transport.pid is None:
            # Reaped already: the protocol still learns which process it was
            # (as on the fast path, where it is connected before the reaping).
            transport.pid = self.pid
            self._target.makeConnection(transport)
            transport.pid = None
        else:
            self._target.makeConnection(transport)
        self._live = True
        held, self._held = self._held, []
        for name, args in held:
            getattr(self._target, name)(*args)

    def _pass(self, name: str, *args: Any) -> None:
        if self._live:
            getattr(self._target, name)(*args)
        else:
            self._held.append((name, args))

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        self._pass("childDataReceived", childFD, data)

    def childConnectionLost(self, childFD: int) -> None:
        self._pass("childConnectionLost", childFD)

    def processExited(self, reason: Failure) -> None:
        self._pass("processExited", reason)

    def processEnded(self, reason: Failure) -> None:
        if self.on_end is not None:
            self.on_end()
        self._pass("processEnded", reason)


def _drain_pipes(transport: Any, proto: _ConnectLater) -> None:
    # Twisted's public ``pipes`` map; each reader's fileno() is its pipe.
    for child_fd, pipe in list(transport.pipes.items()):
        if child_fd in (1, 2) and getattr(pipe, "connected", False):
            drain(pipe.fileno(), functools.partial(proto.childDataReceived, child_fd))


def spawn_stock(
    reactor: IReactorProcess,
    tools: tuple[str, str],
    cwd: str,
    program: str,
    executable: str,
    args: list[str],
    env: dict[str, str],
    pipe_stdin: bool,
    pty_size: tuple[int, int] | None,
    proto: IProcessProtocol,
    containment: Placing | None,
    stdin_fd: int,
) -> ChildTransport:
    """Start one child through ``reactor.spawnProcess``; see the module doc."""
    check_cwd(cwd)
    check_format(program, executable)
    setsid, env_tool = tools
    if args[0] == program and "=" not in program:
        # env(1) finds the program in the child's PATH from cwd, as
        # resolve_executable did (it would read NAME=VALUE as a setting).
        command = [env_tool, "-C", cwd, "--", *args]
    else:
        command = [env_tool, "-C", cwd, "--", sys.executable, "-I", "-S", "-c", _ARGV0_HELPER,
                   os.path.abspath(executable), *args]  # fmt: skip
    relay = _ConnectLater(proto)
    transport: Any = None
    keep_master: list[int] = []

    def create() -> int:
        nonlocal transport
        if pty_size is None:
            child_fds: dict[int, int | str] = {0: "w" if pipe_stdin else stdin_fd, 1: "r", 2: "r"}
            transport = reactor.spawnProcess(
                relay, setsid, ["setsid", *command], env=env, path=None, childFDs=child_fds
            )
        else:
            master, slave = os.openpty()
            try:
                set_window_size(master, *pty_size)
                keep_master.append(os.dup(master))
                transport = reactor.spawnProcess(
                    relay, env_tool, command, env=env, path=None,
                    # Documented as "optionally a tuple of (masterfd, slavefd,
                    # ttyname)"; the interface stub says bool.
                    usePTY=(master, slave, os.ttyname(slave)),  # type: ignore[arg-type]
                )  # fmt: skip
            except BaseException:
                for fd in (master, slave, *keep_master):
                    with contextlib.suppress(OSError):
                        os.close(fd)
                keep_master.clear()
                raise
        pid = relay.pid
        # The child calls setsid only once it runs: until then a signal to
        # its group (process/signal, terminate) would miss it.
        wait_until_leader(pid, LEADER_TIMEOUT)
        return pid

    tree: ProcessTree | None = None
    try:
        if containment is None:
            create()
        else:
            _pid, tree = containment.spawn(create)
    except ContainmentError as exc:
        raise SpawnError("spawnFailed", exc.errno, str(exc)) from None
    except OSError as exc:
        # E.g. E2BIG: the same error the fast path's posix_spawn reports.
        raise exec_error(args[0], exc.errno or errno.EIO) from None
    transport.tree = tree
    if pty_size is None:
        transport.drain_output = lambda: _drain_pipes(transport, relay)
    else:
        fd = transport.fileno()
        transport.set_window_size = lambda rows, cols: set_window_size(fd, rows, cols)
        transport.eof_char = lambda: terminal_eof_char(fd)
        transport.drain_output = lambda: (
            drain(fd, lambda data: relay.childDataReceived(1, data), PTY_READ_SIZE)
            if transport.connected
            else None
        )

        def release_master() -> None:
            while keep_master:
                with contextlib.suppress(OSError):
                    os.close(keep_master.pop())

        relay.on_end = release_master
    relay.release(transport)
    result: ChildTransport = transport
    return result


__all__ = ["READ_SIZE", "find_tools", "spawn_stock"]
