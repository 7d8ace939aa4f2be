"""The seven ``fs/*`` methods, with the reference's behaviour and error texts.

Paths arrive as absolute path strings; ``.`` and empty components are
dropped on arrival and ``..`` is resolved on the pool the way the kernel
resolves it (after a symlink, ``..`` is the parent of the link's target;
see :func:`resolve_path`); a relative path is ``-32602``. ``fs/remove``
refuses the root directory in every spelling. The blocking work runs on a
small dedicated thread pool (:class:`PoolRunner`), never on the reactor
thread; because the reactor thread changes directory around
``posix_spawn``, everything here works on absolute paths only.

No operation may hold a pool thread without bound: nothing non-regular
(FIFO, device, socket) is ever opened for reading or writing (files are
opened ``O_NONBLOCK`` and checked with ``fstat`` before any read or write,
directories ``O_DIRECTORY``); a request waits for
a free thread at most ``fs_wait_timeout_ms``; and the pool reports itself
wedged (``/readyz``) when every thread has been busy on one operation for
longer than ``fs_stall_ms``. ``fs/readFile`` replies are charged to a
:class:`ReplyBudget` (per connection and per server) from before the file
is read until the transport has sent them.

Errors follow the reference's mapping: its invalid-input errors are
``-32600`` with its message texts; every OS error is ``-32603`` with the
message Rust prints (``No such file or directory (os error 2)``). Each error
also carries ``data: {"kind": ..., "errno": ...}`` (``errno`` only for OS
errors) so clients can branch without parsing text.

Large payloads never sit in memory more than about twice: ``fs/readFile``
reads the file into one buffer and base64-encodes it, in slices (so the GIL
is released regularly), into the pre-rendered result; ``fs/writeFile``
decodes base64 straight from the request line into one buffer.
"""

from __future__ import annotations

import binascii
import contextlib
import ctypes
import ctypes.util
import errno
import os
import secrets
import stat
import struct
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, NoReturn, ParamSpec, TypeVar

import attrs
import msgspec
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.interfaces import IDelayedCall
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool

from execserver import protocol as p
from execserver.errors import RpcError

if TYPE_CHECKING:
    from execserver.dispatcher import Connection, Dispatcher

_P = ParamSpec("_P")
_T = TypeVar("_T")

#: Threads doing blocking file I/O (per server).
FS_THREADS: Final = 4
#: Family named in "client must call initialize before using filesystem methods".
FAMILY: Final = "filesystem"
#: Slice of a large payload base64-encoded or decoded per C call; a multiple of
#: 3 and 4 so slices join seamlessly. Small enough that other threads (the
#: reactor) get the GIL between slices.
_B64_SLICE: Final = 3 * 1024 * 1024
_RELATIVE_PATH_MESSAGE: Final = "AbsolutePathBuf deserialized without a base path"
_NUL_MESSAGE: Final = "file name contained an unexpected NUL byte"
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
    message = f"{os.strerror(code)} (os error {code})"
    data = {"kind": _KINDS.get(code, "other"), "errno": code}
    if code == errno.EINVAL:
        return RpcError.invalid_request(message, data)
    return RpcError.internal(message, data)


def _invalid(message: str, kind: str) -> RpcError:
    return RpcError.invalid_request(message, {"kind": kind})


def _raise_errno(code: int) -> NoReturn:
    raise OSError(code, os.strerror(code))


# --- paths --------------------------------------------------------------------


def absolute_path(value: str, field: str = "path") -> str:
    """Validate an absolute path; drop ``.`` and empty components (no disk access).

    ``..`` components stay: :func:`resolve_path` resolves them on the pool
    as the kernel would. A leading ``..`` is dropped (``/..`` is ``/``).
    Relative paths are ``-32602``.
    """
    if not value.startswith("/"):
        raise RpcError.invalid_params(
            _RELATIVE_PATH_MESSAGE, {"kind": "relativePath", "field": field, "path": value}
        )
    if "\0" in value:
        raise RpcError.invalid_request(_NUL_MESSAGE, {"kind": "invalidInput", "field": field})
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


def _lossy(name: str) -> str:
    """A directory entry name as valid UTF-8 (invalid bytes become U+FFFD)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return name


# --- creation time (statx) ----------------------------------------------------

_STATX_BTIME: Final = 0x800
_AT_FDCWD: Final = -100


def _load_statx() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        func = libc.statx
    except (OSError, AttributeError):
        return None
    func.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
    func.restype = ctypes.c_int
    return func


_statx: Final = _load_statx()


def created_at_ms(path: str) -> int:
    """Birth time in ms since the epoch, or 0 where the platform has none.

    Python 3.11 does not expose ``statx``; the reference (Rust's
    ``Metadata::created``) reads ``stx_btime`` through it.
    """
    if _statx is None:
        return 0
    buf = ctypes.create_string_buffer(256)
    if _statx(_AT_FDCWD, os.fsencode(path), 0, _STATX_BTIME, buf) != 0:
        return 0
    mask = struct.unpack_from("=I", buf, 0)[0]
    if not mask & _STATX_BTIME:
        return 0
    seconds, nanos = struct.unpack_from("=qI", buf, 80)
    return _unix_ms(seconds * 1_000_000_000 + nanos)


def _unix_ms(ns: int) -> int:
    return ns // 1_000_000 if ns >= 0 else 0


# --- base64 -------------------------------------------------------------------


_slice_encoder: Final = msgspec.json.Encoder()
_slice_decoder: Final = msgspec.json.Decoder(bytes)


def encode_read_response(data: bytes) -> msgspec.Raw:
    """``{"dataBase64": "..."}`` rendered in slices, ready to embed in a response.

    Produces exactly what ``msgspec.json.encode(FsReadFileResponse(data))``
    would (msgspec's base64 is about twice as fast as binascii's), without
    holding the GIL for the whole payload.
    """
    prefix = b'{"dataBase64":"'
    suffix = b'"}'
    size = len(data)
    out = bytearray(len(prefix) + 4 * ((size + 2) // 3) + len(suffix))
    out[: len(prefix)] = prefix
    pos = len(prefix)
    view = memoryview(data)
    for start in range(0, size, _B64_SLICE):
        piece = memoryview(_slice_encoder.encode(view[start : start + _B64_SLICE]))[1:-1]
        out[pos : pos + len(piece)] = piece
        pos += len(piece)
    out[pos:] = suffix
    return msgspec.Raw(out)


_ALPHABET: Final = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")
_PAD: Final = ord("=")


def rust_base64_error(text: bytes) -> str | None:
    """The message Rust's ``base64`` STANDARD engine gives for ``text``, or None.

    Mirrors its order of checks (an invalid trailing byte first, then the
    body quad by quad, then padding and trailing bits of the last quad) so
    ``fs/writeFile`` errors read exactly like the reference's.
    """
    size = len(text)
    rem = size % 4
    if rem == 1 and text[-1] != _PAD and text[-1] not in _ALPHABET:
        return f"Invalid symbol {text[-1]}, offset {size - 1}."
    body = max(0, size - rem - 4) if rem else max(0, size - 4)
    for index in range(body):
        if text[index] not in _ALPHABET:
            return f"Invalid symbol {text[index]}, offset {index}."
    padding = 0
    first_pad = 0
    morsels: list[int] = []
    last_symbol = 0
    for i, byte in enumerate(text[body:]):
        if byte == _PAD:
            if i % 4 < 2:
                where = first_pad if padding else i
                return f"Invalid symbol {byte}, offset {body + where}."
            if not padding:
                first_pad = i
            padding += 1
            continue
        if padding:
            return f"Invalid symbol {_PAD}, offset {body + first_pad}."
        if byte not in _ALPHABET:
            return f"Invalid symbol {byte}, offset {body + i}."
        last_symbol = byte
        morsels.append(_B64_VALUES[byte])
    if (padding + len(morsels)) % 4:
        return "Invalid padding"
    if len(morsels) % 4 in (2, 3):
        used_bits = (len(morsels) * 6) // 8 * 8
        bits = 0
        for morsel in morsels:
            bits = (bits << 6) | morsel
        spare = len(morsels) * 6 - used_bits
        if bits & ((1 << spare) - 1):
            return f"Invalid last symbol {last_symbol}, offset {body + len(morsels) - 1}."
    return None


_B64_VALUES: Final = {
    byte: value
    for value, byte in enumerate(
        b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    )
}


def _noncanonical_tail(tail: bytes, decoded: bytearray) -> bool:
    """Whether a padded last quad carries set bits that decoding drops (``YR==``)."""
    leftover = len(decoded) % 3
    if not tail.endswith(b"=") or not leftover:
        return False
    return binascii.b2a_base64(decoded[-leftover:], newline=False) != tail


def _invalid_base64(detail: str) -> RpcError:
    return _invalid(f"fs/writeFile requires valid base64 dataBase64: {detail}", "invalidBase64")


def decode_base64_field(raw: msgspec.Raw) -> bytearray:
    """Decode the JSON string ``raw`` (quotes included) as strict standard base64.

    The fast path decodes slices of the request line straight into one
    buffer. Anything unusual (JSON escapes, invalid base64) takes the slow
    path, which decodes the string once more to report the reference's error.
    """
    view = memoryview(raw).cast("B")
    text = view[1:-1]
    size = len(text)
    if size % 4 == 0 and view[0] == ord('"'):
        out = bytearray(size // 4 * 3)
        pos = 0
        try:
            step = _B64_SLICE // 3 * 4
            for start in range(0, size, step):
                piece = _slice_decoder.decode(b'"' + text[start : start + step] + b'"')
                out[pos : pos + len(piece)] = piece
                pos += len(piece)
        except msgspec.DecodeError:
            pass
        else:
            del out[pos:]
            if not _noncanonical_tail(bytes(text[-4:]), out):
                return out
            # Non-canonical trailing bits: the slow path names them.
    try:
        value = msgspec.json.decode(raw, type=str)
    except msgspec.ValidationError as exc:
        raise RpcError.invalid_params(f"{exc} - at `$.dataBase64`") from None
    encoded = value.encode("utf-8")
    problem = rust_base64_error(encoded)
    if problem is not None:
        raise _invalid_base64(problem)
    return bytearray(binascii.a2b_base64(encoded, strict_mode=True))


# --- blocking operations (run on the pool) ------------------------------------


def _oserrors(func: Callable[_P, _T]) -> Callable[_P, _T]:
    """Turn OSErrors (and NUL bytes in names) of a blocking operation into RpcErrors."""

    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return func(*args, **kwargs)
        except OSError as exc:
            raise os_error(exc) from None
        except ValueError as exc:
            if "null" in str(exc):
                raise _invalid(_NUL_MESSAGE, "invalidInput") from None
            raise

    wrapper.__name__ = func.__name__
    wrapper.__doc__ = func.__doc__
    return wrapper


def _not_regular(method: str) -> RpcError:
    return _invalid(f"{method} only supports regular files", "notRegularFile")


def _too_large(limit: int) -> RpcError:
    return _invalid(f"file is too large to read: limit is {limit} bytes", "fileTooLarge")


#: fs/readFile of a file up to this size takes one pool trip: its reply's
#: budget for this size is reserved up front, and the file read at once.
SMALL_READ_BYTES: Final = 64 * 1024


@_oserrors
def stat_for_read(path: str, limit: int, small: int = 0) -> tuple[str, int] | msgspec.Raw:
    """The first step of ``fs/readFile``: resolve, check, and size the file.

    ``stat`` never opens anything, so it cannot block on a FIFO or device.
    Returns the resolved path and the size to charge to the reply budget,
    or, for a file of at most ``small`` bytes, its rendered result at once.
    """
    path = resolve_path(path)
    st = os.stat(path)
    if stat.S_ISDIR(st.st_mode):
        _raise_errno(errno.EISDIR)
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular("fs/readFile")
    if st.st_size > limit:
        raise _too_large(limit)
    if st.st_size <= small:
        return read_file(path, limit)
    return path, st.st_size


@_oserrors
def read_file(path: str, limit: int) -> msgspec.Raw:
    path = resolve_path(path)
    # O_NONBLOCK: opening a FIFO must not wait for a writer, and a file that
    # blocks on read (/proc/kmsg) fails with EAGAIN instead of hanging a
    # pool thread; the descriptor stays non-blocking. O_NOCTTY: a terminal
    # never becomes the server's controlling terminal.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            _raise_errno(errno.EISDIR)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular("fs/readFile")
        if st.st_size > limit:
            raise _too_large(limit)
        # One read into one exactly sized buffer; files whose size lies
        # (/proc) or that grow or shrink while read are read to their end,
        # up to the limit.
        data = os.read(fd, st.st_size + 1)
        if len(data) != st.st_size:
            pieces = [data]
            total = len(data)
            while total <= limit:
                more = os.read(fd, 1024 * 1024)
                if not more:
                    break
                total += len(more)
                pieces.append(more)
            if total > limit:
                raise _too_large(limit)
            if len(pieces) > 1:
                data = b"".join(pieces)
            del pieces
    finally:
        os.close(fd)
    return encode_read_response(data)


def encoded_result_size(size: int) -> int:
    """Bytes of the ``{"dataBase64": ...}`` result for a file of ``size`` bytes."""
    return len(b'{"dataBase64":""}') + 4 * ((size + 2) // 3)


def _write_all(fd: int, data: bytearray) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view[: 1 << 30])
        view = view[written:]


def _open_regular_for_writing(path: str, mode: int, refusal: Callable[[], RpcError]) -> int:
    """Open ``path`` for writing (creating it), only if it is a regular file.

    ``O_NONBLOCK`` makes opening a FIFO or a device return at once, and the
    ``fstat`` check runs before anything could block or truncate: only a
    regular file is ever truncated and written (where ``O_NONBLOCK`` has no
    effect).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
    fd = os.open(path, flags, mode)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise refusal()
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_in_place(path: str, data: bytearray) -> None:
    # What the reference does (create or truncate, then write).
    fd = _open_regular_for_writing(path, 0o666, lambda: _not_regular("fs/writeFile"))
    try:
        os.ftruncate(fd, 0)
        _write_all(fd, data)
    finally:
        os.close(fd)


@_oserrors
def write_file(path: str, raw: msgspec.Raw) -> None:
    path = resolve_path(path)
    data = decode_base64_field(raw)
    del raw
    try:
        st: os.stat_result | None = os.stat(path)
    except FileNotFoundError:
        st = None  # a new file (or a dangling symlink to one)
    if st is not None and stat.S_ISDIR(st.st_mode):
        _raise_errno(errno.EISDIR)
    if st is not None and not stat.S_ISREG(st.st_mode):
        # FIFOs, devices, sockets: writing could block a pool thread for
        # ever (a FIFO whose reader never reads); refused like readFile.
        raise _not_regular("fs/writeFile")
    if st is not None and st.st_nlink > 1:
        # Hard links: renaming would detach this name from the others;
        # write through, as the reference.
        _write_in_place(path, data)
        return
    # A symlink at the path is followed: its final target is replaced.
    target = os.path.realpath(path)
    directory = os.path.dirname(target)
    temp = os.path.join(directory, f".exec-server-{secrets.token_hex(8)}.tmp")
    try:
        # Mode 0o666 lets the kernel apply the umask (and default ACLs) to a
        # new file exactly as for the reference's File::create.
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            _write_in_place(path, data)  # directory not writable
            return
        raise
    try:
        try:
            if st is not None:
                own = os.fstat(fd)
                if (own.st_uid, own.st_gid) != (st.st_uid, st.st_gid):
                    os.fchown(fd, st.st_uid, st.st_gid)
                os.fchmod(fd, stat.S_IMODE(st.st_mode))
        except PermissionError:
            # The owner cannot be kept (someone else's file we may write to):
            # replacing it would change who owns it; write through instead.
            os.close(fd)
            fd = -1
            os.unlink(temp)
            _write_in_place(path, data)
            return
        _write_all(fd, data)
        os.close(fd)
        fd = -1
        os.rename(temp, target)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


@_oserrors
def create_directory(path: str, recursive: bool) -> None:
    path = resolve_path(path)
    if recursive:
        os.makedirs(path, exist_ok=True)
    else:
        os.mkdir(path)


@_oserrors
def get_metadata(path: str) -> p.FsGetMetadataResponse:
    path = resolve_path(path)
    st = os.stat(path)
    is_symlink = stat.S_ISLNK(os.lstat(path).st_mode)
    return p.FsGetMetadataResponse(
        is_directory=stat.S_ISDIR(st.st_mode),
        is_file=stat.S_ISREG(st.st_mode),
        created_at_ms=created_at_ms(path),
        modified_at_ms=_unix_ms(st.st_mtime_ns),
        is_symlink=is_symlink,
        size=st.st_size,
    )


@_oserrors
def read_directory(path: str) -> p.FsReadDirectoryResponse:
    path = resolve_path(path)
    entries: list[p.FsReadDirectoryEntry] = []
    with os.scandir(path) as it:
        for entry in it:
            is_symlink = entry.is_symlink()
            try:
                st = os.stat(entry.path)
            except (FileNotFoundError, OSError) as exc:
                if exc.errno not in (errno.ENOENT, errno.ELOOP):
                    raise
                if not is_symlink:
                    continue  # removed while we listed
                is_dir = is_file = False  # a dangling or looping symlink
            else:
                is_dir = stat.S_ISDIR(st.st_mode)
                is_file = stat.S_ISREG(st.st_mode)
            entries.append(
                p.FsReadDirectoryEntry(
                    file_name=_lossy(entry.name),
                    is_directory=is_dir,
                    is_file=is_file,
                    is_symlink=is_symlink,
                )
            )
    return p.FsReadDirectoryResponse(entries)


def _refuse_root() -> NoReturn:
    raise _invalid(ROOT_MESSAGE, "rootDirectory")


def removal_target(path: str) -> tuple[str, os.stat_result | None]:
    """What ``fs/remove`` of ``path`` (from :func:`absolute_path`) would remove.

    The decision alone, with no removal: the resolved path and its
    ``lstat`` (None if it does not exist). Refuses the root directory in
    every spelling, like ``rm --preserve-root``: ``/`` after resolving
    ``..`` as the kernel does, and any directory that is the root's inode
    on the root's device (a bind mount of ``/``). A symlink is a symlink
    (it is unlinked, never followed), whatever it points at.
    """
    path = resolve_path(path)
    if path == "/":
        _refuse_root()
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path, None
    if stat.S_ISDIR(st.st_mode):
        root = os.stat("/")
        if (st.st_dev, st.st_ino) == (root.st_dev, root.st_ino):
            _refuse_root()
    return path, st


@_oserrors
def remove(path: str, recursive: bool, force: bool) -> None:
    path, st = removal_target(path)
    if st is None:
        if force:
            return
        _raise_errno(errno.ENOENT)
    if stat.S_ISDIR(st.st_mode):
        if recursive:
            _remove_tree(path, st)
        else:
            os.rmdir(path)
    else:
        os.unlink(path)


_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _same_inode(st: os.stat_result, other: os.stat_result) -> bool:
    return (st.st_dev, st.st_ino) == (other.st_dev, other.st_ino)


def _remove_tree(path: str, expected: os.stat_result) -> None:
    """Remove a directory tree, like Rust's ``remove_dir_all`` / ``shutil.rmtree``.

    Walks with directory descriptors (``O_NOFOLLOW``, ``*at`` calls), so a
    symlink is unlinked, never followed, even if swapped in meanwhile; and
    entries that vanish meanwhile are fine. Unlike them, it never enters the
    root directory: a bind mount of ``/`` inside the tree stops the removal
    with the ``rootDirectory`` error (what was removed before it stays
    removed; the root's contents are untouched).
    """
    root = os.stat("/")
    fd = os.open(path, _DIR_FLAGS)
    try:
        if not _same_inode(os.fstat(fd), expected):
            _raise_errno(errno.ENOENT)  # replaced since it was looked at
        _remove_contents(fd, root)
    finally:
        os.close(fd)
    os.rmdir(path)


def _remove_contents(dir_fd: int, root: os.stat_result) -> None:
    with os.scandir(dir_fd) as it:
        entries = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in it]
    for name, is_dir in entries:
        if is_dir and _remove_subtree(dir_fd, name, root):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)


def _remove_subtree(dir_fd: int, name: str, root: os.stat_result) -> bool:
    """Remove the directory ``name``; False if it is no longer a directory."""
    try:
        child = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return True
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):
            return False  # replaced by a file or a symlink meanwhile: unlink that
        raise
    try:
        if _same_inode(os.fstat(child), root):
            _refuse_root()
        _remove_contents(child, root)
    finally:
        os.close(child)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(name, dir_fd=dir_fd)
    return True


@_oserrors
def copy(source: str, destination: str, recursive: bool) -> None:
    source = resolve_path(source)
    destination = resolve_path(destination)
    st = os.lstat(source)
    if stat.S_ISDIR(st.st_mode):
        if not recursive:
            raise _invalid(
                "fs/copy requires recursive: true when sourcePath is a directory",
                "recursiveRequired",
            )
        if _is_same_or_descendant(source, destination):
            raise _invalid(
                "fs/copy cannot copy a directory to itself or one of its descendants",
                "copyIntoItself",
            )
        _copy_tree(source, destination, st.st_mode)
    elif stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(source), destination)
    elif stat.S_ISREG(st.st_mode):
        _copy_file(source, destination)
    else:
        raise _unsupported_copy()


def _is_same_or_descendant(source: str, destination: str) -> bool:
    src = os.path.realpath(source, strict=True)
    # The reference resolves the longest existing prefix of the (lexically
    # normalised) destination and appends the rest.
    existing = destination
    suffix: list[str] = []
    while not os.path.exists(existing) and existing != "/":
        existing, name = os.path.split(existing)
        suffix.append(name)
    resolved = os.path.join(os.path.realpath(existing, strict=True), *reversed(suffix))
    return src in ("/", resolved) or resolved.startswith(src + "/")


def _copy_tree(source: str, target: str, mode: int) -> None:
    created = not os.path.isdir(target)
    os.makedirs(target, exist_ok=True)
    with os.scandir(source) as it:
        for entry in it:
            child = os.path.join(target, entry.name)
            if entry.is_dir(follow_symlinks=False):
                _copy_tree(entry.path, child, entry.stat(follow_symlinks=False).st_mode)
            elif entry.is_file(follow_symlinks=False):
                _copy_file(entry.path, child)
            elif entry.is_symlink():
                os.symlink(os.readlink(entry.path), child)
            # Other types (FIFOs, sockets, devices) are skipped, as the reference does.
    if created:
        # Applied last so a read-only source directory can still be filled.
        os.chmod(target, stat.S_IMODE(mode))


_UNSUPPORTED_COPY: Final = "fs/copy only supports regular files, directories, and symlinks"


def _unsupported_copy() -> RpcError:
    return _invalid(_UNSUPPORTED_COPY, "unsupportedFileType")


def _copy_file(source: str, target: str) -> None:
    """Rust's ``std::fs::copy``: contents and permission bits; follows a symlink at target.

    Source and destination are opened ``O_NONBLOCK`` and must be regular
    files (checked with ``fstat`` before anything is read, truncated or
    written): a FIFO or a device at either end is refused, never waited on.
    """
    src = os.open(source, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        st = os.fstat(src)
        if not stat.S_ISREG(st.st_mode):
            raise _unsupported_copy()
        dst = _open_regular_for_writing(target, stat.S_IMODE(st.st_mode), _unsupported_copy)
        try:
            existing = os.fstat(dst)
            if (existing.st_dev, existing.st_ino) == (st.st_dev, st.st_ino):
                # The reference would truncate the file to nothing.
                raise _invalid("fs/copy cannot copy a file to itself", "sameFile")
            os.ftruncate(dst, 0)
            _copy_contents(src, dst)
            os.fchmod(dst, stat.S_IMODE(st.st_mode))
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _copy_contents(src: int, dst: int) -> None:
    try:
        while os.copy_file_range(src, dst, 1 << 30):
            pass
        return
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
    offset = os.lseek(src, 0, os.SEEK_CUR)
    os.lseek(dst, offset, os.SEEK_SET)
    while True:
        chunk = os.read(src, 1024 * 1024)
        if not chunk:
            return
        view = memoryview(chunk)
        while view:
            view = view[os.write(dst, view) :]


# --- the service --------------------------------------------------------------


class _WriteFileWire(msgspec.Struct, rename="camel"):
    """fs/writeFile params as received: ``dataBase64`` stays raw until decoded on the pool."""

    path: str
    data_base64: msgspec.Raw


Runner = Callable[..., "Deferred[Any]"]

#: ``data.kind`` of requests refused because the server is out of a shared
#: resource for now (a pool thread, reply budget): retrying later may work.
BUSY_KIND: Final = "busy"


def _closed() -> RpcError:
    # Never sent (the connection is gone); an RpcError keeps it out of the log.
    return _invalid("the connection closed before the request ran", "cancelled")


# --- the pool -------------------------------------------------------------------


@attrs.define(eq=False)
class _Job:
    func: Callable[..., Any]
    args: tuple[Any, ...]
    owner: object
    deferred: Deferred[Any]
    started_at: float | None = None
    timer: IDelayedCall | None = None


class PoolRunner:
    """Runs blocking calls on a dedicated, bounded pool tied to the reactor's life.

    The queue is kept here, not in Twisted's ThreadPool: at most ``threads``
    workers run, each taking the next queued job itself when it finishes one
    (no round trip through the reactor between jobs). So a queued job can be
    dropped when its connection closes, fails with a ``busy`` error after
    ``wait_timeout`` seconds without a free thread, and is counted for
    /metrics. The pool starts on first use and stops when the reactor shuts
    down.
    """

    def __init__(
        self,
        reactor: Any,
        threads: int = FS_THREADS,
        wait_timeout: float = 30.0,
        stall_after: float = 10.0,
        clock: Any = None,
    ) -> None:
        self._reactor = reactor
        self._clock = clock if clock is not None else reactor
        self.threads = threads
        self.wait_timeout = wait_timeout
        self.stall_after = stall_after
        self.pool = ThreadPool(minthreads=0, maxthreads=threads, name="exec-server-fs")
        # Shared with the workers: the queue, the running set, the worker count.
        self._lock = threading.Lock()
        self._queue: deque[_Job] = deque()
        self._running: set[_Job] = set()
        self._workers = 0
        self._stopped = False

    @property
    def running(self) -> int:
        """Operations on a pool thread now."""
        return len(self._running)

    @property
    def queued(self) -> int:
        """Operations waiting for a free pool thread."""
        return len(self._queue)

    def __call__(self, func: Callable[..., Any], *args: Any, owner: object = None) -> Deferred[Any]:
        job = _Job(func, args, owner, Deferred(lambda _: self._cancel(job)))
        if self._stopped:
            # A stopped ThreadPool cannot start again (the reactor is stopping).
            job.deferred.errback(_invalid("the server is shutting down", "shuttingDown"))
            return job.deferred
        with self._lock:
            start = self._workers < self.threads
            if start:
                self._workers += 1
                self._begin(job)
            else:
                self._queue.append(job)
        if start:
            if not self.pool.started:
                self.pool.start()
                self._reactor.addSystemEventTrigger("during", "shutdown", self.stop)
            self.pool.callInThread(self._work, job)
        else:
            job.timer = self._clock.callLater(self.wait_timeout, self._expire, job)
        return job.deferred

    def _begin(self, job: _Job) -> None:
        # (Called with the lock held.)
        job.started_at = self._clock.seconds()
        self._running.add(job)

    def _work(self, job: _Job | None) -> None:
        """A worker: run jobs until the queue is empty (on a pool thread)."""
        while job is not None:
            try:
                result: Any = job.func(*job.args)
                success = True
            except BaseException:
                result = Failure()
                success = False
            with self._lock:
                self._running.discard(job)
                following = self._queue.popleft() if self._queue and not self._stopped else None
                if following is None:
                    self._workers -= 1
                else:
                    self._begin(following)
            self._reactor.callFromThread(self._finished, job, success, result, following)
            job = following

    def _finished(self, job: _Job, success: bool, result: Any, following: _Job | None) -> None:
        if following is not None:
            self._stop_timer(following)
        if job.deferred.called:
            return  # cancelled while running: the result is dropped here
        if success:
            job.deferred.callback(result)
        else:
            job.deferred.errback(result)

    @staticmethod
    def _stop_timer(job: _Job) -> None:
        if job.timer is not None and job.timer.active():
            job.timer.cancel()
        job.timer = None

    def _unqueue(self, job: _Job) -> bool:
        with self._lock:
            if job in self._queue:
                self._queue.remove(job)
                return True
            return False

    def _cancel(self, job: _Job) -> None:
        if self._unqueue(job):
            self._stop_timer(job)
        job.deferred.errback(_closed())

    def _expire(self, job: _Job) -> None:
        job.timer = None
        if not self._unqueue(job):
            return  # a worker took it meanwhile
        waited = round(self.wait_timeout * 1000)
        job.deferred.errback(
            _invalid(
                f"filesystem busy: no worker thread became free within {waited} ms "
                f"(all {self.threads} are busy; --fs-wait-timeout-ms); retry later",
                BUSY_KIND,
            )
        )

    def cancel_owner(self, owner: object) -> None:
        """Drop the queued (not yet running) jobs of ``owner``."""
        with self._lock:
            mine = [job for job in self._queue if job.owner is owner]
        for job in mine:
            job.deferred.cancel()

    def stall_reason(self) -> str | None:
        """Why the pool is wedged, or None.

        Wedged: every thread has been busy on one operation for longer than
        ``stall_after`` seconds, so new requests would wait for them.
        """
        with self._lock:
            started = [job.started_at for job in self._running]
            waiting = len(self._queue)
        if len(started) < self.threads:
            return None
        now = self._clock.seconds()
        youngest = max(now if at is None else at for at in started)
        if now - youngest <= self.stall_after:
            return None
        return (
            f"filesystem pool wedged: all {self.threads} worker threads have been busy "
            f"on one operation each for over {self.stall_after:g} s; "
            f"{waiting} request(s) waiting"
        )

    def stop(self) -> None:
        self._stopped = True
        if self.pool.started:
            self.pool.stop()


def thread_pool_runner(reactor: Any, threads: int = FS_THREADS, **options: Any) -> PoolRunner:
    return PoolRunner(reactor, threads, **options)


def inline_runner(func: Callable[..., Any], *args: Any, owner: object = None) -> Deferred[Any]:
    """Run at once (for dispatchers built on a fake clock in unit tests)."""
    return maybeDeferred(func, *args)


# --- reply budget ---------------------------------------------------------------


@attrs.define(eq=False)
class Charge:
    """Bytes of one reply, held against a :class:`ReplyBudget` until released."""

    budget: ReplyBudget
    owner: object
    size: int
    released: bool = False

    def resize(self, size: int) -> None:
        """Charge what the reply actually took (a file may grow while read)."""
        if not self.released:
            self.budget._adjust(self, size)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.budget._adjust(self, 0)


@attrs.define(eq=False)
class _BudgetWait:
    owner: object
    size: int
    deferred: Deferred[Charge]
    timer: IDelayedCall | None = None


class ReplyBudget:
    """Bytes of replies being built or queued unsent, per connection and per server.

    :meth:`reserve` grants a :class:`Charge` once the reply fits both
    limits; requests wait in order (a request held back by the server-wide
    limit holds back all later ones; one held back by its own connection's
    limit holds back only that connection's later ones), at most
    ``wait_timeout`` seconds. A reply that could never fit fails at once.
    """

    def __init__(self, clock: Any, limit: int, connection_limit: int, wait_timeout: float) -> None:
        self._clock = clock
        self.limit = limit
        self.connection_limit = connection_limit
        self.wait_timeout = wait_timeout
        self.used = 0
        self._owned: dict[object, int] = {}
        self._waits: deque[_BudgetWait] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waits)

    def owned(self, owner: object) -> int:
        return self._owned.get(owner, 0)

    def try_reserve(self, owner: object, size: int) -> Charge | None:
        """A charge at once if nothing waits and ``size`` fits now, else None."""
        if self._waits or self.used + size > self.limit:
            return None
        if self.owned(owner) + size > self.connection_limit:
            return None
        self.used += size
        self._owned[owner] = self.owned(owner) + size
        return Charge(self, owner, size)

    def reserve(self, owner: object, size: int) -> Deferred[Charge]:
        if size > min(self.limit, self.connection_limit):
            flag, cap = (
                ("--connection-reply-budget-bytes", self.connection_limit)
                if self.connection_limit <= self.limit
                else ("--reply-budget-bytes", self.limit)
            )
            raise _invalid(
                f"fs/readFile reply of {size} bytes exceeds the reply budget "
                f"of {cap} bytes ({flag})",
                "replyTooLarge",
            )
        wait = _BudgetWait(owner, size, Deferred(lambda _: self._cancel(wait)))
        self._waits.append(wait)
        self._serve()
        if not wait.deferred.called:
            wait.timer = self._clock.callLater(self.wait_timeout, self._expire, wait)
        return wait.deferred

    def _serve(self) -> None:
        granted: list[tuple[_BudgetWait, Charge]] = []
        held: set[int] = set()
        for wait in list(self._waits):
            if id(wait.owner) in held:
                continue
            if self.owned(wait.owner) + wait.size > self.connection_limit:
                held.add(id(wait.owner))
                continue
            if self.used + wait.size > self.limit:
                break
            self._waits.remove(wait)
            self._stop_timer(wait)
            self.used += wait.size
            self._owned[wait.owner] = self.owned(wait.owner) + wait.size
            granted.append((wait, Charge(self, wait.owner, wait.size)))
        # Fired after the scan: callbacks may release or reserve again.
        for wait, charge in granted:
            wait.deferred.callback(charge)

    def _adjust(self, charge: Charge, size: int) -> None:
        delta = size - charge.size
        charge.size = size
        self.used += delta
        owned = self.owned(charge.owner) + delta
        if owned:
            self._owned[charge.owner] = owned
        else:
            self._owned.pop(charge.owner, None)
        if delta < 0:
            self._serve()

    @staticmethod
    def _stop_timer(wait: _BudgetWait) -> None:
        if wait.timer is not None and wait.timer.active():
            wait.timer.cancel()
        wait.timer = None

    def _cancel(self, wait: _BudgetWait) -> None:
        if wait in self._waits:
            self._waits.remove(wait)
        self._stop_timer(wait)
        wait.deferred.errback(_closed())
        self._serve()

    def _expire(self, wait: _BudgetWait) -> None:
        wait.timer = None
        if wait not in self._waits:
            return
        self._waits.remove(wait)
        waited = round(self.wait_timeout * 1000)
        wait.deferred.errback(
            _invalid(
                f"fs/readFile could not get {wait.size} bytes of reply budget within "
                f"{waited} ms (--fs-wait-timeout-ms): replies being built or not yet sent "
                f"hold {self.used} of {self.limit} bytes on this server and "
                f"{self.owned(wait.owner)} of {self.connection_limit} on this connection; "
                "retry later",
                BUSY_KIND,
            )
        )
        self._serve()

    def cancel_owner(self, owner: object) -> None:
        """Drop the waiting reservations of ``owner`` (its connection closed)."""
        for wait in [wait for wait in self._waits if wait.owner is owner]:
            wait.deferred.cancel()


@attrs.frozen
class Charged:
    """A result charged to the reply budget until the transport has sent it.

    The dispatcher releases :attr:`charge` once the transport's unsent bytes
    show the reply has left, or at once if the connection is closed.
    """

    result: msgspec.Raw
    charge: Charge


# --- the handlers ---------------------------------------------------------------


@attrs.define
class FileSystem:
    """The fs/* handlers; ``run(f, *args, owner=conn)`` runs blocking work off the reactor."""

    max_read_file_bytes: int
    run: Runner
    budget: ReplyBudget
    pool: PoolRunner | None = None

    def read_file(self, conn: Connection, params: p.FsReadFileParams) -> Deferred[Any]:
        path = absolute_path(params.path)
        limit = self.max_read_file_bytes
        # A small file is read in the first pool trip, against budget
        # reserved up front for its largest reply; larger ones are sized
        # first (stat only), so their reply's bytes are reserved before the
        # file is read: a reply that must wait holds no memory.
        early = self.budget.try_reserve(conn, encoded_result_size(SMALL_READ_BYTES))
        small = SMALL_READ_BYTES if early is not None else 0

        def sized(found: tuple[str, int] | msgspec.Raw) -> Any:
            if isinstance(found, msgspec.Raw):
                assert early is not None
                early.resize(len(found))
                return Charged(found, early)
            if early is not None:
                early.release()
            resolved, size = found
            reserved = self.budget.reserve(conn, encoded_result_size(size))
            return reserved.addCallback(build, resolved)

        def unsized(failure: Failure) -> Failure:
            if early is not None:
                early.release()
            return failure

        def build(charge: Charge, resolved: str) -> Deferred[Charged]:
            def built(raw: msgspec.Raw) -> Charged:
                charge.resize(len(raw))
                return Charged(raw, charge)

            def failed(failure: Failure) -> Failure:
                charge.release()
                return failure

            built_d: Deferred[Any] = self.run(read_file, resolved, limit, owner=conn)
            return built_d.addCallbacks(built, failed)

        first: Deferred[Any] = self.run(stat_for_read, path, limit, small, owner=conn)
        return first.addCallbacks(sized, unsized)

    def write_file(self, conn: Connection, params: _WriteFileWire) -> Deferred[Any]:
        path = absolute_path(params.path)
        raw = params.data_base64
        if bytes(memoryview(raw)[:1]) != b'"':
            # Not a string: the same -32602 a typed decode would give.
            try:
                msgspec.json.decode(raw, type=str)
            except msgspec.ValidationError as exc:
                raise RpcError.invalid_params(f"{exc} - at `$.dataBase64`") from None
        return self.run(write_file, path, raw, owner=conn).addCallback(lambda _: p.Empty())

    def create_directory(
        self, conn: Connection, params: p.FsCreateDirectoryParams
    ) -> Deferred[Any]:
        recursive = True if params.recursive is None else params.recursive
        path = absolute_path(params.path)
        return self.run(create_directory, path, recursive, owner=conn).addCallback(
            lambda _: p.Empty()
        )

    def get_metadata(self, conn: Connection, params: p.FsGetMetadataParams) -> Deferred[Any]:
        return self.run(get_metadata, absolute_path(params.path), owner=conn)

    def read_directory(self, conn: Connection, params: p.FsReadDirectoryParams) -> Deferred[Any]:
        return self.run(read_directory, absolute_path(params.path), owner=conn)

    def remove(self, conn: Connection, params: p.FsRemoveParams) -> Deferred[Any]:
        recursive = True if params.recursive is None else params.recursive
        force = True if params.force is None else params.force
        path = absolute_path(params.path)
        return self.run(remove, path, recursive, force, owner=conn).addCallback(lambda _: p.Empty())

    def copy(self, conn: Connection, params: p.FsCopyParams) -> Deferred[Any]:
        source = absolute_path(params.source_path, "sourcePath")
        destination = absolute_path(params.destination_path, "destinationPath")
        return self.run(copy, source, destination, params.recursive, owner=conn).addCallback(
            lambda _: p.Empty()
        )

    # --- state for the dispatcher, /readyz and /metrics ----------------------------

    def connection_closed(self, conn: Connection) -> None:
        """Drop ``conn``'s requests that have not started (nobody will read them)."""
        if self.pool is not None:
            self.pool.cancel_owner(conn)
        self.budget.cancel_owner(conn)

    def stall_reason(self) -> str | None:
        return self.pool.stall_reason() if self.pool is not None else None

    @property
    def running(self) -> int:
        return self.pool.running if self.pool is not None else 0

    @property
    def queued(self) -> int:
        return self.pool.queued if self.pool is not None else 0


def register(dispatcher: Dispatcher, run: Runner | None = None) -> FileSystem:
    """Add the seven fs/* routes to ``dispatcher``."""
    clock: Any = dispatcher.clock
    config = dispatcher.config
    pool: PoolRunner | None = None
    if run is None:
        real = hasattr(clock, "callFromThread") and hasattr(clock, "addSystemEventTrigger")
        if real:
            pool = thread_pool_runner(
                clock,
                wait_timeout=config.fs_wait_timeout_ms / 1000.0,
                stall_after=config.fs_stall_ms / 1000.0,
            )
            run = pool
        else:
            run = inline_runner
    elif isinstance(run, PoolRunner):
        pool = run
    budget = ReplyBudget(
        clock,
        config.reply_budget_bytes,
        config.connection_reply_budget_bytes,
        config.fs_wait_timeout_ms / 1000.0,
    )
    fs = FileSystem(config.max_read_file_bytes, run, budget, pool)
    dispatcher.add_route(p.FS_READ_FILE, p.FsReadFileParams, fs.read_file, FAMILY)
    dispatcher.add_route(p.FS_WRITE_FILE, _WriteFileWire, fs.write_file, FAMILY)
    dispatcher.add_route(
        p.FS_CREATE_DIRECTORY, p.FsCreateDirectoryParams, fs.create_directory, FAMILY
    )
    dispatcher.add_route(p.FS_GET_METADATA, p.FsGetMetadataParams, fs.get_metadata, FAMILY)
    dispatcher.add_route(p.FS_READ_DIRECTORY, p.FsReadDirectoryParams, fs.read_directory, FAMILY)
    dispatcher.add_route(p.FS_REMOVE, p.FsRemoveParams, fs.remove, FAMILY)
    dispatcher.add_route(p.FS_COPY, p.FsCopyParams, fs.copy, FAMILY)
    return fs
