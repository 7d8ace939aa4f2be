"""``run`` and ``shell``: a remote command with its output, input, terminal and signals.

Ctrl-C (SIGINT) while ``run`` waits: the first sends SIGINT to the remote
process group, the second terminates it (SIGTERM, then SIGKILL after the
server's grace), the third kills it at once. SIGTERM and SIGHUP start at
the second step.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import os
import signal
import struct
import termios
import tty
from collections.abc import Callable, Sequence
from typing import Any

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

from execserver import protocol as p
from execserver.client.cli.common import (
    EXIT_BROKEN_PIPE,
    EXIT_CONNECTION,
    EXIT_NOT_EXECUTABLE,
    EXIT_NOT_FOUND,
    EXIT_OUTPUT_LOST,
    EXIT_REMOTE_ERROR,
    EXIT_TIMED_OUT,
    EXIT_USAGE,
    CliError,
    connect,
    connection_options,
    milliseconds,
    note,
    write_all,
)
from execserver.client.client import DEFAULT_PATH, ExecServerClient
from execserver.client.connect import wait_at_most
from execserver.client.errors import ExecServerError, OutcomeUnknown, ServerError
from execserver.client.process import RemoteProcess
from execserver.client.reconnect import ResumingClient
from execserver.client.types import GapEvent, OutputEvent
from execserver.clientcore.start import SANDBOX_MODES, sandbox_config

#: ``run``/``shell`` over --url: the session outlives a drop this long (ms).
RESUME_TTL_MS = 60_000
#: After ``process/exited``, how long to wait for ``process/closed`` (the rest
#: of the output); a baseline server never sends it.
CLOSED_AFTER_EXIT_SECONDS = 2.0
DEFAULT_SHELL = [
    "/bin/sh",
    "-c",
    "if command -v bash >/dev/null 2>&1; then exec bash -i; else exec sh -i; fi",
]
_ENV_KEYS = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TZ")


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``run`` and ``shell`` subcommands."""
    run = sub.add_parser("run", help="run a command, streaming its stdout and stderr")
    connection_options(run)
    _process_options(run)
    run.add_argument("-t", "--tty", action="store_true", help="interactive, in a remote PTY")
    run.add_argument(
        "-i",
        "--stdin",
        action="store_true",
        help="forward stdin to the command (without -t; needs a server with pipeStdin)",
    )
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]")

    shell = sub.add_parser("shell", help="an interactive remote shell (run -t)")
    connection_options(shell)
    _process_options(shell)
    shell.add_argument("argv", nargs=argparse.REMAINDER, metavar="[-- CMD [ARGS...]]")


def _process_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sandbox",
        choices=SANDBOX_MODES,
        help="run the command confined: read-only (no writes), workspace-write (writes only "
        "in the --writable-root directories, default the cwd, and not in their .git, .codex, "
        ".agents) or danger-full-access (none; refused by a server with a --sandbox-floor)",
    )
    parser.add_argument(
        "--writable-root",
        action="append",
        default=[],
        metavar="DIR",
        help="with --sandbox workspace-write: a remote directory the command may write "
        "(repeatable)",
    )
    parser.add_argument(
        "--no-network",
        action="store_true",
        help="with --sandbox read-only or workspace-write: no network for the command",
    )
    parser.add_argument("--cwd", help="remote working directory (default: . with --stdio, else /)")
    parser.add_argument(
        "-e",
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set a remote environment variable (repeatable)",
    )
    parser.add_argument(
        "--inherit-env",
        action="store_true",
        help="send this whole environment (default: only PATH, HOME, USER, LANG, ...)",
    )
    parser.add_argument(
        "--timeout-ms",
        type=milliseconds,
        default=None,
        metavar="MS",
        help="wall-clock limit enforced by the server (0: none); on expiry the "
        "command is terminated and the exit status is 124",
    )
    parser.add_argument(
        "--session-ttl-ms",
        type=milliseconds,
        default=RESUME_TTL_MS,
        metavar="MS",
        help="with --url: how long the server keeps the command running after a "
        f"dropped connection while this client reconnects (default {RESUME_TTL_MS}; "
        "0: a drop ends the command, exit 255)",
    )
    parser.add_argument(
        "--on-detached-full",
        choices=("pause", "drop"),
        default="pause",
        help="with --url: while this client is away and the server's retained output "
        "fills, pause the command (default; nothing is lost) or drop the oldest "
        f"output (the command never waits; lost output is reported, exit {EXIT_OUTPUT_LOST})",
    )


class _Output:
    """Writes process output to local fds.

    When a reader goes away (EPIPE, e.g. ``| head``), writing stops and
    ``on_broken`` runs once: the remote process is terminated, as a local
    one would die of SIGPIPE. Output the server dropped (a :class:`GapEvent`)
    is kept in ``gaps``: the run then reports it and exits
    :data:`EXIT_OUTPUT_LOST`.
    """

    def __init__(self, on_broken: Callable[[], None], stdout: int = 1, stderr: int = 2) -> None:
        self._fds = {"stdout": stdout, "stderr": stderr, "pty": stdout}
        self._on_broken = on_broken
        self.broken = False
        self.gaps: list[GapEvent] = []

    def __call__(self, event: OutputEvent) -> None:
        if isinstance(event, GapEvent):
            self.gaps.append(event)
            return
        if self.broken:
            return
        try:
            write_all(self._fds[event.stream], event.chunk)
        except OSError as exc:
            if exc.errno != errno.EPIPE:
                raise
            self.broken = True
            self._on_broken()


def _env(args: argparse.Namespace, tty_mode: bool) -> dict[str, str]:
    if args.inherit_env:
        env = dict(os.environ)
    else:
        env = {k: os.environ[k] for k in _ENV_KEYS if k in os.environ}
        env.setdefault("PATH", DEFAULT_PATH)
        if tty_mode:
            env["TERM"] = os.environ.get("TERM", "xterm-256color")
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise CliError(f"--env takes NAME=VALUE, got `{item}`", EXIT_USAGE)
        env[name] = value
    return env


def _argv(args: argparse.Namespace, default: list[str] | None) -> list[str]:
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        if default is None:
            raise CliError("no command given: run ... -- CMD [ARGS...]", EXIT_USAGE)
        return default
    return argv


def terminal_size(fd: int) -> tuple[int, int] | None:
    try:
        rows, cols, _, _ = struct.unpack("HHHH", fcntl.ioctl(fd, termios.TIOCGWINSZ, b"\0" * 8))
    except OSError:
        return None
    return (rows, cols) if rows > 0 and cols > 0 else None


def _spawn_error(exc: ServerError, argv: Sequence[str]) -> CliError:
    kind = exc.kind or ""
    if kind in ("spawnNotFound",):
        code = EXIT_NOT_FOUND
    elif kind.startswith("spawn") and kind != "spawnFailed":
        code = EXIT_NOT_EXECUTABLE
    else:
        code = EXIT_REMOTE_ERROR
    return CliError(f"cannot start `{argv[0]}`: {exc.message}", code)


class _StdinForwarder:
    """Reads local stdin in the reactor and writes it to the remote process.

    One ``process/write`` is in flight at a time (reading pauses meanwhile),
    so a large input is paced by the remote reader; a write refused because
    the remote stdin buffer is full is retried. At end of input the remote
    stdin is closed (``process/closeStdin``; on a PTY, the EOF character).
    """

    def __init__(
        self, reactor: Any, proc: RemoteProcess, client: ExecServerClient, tty: bool = False
    ) -> None:
        self._reactor = reactor
        self._proc = proc
        self._client = client
        self._tty = tty
        self._reading = False
        self._stopped = False

    def fileno(self) -> int:
        return 0

    def logPrefix(self) -> str:
        return "stdin"

    def start(self) -> None:
        if not self._stopped and not self._reading:
            self._reactor.addReader(self)
            self._reading = True

    def _pause(self) -> None:
        if self._reading:
            self._reactor.removeReader(self)
            self._reading = False

    def stop(self) -> None:
        self._stopped = True
        self._pause()

    def doRead(self) -> None:
        try:
            data = os.read(0, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._end_of_input()
            return
        self._pause()
        self._send(data)

    def _end_of_input(self) -> None:
        if self._stopped:
            return
        self.stop()
        if self._client.supports(p.PROCESS_CLOSE_STDIN):
            self._close_stdin()

    def _close_stdin(self) -> None:
        if not self._proc.has_exited:
            self._proc.close_stdin().addErrback(self._close_failed)

    def _close_failed(self, failure: Failure) -> None:
        # In flight at a dropped connection: closing a pipe again changes
        # nothing, so it is sent again on the resumed session (else the
        # command would wait for the end of its input forever). Not so a
        # PTY's, whose every close is one more end-of-file character.
        if failure.check(OutcomeUnknown) and not self._tty:
            self._close_stdin()

    def _send(self, data: bytes) -> None:
        d = self._proc.write(data)
        d.addCallbacks(lambda _: self.start(), self._write_failed, errbackArgs=(data,))
        d.addErrback(_ignore)

    def _write_failed(self, failure: Failure, data: bytes) -> None:
        error = failure.value
        if (
            isinstance(error, ServerError)
            and "retry later" in error.message
            and not self._proc.has_exited
            and not self._stopped
        ):
            self._reactor.callLater(0.05, self._send, data)
            return
        # The process exited or closed its input: nothing more to forward.
        self.stop()

    def connectionLost(self, reason: Failure) -> None:
        # The reactor saw a hangup on stdin (a pipe whose writer is gone).
        self._reading = False
        self._end_of_input()


def _ignore(_: Failure) -> None:
    """Writes racing the process's exit fail; the exit is reported anyway."""


def terminate_through_drops(proc: RemoteProcess) -> None:
    """Terminate ``proc`` (its output's reader went away), sent again on the
    resumed session when a drop left the outcome unknown: nobody presses
    Ctrl-C again for a terminate nobody asked for, and the command, its
    output now unread, would run on while ``run`` waits for its exit.
    A terminate repeated is harmless (the process is ending either way)."""

    def failed(failure: Failure) -> None:
        if failure.check(OutcomeUnknown) and not proc.has_exited:
            terminate_through_drops(proc)

    if not proc.has_exited:
        proc.terminate().addErrback(failed)


class _Interrupts:
    """Escalates on each Ctrl-C: SIGINT, then terminate, then kill at once.

    A remote command is in its own process group on the server, so the
    terminal's SIGINT never reaches it; the first Ctrl-C forwards it (as
    ``docker exec`` and ``ssh -t`` users expect: a program may catch it and
    clean up). SIGTERM and SIGHUP of this client skip the SIGINT step.
    A server without ``process/signal`` (the baseline) gets terminate first.
    """

    def __init__(
        self,
        proc: RemoteProcess,
        client: ExecServerClient,
        argv0: str,
        note: Callable[[str], None],
    ) -> None:
        self._proc = proc
        self._argv0 = argv0
        self._note = note
        self._can_signal = client.supports(p.PROCESS_SIGNAL)
        self.step = 0
        #: The first SIGTERM or SIGHUP this client received: it then exits
        #: 128 + that signal once the remote process is gone, as a local
        #: command killed by it would (not the remote's 143 from our terminate).
        self.stopped_by: int | None = None

    def on_signal(self, signum: int) -> None:
        if self._proc.has_exited:
            return
        if signum != signal.SIGINT and self.stopped_by is None:
            self.stopped_by = signum
        first = 1 if signum == signal.SIGINT and self._can_signal else 2
        self.step = max(self.step + 1, first)
        if self.step == 1:
            self._proc.send_signal("SIGINT").addErrback(_ignore)
        elif self.step == 2:
            self._note(f"terminating `{self._argv0}` (interrupt again to kill it at once)")
            self._proc.terminate().addErrback(_ignore)
        else:
            self._note(f"killing `{self._argv0}`")
            self._proc.terminate(grace_ms=0).addErrback(_ignore)


def _sandbox(args: argparse.Namespace) -> p.SandboxConfig | None:
    if args.sandbox is None:
        if args.writable_root or args.no_network:
            raise CliError("--writable-root and --no-network need --sandbox", EXIT_USAGE)
        return None
    if args.writable_root and args.sandbox != "workspace-write":
        raise CliError("--writable-root needs --sandbox workspace-write", EXIT_USAGE)
    if args.no_network and args.sandbox == "danger-full-access":
        raise CliError("--no-network needs --sandbox read-only or workspace-write", EXIT_USAGE)
    return sandbox_config(args.sandbox, args.writable_root, not args.no_network)


async def run_process(reactor: Any, args: argparse.Namespace, tty_mode: bool) -> int:
    argv = _argv(args, DEFAULT_SHELL if tty_mode else None)
    sandbox = _sandbox(args)
    forward_stdin = tty_mode or getattr(args, "stdin", False)
    env = _env(args, tty_mode)
    first = await connect(reactor, args)
    client: Any = first
    if first.resumable:
        # A dropped connection is re-dialed and the session resumed: the
        # command keeps running and its output stays byte-exact.
        client = ResumingClient(
            reactor,
            first,
            lambda session_id: Deferred.fromCoroutine(
                connect(reactor, args, resume_session_id=session_id)
            ),
        )
    stdin_is_tty = os.isatty(0)
    saved_tty: list[Any] | None = None
    old_handlers: dict[int, Any] = {}
    forwarder: _StdinForwarder | None = None
    output: _Output | None = None
    command_code: int | None = None
    timed_out_after: int | None = None
    limit_hit: str | None = None
    try:
        cwd = args.cwd or (os.getcwd() if args.stdio else "/")
        size = terminal_size(0) if tty_mode else None
        try:
            proc: RemoteProcess = await client.start_process(
                argv,
                cwd=cwd,
                env=env,
                tty=tty_mode,
                pipe_stdin=forward_stdin and not tty_mode,
                size=size,
                timeout_ms=args.timeout_ms or None,
                sandbox=sandbox,
            )
        except ServerError as exc:
            raise _spawn_error(exc, argv) from None
        except ExecServerError as exc:
            raise CliError(str(exc), EXIT_CONNECTION) from None

        def reader_gone() -> None:
            # As a local process would die of SIGPIPE; we then exit 141.
            if forwarder is not None:
                forwarder.stop()
            terminate_through_drops(proc)

        output = _Output(reader_gone)
        proc.add_output_listener(output, gaps=True)

        interrupts = _Interrupts(
            proc, client, argv[0], lambda text: note(text, raw_terminal=saved_tty is not None)
        )

        def on_signal(signum: int, frame: object) -> None:
            reactor.callFromThread(interrupts.on_signal, signum)

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            old_handlers[sig] = signal.signal(sig, on_signal)

        if tty_mode and stdin_is_tty:
            saved_tty = termios.tcgetattr(0)
            tty.setraw(0)
            if client.supports(p.PROCESS_RESIZE):

                def resized() -> None:
                    new = terminal_size(0)
                    if new is not None:
                        proc.resize(*new).addErrback(_ignore)

                old_handlers[signal.SIGWINCH] = signal.signal(
                    signal.SIGWINCH, lambda s, f: reactor.callFromThread(resized)
                )
        if forward_stdin:
            forwarder = _StdinForwarder(reactor, proc, client, tty_mode)
            forwarder.start()

        code = await proc.exited()
        command_code = code
        if code is None:
            raise CliError(
                f"connection lost while `{argv[0]}` was running: "
                f"{_closed_reason(client) or 'connection closed'}",
                EXIT_CONNECTION,
            )
        await rest_of_output(proc, client, reactor)
        if output.broken:
            return EXIT_BROKEN_PIPE
        if interrupts.stopped_by is not None:
            return 128 + interrupts.stopped_by
        if output.gaps:
            return EXIT_OUTPUT_LOST  # said below, once the terminal is restored
        if proc.timed_out is not None:
            # Said after the terminal is restored (below).
            timed_out_after = args.timeout_ms
            return EXIT_TIMED_OUT
        limit_hit = limit_line(argv[0], proc.limit_exceeded)
        return code
    finally:
        if forwarder is not None:
            forwarder.stop()
        if saved_tty is not None:
            termios.tcsetattr(0, termios.TCSADRAIN, saved_tty)
        for signum, handler in old_handlers.items():
            signal.signal(signum, handler)
        if output is not None and not output.broken:
            for gap in output.gaps:
                note(gap_line(gap, argv[0], command_code))
        if timed_out_after is not None:
            note(
                f"`{argv[0]}` timed out after {timed_out_after} ms (--timeout-ms) "
                "and was terminated"
            )
        if limit_hit is not None:
            note(limit_hit)
        await client.close()


async def rest_of_output(proc: RemoteProcess, client: object, clock: Any) -> bool:
    """After ``process/exited``: wait for ``process/closed`` (the rest of the
    output), at most :data:`CLOSED_AFTER_EXIT_SECONDS` while connected. A
    drop meanwhile is ridden through first: while ``client`` (a
    :class:`ResumingClient`) re-dials or catches the handle up, the bound
    starts again, so a slow resume cannot cut the output short. False when
    the close did not come (a baseline server, or a descendant holding the
    output open)."""
    while not await wait_at_most(proc.closed(), CLOSED_AFTER_EXIT_SECONDS, clock):
        if not (isinstance(client, ResumingClient) and (client.resuming or proc.catching_up)):
            return False
    return True


def gap_line(gap: GapEvent, argv0: str, code: int | None) -> str:
    """The line ``run`` prints for output the server dropped (docs/client.md)."""
    delivered = ", ".join(f"{stream} {count} bytes" for stream, count in gap.delivered)
    line = (
        f"output lost: the server dropped output seqs {gap.from_seq}-{gap.to_seq} of "
        f"`{argv0}` before this client read them (delivered before the gap: {delivered})"
    )
    if code is not None:
        line += f"; exiting {EXIT_OUTPUT_LOST}, not with the command's {code}"
    return line


_LIMIT_WORDS = {
    "memory": ("memory limit", "bytes", "memoryBytes"),
    "processes": ("process limit", "processes", "maxProcesses"),
    "cpu": ("CPU limit", "% of a CPU", "cpuPercent"),
    "fileSize": ("file size limit", "bytes", "fileSizeBytes"),
}


def limit_line(program: str, exceeded: tuple[str, int | None] | None) -> str | None:
    """The one line ``run`` prints when a resource limit ended or crippled the command."""
    if exceeded is None:
        return None
    kind, value = exceeded
    what, unit, field = _LIMIT_WORDS.get(kind, (f"{kind} limit", "", kind))
    figure = (
        "" if value is None else f" ({field} {value}{'' if unit.startswith('%') else ' '}{unit})"
    )
    return f"`{program}` hit its {what}{figure}"


def _closed_reason(client: Any) -> str | None:
    if isinstance(client, ResumingClient):
        return client.closed_reason
    reason: str | None = client.rpc.closed_reason
    return reason
