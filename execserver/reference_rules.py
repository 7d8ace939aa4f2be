"""The reference's current-dialect answers that the session gives Codex.

Small pure helpers (no state): the reference's one signal name and its
spawn-error wording (docs/protocol.md, "Dialects").
"""

from __future__ import annotations

import errno

from execserver.errors import RpcError
from execserver.spawn import SpawnError, os_error_text

#: The reference's one signal (``ProcessSignal::Interrupt``): Codex's Ctrl-C.
REFERENCE_SIGNAL = "interrupt"


def reference_signal(value: int | str | dict[str, None]) -> bool:
    """Whether ``value`` is the reference's form: ``"interrupt"`` or ``{"interrupt": null}``.

    Any other object is the reference's ``-32602``; other strings and
    numbers are this server's own names (:func:`parse_signal`).
    """
    if isinstance(value, dict):
        if list(value) != [REFERENCE_SIGNAL]:
            variant = next(iter(value), "")
            raise RpcError.invalid_params(
                f"unknown variant `{variant}`, expected `{REFERENCE_SIGNAL}`"
            )
        return True
    return value == REFERENCE_SIGNAL


#: The spawn errors the reference's current dialect words as the bare OS error.
_REWORDED_KINDS = frozenset(
    {
        "cwdNotFound",
        "cwdNotADirectory",
        "cwdPermissionDenied",
        "cwdUnusable",
        "spawnNotFound",
        "spawnPermissionDenied",
        "spawnExecFormatError",
        "spawnArgumentListTooLong",
    }
)


def reference_spawn_error(exc: SpawnError) -> RpcError:
    """A spawn error as the reference's current dialect words it.

    The reference reports the bare OS error (``No such file or directory (os
    error 2)``), naming neither the program nor the cwd, and kinds its
    ``io::ErrorKind``: not found is ``spawnNotFound`` (a missing cwd too),
    permission ``spawnPermissionDenied``; a cwd that fails otherwise (not a
    directory) is ``spawnFailed``. ``data.errno`` stays (an addition).
    """
    if exc.kind not in _REWORDED_KINDS or not exc.errno:
        return exc
    if exc.errno == errno.ENOENT:
        kind = "spawnNotFound"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        kind = "spawnPermissionDenied"
    elif exc.kind.startswith("cwd"):
        kind = "spawnFailed"
    else:
        kind = exc.kind
    return RpcError(exc.code, os_error_text(exc.errno), {"kind": kind, "errno": exc.errno})
