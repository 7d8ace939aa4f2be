"""The base of every server process a test starts on the reactor.

:class:`ServerProcessBase` owns what the stdio (``ServerProcess``,
``tests/support/stdio_server.py``) and WebSocket (``WsServerProcess``,
``tests/support/ws_harness.py``) harnesses used to do each on their own:
launching the command (by default the installed ``exec-server`` console
script, never this checkout's code), capturing stderr, recording the exit
status, registering for the teardown checks of ``tests/support/server_checks.py``
(a traceback, an "Unhandled error" or an error-level line in stderr, or an
undeclared exit status, fails the test), and stopping it: asked politely
first (each subclass says how), then SIGKILL, every wait bounded, the process
always reaped.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any, Self

import pytest_twisted
from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

from execserver.exits import exit_status as process_exit_status
from tests.support.harness import DEFAULT_TIMEOUT, REPO_ROOT, observe, reactor, with_timeout
from tests.support.server_checks import ServerChecks


class ServerProcessBase(ServerChecks, ProcessProtocol):
    """A server child on the reactor: launched, its stderr kept, its end recorded and checked.

    Subclasses implement :meth:`_request_stop` (how the server is asked to
    end: close its stdin, send SIGTERM) and may extend :meth:`_process_ended`.
    """

    def __init__(self) -> None:
        self.stderr = b""
        self.ended: Deferred[int | None] = Deferred()
        self.exit_code: int | None = None
        self.exit_signal: int | None = None
        self.pid: int | None = None

    # --- starting -----------------------------------------------------------------------

    def launch(
        self,
        argv: Sequence[str],
        *,
        env: dict[str, str],
        path: str | os.PathLike[str] | None = None,
        description: str | None = None,
    ) -> Self:
        """Spawn ``argv`` with exactly ``env`` (use ``server_env()`` for our server),
        in ``path`` (the checkout's root by default), and register it for the
        teardown checks under ``description`` (default: the command line)."""
        transport = reactor.spawnProcess(
            self, argv[0], list(argv), env=env, path=str(path if path is not None else REPO_ROOT)
        )
        self.pid = transport.pid
        self._init_checks(f"{description or ' '.join(argv)} (pid {self.pid})")
        return self

    # --- the process's side -------------------------------------------------------------

    def errReceived(self, data: bytes) -> None:
        self.stderr += data

    def processEnded(self, reason: Failure) -> None:
        status = process_exit_status(reason)
        self.exit_code = status.code
        self.exit_signal = status.signal
        self._process_ended()
        self.ended.callback(self.exit_code)

    def _process_ended(self) -> None:
        """What a subclass does once the process has ended (before ``ended`` fires)."""

    # --- ending -------------------------------------------------------------------------

    def _request_stop(self) -> None:
        raise NotImplementedError

    def exited(self) -> Deferred[Any]:
        """A Deferred firing with the exit code once the process has ended (``ended`` untouched)."""
        return observe(self.ended)

    async def stop(self, timeout: float = DEFAULT_TIMEOUT) -> int | None:
        """Ask the server to end and wait; SIGKILL (a teardown failure) if it does not in time."""
        if not self.ended.called:
            self._request_stop()
            try:
                await with_timeout(self.exited(), timeout, "server exit")
            except TimeoutError:
                self.harness_killed = True
                self._signal("KILL")
                await with_timeout(self.exited(), timeout, "server exit after SIGKILL")
                raise
        return self.exit_code

    def signal(self, sig: str) -> None:
        """Send ``sig`` on purpose: the server may then die of it."""
        self._signalled_by_test(sig)
        self._signal(sig)

    def kill(self, sig: str = "KILL") -> None:
        """:meth:`signal`, SIGKILL by default."""
        self.signal(sig)

    def _signal(self, sig: str) -> None:
        with contextlib.suppress(ProcessExitedAlready, AttributeError):
            self.transport.signalProcess(sig)  # type: ignore[union-attr]

    # --- teardown checks ----------------------------------------------------------------

    def stderr_bytes(self) -> bytes:
        return self.stderr

    def exit_status(self) -> tuple[int | None, int | None] | None:
        return (self.exit_code, self.exit_signal) if self.ended.called else None

    def stop_for_teardown(self) -> None:
        pytest_twisted.blockon(Deferred.fromCoroutine(self.stop()))
