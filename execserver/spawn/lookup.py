"""What a spawn request resolves to before any process exists: the executable and cwd.

The executable is looked up in the *child's* ``PATH`` (or
:data:`DEFAULT_PATH` when it has none), relative to its working directory, as
the reference's Rust ``Command`` does. Failures are :class:`SpawnError`, with
the reference's ``{strerror} (os error N)`` text and a ``data.kind``.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Final

from execserver.errors import RpcError

#: Glibc's search path when PATH is unset, as ``execvp`` uses (``confstr(_CS_PATH)``).
DEFAULT_PATH: Final = "/bin:/usr/bin"


class SpawnError(RpcError):
    """The process could not be started. ``-32603`` with ``data.kind``/``data.errno``."""

    def __init__(self, kind: str, err: int, message: str) -> None:
        super().__init__(-32603, message, {"kind": kind, "errno": err})
        self.kind = kind
        self.errno = err


def os_error_text(err: int) -> str:
    """An errno as the reference words it: ``No such file or directory (os error 2)``."""
    return f"{os.strerror(err)} (os error {err})"


_EXEC_KINDS: Final = {
    errno.ENOENT: "spawnNotFound",
    errno.EACCES: "spawnPermissionDenied",
    errno.EPERM: "spawnPermissionDenied",
    errno.ENOEXEC: "spawnExecFormatError",
    errno.E2BIG: "spawnArgumentListTooLong",
    errno.ENOTDIR: "spawnNotFound",
    errno.ELOOP: "spawnNotFound",
    errno.EISDIR: "spawnPermissionDenied",
}
_CWD_KINDS: Final = {
    errno.ENOENT: "cwdNotFound",
    errno.ENOTDIR: "cwdNotADirectory",
    errno.EACCES: "cwdPermissionDenied",
    errno.EPERM: "cwdPermissionDenied",
    errno.ELOOP: "cwdNotFound",
}


def exec_error(program: str, err: int) -> SpawnError:
    return SpawnError(
        _EXEC_KINDS.get(err, "spawnFailed"),
        err,
        f"failed to start `{program}`: {os_error_text(err)}",
    )


def cwd_error(cwd: str, err: int) -> SpawnError:
    return SpawnError(
        _CWD_KINDS.get(err, "cwdUnusable"),
        err,
        f"cannot use cwd `{cwd}`: {os_error_text(err)}",
    )


def check_cwd(cwd: str) -> None:
    """Raise the error ``chdir(cwd)`` would meet, without changing directory.

    For spawn paths that enter ``cwd`` in the child, where a failure would
    only show as an exit status.
    """
    try:
        st = os.stat(cwd)
    except OSError as exc:
        raise cwd_error(cwd, exc.errno or errno.ENOENT) from None
    if not stat.S_ISDIR(st.st_mode):
        raise cwd_error(cwd, errno.ENOTDIR)
    if not os.access(cwd, os.X_OK):
        raise cwd_error(cwd, errno.EACCES)


def resolve_executable(program: str, env: dict[str, str], cwd: str) -> str:
    """Find what ``execvp(program)`` would run with ``env``'s PATH from ``cwd``."""
    if "/" in program:
        candidate = os.path.join(cwd, program)
        err = _unusable(candidate)
        if err:
            raise exec_error(program, err)
        return candidate
    denied = 0
    for entry in env.get("PATH", DEFAULT_PATH).split(":"):
        candidate = os.path.join(cwd, entry, program)
        err = _unusable(candidate)
        if not err:
            return candidate
        if err in (errno.EACCES, errno.EISDIR):
            denied = err
    raise exec_error(program, denied or errno.ENOENT)


def _unusable(path: str) -> int:
    """0 if ``path`` is an executable file, else the errno exec would report.

    Cheap on a miss: a lookup along PATH misses once per entry before the hit.
    """
    try:
        st = os.stat(path)
    except OSError as exc:
        return exc.errno or errno.ENOENT
    if stat.S_ISDIR(st.st_mode):
        return errno.EISDIR
    if not os.access(path, os.X_OK):
        return errno.EACCES
    return 0
