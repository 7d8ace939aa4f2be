"""Starting child processes, each leading its own session and process group.

Two paths create the child; both keep Twisted's process transports (pipes,
readers, SIGCHLD reaping) and both put every child in a session of its own,
so one ``killpg`` reaches the members that stay in its group, and the
server's :class:`~execserver.containment.Containment` wraps the creation so
the child starts inside its own cgroup (or is tracked as a subreaper's
descendant):

- ``fast`` (the default): ``posix_spawn`` through Twisted's private hooks,
  big reads; every override and why is in :mod:`execserver.spawn.overrides`.
- ``stock``: public ``reactor.spawnProcess`` through ``setsid(1)``
  (:mod:`execserver.spawn.stock`). Chosen with ``--spawn-path stock``, or
  automatically, with one warning, when the overrides' check at import or
  the startup probe (:meth:`PosixSpawner.check`) fails.

The rest of the package: :mod:`~execserver.spawn.lookup` (executable and
cwd, the error texts), :mod:`~execserver.fdreads` (the large pipe
reader), :mod:`~execserver.spawn.groups` (process-group helpers),
:mod:`~execserver.spawn.terminal` (PTY size and EOF character).
"""

from __future__ import annotations

import contextlib
import os
from typing import Final, Literal, Protocol

import attrs
from twisted.internet.interfaces import IProcessProtocol, IReactorProcess
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import Logger

from execserver.containment import Containment, Placing
from execserver.errors import RpcError
from execserver.fdreads import READ_SIZE
from execserver.limits import NO_LIMITS, Limits
from execserver.spawn import overrides, stock
from execserver.spawn.groups import group_alive, kill_group, leads_own_group
from execserver.spawn.lookup import DEFAULT_PATH, SpawnError, os_error_text, resolve_executable
from execserver.spawn.overrides import PipeProcess, PtyProcess
from execserver.spawn.terminal import set_window_size, terminal_eof_char
from execserver.spawn.transport import ChildTransport, TerminalTransport

log = Logger()

SpawnPath = Literal["fast", "stock"]
SPAWN_PATHS: Final[tuple[SpawnPath, ...]] = ("fast", "stock")


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
    #: Resource limits of the whole tree (execserver.limits).
    limits: Limits = NO_LIMITS
    #: Processes of the sandbox's own that run around the command (set by
    #: the sandbox engine): ``maxProcesses`` counts the command's only.
    sandbox_processes: int = 0

    @property
    def child_args(self) -> list[str]:
        """The argv the child sees: ``arg0`` (when given) replaces ``argv[0]``."""
        return [self.arg0 if self.arg0 is not None else self.argv[0], *self.argv[1:]]


def seal_inherited_fds() -> None:
    """Mark every fd above 2 close-on-exec, so no child inherits the server's.

    Descriptors Python opens are close-on-exec already; this catches those the
    server was started with. Process-wide: called when the service starts.
    """
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        if fd > 2:
            with contextlib.suppress(OSError):
                os.set_inheritable(fd, False)


class Spawner(Protocol):
    """What the supervisor needs to start a process (faked in unit tests)."""

    def spawn(self, proto: IProcessProtocol, spec: ProcessSpec) -> ChildTransport:
        """Start ``spec`` connected to ``proto``; return its transport or raise SpawnError."""


class SpawnPathError(RuntimeError):
    """No spawn path gives children a process group of their own here."""


@attrs.define
class PosixSpawner:
    """The production :class:`Spawner`."""

    reactor: IReactorProcess
    #: Started by the service; None (the local client) contains nothing
    #: beyond the process group.
    containment: Containment | None = None
    #: The path asked for; :attr:`path` is the one in use.
    requested: SpawnPath = "fast"
    path: SpawnPath = attrs.field(init=False)
    _tools: tuple[str, str] | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        self.path = self.requested
        if self.path == "fast" and overrides.PROBLEM is not None:
            self._fall_back(f"Twisted's private process hooks changed: {overrides.PROBLEM}")

    def _fall_back(self, why: str) -> None:
        log.warn(
            "spawn: {why}; using the stock path (reactor.spawnProcess through setsid), "
            "slower but every process still leads its own process group",
            why=why,
        )
        self.path = "stock"

    def check(self) -> None:
        """Start one child on the path in use and check it leads its own process group.

        On the fast path a failure switches to the stock path (with a
        warning); if the stock path fails too, :class:`SpawnPathError`.
        """
        if self.path == "fast":
            problem = self._probe()
            if problem is None:
                return
            self._fall_back(f"the fast path's probe failed: {problem}")
        problem = self._probe()
        if problem is not None:
            raise SpawnPathError(f"the stock spawn path does not work here: {problem}")

    def _probe(self) -> str | None:
        # `cat` waits for its stdin: it cannot end (and be reaped) before the check.
        spec = ProcessSpec(
            argv=("cat",), cwd="/", env={"PATH": DEFAULT_PATH}, tty=False, pipe_stdin=True
        )
        try:
            executable = resolve_executable("cat", spec.env, "/")
            transport = self._start(ProcessProtocol(), spec, executable)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        try:
            pid = transport.pid
            if not isinstance(pid, int) or not leads_own_group(pid):
                return f"child {pid} does not lead its own session and process group"
            return None
        finally:
            transport.closeStdin()

    def spawn(self, proto: IProcessProtocol, spec: ProcessSpec) -> ChildTransport:
        executable = resolve_executable(spec.argv[0], spec.env, spec.cwd)
        placing: Placing | None = self.containment
        if spec.limits:
            if self.containment is None:
                raise RpcError.invalid_request(
                    f"limits.{spec.limits.set_fields()[0]} cannot be enforced: this server "
                    "starts processes without containment",
                    {"kind": "limitUnsupported", "field": spec.limits.set_fields()[0]},
                )
            placing = self.containment.placing(spec.limits, spec.sandbox_processes)
        try:
            return self._start(proto, spec, executable, placing)
        except ValueError as exc:
            # posix_spawn's own validation (e.g. an environment name containing "=").
            raise RpcError.invalid_params(str(exc)) from None

    def _start(
        self,
        proto: IProcessProtocol,
        spec: ProcessSpec,
        executable: str,
        containment: Placing | None = None,
    ) -> ChildTransport:
        size = (spec.rows, spec.cols)
        if self.path == "fast":
            if spec.tty:
                return PtyProcess(
                    self.reactor, spec.cwd, executable, spec.child_args, spec.env, size,
                    proto, containment,
                )  # fmt: skip
            return PipeProcess(
                self.reactor, spec.cwd, executable, spec.child_args, spec.env, spec.pipe_stdin,
                proto, containment,
            )  # fmt: skip
        if self._tools is None:
            tools = stock.find_tools()
            if isinstance(tools, str):
                raise SpawnError("spawnFailed", 0, tools)
            self._tools = tools
        return stock.spawn_stock(
            self.reactor, self._tools, spec.cwd, spec.argv[0], executable, spec.child_args,
            spec.env, spec.pipe_stdin, size if spec.tty else None, proto, containment,
            overrides.devnull(),
        )  # fmt: skip


__all__ = [
    "DEFAULT_PATH",
    "READ_SIZE",
    "SPAWN_PATHS",
    "ChildTransport",
    "PipeProcess",
    "PosixSpawner",
    "ProcessSpec",
    "PtyProcess",
    "SpawnError",
    "SpawnPath",
    "SpawnPathError",
    "Spawner",
    "TerminalTransport",
    "group_alive",
    "kill_group",
    "os_error_text",
    "resolve_executable",
    "seal_inherited_fds",
    "set_window_size",
    "terminal_eof_char",
]
