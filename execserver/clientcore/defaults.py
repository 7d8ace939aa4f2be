"""Defaults every client applies the same way."""

from __future__ import annotations

import sys

#: ``env`` sent by ``start``/``start_process`` when none is given.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

#: How long ``close()`` waits for the processes it terminated to exit.
CLOSE_WAIT_SECONDS = 10.0
#: How long a handle stays routable after ``process/exited`` when the server
#: never sends ``process/closed`` (a baseline server); then it is closed.
EXITED_LINGER_SECONDS = 30.0


def default_server_command() -> list[str]:
    """The local server a client launches over stdio: this interpreter, ``-m execserver``."""
    return [sys.executable, "-m", "execserver"]
