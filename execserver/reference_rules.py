"""The reference's current-dialect answers that the session gives Codex.

Small pure helpers (no state): the reference's one signal name and its
spawn-error wording (docs/protocol.md, "Dialects").
"""

from __future__ import annotations

import errno
import re

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


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


def reference_path_error(value: str, field: str, *, process_cwd: bool = False) -> RpcError | None:
    """The current reference's refusal of a path that is not a usable ``file://`` URI.

    Its texts, as codex exec-server 0.171.0 words them (docs/protocol.md,
    "Dialects"): no scheme, another scheme, a query, a fragment (in this
    order), another host (``-32600``; ``-32602`` for a ``cwd``, worded
    differently for process/start's: ``process_cwd``). ``None`` where the
    reference would take the value (``file:/x``, ``file:x``): this server's
    own relative-path error stays.
    ``data`` is this server's (``relativePath``, the field, the value).
    """
    data = {"kind": "relativePath", "field": field, "path": value}
    scheme = _SCHEME.match(value)
    if scheme is None:
        return RpcError.invalid_params("invalid URI: relative URL without a base", data)
    if scheme[1].lower() != "file":
        return RpcError.invalid_params(f"unsupported path URI scheme `{scheme[1].lower()}`", data)
    if "?" in value:
        return RpcError.invalid_params("query parameters are not allowed in path URIs", data)
    if "#" in value:
        return RpcError.invalid_params("fragments are not allowed in path URIs", data)
    rest = value[scheme.end() :]
    if rest.startswith("//") and rest[2:].split("/", 1)[0].lower() not in ("", "localhost"):
        invalid = f"'{value}' is invalid on 'linux'"
        if process_cwd:
            return RpcError.invalid_params(
                f"cwd URI `{value}` is not valid on this exec-server host: {invalid}", data
            )
        if field == "cwd":  # environmentConfig/read's, capabilities/discoverV2's
            return RpcError.invalid_params(invalid, data)
        return RpcError.invalid_request(invalid, data)
    return None
