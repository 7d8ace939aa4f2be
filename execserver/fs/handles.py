"""``fs/open``, ``fs/readBlock``, ``fs/writeBlock``, ``fs/close``: files in blocks, by handle.

The reference's methods (codex exec-server 0.171.0), with its limits and
texts (docs/filesystem.md, "Block reads"): the client names the handle
(at most 32 bytes of UTF-8); a connection holds at most 128 handles; a
block is 1 to 1 MiB from any offset, ``eof`` when it came short. A handle
stays open at the end of the file and closes on ``fs/close``, on a read
that fails, and with its connection.

A handle is an open descriptor: what it reads is the file that was opened
(checked by the sandbox then), whatever is renamed over its path later.
"""

from __future__ import annotations

import base64
import errno
import os
import stat
from typing import TYPE_CHECKING, Any, ClassVar, Final

import attrs
import msgspec
from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

from execserver import fdlimit
from execserver import protocol as p
from execserver.errors import RpcError
from execserver.fs.b64 import rust_base64_error
from execserver.fs.paths import absolute_path, closed_error, oserrors, resolve_path
from execserver.fs.pool import Runner

if TYPE_CHECKING:
    from execserver.sandbox.fsguard import Guard

#: The reference's bounds (its MAX_FILE_READ_HANDLE_ID_BYTES, per-connection
#: handle cap and FILE_READ_BLOCK_SIZE).
MAX_HANDLE_ID_BYTES: Final = 32
MAX_HANDLES: Final = 128
MAX_BLOCK_BYTES: Final = 1024 * 1024
#: The reference's code for a missing path or handle (io::ErrorKind::NotFound).
NOT_FOUND: Final = -32004

FS_OPEN: Final = "fs/open"
FS_READ_BLOCK: Final = "fs/readBlock"
FS_CLOSE: Final = "fs/close"
FS_WRITE_BLOCK: Final = "fs/writeBlock"
MODES: Final = ("read", "replace")


class FsOpenParams(msgspec.Struct, rename="camel"):
    handle_id: str
    path: str
    sandbox: p.SandboxConfig | None = None
    #: ``read`` (the default) or ``replace``: the file created or truncated,
    #: then written in place with fs/writeBlock.
    mode: str | None = None


class FsOpenResponse(msgspec.Struct, rename="camel"):
    handle_id: str


class FsReadBlockParams(msgspec.Struct, rename="camel"):
    handle_id: str
    offset: p.U64
    len: p.U64

    U64_FIELDS: ClassVar[tuple[str, ...]] = ("offset", "len")

    def __post_init__(self) -> None:
        p._check_u64(self, self.U64_FIELDS)


class FsReadBlockResponse(msgspec.Struct):
    chunk: bytes
    eof: bool


class FsWriteBlockParams(msgspec.Struct, rename="camel"):
    handle_id: str
    offset: p.U64
    #: Kept raw: decoded with the reference's base64 texts.
    chunk: str

    U64_FIELDS: ClassVar[tuple[str, ...]] = ("offset",)

    def __post_init__(self) -> None:
        p._check_u64(self, self.U64_FIELDS)


class FsCloseParams(msgspec.Struct, rename="camel"):
    handle_id: str


FsOpen = p.Method(FS_OPEN, FsOpenParams, FsOpenResponse, "filesystem")
FsReadBlock = p.Method(FS_READ_BLOCK, FsReadBlockParams, FsReadBlockResponse, "filesystem")
FsClose = p.Method(FS_CLOSE, FsCloseParams, p.Empty, "filesystem")
FsWriteBlock = p.Method(FS_WRITE_BLOCK, FsWriteBlockParams, p.Empty, "filesystem")
METHODS: Final = (FsOpen, FsReadBlock, FsWriteBlock, FsClose)


def not_a_file(path: str, kind: str) -> RpcError:
    """The reference's refusal of a directory or of anything but a regular file."""
    return RpcError.invalid_request(
        f"path `{os.path.normpath(path)}` is not a file", {"kind": kind}
    )


def _checked_id(handle_id: str) -> str:
    if len(handle_id.encode("utf-8", "surrogatepass")) > MAX_HANDLE_ID_BYTES:
        raise RpcError.invalid_request(
            f"file handle ID must not exceed {MAX_HANDLE_ID_BYTES} bytes"
        )
    return handle_id


@oserrors
def open_for_reading(path: str) -> int:
    """A descriptor of the regular file at ``path`` (blocking: on the pool)."""
    # O_NONBLOCK: a FIFO's open must not wait for a writer (it is refused
    # below anyway); O_NOCTTY: a terminal never becomes ours.
    fd = os.open(resolve_path(path), os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise not_a_file(path, "isADirectory" if stat.S_ISDIR(mode) else "notRegularFile")
    except BaseException:
        os.close(fd)
        raise
    return fd


@oserrors
def open_for_replacing(path: str) -> int:
    """A descriptor of the file at ``path``, created or truncated (blocking)."""
    # In place, as the reference: an existing file keeps its inode and mode.
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
    resolved = resolve_path(path)
    try:
        fd = os.open(resolved, flags, 0o666)
    except OSError as exc:
        # ENXIO: a FIFO without a reader (O_NONBLOCK: not waited for) or a
        # socket; neither is a file.
        if exc.errno == errno.ENXIO and not stat.S_ISREG(os.stat(resolved).st_mode):
            raise not_a_file(path, "notRegularFile") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise not_a_file(path, "notRegularFile")
    except BaseException:
        os.close(fd)
        raise
    return fd


@oserrors
def write_block(fd: int, offset: int, data: bytes) -> None:
    """All of ``data`` at ``offset`` (blocking)."""
    view = memoryview(data)
    while view:
        try:
            written = os.pwrite(fd, view, offset)
        except InterruptedError:
            continue
        view = view[written:]
        offset += written


@oserrors
def read_block(fd: int, offset: int, length: int) -> tuple[bytes, bool]:
    """Up to ``length`` bytes at ``offset``; ``eof`` when fewer came (blocking)."""
    if offset + length > p.I64_MAX:
        # Past the largest file offset (Rust's pread says EINVAL).
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
    pieces: list[bytes] = []
    got = 0
    while got < length:
        try:
            piece = os.pread(fd, length - got, offset + got)
        except InterruptedError:
            continue
        if not piece:
            break
        pieces.append(piece)
        got += len(piece)
    return b"".join(pieces), got < length


@attrs.define(eq=False)
class _Handle:
    fd: int
    #: Reads on the pool now: the descriptor is closed after the last one.
    reading: int = 0
    closed: bool = False

    def close(self) -> None:
        self.closed = True
        if self.reading == 0 and self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


@attrs.define
class FileHandles:
    """Each connection's open handles; ``run(f, *args, owner=conn)`` runs blocking work."""

    run: Runner
    guard: Guard
    #: Handles open on the whole server at most (this server's bound, not the
    #: reference's): half the descriptors kept out of the process limit, so
    #: handles never starve process starts, accepts or fs calls.
    max_total: int = attrs.field(factory=lambda: fdlimit.reserved_fds(fdlimit.soft_limit()) // 2)
    _total: int = 0
    _by_conn: dict[object, dict[str, _Handle]] = attrs.field(factory=dict)
    #: The ids of the opens on the pool now, per connection: they count
    #: against the caps and their ids are taken.
    _opening: dict[object, set[str]] = attrs.field(factory=dict)
    _opening_total: int = 0
    #: Connections closed while an open of theirs was on the pool.
    _gone: set[object] = attrs.field(factory=set)

    def open(self, conn: object, params: FsOpenParams) -> Deferred[Any]:
        handle_id = _checked_id(params.handle_id)
        mode = params.mode or "read"
        if mode not in MODES:
            raise RpcError.invalid_params(f"unknown variant `{mode}`, expected `read` or `replace`")
        path = absolute_path(params.path)
        # Refused before the file is touched (as the reference): a refused
        # replace must neither truncate nor create it.
        handles = self._by_conn.get(conn, {})
        opening = self._opening.get(conn, set())
        if handle_id in handles or handle_id in opening:
            raise RpcError.invalid_request(f"file handle `{handle_id}` already exists")
        if len(handles) + len(opening) >= MAX_HANDLES:
            raise RpcError.invalid_request(
                f"at most {MAX_HANDLES} file handles may be open per connection"
            )
        if self._total + self._opening_total >= self.max_total:
            raise RpcError.invalid_request(
                f"too many file handles are open on this server (limit {self.max_total});"
                " close some or retry later",
                {"kind": "busy"},
            )
        opener = open_for_reading if mode == "read" else open_for_replacing
        if self.guard.applies(params.sandbox):
            reads, writes = (((path, False),), ()) if mode == "read" else ((), ((path, True),))
            opened = self.run(
                self.guard.run, params.sandbox, reads, writes, opener, path, owner=conn
            )
        else:
            opened = self.run(opener, path, owner=conn)
        self._opening.setdefault(conn, opening).add(handle_id)
        self._opening_total += 1

        def settled(result: int | Failure) -> int | Failure:
            self._opening_total -= 1
            left = self._opening[conn]
            left.discard(handle_id)
            gone = conn in self._gone
            if not left:
                del self._opening[conn]
                self._gone.discard(conn)
            if gone and not isinstance(result, Failure):
                # The connection closed while the file was being opened.
                os.close(result)
                raise closed_error()
            return result

        def keep(fd: int) -> FsOpenResponse:
            self._by_conn.setdefault(conn, {})[handle_id] = _Handle(fd)
            self._total += 1
            return FsOpenResponse(handle_id)

        return opened.addBoth(settled).addCallback(keep)

    def read_block(self, conn: object, params: FsReadBlockParams) -> Deferred[FsReadBlockResponse]:
        handle_id = _checked_id(params.handle_id)
        if not 1 <= params.len <= MAX_BLOCK_BYTES:
            raise RpcError.invalid_request(
                f"file read block length must be between 1 and {MAX_BLOCK_BYTES}"
            )
        handle = self._open_handle(conn, handle_id)
        return self._use(
            conn, handle_id, handle, read_block, params.offset, params.len
        ).addCallback(lambda block: FsReadBlockResponse(*block))

    def write_block(self, conn: object, params: FsWriteBlockParams) -> Deferred[Any]:
        handle_id = _checked_id(params.handle_id)
        problem = rust_base64_error(params.chunk.encode("utf-8"))
        if problem is not None:
            raise RpcError.invalid_params(problem)
        data = base64.b64decode(params.chunk)
        if not 1 <= len(data) <= MAX_BLOCK_BYTES:
            raise RpcError.invalid_request(
                f"file write block length must be between 1 and {MAX_BLOCK_BYTES}"
            )
        if params.offset + len(data) > p.I64_MAX:
            raise RpcError.invalid_request(
                "file write range exceeds the signed 64-bit file offset limit"
            )
        handle = self._open_handle(conn, handle_id)
        return self._use(conn, handle_id, handle, write_block, params.offset, data).addCallback(
            lambda _: p.Empty()
        )

    def _open_handle(self, conn: object, handle_id: str) -> _Handle:
        """``conn``'s open handle ``handle_id`` (the reference's -32004 if there is none)."""
        handle = self._by_conn.get(conn, {}).get(handle_id)
        if handle is None:
            raise RpcError(NOT_FOUND, f"unknown file handle `{handle_id}`")
        return handle

    def _use(
        self, conn: object, handle_id: str, handle: _Handle, func: Any, *args: Any
    ) -> Deferred[Any]:
        """``func(fd, *args)`` on the pool; a failure closes the handle (as the reference)."""
        handle.reading += 1

        def done(result: object) -> object:
            handle.reading -= 1
            if isinstance(result, Failure):
                self._forget(conn, handle_id, handle)
                handle.close()
            elif handle.closed:
                handle.close()
            return result

        return self.run(func, handle.fd, *args, owner=conn).addBoth(done)

    def close(self, conn: object, params: FsCloseParams) -> p.Empty:
        handle_id = _checked_id(params.handle_id)
        handle = self._by_conn.get(conn, {}).get(handle_id)
        if handle is not None:
            self._forget(conn, handle_id, handle)
            handle.close()
        return p.Empty()

    def _forget(self, conn: object, handle_id: str, handle: _Handle) -> None:
        handles = self._by_conn.get(conn)
        if handles is not None and handles.get(handle_id) is handle:
            del handles[handle_id]
            self._total -= 1
            if not handles:
                del self._by_conn[conn]

    def connection_closed(self, conn: object) -> None:
        """Close every handle of ``conn`` (those being read, once their reads end)."""
        for handle in self._by_conn.pop(conn, {}).values():
            self._total -= 1
            handle.close()
        if conn in self._opening:
            self._gone.add(conn)

    def open_count(self) -> int:
        return self._total


def register(dispatcher: Any, run: Runner, guard: Guard) -> FileHandles:
    """Add the three routes to ``dispatcher``; ``run`` and ``guard`` are the fs pool's."""
    handles = FileHandles(run, guard)
    dispatcher.add_method(FsOpen, handles.open)
    dispatcher.add_method(FsReadBlock, handles.read_block)
    dispatcher.add_method(FsWriteBlock, handles.write_block)
    dispatcher.add_method(FsClose, handles.close)
    dispatcher.closed_hooks.append(handles.connection_closed)
    return handles
