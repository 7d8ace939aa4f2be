"""Child processes the tests run that are not servers (clients, the CLI, fakes):
their output collected, their end awaited (always bounded by the caller).
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessDone
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure


class Collected(ProcessProtocol):
    """Collects a child's stdout and stderr; ``ended`` fires with its exit code."""

    def __init__(self, on_line: Any = None) -> None:
        self.out = b""
        self.err = b""
        self.ended: Deferred[int | None] = Deferred()
        self.first_line: Deferred[bytes] = Deferred()
        self.on_line = on_line

    def outReceived(self, data: bytes) -> None:
        self.out += data
        if b"\n" in self.out and not self.first_line.called:
            self.first_line.callback(self.out.split(b"\n", 1)[0])

    def errReceived(self, data: bytes) -> None:
        self.err += data

    def processEnded(self, reason: Failure) -> None:
        code = 0 if reason.check(ProcessDone) else getattr(reason.value, "exitCode", None)
        self.ended.callback(code)

    def kill(self) -> None:
        if not self.ended.called and self.transport is not None:
            self.transport.signalProcess("KILL")
