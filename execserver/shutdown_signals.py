"""A second SIGTERM or SIGINT while the server shuts down: logged, not a second stop.

The reactor's own handlers (installed by ``reactor.run``) call
``reactor.stop`` on every SIGTERM/SIGINT; a second one during the
shutdown's grace makes that raise ``ReactorNotRunning``, which Twisted logs
at critical level. :class:`RepeatSignals` wraps those handlers once the
reactor runs: the first signal goes to the reactor as before, any later one
(or any signal once the shutdown began another way) is logged as a warning
and otherwise ignored: the shutdown already under way continues with its
bounds (docs/operations.md, "Signals and shutdown"). A supervisor that must
stop the server sooner sends SIGKILL.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType
from typing import Any

from twisted.logger import Logger

log = Logger()

#: The signals whose repetition is absorbed.
SIGNALS = (signal.SIGTERM, signal.SIGINT)

Handler = Callable[[int, FrameType | None], Any]


class RepeatSignals:
    """Forward the first stop signal to the reactor's handler; log the others."""

    def __init__(
        self,
        call_from_thread: Callable[..., object],
        getsignal: Callable[[int], Any] = signal.getsignal,
        setsignal: Callable[[int, Handler], object] = signal.signal,
    ) -> None:
        self._call_from_thread = call_from_thread
        self._getsignal = getsignal
        self._setsignal = setsignal
        self._originals: dict[int, Handler] = {}
        #: The shutdown began (a signal forwarded, or :meth:`shutting_down`).
        self.stopping = False
        #: Signals absorbed so far.
        self.repeated = 0

    def install(self) -> None:
        """Wrap the handlers in place now (call once the reactor runs and has its own)."""
        for number in SIGNALS:
            current = self._getsignal(number)
            if callable(current):
                self._originals[number] = current
                self._setsignal(number, self._received)

    def shutting_down(self) -> None:
        """The shutdown began (e.g. ``reactor.stop`` called): later signals are repeats."""
        self.stopping = True

    def _received(self, number: int, frame: FrameType | None) -> None:
        if not self.stopping:
            self.stopping = True
            self._originals[number](number, frame)
            return
        # (A signal handler runs between two bytecodes: the log call waits
        # for the reactor's thread, like the reactor's own handlers do.)
        self._call_from_thread(self._repeated, number)

    def _repeated(self, number: int) -> None:
        self.repeated += 1
        log.warn(
            "received {name} again while shutting down: ignored, the shutdown under way "
            "continues (send SIGKILL to stop at once)",
            name=signal.Signals(number).name,
        )
