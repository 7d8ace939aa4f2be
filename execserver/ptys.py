"""The PTY caps: per session and server-wide, the server-wide one sized from the host.

A PTY is a host-wide resource (``/proc/sys/kernel/pty/max``, 4096 by
default): without a cap one session could take all of them and leave the
host's other programs (terminals, sshd) none. A ``tty: true``
``process/start`` beyond either cap is refused with ``-32600`` (the texts
below); a PTY is counted from its start until its process is closed (the
server holds the PTY's descriptor until then).
"""

from __future__ import annotations

from collections import Counter
from typing import Final, Protocol

from execserver.errors import RpcError

#: Where the kernel says how many PTYs the host may have.
PTY_MAX_PATH: Final = "/proc/sys/kernel/pty/max"
#: The host's PTYs the server may take by default: a quarter of them.
HOST_SHARE: Final = 4
#: The server-wide default when the host's figure cannot be read.
FALLBACK_SERVER_PTYS: Final = 1024
#: PTYs one session may hold at once by default.
DEFAULT_SESSION_PTYS: Final = 64


class _Stats(Protocol):
    ptys_open: int
    refused: Counter[str]


def host_pty_max(path: str = PTY_MAX_PATH) -> int | None:
    try:
        with open(path) as stream:
            value = int(stream.read().strip())
    except (OSError, ValueError):
        return None
    return value if value > 0 else None


def default_server_ptys(path: str = PTY_MAX_PATH) -> int:
    """A quarter of the host's ``pty/max`` (at least 1), or 1024 without ``/proc``."""
    host = host_pty_max(path)
    return FALLBACK_SERVER_PTYS if host is None else max(1, host // HOST_SHARE)


def check_start(session_ptys: int, stats: _Stats | None, per_session: int, server: int) -> None:
    """Refuse a PTY start beyond ``per_session`` or ``server`` (``-32600``)."""
    if session_ptys >= per_session:
        if stats is not None:
            stats.refused["session_ptys"] += 1
        raise RpcError.invalid_request(
            f"too many PTYs: this session already holds {session_ptys}, the limit set by "
            f"--max-ptys-per-session is {per_session}; close some tty processes first"
        )
    if stats is not None and stats.ptys_open >= server:
        stats.refused["server_ptys"] += 1
        raise RpcError.invalid_request(
            f"too many PTYs: the server already holds {stats.ptys_open}, the limit set by "
            f"--max-server-ptys is {server}; retry once other tty processes have closed"
        )
