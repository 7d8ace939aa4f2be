"""``exec-server-client``: run commands, shells and file operations remotely.

    exec-server-client run --url ws://127.0.0.1:8080 -- make test
    exec-server-client run --stdio -- uname -a
    exec-server-client run -i --stdio -- sha256sum < big.iso
    exec-server-client shell --url ws://127.0.0.1:8080
    exec-server-client fs --stdio ls /tmp

Exit status: the remote command's exit code for ``run``/``shell`` (128+N when
it died of signal N); 124 when ``--timeout-ms`` expired; 125 when output
was lost (the server dropped output this client had not read: ``run``
prints a line naming the lost range); 141 when the reader
of the output went away; 127/126 when the command cannot be found /
executed; 1 for other remote errors; 2 for usage errors; 255 when the server
cannot be reached, refuses authentication, does not answer the handshake in
time or the connection is lost.

Ctrl-C (SIGINT) while ``run`` waits: the first sends SIGINT to the remote
process group, the second terminates it (SIGTERM, then SIGKILL after the
server's grace), the third kills it at once. SIGTERM and SIGHUP start at
the second step; the client then exits 128 + that signal (143, 129).

Modules: :mod:`~execserver.client.cli.common` (exit statuses, connection
options, connecting), :mod:`~execserver.client.cli.run` (``run``, ``shell``),
:mod:`~execserver.client.cli.fs` (``fs``); the parser and :func:`main` here.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

from execserver.client.cli import fs, run
from execserver.client.cli.common import EXIT_BROKEN_PIPE, EXIT_REMOTE_ERROR, PROG, CliError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run commands and touch files through an exec-server.",
        epilog="Exit status: the remote exit code (128+N: killed by signal N); "
        "124 --timeout-ms expired; 125 output lost (the server dropped some); "
        "141 output reader gone; "
        "126/127 command not executable/found; 1 other remote error; 2 usage; "
        "255 connection, auth or handshake failure. "
        "Ctrl-C: SIGINT to the remote process, again: terminate, again: kill.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run.add_parsers(sub)
    fs.add_parser(sub)
    return parser


async def _main(reactor: Any, args: argparse.Namespace) -> int:
    try:
        if args.command == "run":
            return await run.run_process(reactor, args, tty_mode=args.tty)
        if args.command == "shell":
            return await run.run_process(reactor, args, tty_mode=True)
        return await fs.run_fs(reactor, args)
    except BrokenPipeError:
        # Our output's reader is gone (``| head``): end quietly, as SIGPIPE would.
        return EXIT_BROKEN_PIPE


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
