"""The blocking operations of the ``fs/*`` methods (run on the pool).

No operation may hold a pool thread without bound: nothing non-regular
(FIFO, device, socket) is ever opened for reading or writing (files are
opened ``O_NONBLOCK`` and checked with ``fstat`` before any read or write,
directories ``O_DIRECTORY``). Because the reactor thread changes directory
around ``posix_spawn``, everything here works on absolute paths only.
Large payloads are moved in slices: ``fs/readFile`` reads and encodes the
file a slice at a time into the result's pieces; ``fs/writeFile`` decodes
the request's text a slice at a time into the file.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
from collections.abc import Callable
from typing import Final, NoReturn

import attrs
import msgspec
import pybase64

from execserver import protocol as p
from execserver.codec import RenderedParts
from execserver.errors import RpcError
from execserver.fs import b64, stream
from execserver.fs.journal import copy_back, journal
from execserver.fs.paths import (
    ROOT_MESSAGE,
    created_at_ms,
    invalid,
    lossy,
    not_regular,
    oserrors,
    raise_errno,
    resolve_path,
    too_large,
    unix_ms,
)
from execserver.fs.pool import check_cancelled
from execserver.sandbox.policy import is_within

#: fs/readFile of a file up to this size takes one pool trip: its reply's
#: budget for this size is reserved up front, and the file read at once.
SMALL_READ_BYTES: Final = 64 * 1024

#: What surrounds the base64 text of an ``fs/readFile`` result (a ranged
#: read's suffix also carries ``"size"``).
_READ_PREFIX: Final = b'{"dataBase64":"'
_READ_SUFFIX: Final = b'"}'


@attrs.frozen
class ReadRange:
    """The optional range of an ``fs/readFile``: ``offset`` and ``length``.

    ``ranged`` is whether either was given: then the result also reports the
    file's ``size``, and the read limit applies to the range, not the file.
    """

    offset: int = 0
    length: int | None = None
    ranged: bool = False

    def bytes_of(self, file_size: int) -> int:
        """Bytes this range covers in a file of ``file_size`` bytes."""
        available = max(0, file_size - self.offset)
        return available if self.length is None else min(self.length, available)


WHOLE: Final = ReadRange()


def encoded_result_size(size: int, file_size: int | None = None) -> int:
    """Bytes of the ``{"dataBase64": ...}`` result for ``size`` bytes of data.

    With ``file_size`` (a ranged read), ``,"size":N`` is counted too.
    """
    extra = 0 if file_size is None else len(b',"size":') + len(str(file_size))
    return len(_READ_PREFIX) + 4 * ((size + 2) // 3) + len(_READ_SUFFIX) + extra


@oserrors
def stat_for_read(
    path: str, limit: int, small: int = 0, span: ReadRange = WHOLE
) -> tuple[str, int] | RenderedParts:
    """The first step of ``fs/readFile``: resolve, check, and size the file.

    ``stat`` never opens anything, so it cannot block on a FIFO or device.
    Returns the resolved path and the size of the reply to charge to the
    reply budget, or, for at most ``small`` bytes, the rendered result at once.
    """
    path = resolve_path(path)
    st = os.stat(path)
    if stat.S_ISDIR(st.st_mode):
        raise_errno(errno.EISDIR)
    if not stat.S_ISREG(st.st_mode):
        raise not_regular("fs/readFile")
    size = span.bytes_of(st.st_size)
    if size > limit:
        raise too_large(limit)
    if size <= small:
        return read_file(path, limit, span)
    return path, encoded_result_size(size, st.st_size if span.ranged else None)


def _open_regular_for_reading(path: str, extra: int = 0) -> tuple[int, os.stat_result]:
    # O_NONBLOCK: opening a FIFO must not wait for a writer, and a file that
    # blocks on read (/proc/kmsg) fails with EAGAIN instead of hanging a
    # pool thread; the descriptor stays non-blocking. O_NOCTTY: a terminal
    # never becomes the server's controlling terminal.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY | extra)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise_errno(errno.EISDIR)
        if not stat.S_ISREG(st.st_mode):
            raise not_regular("fs/readFile")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _seek(fd: int, offset: int) -> bool:
    """Move ``fd`` to ``offset``; False if the file system allows no file that long."""
    try:
        os.lseek(fd, offset, os.SEEK_SET)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOVERFLOW, errno.EFBIG):
            return False
        raise
    return True


@oserrors
def read_file(path: str, limit: int, span: ReadRange = WHOLE) -> RenderedParts:
    """``fs/readFile``: the result rendered as pieces, the file read a slice at a time.

    Each slice of the file is read into one reused buffer and base64-encoded
    into its own piece (:func:`_read_encoded`). A file read whole must stay
    within ``limit``; a range's bytes must (the file may be larger).
    """
    fd, st = _open_regular_for_reading(resolve_path(path))
    try:
        if not span.ranged and st.st_size > limit:
            raise too_large(limit)
        if span.offset and not _seek(fd, span.offset):
            # Past what the file system allows a file to reach (2^63-1 on
            # ext4 is EINVAL): nothing there, as past the end.
            tail = b'","size":%d}' % os.fstat(fd).st_size
            return RenderedParts((_READ_PREFIX, tail))
        # Files whose size lies (/proc) or that grow or shrink while read
        # are read to their end (or the range's), up to the limit.
        want = limit + 1 if span.length is None else min(span.length, limit + 1)
        pieces, total = _read_encoded(fd, want, min(want, max(0, st.st_size - span.offset)))
        if total > limit:
            raise too_large(limit)
        # A range reports the file's size (as it is after the read).
        tail = b'","size":%d}' % os.fstat(fd).st_size if span.ranged else _READ_SUFFIX
    finally:
        os.close(fd)
    return RenderedParts((_READ_PREFIX, *pieces, tail))


#: Bytes of the file read (and base64-encoded into one piece) per system
#: call, in bulk. Their text (4 MiB) is above glibc's mmap threshold (4 MiB
#: in the server), so each piece is unmapped as soon as it has been sent.
BULK_SLICE_BYTES: Final = 3 * 1024 * 1024

#: The last BULK_SLICE_BYTES of a file are read in slices this small: when the
#: last slice is encoded, it sits beside the whole text (at 16 MiB a bulk
#: slice alone took 0.19x of the file, peak RSS over idle).
TAIL_SLICE_BYTES: Final = 3 * 64 * 1024


def _read_encoded(fd: int, want: int, expected: int) -> tuple[list[bytes], int]:
    """Read up to ``want`` bytes from ``fd`` (``expected``: its size): their base64, as pieces.

    Each slice of the file is read into one reused buffer and base64-encoded
    into its own piece, so the reply's text exists once and the file's bytes
    never exist whole. The bulk buffer is an anonymous mapping, unmapped
    before the tail is read (from the heap it would stay resident beside the
    reply, glibc keeping freed heap memory below its trim threshold).
    """
    pieces: list[bytes] = []
    total = 0
    carry = b""
    eof = False
    bulk = min(want, expected - BULK_SLICE_BYTES)
    if bulk >= BULK_SLICE_BYTES:
        buffer = mmap.mmap(-1, BULK_SLICE_BYTES, flags=mmap.MAP_PRIVATE)
        try:
            with memoryview(buffer) as view:
                total, filled, eof = _read_slices(fd, view, bulk - bulk % 3, 0, 0, pieces)
                carry = bytes(view[:filled])
        finally:
            buffer.close()
    if not eof and total < want:
        size = max(len(carry), min(want - total + len(carry), TAIL_SLICE_BYTES))
        tail = bytearray(size)
        tail[: len(carry)] = carry
        view = memoryview(tail)
        total, filled, eof = _read_slices(fd, view, want, total, len(carry), pieces)
        carry = bytes(view[:filled])
    if carry:
        pieces.append(pybase64.b64encode(carry))
    return pieces, total


def _read_slices(
    fd: int, view: memoryview, want: int, total: int, filled: int, pieces: list[bytes]
) -> tuple[int, int, bool]:
    """Read into ``view`` until ``total`` reaches ``want``, one piece per full buffer.

    ``view[:filled]`` holds bytes not yet encoded, on entry and on return
    (fewer than 3 unless the end of the file came first). Returns the new
    total, ``filled``, and whether the end of the file came.
    """
    while total < want:
        count = os.readv(fd, [view[filled : min(len(view), filled + want - total)]])
        if not count:
            return total, filled, True
        total += count
        filled += count
        usable = filled - filled % 3
        if filled == len(view) or (usable and total >= want):
            pieces.append(pybase64.b64encode(view[:usable]))
            view[: filled - usable] = view[usable:filled]
            filled -= usable
    return total, filled, False


def _write_all(fd: int, data: bytes | bytearray | memoryview, offset: int | None = None) -> int:
    """Write all of ``data`` (at ``offset``, or at the file position); its length."""
    view = memoryview(data)
    size = len(view)
    while view:
        if offset is None:
            written = os.write(fd, view[: 1 << 30])
        else:
            written = os.pwrite(fd, view[: 1 << 30], offset)
            offset += written
        view = view[written:]
    return size


def _write_pieces(fd: int, raw: msgspec.Raw, slow: bytes | None, offset: int | None = None) -> int:
    """Write the decoded ``raw`` (or the already decoded ``slow``); bytes written."""
    total = 0
    for piece in (slow,) if slow is not None else b64.decoded_pieces(raw):
        total += _write_all(fd, piece, None if offset is None else offset + total)
        del piece  # not held while the next one is decoded
    return total


def _open_regular_for_writing(
    path: str, mode: int, refusal: Callable[[], RpcError], extra: int = 0, dir_fd: int | None = None
) -> int:
    """Open ``path`` for writing (creating it), only if it is a regular file.

    ``O_NONBLOCK`` makes opening a FIFO or a device return at once, and the
    ``fstat`` check runs before anything could block or truncate: only a
    regular file is ever truncated and written (where ``O_NONBLOCK`` has no
    effect).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY | extra
    try:
        if dir_fd is None:
            fd = os.open(path, flags, mode)
        else:
            fd = os.open(path, flags, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            # A FIFO without a reader (or a device node without a device)
            # refuses a non-blocking writer: it is not a regular file.
            raise refusal() from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise refusal()
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_in_place(path: str, raw: msgspec.Raw) -> None:
    # What the reference does (create or truncate, then write), once the
    # text is known to decode: nothing is truncated for invalid base64.
    slow = b64.validate(raw)
    fd = _open_regular_for_writing(path, 0o666, lambda: not_regular("fs/writeFile"))
    try:
        os.ftruncate(fd, 0)
        _write_pieces(fd, raw, slow)
    finally:
        os.close(fd)


def _check_write_target(path: str) -> os.stat_result | None:
    try:
        st: os.stat_result | None = os.stat(path)
    except FileNotFoundError:
        st = None  # a new file (or a dangling symlink to one)
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise_errno(errno.EISDIR)
    if st is not None and not stat.S_ISREG(st.st_mode):
        # FIFOs, devices, sockets: writing could block a pool thread for
        # ever (a FIFO whose reader never reads); refused like readFile.
        raise not_regular("fs/writeFile")
    return st


@oserrors
def write_file(path: str, raw: msgspec.Raw, streamed: stream.StreamedWrite | None = None) -> None:
    """``fs/writeFile`` without a range: atomic replacement (see docs/filesystem.md).

    The text is decoded a slice at a time straight into the temporary file,
    or was already, as the line arrived (``streamed``, :mod:`.stream`: that
    file is used if it was written in the target's directory, else closed).
    On any failure the text's own error, if it has one, is reported instead,
    as the reference (which decodes before anything else) would.
    """
    try:
        _write_file(path, raw, streamed)
    except (OSError, RpcError):
        b64.validate(raw)  # raises the text's error, which comes first
        raise
    finally:
        stream.discard(streamed)  # (a no-op once adopted)


def _fill(fd: int, raw: msgspec.Raw) -> int:
    """Decode ``raw`` into the empty file ``fd``; bytes written."""
    try:
        return _write_pieces(fd, raw, None)
    except b64.NotFast:
        # JSON escapes or invalid base64: start over with the exact decoder.
        slow = b64.decode_slow(raw)
        os.ftruncate(fd, 0)
        return _write_all(fd, slow, 0)


def _create_temp(directory: str) -> tuple[str, int] | None:
    """A new temporary file in ``directory`` (None if the directory refuses one)."""
    temp = journal().temp_path(directory)
    try:
        # Mode 0o666 lets the kernel apply the umask (and default ACLs) to a
        # new file exactly as for the reference's File::create.
        fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return None
        raise
    return temp, fd


def _write_file(path: str, raw: msgspec.Raw, streamed: stream.StreamedWrite | None) -> None:
    path = resolve_path(path)
    st = _check_write_target(path)
    # A symlink at the path is followed: its final target is replaced.
    target = os.path.realpath(path)
    directory = os.path.dirname(target)
    # Hard links: renaming would detach this name from the others, so the
    # new bytes are copied back into the same inode (under the journal).
    replace = st is None or st.st_nlink == 1
    filled = -1
    created: tuple[str, int] | None = None
    if streamed is not None:
        # Named as _create_temp would have created it; an existing target's
        # copy is private until its owner and mode are given below.
        temp = journal().temp_path(directory)
        fd = streamed.adopt(directory, st is not None, temp)
        if fd is not None:
            created = temp, fd
            filled = streamed.size
    if created is None:
        created = _create_temp(directory)
    if created is None:
        # The directory is not writable: the temporary file goes to the
        # state directory, and the target is written in place from it.
        replace = False
        if not journal().enabled:
            _write_in_place(path, raw)
            return
        created = _create_temp(journal().directory)
        if created is None:
            _write_in_place(path, raw)
            return
    temp, fd = created
    try:
        if replace and st is not None:
            # Owner and mode before any byte is written: the temporary
            # file is never readable by more people than the target.
            replace = _keep_owner_and_mode(fd, st)
        if not replace:
            os.fchmod(fd, 0o600)  # only a copy of bytes for the target's own inode
        size = _fill(fd, raw) if filled < 0 else filled
        if replace and st is not None:
            replace = _keep_attributes(fd, target, st)
        if replace:
            os.close(fd)
            fd = -1
            os.rename(temp, target)
            return
        _copy_into(path, temp, fd, size)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(temp)


def _copy_into(path: str, temp: str, temp_fd: int, size: int) -> None:
    """Copy the complete temporary file into ``path``'s own inode, under a journal record.

    The temporary file is synced, then a record naming it and the target's
    inode is written and synced, then the target is overwritten, ended and
    synced, and only then is the record removed: a server killed at any
    point leaves the old contents (before the record) or a record that the
    next server replays (:meth:`Journal.recover`) to the new contents.
    """
    os.fsync(temp_fd)
    fd = _open_regular_for_writing(path, 0o666, lambda: not_regular("fs/writeFile"))
    try:
        record = journal().begin_copy(temp, os.path.realpath(path), os.fstat(fd), size)
        try:
            copy_back(temp_fd, fd, size)
        finally:
            journal().end_copy(record)
    finally:
        os.close(fd)


def _keep_owner_and_mode(fd: int, st: os.stat_result) -> bool:
    """Give the temporary file ``st``'s owner, group and mode; False if the owner cannot be kept."""
    own = os.fstat(fd)
    try:
        if (own.st_uid, own.st_gid) != (st.st_uid, st.st_gid):
            os.fchown(fd, st.st_uid, st.st_gid)
    except PermissionError:
        # Someone else's file we may write to: replacing it would change
        # who owns it; it is written in place instead.
        return False
    os.fchmod(fd, stat.S_IMODE(st.st_mode))
    return True


#: Set after every other attribute: a change of owner or a write clears it.
_CAPABILITY: Final = "security.capability"


def _keep_attributes(fd: int, target: str, st: os.stat_result) -> bool:
    """Copy every extended attribute of ``target`` onto ``fd``; False if one cannot be.

    User attributes, the POSIX ACL (``system.posix_acl_access``), the
    SELinux label and the rest; the file capabilities
    (``security.capability``) last, because a write or a ``chown`` clears
    them. The setuid and setgid bits a write may have cleared are set
    again. If an attribute cannot be set here (not permitted, not
    supported), the target is written in place instead, so it keeps all.
    """
    try:
        names = os.listxattr(target)
    except OSError as exc:
        if exc.errno not in (errno.ENOTSUP, errno.ENODATA):
            raise
        names = []
    special = stat.S_IMODE(st.st_mode) & (stat.S_ISUID | stat.S_ISGID)
    if special and (os.fstat(fd).st_mode & special) != special:
        os.fchmod(fd, stat.S_IMODE(os.fstat(fd).st_mode) | special)
    try:
        extra = [name for name in os.listxattr(fd) if name not in names]
    except OSError:
        extra = []
    for name in extra:
        # Given to the new file by the directory (a default ACL): the
        # target does not have it.
        try:
            os.removexattr(fd, name)
        except OSError:
            return False
    for name in sorted(names, key=lambda n: n == _CAPABILITY):
        try:
            value = os.getxattr(target, name)
        except OSError as exc:
            if exc.errno == errno.ENODATA:
                continue  # removed meanwhile
            return False
        try:
            os.setxattr(fd, name, value)
        except OSError:
            return False
    return True


#: A ranged ``fs/writeFile`` whose text is at most this long is decoded at
#: once (its bytes held beside the text) instead of checked and then decoded
#: again (the client library's 8 MiB ranges are 11 MiB of text).
DECODE_WHOLE_TEXT_BYTES: Final = 16 * 1024 * 1024


@oserrors
def write_range(
    path: str,
    raw: msgspec.Raw,
    offset: int | None,
    append: bool,
    truncate: bool,
    streamed: stream.StreamedWrite | None = None,
) -> None:
    """``fs/writeFile`` with ``offset`` or ``append``: write in place.

    The text is checked first (nothing is written for invalid base64), then
    decoded a slice at a time into the file: at ``offset`` (a gap past the
    end reads as zeros) or at its end with ``append``. Afterwards the file
    reaches at least the write's end; ``truncate`` with an offset ends it
    there. The file is created if missing; only a regular file is opened.
    With ``streamed`` (:mod:`.stream`) complete, the text was checked and
    decoded as it arrived: the bytes are copied from its file instead.
    """
    try:
        _write_range(path, raw, offset, append, truncate, streamed)
    finally:
        stream.discard(streamed)


def _write_range(
    path: str,
    raw: msgspec.Raw,
    offset: int | None,
    append: bool,
    truncate: bool,
    streamed: stream.StreamedWrite | None,
) -> None:
    path = resolve_path(path)
    source = streamed.decoded() if streamed is not None else None
    slow = None
    if source is None:
        # Checked before anything is written: a range small enough to hold
        # decoded is decoded once; a larger one is checked, then decoded
        # again a slice at a time while written.
        small = len(raw) <= DECODE_WHOLE_TEXT_BYTES
        slow = b64.decode_whole(raw) if small else b64.validate(raw)
    existed = _check_write_target(path) is not None
    extra = os.O_APPEND if append else 0
    fd = _open_regular_for_writing(path, 0o666, lambda: not_regular("fs/writeFile"), extra)
    try:
        at = None if append else offset or 0
        if source is not None:
            written = _copy_from(source, fd, at)
        else:
            written = _write_pieces(fd, raw, slow, at)
        end = (offset or 0) + written
        # The file ends at the write's end with truncate, and reaches it in
        # any case (an empty write past the end extends the file too).
        if not append and (truncate or os.fstat(fd).st_size < end):
            os.ftruncate(fd, end)
    except BaseException:
        if not existed:
            _remove_created(path, fd)
        raise
    finally:
        os.close(fd)


def _copy_from(source: tuple[int, int], fd: int, offset: int | None) -> int:
    """Copy the ``(descriptor, size)`` file's bytes into ``fd`` (at ``offset``, or
    at its position); bytes written."""
    source_fd, size = source
    done = 0
    while done < size:
        piece = os.pread(source_fd, min(b64.B64_SLICE, size - done), done)
        if not piece:
            raise OSError(errno.EIO, os.strerror(errno.EIO))  # (it never shrinks)
        _write_all(fd, piece, None if offset is None else offset + done)
        done += len(piece)
        del piece
    return done


def _remove_created(path: str, fd: int) -> None:
    """Unlink the file this failed write created at ``path``, if it is still that file."""
    with contextlib.suppress(OSError):
        target = os.path.realpath(path)  # a dangling symlink's new target, not the link
        if _same_inode(os.fstat(fd), os.lstat(target)):
            os.unlink(target)


@oserrors
def create_directory(path: str, recursive: bool) -> None:
    path = resolve_path(path)
    if recursive:
        os.makedirs(path, exist_ok=True)
    else:
        os.mkdir(path)


@oserrors
def get_metadata(path: str) -> p.FsGetMetadataResponse:
    path = resolve_path(path)
    st = os.stat(path)
    is_symlink = stat.S_ISLNK(os.lstat(path).st_mode)
    return p.FsGetMetadataResponse(
        is_directory=stat.S_ISDIR(st.st_mode),
        is_file=stat.S_ISREG(st.st_mode),
        created_at_ms=created_at_ms(path),
        modified_at_ms=unix_ms(st.st_mtime_ns),
        is_symlink=is_symlink,
        size=st.st_size,
    )


@oserrors
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
                    file_name=lossy(entry.name),
                    is_directory=is_dir,
                    is_file=is_file,
                    is_symlink=is_symlink,
                )
            )
    return p.FsReadDirectoryResponse(entries)


def without_dangling(listed: p.FsReadDirectoryResponse, path: str) -> p.FsReadDirectoryResponse:
    """``listed`` without its dangling or looping symlinks (the current reference's listing)."""
    directory = resolve_path(path)
    kept = []
    for entry in listed.entries:
        if entry.is_symlink is True and not entry.is_file and not entry.is_directory:
            try:
                os.stat(os.path.join(directory, entry.file_name))
            except OSError:
                continue
        kept.append(entry)
    return p.FsReadDirectoryResponse(kept)


def _refuse_root() -> NoReturn:
    raise invalid(ROOT_MESSAGE, "rootDirectory")


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


@oserrors
def remove(path: str, recursive: bool, force: bool) -> None:
    path, st = removal_target(path)
    if st is None:
        if force:
            return
        raise_errno(errno.ENOENT)
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


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


class _Walk:
    """A position in a directory tree, walked without recursion and with one descriptor.

    :meth:`down` opens a subdirectory (``O_NOFOLLOW``: never through a
    symlink) and closes the parent; :meth:`up` reopens the parent through
    ``..`` and checks that it is the same directory it left (dev, inode),
    so a directory moved meanwhile stops the walk (``ENOENT``) instead of
    letting it continue somewhere else. Any depth the kernel lets a tree
    have works: no path longer than one name is ever given to the kernel,
    and no more than one descriptor per walk is open.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._parents: list[tuple[int, int]] = []

    @property
    def depth(self) -> int:
        return len(self._parents)

    def down(self, name: str) -> os.stat_result:
        child = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
        try:
            st = os.fstat(child)
            self._parents.append(_identity(os.fstat(self.fd)))
        except BaseException:
            os.close(child)
            raise
        os.close(self.fd)
        self.fd = child
        return st

    def up(self) -> None:
        parent = os.open("..", _DIR_FLAGS, dir_fd=self.fd)
        try:
            if _identity(os.fstat(parent)) != self._parents.pop():
                raise_errno(errno.ENOENT)  # moved while walked
        except BaseException:
            os.close(parent)
            raise
        os.close(self.fd)
        self.fd = parent

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _entries(dir_fd: int) -> list[tuple[str, bool]]:
    """Names in ``dir_fd`` (the last one first), and whether each is a directory (not followed)."""
    with os.scandir(dir_fd) as it:
        found = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in it]
    found.reverse()
    return found


def _remove_tree(path: str, expected: os.stat_result, cancellable: bool = True) -> None:
    """Remove a directory tree, like Rust's ``remove_dir_all`` / ``shutil.rmtree``.

    Walks with one directory descriptor at a time (:class:`_Walk`:
    ``O_NOFOLLOW``, ``*at`` calls, no recursion), so a symlink is unlinked,
    never followed, even if swapped in meanwhile; entries that vanish
    meanwhile are fine; and any depth works. Unlike them, it never enters
    the root directory: a bind mount of ``/`` inside the tree stops the
    removal with the ``rootDirectory`` error (what was removed before it
    stays removed; the root's contents are untouched).
    """
    root = os.stat("/")
    fd = os.open(path, _DIR_FLAGS)
    walk = _Walk(fd)
    try:
        if not _same_inode(os.fstat(fd), expected):
            raise_errno(errno.ENOENT)  # replaced since it was looked at
        # One list of the entries still to remove per directory on the way.
        pending: list[list[tuple[str, bool]]] = [_entries(fd)]
        names: list[str] = []
        while pending:
            if not pending[-1]:
                pending.pop()
                if not names:
                    break
                walk.up()
                with contextlib.suppress(FileNotFoundError):
                    os.rmdir(names.pop(), dir_fd=walk.fd)
                continue
            if cancellable:
                check_cancelled()
            name, is_dir = pending[-1].pop()
            if is_dir and _enter(walk, name, root):
                names.append(name)
                pending.append(_entries(walk.fd))
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=walk.fd)
    finally:
        walk.close()
    os.rmdir(path)


def _enter(walk: _Walk, name: str, root: os.stat_result) -> bool:
    """Go into the directory ``name``; False if it is no longer a directory (or is gone)."""
    try:
        st = walk.down(name)
    except FileNotFoundError:
        return False  # the unlink that follows finds nothing either
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):
            return False  # replaced by a file or a symlink meanwhile: unlink that
        raise
    if _same_inode(st, root):
        _refuse_root()
    return True


@oserrors
def copy(source: str, destination: str, recursive: bool) -> None:
    source = resolve_path(source)
    destination = resolve_path(destination)
    st = os.lstat(source)
    if stat.S_ISDIR(st.st_mode):
        if not recursive:
            raise invalid(
                "fs/copy requires recursive: true when sourcePath is a directory",
                "recursiveRequired",
            )
        if _is_same_or_descendant(source, destination):
            raise invalid(
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
    return is_within(resolved, src)


def _copy_tree(source: str, target: str, mode: int) -> None:
    """Copy the directory ``source`` to ``target``, without recursion, at any depth.

    Both trees are walked with one descriptor each (:class:`_Walk`). A new
    directory gets its mode once its contents are in (so a read-only source
    directory can still be filled). If the copy fails or is cancelled and
    ``target`` did not exist before, what was created is removed again:
    the error leaves no partial tree (into an existing directory, what was
    copied stays).
    """
    created = not os.path.isdir(target)
    os.makedirs(target, exist_ok=True)
    try:
        _copy_tree_into(source, target, mode, created)
    except BaseException:
        if created:
            with contextlib.suppress(OSError, RpcError):
                _remove_tree(target, os.lstat(target), cancellable=False)
        raise


def _copy_tree_into(source: str, target: str, mode: int, created: bool) -> None:
    src = _Walk(os.open(source, _DIR_FLAGS))
    try:
        # The destination itself may be a symlink to a directory (merged
        # into, as before); below it nothing is followed.
        dst = _Walk(os.open(target, _DIR_FLAGS & ~os.O_NOFOLLOW))
        try:
            # Per level: the entries still to copy, and the mode to give the
            # destination directory when it is done (None: it existed).
            pending: list[list[tuple[str, bool]]] = [_entries(src.fd)]
            modes: list[int | None] = [stat.S_IMODE(mode) if created else None]
            while pending:
                if not pending[-1]:
                    pending.pop()
                    done = modes.pop()
                    if done is not None:
                        os.fchmod(dst.fd, done)
                    if pending:
                        src.up()
                        dst.up()
                    continue
                check_cancelled()
                name, is_dir = pending[-1].pop()
                if is_dir:
                    child_mode = _copy_directory_entry(src, dst, name)
                    if child_mode is not False:
                        pending.append(_entries(src.fd))
                        modes.append(child_mode)
                    continue
                _copy_entry(src.fd, dst.fd, name)
        finally:
            dst.close()
    finally:
        src.close()


def _copy_directory_entry(src: _Walk, dst: _Walk, name: str) -> int | bool | None:
    """Enter the source directory ``name`` and its copy (created if missing).

    The mode to give the copy when done (None if it existed), or False if
    ``name`` is no longer a directory (then nothing was entered).
    """
    try:
        st = src.down(name)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return False  # gone or replaced meanwhile: skipped
        raise
    try:
        try:
            os.mkdir(name, 0o700, dir_fd=dst.fd)
            new = True
        except FileExistsError:
            new = False
        try:
            dst.down(name)
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                raise_errno(errno.EEXIST)  # a file or a symlink in the way
            raise
    except BaseException:
        src.up()
        raise
    return stat.S_IMODE(st.st_mode) if new else None


def _copy_entry(src_dir: int, dst_dir: int, name: str) -> None:
    """Copy the non-directory ``name``: a file's contents, a symlink's text; skip the rest."""
    try:
        st = os.lstat(name, dir_fd=src_dir)
    except FileNotFoundError:
        return  # removed meanwhile
    if stat.S_ISREG(st.st_mode):
        _copy_file(name, name, src_dir, dst_dir)
    elif stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(name, dir_fd=src_dir), name, dir_fd=dst_dir)
    # Other types (FIFOs, sockets, devices) are skipped, as the reference does.


_UNSUPPORTED_COPY: Final = "fs/copy only supports regular files, directories, and symlinks"


def _unsupported_copy() -> RpcError:
    return invalid(_UNSUPPORTED_COPY, "unsupportedFileType")


def _copy_file(
    source: str, target: str, src_dir: int | None = None, dst_dir: int | None = None
) -> None:
    """Rust's ``std::fs::copy``: contents and permission bits; follows a symlink at target.

    Source and destination are opened ``O_NONBLOCK`` and must be regular
    files (checked with ``fstat`` before anything is read, truncated or
    written): a FIFO or a device at either end is refused, never waited on.
    Holes stay holes (:func:`_copy_contents`). ``src_dir``/``dst_dir``: the
    directories the names are in (None: the names are absolute paths).
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
    src = os.open(source, flags, dir_fd=src_dir)
    try:
        st = os.fstat(src)
        if not stat.S_ISREG(st.st_mode):
            raise _unsupported_copy()
        dst = _open_regular_for_writing(
            target, stat.S_IMODE(st.st_mode), _unsupported_copy, dir_fd=dst_dir
        )
        try:
            existing = os.fstat(dst)
            if (existing.st_dev, existing.st_ino) == (st.st_dev, st.st_ino):
                # The reference would truncate the file to nothing.
                raise invalid("fs/copy cannot copy a file to itself", "sameFile")
            os.ftruncate(dst, 0)
            _copy_contents(src, dst, st.st_size)
            os.fchmod(dst, stat.S_IMODE(st.st_mode))
        finally:
            os.close(dst)
    finally:
        os.close(src)


#: Bytes copied between two checks for cancellation.
COPY_STEP_BYTES: Final = 16 * 1024 * 1024
_NO_COPY_RANGE: Final = (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP)


def _copy_contents(src: int, dst: int, size: int) -> None:
    """Copy the file ``src`` (``size`` bytes when opened) into the empty ``dst``, keeping holes.

    Only the data regions that ``SEEK_DATA``/``SEEK_HOLE`` report are
    copied, at their offsets; the file is then extended to its size, so a
    sparse file stays sparse (a 1 TiB file with 4 KiB of data takes 4 KiB).
    Bytes move with ``copy_file_range`` (``pread``/``pwrite`` where the file
    systems cannot), :data:`COPY_STEP_BYTES` at a time, and the copy stops
    between two steps once its connection has closed. Whatever the file
    holds past ``size`` (it grew, or its size is not known, as in ``/proc``)
    is copied to its end.
    """
    offset = 0
    while offset < size:
        try:
            data = os.lseek(src, offset, os.SEEK_DATA)
            hole = min(size, os.lseek(src, data, os.SEEK_HOLE))
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                break  # only a hole (or nothing) after offset
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            data, hole = offset, size  # no hole information: all data
        if data >= size:
            break
        _copy_range(src, dst, data, hole)
        offset = hole
    if os.fstat(dst).st_size < size:
        os.ftruncate(dst, size)
    # The rest, if the file is longer than it said.
    end = size
    while True:
        copied = _copy_range(src, dst, end, None)
        if not copied:
            return
        end += copied


def _copy_range(src: int, dst: int, start: int, stop: int | None) -> int:
    """Copy ``src[start:stop]`` (``stop`` None: to the end) to the same offsets; bytes copied."""
    at = start
    while stop is None or at < stop:
        check_cancelled()
        want = COPY_STEP_BYTES if stop is None else min(COPY_STEP_BYTES, stop - at)
        try:
            count = os.copy_file_range(src, dst, want, at, at)
        except OSError as exc:
            if exc.errno not in _NO_COPY_RANGE:
                raise
            count = _copy_slowly(src, dst, at, want)
        if not count:
            break
        at += count
    return at - start


def _copy_slowly(src: int, dst: int, offset: int, length: int) -> int:
    done = 0
    while done < length:
        chunk = os.pread(src, min(length - done, 1024 * 1024), offset + done)
        if not chunk:
            break
        _write_all(dst, chunk, offset + done)
        done += len(chunk)
    return done
