"""The ``exec-server`` console script: the same service as the twistd plugin."""

from __future__ import annotations

import sys

from twisted.python import usage


def main(argv: list[str] | None = None) -> None:
    from execserver.service import Options

    options = Options()
    try:
        options.parseOptions(sys.argv[1:] if argv is None else argv)
    except usage.UsageError as exc:
        print(f"exec-server: {exc}", file=sys.stderr)
        print("Try `exec-server --help` for usage.", file=sys.stderr)
        raise SystemExit(2) from None

    from twisted.internet import reactor
    from twisted.logger import globalLogBeginner, textFileLogObserver

    globalLogBeginner.beginLoggingTo([textFileLogObserver(sys.stderr)], redirectStandardIO=False)
    from execserver.service import build_service

    try:
        service = build_service(options, reactor)
        service.startService()
    except Exception as exc:
        print(f"exec-server: cannot start: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    reactor.addSystemEventTrigger("before", "shutdown", service.stopService)
    reactor.run()
    raise SystemExit(getattr(service, "exit_code", 0))


if __name__ == "__main__":
    main()
