"""Decoding how a child ended from Twisted's reason (execserver.exits)."""

from __future__ import annotations

import signal

from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.python.failure import Failure

from execserver.exits import ExitStatus, exit_status, signal_name


def test_an_exit_code_a_signal_and_an_unknown_end() -> None:
    assert exit_status(Failure(ProcessDone(0))) == ExitStatus(0, None)
    assert exit_status(Failure(ProcessTerminated(3))) == ExitStatus(3, None)
    killed = exit_status(Failure(ProcessTerminated(None, signal.SIGKILL)))
    assert killed == ExitStatus(None, 9)
    assert killed.shell_code == 137
    assert exit_status(Failure(ProcessTerminated(3))).shell_code == 3
    assert exit_status(Failure(ProcessTerminated())).shell_code == -1


def test_signal_names() -> None:
    assert signal_name(signal.SIGTERM) == "SIGTERM"
    assert signal_name(200) == "SIG200"
