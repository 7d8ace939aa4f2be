"""``exec-server-client``: run commands, shells and file operations remotely.

    exec-server-client run --url ws://127.0.0.1:8080 -- make test
    exec-server-client run --stdio -- uname -a
    exec-server-client run -i --stdio -- sha256sum < big.iso
    exec-server-client shell --url ws://127.0.0.1:8080
    exec-server-client fs --stdio ls /tmp

Exit status: the remote command's exit code for ``run``/``shell`` (128+N when
it died of signal N); 124 when ``--timeout-ms`` expired; 141 when the reader
of the output went away; 127/126 when the command cannot be found /
executed; 1 for other remote errors; 2 for usage errors; 255 when the server
cannot be reached, refuses authentication, does not answer the handshake in
time or the connection is lost.

Ctrl-C (SIGINT) while ``run`` waits: the first sends SIGINT to the remote
process group, the second terminates it (SIGTERM, then SIGKILL after the
server's grace), the third kills it at once. SIGTERM and SIGHUP start at
the second step.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import os
import select
import shlex
import signal
import struct
import sys
import termios
import tty
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

from execserver import protocol as p
from execserver.client.client import ConnectOptions, ExecServerClient
from execserver.client.errors import (
    ConnectFailed,
    ExecServerError,
    InitializeTimeout,
    ServerError,
    SpawnFailed,
)
from execserver.client.process import RemoteProcess
from execserver.client.reconnect import ResumingClient
from execserver.client.types import OutputEvent
from execserver.tls import ClientTls

#: ``run``/``shell`` over --url: the session outlives a drop this long (ms).
RESUME_TTL_MS = 60_000
PROG = "exec-server-client"
EXIT_REMOTE_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127
EXIT_CONNECTION = 255
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE
#: As GNU ``timeout``: the command ran out of its ``--timeout-ms``.
EXIT_TIMED_OUT = 124
#: After ``process/exited``, how long to wait for ``process/closed`` (the rest
#: of the output); a baseline server never sends it.
CLOSE_WAIT_SECONDS = 2.0
DEFAULT_SHELL = [
    "/bin/sh",
    "-c",
    "if command -v bash >/dev/null 2>&1; then exec bash -i; else exec sh -i; fi",
]
_ENV_KEYS = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TZ")


class CliError(Exception):
    """Reported as ``exec-server-client: MESSAGE`` with ``exit_code``."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# --- arguments --------------------------------------------------------------------


def _connection_options(parser: argparse.ArgumentParser, suppress: bool = False) -> None:
    # ``suppress``: for sub-subcommands, whose defaults would otherwise
    # overwrite values given before the subcommand name.
    def default(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    group = parser.add_argument_group("connection")
    where = group.add_mutually_exclusive_group()
    where.add_argument(
        "--url",
        default=default(None),
        help="server URL, ws://HOST:PORT, wss://... or unix:///PATH (env EXEC_SERVER_URL)",
    )
    where.add_argument(
        "--stdio",
        action="store_true",
        default=default(False),
        help="launch a local exec-server and talk over its stdio",
    )
    group.add_argument(
        "--token-file",
        metavar="PATH",
        default=default(None),
        help="file holding the bearer token (env EXEC_SERVER_AUTH_TOKEN also works)",
    )
    group.add_argument(
        "--ca-file",
        metavar="PATH",
        default=default(None),
        help="wss://: PEM CA certificates to trust (default: the system's trust store)",
    )
    group.add_argument(
        "--client-cert",
        metavar="PATH",
        default=default(None),
        help="wss://: PEM client certificate to present (mutual TLS)",
    )
    group.add_argument(
        "--client-key",
        metavar="PATH",
        default=default(None),
        help="wss://: PEM key of --client-cert (default: in the --client-cert file)",
    )
    group.add_argument("--connect-timeout", type=_seconds, default=default(10.0), metavar="SECONDS")
    group.add_argument(
        "--initialize-timeout", type=_seconds, default=default(10.0), metavar="SECONDS"
    )
    group.add_argument(
        "--server-command",
        metavar="CMD",
        default=default(None),
        help="with --stdio: the server to launch (default: python -m execserver)",
    )


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got `{text}`") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got `{text}`")
    return value


def _milliseconds(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole milliseconds, got `{text}`") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected milliseconds >= 0, got `{text}`")
    return value


def _process_options(parser: argparse.ArgumentParser) -> None:
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
        type=_milliseconds,
        default=None,
        metavar="MS",
        help="wall-clock limit enforced by the server (0: none); on expiry the "
        "command is terminated and the exit status is 124",
    )
    parser.add_argument(
        "--session-ttl-ms",
        type=_milliseconds,
        default=RESUME_TTL_MS,
        metavar="MS",
        help="with --url: how long the server keeps the command running after a "
        f"dropped connection while this client reconnects (default {RESUME_TTL_MS}; "
        "0: a drop ends the command, exit 255)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run commands and touch files through an exec-server.",
        epilog="Exit status: the remote exit code (128+N: killed by signal N); "
        "124 --timeout-ms expired; 141 output reader gone; "
        "126/127 command not executable/found; 1 other remote error; 2 usage; "
        "255 connection, auth or handshake failure. "
        "Ctrl-C: SIGINT to the remote process, again: terminate, again: kill.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run a command, streaming its stdout and stderr")
    _connection_options(run)
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
    _connection_options(shell)
    _process_options(shell)
    shell.add_argument("argv", nargs=argparse.REMAINDER, metavar="[-- CMD [ARGS...]]")

    fs = sub.add_parser("fs", help="file operations: cat put get ls stat rm cp mkdir")
    _connection_options(fs)
    fs_sub = fs.add_subparsers(dest="fs_command", required=True, metavar="OP")
    for name, help_text, args in _FS_COMMANDS:
        op = fs_sub.add_parser(name, help=help_text)
        _connection_options(op, suppress=True)
        for arg, arg_help in args:
            if arg.startswith("-"):
                op.add_argument(arg, action="store_true", help=arg_help)
            else:
                op.add_argument(arg, help=arg_help)
    return parser


_REMOTE = "remote path (a relative one is resolved against this directory with --stdio)"
_FS_COMMANDS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("cat", "write a remote file to stdout", [("path", _REMOTE)]),
    (
        "put",
        "write stdin or a local file to a remote file (in 8 MiB ranges; progress on a terminal)",
        [("local", "local file, or - for stdin"), ("path", _REMOTE)],
    ),
    (
        "get",
        "copy a remote file to a local file or stdout (in 8 MiB ranges; progress on a terminal)",
        [("path", _REMOTE), ("local", "local file, or - for stdout")],
    ),
    ("ls", "list a remote directory", [("path", _REMOTE)]),
    ("stat", "show a remote path's metadata", [("path", _REMOTE)]),
    (
        "rm",
        "remove a remote path",
        [("path", _REMOTE), ("-r", "recursive"), ("-f", "ignore a missing path")],
    ),
    (
        "cp",
        "copy on the remote host",
        [("source", _REMOTE), ("destination", _REMOTE), ("-r", "recursive")],
    ),
    ("mkdir", "create a remote directory", [("path", _REMOTE), ("-p", "create parents")]),
]


# --- connecting -------------------------------------------------------------------


def _token(args: argparse.Namespace) -> str | None:
    if args.token_file:
        try:
            with open(args.token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as exc:
            raise CliError(f"cannot read --token-file: {exc.strerror}", EXIT_USAGE) from None
        if not token:
            raise CliError(f"--token-file {args.token_file} is empty", EXIT_USAGE)
        return token
    return os.environ.get("EXEC_SERVER_AUTH_TOKEN") or None


async def connect(
    reactor: Any, args: argparse.Namespace, *, resume_session_id: str | None = None
) -> ExecServerClient:
    ttl = getattr(args, "session_ttl_ms", None)
    options = ConnectOptions(
        client_name=PROG,
        initialize_timeout=args.initialize_timeout,
        session_ttl_ms=ttl or None,
        resume_session_id=resume_session_id,
    )
    url = args.url or (None if args.stdio else os.environ.get("EXEC_SERVER_URL"))
    try:
        if url is None and not args.stdio:
            raise CliError(
                "no server given: use --url ws://HOST:PORT (or EXEC_SERVER_URL) or --stdio",
                EXIT_USAGE,
            )
        if url is None:
            command = shlex.split(args.server_command) if args.server_command else None
            # The server's stderr (its log) is not shown; its tail is quoted
            # if it fails to start.
            return await ExecServerClient.spawn_local(reactor, options, command=command)
        if not url.startswith(("ws://", "wss://", "unix:///")):
            raise CliError(
                f"invalid --url `{url}`: expected ws://HOST:PORT, wss://... or unix:///PATH",
                EXIT_USAGE,
            )
        return await ExecServerClient.connect_websocket(
            reactor,
            url,
            options,
            token=_token(args),
            connect_timeout=args.connect_timeout,
            tls=ClientTls(args.ca_file, args.client_cert, args.client_key),
        )
    except (ConnectFailed, InitializeTimeout, SpawnFailed) as exc:
        raise CliError(str(exc), EXIT_CONNECTION) from None
    except ServerError as exc:
        if resume_session_id is not None:
            # ResumingClient tells "unknown session id" (give up) from
            # "already attached" (retry) by the ServerError itself.
            raise
        raise CliError(
            f"the server refused the handshake: {exc.message}", EXIT_CONNECTION
        ) from None
    except ExecServerError as exc:
        raise CliError(str(exc), EXIT_CONNECTION) from None


# --- output -----------------------------------------------------------------------


def write_all(fd: int, data: bytes) -> None:
    """Write everything, waiting when the descriptor is non-blocking and full."""
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except BlockingIOError:
            select.select([], [fd], [])
            continue
        except InterruptedError:
            continue
        view = view[written:]


class _Output:
    """Writes process output to local fds.

    When a reader goes away (EPIPE, e.g. ``| head``), writing stops and
    ``on_broken`` runs once: the remote process is terminated, as a local
    one would die of SIGPIPE.
    """

    def __init__(self, on_broken: Callable[[], None], stdout: int = 1, stderr: int = 2) -> None:
        self._fds = {"stdout": stdout, "stderr": stderr, "pty": stdout}
        self._on_broken = on_broken
        self.broken = False

    def __call__(self, event: OutputEvent) -> None:
        if self.broken:
            return
        try:
            write_all(self._fds[event.stream], event.chunk)
        except OSError as exc:
            if exc.errno != errno.EPIPE:
                raise
            self.broken = True
            self._on_broken()


# --- run / shell ------------------------------------------------------------------


def _env(args: argparse.Namespace, tty_mode: bool) -> dict[str, str]:
    if args.inherit_env:
        env = dict(os.environ)
    else:
        env = {k: os.environ[k] for k in _ENV_KEYS if k in os.environ}
        env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
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

    def __init__(self, reactor: Any, proc: RemoteProcess, client: ExecServerClient) -> None:
        self._reactor = reactor
        self._proc = proc
        self._client = client
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
        if self._client.supports(p.PROCESS_CLOSE_STDIN) and not self._proc.has_exited:
            self._proc.close_stdin().addErrback(_ignore)

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

    def on_signal(self, signum: int) -> None:
        if self._proc.has_exited:
            return
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


def _note(message: str, raw_terminal: bool = False) -> None:
    """One line on stderr; a terminal in raw mode needs its carriage return."""
    with contextlib.suppress(OSError):
        sys.stderr.write(f"{PROG}: {message}{chr(13) if raw_terminal else ''}\n")
        sys.stderr.flush()


async def run_process(reactor: Any, args: argparse.Namespace, tty_mode: bool) -> int:
    argv = _argv(args, DEFAULT_SHELL if tty_mode else None)
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
    timed_out_after: int | None = None
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
            )
        except ServerError as exc:
            raise _spawn_error(exc, argv) from None
        except ExecServerError as exc:
            raise CliError(str(exc), EXIT_CONNECTION) from None

        def reader_gone() -> None:
            # As a local process would die of SIGPIPE; we then exit 141.
            if forwarder is not None:
                forwarder.stop()
            if not proc.has_exited:
                proc.terminate().addErrback(_ignore)

        output = _Output(reader_gone)
        proc.add_output_listener(output)

        interrupts = _Interrupts(
            proc, client, argv[0], lambda text: _note(text, raw_terminal=saved_tty is not None)
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
            forwarder = _StdinForwarder(reactor, proc, client)
            forwarder.start()

        code = await proc.exited()
        if code is None:
            raise CliError(
                f"connection lost while `{argv[0]}` was running: "
                f"{_closed_reason(client) or 'connection closed'}",
                EXIT_CONNECTION,
            )
        await _bounded(proc.closed(), CLOSE_WAIT_SECONDS, reactor)
        if output.broken:
            return EXIT_BROKEN_PIPE
        if proc.timed_out is not None:
            # Said after the terminal is restored (below).
            timed_out_after = args.timeout_ms
            return EXIT_TIMED_OUT
        return code
    finally:
        if forwarder is not None:
            forwarder.stop()
        if saved_tty is not None:
            termios.tcsetattr(0, termios.TCSADRAIN, saved_tty)
        for signum, handler in old_handlers.items():
            signal.signal(signum, handler)
        if timed_out_after is not None:
            _note(
                f"`{argv[0]}` timed out after {timed_out_after} ms (--timeout-ms) "
                "and was terminated"
            )
        await client.close()


def _closed_reason(client: Any) -> str | None:
    if isinstance(client, ResumingClient):
        return client.closed_reason
    reason: str | None = client.rpc.closed_reason
    return reason


async def _bounded(d: Deferred[Any], seconds: float, clock: Any) -> None:
    def expired(result: object, timeout: float) -> None:
        return None

    d.addTimeout(seconds, clock, onTimeoutCancel=expired)
    await d


# --- fs ---------------------------------------------------------------------------


async def run_fs(reactor: Any, args: argparse.Namespace) -> int:
    from execserver.client.fs import describe, resolve_paths, run_fs_command

    # Before connecting: a path that cannot be sent is a usage error (unless
    # no server is given at all, which connect() reports).
    if args.stdio or args.url or os.environ.get("EXEC_SERVER_URL"):
        resolve_paths(args, local_server=bool(args.stdio))
    client = await connect(reactor, args)
    try:
        return await run_fs_command(client, args)
    except ServerError as exc:
        raise CliError(f"{describe(args)}: {exc.message}", EXIT_REMOTE_ERROR) from None
    except ExecServerError as exc:
        raise CliError(f"{describe(args)}: {exc}", EXIT_CONNECTION) from None
    finally:
        await client.close()


# --- entry point --------------------------------------------------------------------


async def _main(reactor: Any, args: argparse.Namespace) -> int:
    try:
        if args.command == "run":
            return await run_process(reactor, args, tty_mode=args.tty)
        if args.command == "shell":
            return await run_process(reactor, args, tty_mode=True)
        return await run_fs(reactor, args)
    except BrokenPipeError:
        # Our output's reader is gone (``| head``): end quietly, as SIGPIPE would.
        return EXIT_BROKEN_PIPE


def _fail(message: str, code: int) -> NoReturn:
    sys.stderr.write(f"{PROG}: {message}\n")
    sys.stderr.flush()
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    from twisted.internet import task

    outcome: list[int] = []

    def start(r: Any) -> Deferred[None]:
        d = Deferred.fromCoroutine(_main(r, args))

        def done(code: int) -> None:
            outcome.append(code)

        def failed(f: Failure) -> None:
            if f.check(CliError):
                err = f.value
                assert isinstance(err, CliError)
                sys.stderr.write(f"{PROG}: {err}\n")
                outcome.append(err.exit_code)
            else:
                sys.stderr.write(f"{PROG}: unexpected error: {f.getTraceback()}\n")
                outcome.append(EXIT_REMOTE_ERROR)

        return d.addCallbacks(done, failed)

    try:
        task.react(start)
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    raise SystemExit(outcome[0] if outcome else EXIT_REMOTE_ERROR)


if __name__ == "__main__":
    # Run the module's own main, not this __main__ copy: fs.py raises the
    # module's CliError, which a copy's ``except CliError`` would not catch.
    from execserver.client.cli import main as module_main

    module_main()
