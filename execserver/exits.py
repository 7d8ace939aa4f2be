"""How a child process ended, decoded once from the reason Twisted reports.

``processExited``/``processEnded`` get a Failure wrapping
``ProcessDone`` (exit code 0) or ``ProcessTerminated`` (``exitCode``, or
``signal`` when a signal killed it). The server's ``ManagedProcess`` and the
test harness's server process read it through :func:`exit_status`.
"""

from __future__ import annotations

import signal as _signal

import attrs
from twisted.internet.error import ProcessDone
from twisted.python.failure import Failure


@attrs.frozen
class ExitStatus:
    #: The exit code, when the process exited (None: killed by a signal, or unknown).
    code: int | None
    #: The signal that killed it, or None.
    signal: int | None

    @property
    def shell_code(self) -> int:
        """The code a shell reports: 128+N for signal N; -1 when unknown."""
        if self.signal is not None:
            return 128 + self.signal
        return self.code if self.code is not None else -1


def exit_status(reason: Failure) -> ExitStatus:
    value = reason.value
    signum = getattr(value, "signal", None)
    if signum is not None:
        return ExitStatus(None, signum)
    if isinstance(value, ProcessDone):
        return ExitStatus(0, None)
    return ExitStatus(getattr(value, "exitCode", None), None)


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15; ``SIG64`` for a number without a name."""
    try:
        return _signal.Signals(signum).name
    except ValueError:
        return f"SIG{signum}"
