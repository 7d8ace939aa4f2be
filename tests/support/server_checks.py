"""Teardown checks for every server process a test starts.

Each harness server class (``ServerProcess``, ``WsServerProcess``,
``RawServer``) registers itself here when it starts. The autouse fixtures in
``tests/conftest.py`` stop whatever a test left running and then fail the test
if the server's stderr holds a traceback, an "Unhandled error" or an
error-level log line, or if it exited with a status the test did not declare
(the default is 0; ``expect_exit`` declares another).

This module must not import the reactor: ``conftest.py`` imports it before
pytest-twisted installs one.
"""

from __future__ import annotations

import os
import re
import signal as signals
from collections.abc import Iterable

#: What the server writes to stderr only when something went wrong: Python's
#: traceback header, Twisted's "Unhandled error in Deferred" / "Unhandled
#: Error", the level tag ``textFileLogObserver`` gives error and critical
#: events (``[namespace#error]``), and the warnings that containment failed
#: (a process tree that outlived its SIGKILL, output held open by a member
#: beyond reach): each means a process may have escaped.
FORBIDDEN_STDERR = re.compile(
    rb"Traceback \(most recent call last\)|Unhandled error|#error\]|#critical\]"
    rb"|members still alive .* after SIGKILL|output still open after SIGKILL",
    re.IGNORECASE,
)

#: Every server started and not yet checked, oldest first.
STARTED: list[ServerChecks] = []
_serial = 0


def next_serial() -> int:
    """The serial number the next server to start will get."""
    return _serial


def signal_number(sig: int | str) -> int:
    if isinstance(sig, int):
        return sig
    name = sig if sig.startswith("SIG") else f"SIG{sig}"
    return int(getattr(signals, name))


class ServerChecks:
    """Exit-status and stderr bookkeeping shared by the harness server classes.

    Subclasses call :meth:`_init_checks` once the process exists, and
    implement :meth:`stderr_bytes`, :meth:`exit_status` and
    :meth:`stop_for_teardown`.
    """

    def _init_checks(self, description: str) -> None:
        self.description = description
        #: Accepted outcomes as (exit code, terminating signal) pairs.
        self.accepted_exits: set[tuple[int | None, int | None]] = {(0, None)}
        self.allowed_stderr: list[re.Pattern[bytes]] = []
        self.harness_killed = False
        self.checked = False
        global _serial
        self.serial = _serial
        _serial += 1
        STARTED.append(self)

    # --- what tests declare ------------------------------------------------------------

    def expect_exit(self, *codes: int, signal: int | str | None = None) -> None:
        """This test expects the server to end with one of ``codes`` (or ``signal``), not 0."""
        self.accepted_exits = {(code, None) for code in codes}
        if signal is not None:
            self.accepted_exits.add((None, signal_number(signal)))

    def allow_stderr(self, pattern: str) -> None:
        """Lines matching ``pattern`` are expected even though they look like errors."""
        self.allowed_stderr.append(re.compile(pattern.encode()))

    def _signalled_by_test(self, sig: int | str) -> None:
        # A signal the test sent on purpose may end the server: death by that
        # signal is then expected (a handled SIGTERM still has to exit 0).
        self.accepted_exits.add((None, signal_number(sig)))

    # --- what subclasses provide -------------------------------------------------------

    def stderr_bytes(self) -> bytes:
        raise NotImplementedError

    def exit_status(self) -> tuple[int | None, int | None] | None:
        """(exit code, signal) once the process has ended; None while it runs."""
        raise NotImplementedError

    def stop_for_teardown(self) -> None:
        """Stop the process (blocking until it has ended); called only if still running."""
        raise NotImplementedError

    # --- the check ---------------------------------------------------------------------

    def problems(self) -> list[str]:
        found: list[str] = []
        status = self.exit_status()
        if status is None:
            found.append("still running after teardown")
        elif self.harness_killed:
            found.append(f"did not exit in time and was killed (status {status})")
        elif status not in self.accepted_exits:
            code, sig = status
            how = f"exit code {code}" if sig is None else f"signal {sig}"
            wanted = sorted(self.accepted_exits, key=repr)
            found.append(f"ended with {how}; the test expects one of {wanted} (code, signal)")
        bad = [line for line in self.stderr_bytes().splitlines() if self._forbidden(line)]
        if bad:
            found.append(
                "stderr shows errors: " + " | ".join(b.decode(errors="replace") for b in bad[:5])
            )
        return found

    def _forbidden(self, line: bytes) -> bool:
        return bool(forbidden_lines(line, self.allowed_stderr))


def forbidden_lines(text: bytes, allowed: Iterable[re.Pattern[bytes]] = ()) -> list[bytes]:
    """The lines of ``text`` that show an error (and match none of ``allowed``)."""
    patterns = list(allowed)
    return [
        line
        for line in text.splitlines()
        if FORBIDDEN_STDERR.search(line) and not any(p.search(line) for p in patterns)
    ]


def check_local_server_logs(directory: str) -> list[str]:
    """Problems in the stderr copies of servers that clients launched themselves
    (``EXEC_SERVER_LOCAL_LOG_DIR``: the CLI's ``--stdio``, ``connect()``
    without a URL, ``spawn_local``); the files are removed once read."""
    report: list[str] = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        with open(path, "rb") as f:
            text = f.read()
        os.unlink(path)
        bad = forbidden_lines(text)
        if bad:
            shown = " | ".join(b.decode(errors="replace") for b in bad[:5])
            tail = text[-2000:].decode(errors="replace")
            report.append(
                f"local server {name} (launched by a client): stderr shows errors: {shown}"
                f"\n--- stderr tail ---\n{tail}"
            )
    return report


def check(servers: Iterable[ServerChecks]) -> list[str]:
    """Stop what still runs, then report every problem of ``servers`` (marking them checked)."""
    report: list[str] = []
    for server in servers:
        if server.checked:
            continue
        server.checked = True
        if server.exit_status() is None:
            try:
                server.stop_for_teardown()
            except Exception as exc:
                report.append(f"{server.description}: stopping it failed: {exc!r}")
        problems = server.problems()
        if problems:
            tail = server.stderr_bytes()[-2000:].decode(errors="replace")
            report.append(
                f"{server.description}: " + "; ".join(problems) + f"\n--- stderr tail ---\n{tail}"
            )
    STARTED[:] = [s for s in STARTED if not s.checked]
    return report
