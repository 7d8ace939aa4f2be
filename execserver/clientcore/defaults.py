"""Defaults every client applies the same way."""

from __future__ import annotations

import sys

#: ``env`` sent by ``start``/``start_process`` when none is given.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def default_server_command() -> list[str]:
    """The local server a client launches over stdio: this interpreter, ``-m execserver``."""
    return [sys.executable, "-m", "execserver"]
