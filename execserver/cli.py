"""The ``exec-server`` console script: the same service as the twistd plugin.

Differences from ``twistd exec-server``: log lines go to stderr (stdout
carries protocol messages only), only warnings and errors are logged unless
``-v`` is given, and a server reading requests from a terminal says how to
type one.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from twisted.python import usage

from execserver.logsink import SinkStream, StderrSink, stderr_observer
from execserver.service import Options
from execserver.transports.listen import StdioAddress

PROG = "exec-server"

#: The last line of ``--help``, kept on a line of its own.
SECURITY_NOTE = "Security: anyone who can connect can run commands; bind to loopback (127.0.0.1)."

#: Printed on stderr when stdin is a terminal and stdio:// is listened on.
TTY_HINT = (
    f"{PROG}: reading JSON-RPC requests from this terminal, one per line, e.g. "
    '{"id":1,"method":"initialize","params":{"clientName":"me"}}'
    " - Ctrl-D quits"
)


class ServerOptions(Options):
    """The twistd plugin's options, plus the script's own ``--verbose``."""

    synopsis = f"Usage: {PROG} [--listen URL]... [options]"
    longdesc = (
        "Serve the exec-server JSON-RPC protocol: start and steer processes and read "
        "and write files for a client. By default it speaks JSON-RPC on its "
        "stdin/stdout, one message per line (--listen stdio://); --listen "
        "ws://IP:PORT serves WebSocket clients (repeatable)."
    )
    optFlags = [
        [
            "verbose",
            "v",
            "Also log informational messages (listeners, connections, shutdown); "
            "warnings and errors are always logged.",
        ],
    ]

    def getUsage(self, width: int | None = None) -> str:
        return f"{super().getUsage(width)}\n{SECURITY_NOTE}"


#: How long the script waits at exit for queued log lines to reach stderr.
LOG_DRAIN_SECONDS = 2.0


def main(argv: list[str] | None = None) -> None:
    options = ServerOptions()
    try:
        options.parseOptions(sys.argv[1:] if argv is None else argv)
    except usage.UsageError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        print(f"Try `{PROG} --help` for usage.", file=sys.stderr)
        raise SystemExit(2) from None

    if options["check-sandbox"]:
        from execserver.sandbox.check import check_sandbox

        raise SystemExit(check_sandbox(options))
    from twisted.internet import reactor
    from twisted.logger import globalLogBeginner

    # fd 2 is written by a thread through a bounded queue: a stderr pipe
    # nobody reads never blocks the reactor (docs/operations.md, "Logging").
    # sys.stderr writes through it too, so prints and log lines keep their order.
    real_stderr = sys.stderr
    sink = StderrSink(real_stderr.fileno())
    sys.stderr = SinkStream(sink, real_stderr.fileno())
    try:
        # Warnings and worse (everything with --verbose), repeats
        # rate-limited, each event's text bounded (execserver.logsink).
        globalLogBeginner.beginLoggingTo(
            [stderr_observer(sink, reactor, bool(options["verbose"]))], redirectStandardIO=False
        )
        code = _serve(options, reactor)
    finally:
        sys.stderr.flush()
        sink.drain(LOG_DRAIN_SECONDS)
        # (What Python prints on its way out goes straight to fd 2.)
        sys.stderr = real_stderr
    raise SystemExit(code)


def _serve(options: ServerOptions, reactor: Any) -> int:
    """Build and run the service; the exit status."""
    from execserver.service import build_service

    try:
        service = build_service(options, reactor, repeat_signals=True)
    except Exception as exc:
        print(f"{PROG}: cannot start: {exc}", file=sys.stderr)
        return 1
    failed: list[int] = []

    def start() -> None:
        # Started once the reactor runs, so its SIGTERM/SIGINT handlers are
        # in place before a listener is announced: a supervisor that signals
        # the server as soon as it reads "listening on" gets a clean stop.
        try:
            service.startService()
        except Exception as exc:
            print(f"{PROG}: cannot start: {exc}", file=sys.stderr)
            failed.append(1)
            reactor.stop()
            return
        reactor.addSystemEventTrigger("before", "shutdown", service.stopService)
        if os.isatty(0) and any(isinstance(a, StdioAddress) for a in options["listen"]):
            print(TTY_HINT, file=sys.stderr, flush=True)

    reactor.callWhenRunning(start)
    reactor.run()
    return failed[0] if failed else int(getattr(service, "exit_code", 0))


if __name__ == "__main__":
    main()
