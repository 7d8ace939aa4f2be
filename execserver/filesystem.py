"""The seven ``fs/*`` methods, with the reference's behaviour and error texts.

Paths arrive as absolute path strings and are normalised lexically (``.``
and ``..`` removed, like the reference's ``AbsolutePathBuf``); a relative
path is ``-32602``. The blocking work runs on a small dedicated thread pool,
never on the reactor thread; because the reactor thread changes directory
around ``posix_spawn``, everything here works on absolute paths only.

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
import shutil
import stat
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, NoReturn, ParamSpec, TypeVar

import attrs
import msgspec
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.threads import deferToThreadPool
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
    """Validate an absolute path and normalise it lexically, as the reference does.

    ``/a/./b/../c`` becomes ``/a/c`` without looking at the file system (so
    ``..`` after a symlink goes back to the link's directory, as in the
    reference). Relative paths are ``-32602``.
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
        if part == "..":
            if parts:
                parts.pop()
        else:
            parts.append(part)
    return "/" + "/".join(parts)


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


@_oserrors
def read_file(path: str, limit: int) -> msgspec.Raw:
    # O_NONBLOCK: opening a FIFO must not wait for a writer; O_NOCTTY: a
    # terminal never becomes the server's controlling terminal.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            _raise_errno(errno.EISDIR)
        if not stat.S_ISREG(st.st_mode):
            raise _invalid("fs/readFile only supports regular files", "notRegularFile")
        if st.st_size > limit:
            raise _invalid(f"file is too large to read: limit is {limit} bytes", "fileTooLarge")
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
                raise _invalid(f"file is too large to read: limit is {limit} bytes", "fileTooLarge")
            if len(pieces) > 1:
                data = b"".join(pieces)
            del pieces
    finally:
        os.close(fd)
    return encode_read_response(data)


def _write_all(fd: int, data: bytearray) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view[: 1 << 30])
        view = view[written:]


def _write_in_place(path: str, data: bytearray) -> None:
    # What the reference does (create or truncate, then write); O_NONBLOCK
    # keeps a FIFO without a reader from hanging a pool thread.
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
    fd = os.open(path, flags, 0o666)
    try:
        os.set_blocking(fd, True)
        _write_all(fd, data)
    finally:
        os.close(fd)


@_oserrors
def write_file(path: str, raw: msgspec.Raw) -> None:
    data = decode_base64_field(raw)
    del raw
    try:
        st: os.stat_result | None = os.stat(path)
    except FileNotFoundError:
        st = None  # a new file (or a dangling symlink to one)
    if st is not None and stat.S_ISDIR(st.st_mode):
        _raise_errno(errno.EISDIR)
    if st is not None and (not stat.S_ISREG(st.st_mode) or st.st_nlink > 1):
        # Devices, FIFOs: never replace the node. Hard links: renaming would
        # detach this name from the others; write through, as the reference.
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
    if recursive:
        os.makedirs(path, exist_ok=True)
    else:
        os.mkdir(path)


@_oserrors
def get_metadata(path: str) -> p.FsGetMetadataResponse:
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


@_oserrors
def remove(path: str, recursive: bool, force: bool) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if force:
            return
        raise
    if stat.S_ISDIR(st.st_mode):
        if recursive:
            shutil.rmtree(path, onerror=_rmtree_error(path))
        else:
            os.rmdir(path)
    else:
        os.unlink(path)


def _rmtree_error(top: str) -> Callable[[Any, str, Any], None]:
    def onerror(func: Any, path: str, exc_info: Any) -> None:
        exc = exc_info[1]
        # Like Rust's remove_dir_all: entries that vanish meanwhile are fine.
        if isinstance(exc, FileNotFoundError) and path != top:
            return
        raise exc

    return onerror


@_oserrors
def copy(source: str, destination: str, recursive: bool) -> None:
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
        raise _invalid(
            "fs/copy only supports regular files, directories, and symlinks",
            "unsupportedFileType",
        )


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


def _copy_file(source: str, target: str) -> None:
    """Rust's ``std::fs::copy``: contents and permission bits; follows a symlink at target."""
    src = os.open(source, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        st = os.fstat(src)
        if not stat.S_ISREG(st.st_mode):
            raise _invalid(
                "fs/copy only supports regular files, directories, and symlinks",
                "unsupportedFileType",
            )
        try:
            existing = os.stat(target)
        except FileNotFoundError:
            existing = None
        if existing is not None and (existing.st_dev, existing.st_ino) == (st.st_dev, st.st_ino):
            # The reference would truncate the file to nothing.
            raise _invalid("fs/copy cannot copy a file to itself", "sameFile")
        if existing is not None and stat.S_ISFIFO(existing.st_mode):
            raise _invalid(
                "fs/copy only supports regular files, directories, and symlinks",
                "unsupportedFileType",
            )
        dst = os.open(
            target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, stat.S_IMODE(st.st_mode)
        )
        try:
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


@attrs.define
class FileSystem:
    """The fs/* handlers; ``run(f, *args)`` runs blocking work off the reactor thread."""

    max_read_file_bytes: int
    run: Runner

    def read_file(self, conn: Connection, params: p.FsReadFileParams) -> Deferred[Any]:
        return self.run(read_file, absolute_path(params.path), self.max_read_file_bytes)

    def write_file(self, conn: Connection, params: _WriteFileWire) -> Deferred[Any]:
        path = absolute_path(params.path)
        raw = params.data_base64
        if bytes(memoryview(raw)[:1]) != b'"':
            # Not a string: the same -32602 a typed decode would give.
            try:
                msgspec.json.decode(raw, type=str)
            except msgspec.ValidationError as exc:
                raise RpcError.invalid_params(f"{exc} - at `$.dataBase64`") from None
        return self.run(write_file, path, raw).addCallback(lambda _: p.Empty())

    def create_directory(
        self, conn: Connection, params: p.FsCreateDirectoryParams
    ) -> Deferred[Any]:
        recursive = True if params.recursive is None else params.recursive
        return self.run(create_directory, absolute_path(params.path), recursive).addCallback(
            lambda _: p.Empty()
        )

    def get_metadata(self, conn: Connection, params: p.FsGetMetadataParams) -> Deferred[Any]:
        return self.run(get_metadata, absolute_path(params.path))

    def read_directory(self, conn: Connection, params: p.FsReadDirectoryParams) -> Deferred[Any]:
        return self.run(read_directory, absolute_path(params.path))

    def remove(self, conn: Connection, params: p.FsRemoveParams) -> Deferred[Any]:
        recursive = True if params.recursive is None else params.recursive
        force = True if params.force is None else params.force
        return self.run(remove, absolute_path(params.path), recursive, force).addCallback(
            lambda _: p.Empty()
        )

    def copy(self, conn: Connection, params: p.FsCopyParams) -> Deferred[Any]:
        source = absolute_path(params.source_path, "sourcePath")
        destination = absolute_path(params.destination_path, "destinationPath")
        return self.run(copy, source, destination, params.recursive).addCallback(
            lambda _: p.Empty()
        )


class PoolRunner:
    """Runs blocking calls on a dedicated, bounded pool tied to the reactor's life.

    The pool starts on first use and stops when the reactor shuts down.
    """

    def __init__(self, reactor: Any, threads: int = FS_THREADS) -> None:
        self._reactor = reactor
        self.pool = ThreadPool(minthreads=0, maxthreads=threads, name="exec-server-fs")

    def __call__(self, func: Callable[..., Any], *args: Any) -> Deferred[Any]:
        if not self.pool.started:
            self.pool.start()
            self._reactor.addSystemEventTrigger("during", "shutdown", self.stop)
        return deferToThreadPool(self._reactor, self.pool, func, *args)

    def stop(self) -> None:
        if self.pool.started:
            self.pool.stop()


def thread_pool_runner(reactor: Any, threads: int = FS_THREADS) -> PoolRunner:
    return PoolRunner(reactor, threads)


def inline_runner(func: Callable[..., Any], *args: Any) -> Deferred[Any]:
    """Run at once (for dispatchers built on a fake clock in unit tests)."""
    return maybeDeferred(func, *args)


def register(dispatcher: Dispatcher, run: Runner | None = None) -> FileSystem:
    """Add the seven fs/* routes to ``dispatcher``."""
    clock: Any = dispatcher.clock
    if run is None:
        real = hasattr(clock, "callFromThread") and hasattr(clock, "addSystemEventTrigger")
        run = thread_pool_runner(clock) if real else inline_runner
    fs = FileSystem(dispatcher.config.max_read_file_bytes, run)
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
