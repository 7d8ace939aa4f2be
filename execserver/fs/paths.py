"""Paths and errors of the ``fs/*`` methods (no blocking work, no Twisted).

Paths arrive as absolute path strings; ``.`` and empty components are
dropped on arrival (:func:`absolute_path`) and ``..`` is resolved the way
the kernel resolves it (:func:`resolve_path`, which looks at the disk and
so runs off the reactor). Errors follow the reference's mapping: its
invalid-input errors are ``-32600`` with its message texts; every OS error
is ``-32603`` with the message Rust prints (``No such file or directory (os
error 2)``). Each error also carries ``data: {"kind": ..., "errno": ...}``
(``errno`` only for OS errors) so clients can branch without parsing text.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct
import urllib.parse
from collections.abc import Callable
from typing import Any, Final, NoReturn, ParamSpec, TypeVar

from execserver.errors import RpcError
from execserver.spawn.lookup import os_error_text

_P = ParamSpec("_P")
_T = TypeVar("_T")

#: Family named in "client must call initialize before using filesystem methods".
FAMILY: Final = "filesystem"
_RELATIVE_PATH_MESSAGE: Final = "AbsolutePathBuf deserialized without a base path"
#: (Public: the current dialect rewords it, app._current_error.)
RELATIVE_PATH_MESSAGE: Final = _RELATIVE_PATH_MESSAGE
NUL_MESSAGE: Final = "file name contained an unexpected NUL byte"
ROOT_MESSAGE: Final = "fs/remove refuses to remove the root directory `/`"
# --- errors -------------------------------------------------------------------

#: errno -> ``data.kind`` (Rust's io::ErrorKind names in camelCase).
_KINDS: Final[dict[int, str]] = {
    errno.ENOENT: "notFound",
    errno.EACCES: "permissionDenied",
    errno.EPERM: "permissionDenied",
    errno.EISDIR: "isADirectory",
    errno.ENOTDIR: "notADirectory",
    errno.EEXIST: "alreadyExists",
    errno.ENOSPC: "noSpace",
    errno.EDQUOT: "noSpace",
    errno.ENOTEMPTY: "directoryNotEmpty",
    errno.EROFS: "readOnlyFilesystem",
    errno.ELOOP: "filesystemLoop",
    errno.ENAMETOOLONG: "invalidFilename",
    errno.EXDEV: "crossesDevices",
    errno.EBUSY: "resourceBusy",
    errno.ETXTBSY: "executableFileBusy",
    errno.EFBIG: "fileTooLarge",
    errno.EMLINK: "tooManyLinks",
    errno.EINVAL: "invalidInput",
    errno.ENXIO: "noSuchDeviceOrAddress",
    errno.EIO: "io",
    errno.EAGAIN: "wouldBlock",
    # The server's descriptors ran out (processes hold most of them): the
    # same kind process/start reports, so a client can back off either way.
    errno.EMFILE: "tooManyOpenFiles",
    errno.ENFILE: "tooManyOpenFiles",
}


def os_error(exc: OSError) -> RpcError:
    """An OSError as the reference reports it: ``{strerror} (os error N)``.

    Like Rust's ``io::Error``, EINVAL is "invalid input" and so ``-32600``;
    every other OS error is ``-32603``.
    """
    code = exc.errno
    if code is None:
        return RpcError.internal(str(exc), {"kind": "other"})
    message = os_error_text(code)
    data = {"kind": _KINDS.get(code, "other"), "errno": code}
    if code == errno.EINVAL:
        return RpcError.invalid_request(message, data)
    return RpcError.internal(message, data)


def invalid(message: str, kind: str) -> RpcError:
    return RpcError.invalid_request(message, {"kind": kind})


def raise_errno(code: int) -> NoReturn:
    raise OSError(code, os.strerror(code))


# --- paths --------------------------------------------------------------------


FILE_URI_PREFIX: Final = "file://"
#: Bytes a path keeps as they are in a ``file://`` URI (RFC 3986 pchar and
#: ``/``); everything else, ``%``, ``#``, ``?``, spaces and every non-ASCII
#: byte included, is percent-encoded.
_URI_SAFE: Final = "/!$&'()*+,;=:@-._~"


def path_to_uri(path: str) -> str:
    """``file://`` URI of an absolute path (any bytes: surrogate-escaped names too)."""
    raw = path.encode("utf-8", "surrogateescape")
    return FILE_URI_PREFIX + urllib.parse.quote_from_bytes(raw, safe=_URI_SAFE)


def _relative(value: str, field: str) -> RpcError:
    return RpcError.invalid_params(
        _RELATIVE_PATH_MESSAGE, {"kind": "relativePath", "field": field, "path": value}
    )


def uri_to_path(value: str, field: str = "path") -> str:
    """The native path a ``file://`` URI names; other strings are returned unchanged.

    The current reference dialect sends every path as a URI
    (``file:///tmp/a%20b``); the seeds' plain absolute paths stay valid.
    A host other than empty or ``localhost``, a path that is not absolute
    after the host, a query or a fragment is the error a relative path
    gets (``-32602``), so a client learns the same thing either way.
    Percent-escapes decode to bytes, so names that are not UTF-8 survive
    (as surrogate escapes, like ``os.fsdecode``).
    """
    if not value.startswith(FILE_URI_PREFIX):
        return value
    rest = value[len(FILE_URI_PREFIX) :]
    slash = rest.find("/")
    host = rest if slash < 0 else rest[:slash]
    if slash < 0 or host.lower() not in ("", "localhost") or "?" in rest or "#" in rest:
        raise _relative(value, field)
    if rest.isascii() and "%" not in rest:
        return rest[slash:]  # nothing to unescape or re-encode (the common case)
    raw = urllib.parse.unquote_to_bytes(rest[slash:])
    return raw.decode("utf-8", "surrogateescape")


def is_uri(value: str) -> bool:
    return value.startswith(FILE_URI_PREFIX)


#: Paths recently given to :func:`absolute_path` (at most this many, each
#: at most this long) and what they gave: a client asks about the same
#: paths again and again, and the checks and the URI's parse cost about
#: 1-2 µs of a 10-15 µs inline ``fs/getMetadata``.
_ABSOLUTE_CACHE_SIZE: Final = 1024
_ABSOLUTE_CACHE_LENGTH: Final = 512
_absolute_cache: dict[str, str] = {}


def absolute_path(value: str, field: str = "path") -> str:
    """Validate an absolute path or ``file://`` URI; drop ``.`` and empty components.

    No disk access. ``..`` components stay: :func:`resolve_path` resolves
    them on the pool as the kernel would. A leading ``..`` is dropped
    (``/..`` is ``/``). Relative paths are ``-32602``.
    """
    found = _absolute_cache.get(value)
    if found is not None:
        return found
    result = _absolute_path(value, field)
    if len(value) <= _ABSOLUTE_CACHE_LENGTH:
        if len(_absolute_cache) >= _ABSOLUTE_CACHE_SIZE:
            _absolute_cache.clear()
        _absolute_cache[value] = result
    return result


def _absolute_path(value: str, field: str) -> str:
    if value.startswith(FILE_URI_PREFIX):
        value = uri_to_path(value, field)
    if not value.startswith("/"):
        raise _relative(value, field)
    if "\0" in value:
        raise RpcError.invalid_request(NUL_MESSAGE, {"kind": "invalidInput", "field": field})
    if "//" not in value and "/." not in value and (value == "/" or value[-1] != "/"):
        return value  # already normal (the common case, without a split)
    parts: list[str] = []
    for part in value.split("/"):
        if part in ("", "."):
            continue
        if part == ".." and not parts:
            continue
        parts.append(part)
    return "/" + "/".join(parts)


def resolve_path(path: str) -> str:
    """Resolve the ``..`` components of an :func:`absolute_path` as the kernel does.

    Blocking (it looks at the disk): runs on the pool. Everything up to the
    last ``..`` is resolved physically, so ``..`` after a symlink is the
    parent of the link's target, exactly what ``open(2)`` would reach; a
    missing or non-directory component before a ``..`` is the kernel's
    error (``notFound``, ``notADirectory``). What follows the last ``..``
    is kept as given, so a symlink there is still seen as a symlink
    (``fs/remove`` unlinks it, ``getMetadata`` reports ``isSymlink``).
    Paths without ``..`` are returned unchanged, without a system call.
    """
    parts = path.split("/")
    try:
        last = len(parts) - 1 - parts[::-1].index("..")
    except ValueError:
        return path
    head = "/".join(parts[: last + 1])
    os.stat(head)  # the kernel's own errors for an unreachable prefix
    resolved = os.path.realpath(head)
    rest = "/".join(parts[last + 1 :])
    if not rest:
        return resolved
    return resolved.rstrip("/") + "/" + rest


def lossy(name: str) -> str:
    """A directory entry name as valid UTF-8 (invalid bytes become U+FFFD)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return name


# --- creation time (statx) ----------------------------------------------------

_STATX_BTIME: Final = 0x800
_AT_FDCWD: Final = -100


def libc_function(
    name: str, argtypes: list[Any] | None = None, restype: Any = None, *, use_errno: bool = True
) -> Any:
    """libc's function ``name``, or None where this libc has none.

    With ``argtypes`` its argument and result types are declared (an
    errno-capturing library by default); without, it is called as it is.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=use_errno)
        func = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    if argtypes is not None:
        func.argtypes = argtypes
        func.restype = restype
    return func


def _load_bare_statx() -> Any:
    """``statx`` without argument types or errno capture, for :func:`lstatx`
    and :func:`created_at_ms` (neither reads errno).

    Each declared argument type costs a conversion per call (about 1 µs of
    an inline ``fs/getMetadata``'s 20-25); the arguments passed are plain
    ``int``s, a ``bytes`` name and a ctypes buffer, which ctypes passes as
    they are. A failure is raised by ``os.lstat`` instead of from errno.
    """
    return libc_function("statx", use_errno=False)


_bare_statx: Final = _load_bare_statx()


def created_at_ms(path: str) -> int:
    """Birth time in ms since the epoch, or 0 where the platform has none.

    Python 3.11 does not expose ``statx``; the reference (Rust's
    ``Metadata::created``) reads ``stx_btime`` through it.
    """
    if _bare_statx is None:
        return 0
    buf = ctypes.create_string_buffer(256)
    if _bare_statx(_AT_FDCWD, os.fsencode(path), 0, _STATX_BTIME, buf) != 0:
        return 0
    mask = struct.unpack_from("=I", buf, 0)[0]
    if not mask & _STATX_BTIME:
        return 0
    seconds, nanos = struct.unpack_from("=qI", buf, 80)
    return unix_ms(seconds * 1_000_000_000 + nanos)


#: mask, mode, size, btime (s, ns), ctime (s, ns), mtime (s, ns) of a ``struct statx``.
_STATX_FIELDS: Final = struct.Struct("=I24xH10xQ32xqI4xqI4xqI")
_STATX_BASIC_AND_BTIME: Final = 0x7FF | _STATX_BTIME
_AT_SYMLINK_NOFOLLOW: Final = 0x100


def lstatx(path: str, buf: Any = None) -> tuple[int, int, int, int] | None:
    """``(mode, size, mtime_ns, birth_ms)`` of ``path`` itself, with one ``statx``.

    The symlink itself if ``path`` is one (like ``lstat``); ``birth_ms`` is
    0 where not recorded. None if ``statx`` is not available; an OSError as
    ``lstat`` would raise it. ``buf`` (256 bytes) may be reused by one thread.
    """
    if _bare_statx is None:
        return None
    if buf is None:
        buf = ctypes.create_string_buffer(256)
    name = path.encode("utf-8", "surrogateescape")  # os.fsencode, without its checks
    if _bare_statx(_AT_FDCWD, name, _AT_SYMLINK_NOFOLLOW, _STATX_BASIC_AND_BTIME, buf):
        # The error, as lstat reports it (None if lstat now succeeds: the
        # caller then uses lstat).
        os.lstat(path)
        return None
    mask, mode, size, bsec, bnsec, _, _, msec, mnsec = _STATX_FIELDS.unpack_from(buf)
    birth = unix_ms(bsec * 1_000_000_000 + bnsec) if mask & _STATX_BTIME else 0
    return mode, size, msec * 1_000_000_000 + mnsec, birth


def unix_ms(ns: int) -> int:
    return ns // 1_000_000 if ns >= 0 else 0


#: ``data.kind`` of requests refused because the server is out of a shared
#: resource for now (a pool thread, reply budget): retrying later may work.
BUSY_KIND: Final = "busy"


def closed_error() -> RpcError:
    # Never sent (the connection is gone); an RpcError keeps it out of the log.
    return invalid("the connection closed before the request ran", "cancelled")


def oserrors(func: Callable[_P, _T]) -> Callable[_P, _T]:
    """Turn OSErrors (and NUL bytes in names) of a blocking operation into RpcErrors."""

    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return func(*args, **kwargs)
        except OSError as exc:
            raise os_error(exc) from None
        except ValueError as exc:
            if "null" in str(exc):
                raise invalid(NUL_MESSAGE, "invalidInput") from None
            raise

    wrapper.__name__ = func.__name__
    wrapper.__doc__ = func.__doc__
    return wrapper


def not_regular(method: str) -> RpcError:
    return invalid(f"{method} only supports regular files", "notRegularFile")


def too_large(limit: int) -> RpcError:
    return invalid(f"file is too large to read: limit is {limit} bytes", "fileTooLarge")
