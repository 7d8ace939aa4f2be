"""What every ``exec-server-client`` command shares: exit statuses, the
connection options and connecting, writing to local descriptors."""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import shlex
import signal
import sys
from typing import Any

from twisted.internet.error import ConnectionRefusedError as Refused
from twisted.internet.task import deferLater

from execserver.client.client import ConnectOptions, ExecServerClient
from execserver.client.errors import (
    ConnectFailed,
    ExecServerError,
    ServerError,
)
from execserver.clientcore.session import first_dial
from execserver.tls import ClientTls

PROG = "exec-server-client"
EXIT_REMOTE_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127
EXIT_CONNECTION = 255
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE
#: As GNU ``timeout``: the command ran out of its ``--timeout-ms``.
EXIT_TIMED_OUT = 124
#: Output of the command was lost (the server dropped output this client had
#: not read: ``--on-detached-full drop``, or a server without "pause").
EXIT_OUTPUT_LOST = 125


class CliError(Exception):
    """Reported as ``exec-server-client: MESSAGE`` with ``exit_code``."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# --- arguments --------------------------------------------------------------------


def connection_options(parser: argparse.ArgumentParser, suppress: bool = False) -> None:
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
    group.add_argument("--connect-timeout", type=seconds, default=default(10.0), metavar="SECONDS")
    group.add_argument(
        "--initialize-timeout", type=seconds, default=default(10.0), metavar="SECONDS"
    )
    group.add_argument(
        "--server-command",
        metavar="CMD",
        default=default(None),
        help="with --stdio: the server to launch (default: python -m execserver)",
    )


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got `{text}`") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got `{text}`")
    return value


def milliseconds(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole milliseconds, got `{text}`") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected milliseconds >= 0, got `{text}`")
    return value


# --- connecting -------------------------------------------------------------------


def read_token(args: argparse.Namespace) -> str | None:
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
        # Only a session that outlives a drop has output to pause or drop.
        on_detached_full=getattr(args, "on_detached_full", None) if ttl else None,
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
        token = read_token(args)
        tls = ClientTls(args.ca_file, args.client_cert, args.client_key)

        async def dial() -> ExecServerClient:
            return await ExecServerClient.connect_websocket(
                reactor, url, options, token=token, connect_timeout=args.connect_timeout, tls=tls
            )

        if resume_session_id is not None or not ttl:
            return await dial()
        # A cut during this first handshake leaves no session, but nothing
        # started either: dialled again within the session's TTL.
        return await first_dial(
            dial,
            ttl / 1000,
            now=reactor.seconds,
            sleep=lambda seconds: deferLater(reactor, seconds, lambda: None),
            refused=lambda exc: isinstance(exc.__cause__, Refused),
            give_up=lambda reason: ConnectFailed(url, reason),
            budget_note=", --session-ttl-ms",
        )
    except ExecServerError as exc:
        if resume_session_id is not None:
            # ResumingClient decides by the typed error: "unknown session id"
            # or a refused token gives up, "already attached" is retried, a
            # refused connection counts toward giving up.
            raise
        if isinstance(exc, ServerError):
            message = f"the server refused the handshake: {exc.message}"
            raise CliError(message, EXIT_CONNECTION) from None
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


def note(message: str, raw_terminal: bool = False) -> None:
    """One line on stderr; a terminal in raw mode needs its carriage return."""
    with contextlib.suppress(OSError):
        sys.stderr.write(f"{PROG}: {message}{chr(13) if raw_terminal else ''}\n")
        sys.stderr.flush()
