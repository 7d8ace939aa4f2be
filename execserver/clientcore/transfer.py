"""Wire shapes of ranged ``fs/readFile`` / ``fs/writeFile`` (docs/filesystem.md).

The offset/length/truncate fields and the ``size`` of a ranged read are
extensions of this server, listed in its ``capabilities`` as
:data:`RANGE_CAPABILITIES`; :func:`require_ranges` refuses before anything
is sent when a server does not list them (a baseline server would ignore
``offset`` and replace the whole file with each range).

:func:`download` and :func:`upload` are the transfer loops themselves, shared
by the Twisted and the asyncio clients: coroutines that ``await`` whatever
the client's ``call`` returns (a ``Deferred`` inside
``Deferred.fromCoroutine``, an asyncio coroutine), so each client adds only
how it calls.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import BinaryIO, Protocol, TypeVar

import msgspec

from execserver import protocol as p
from execserver.clientcore.errors import RangesNotSupported

T = TypeVar("T")

#: Bytes per ranged call of ``upload`` and ``download``.
TRANSFER_CHUNK_BYTES = 8 * 1024 * 1024

#: ``progress(done, total)``: bytes moved so far, and the file's size when known.
Progress = Callable[[int, "int | None"], None]

#: What a server lists in ``capabilities`` when it takes ranged fs calls.
RANGE_CAPABILITIES = p.RANGE_CAPABILITIES


class RangedRead(msgspec.Struct, rename="camel"):
    path: str
    offset: int
    length: int


class RangedReadResult(msgspec.Struct, rename="camel"):
    data_base64: bytes
    size: int


class RangedWrite(msgspec.Struct, rename="camel", omit_defaults=True):
    path: str
    data_base64: bytes
    offset: int | None = None
    truncate: bool | None = None


def require_ranges(capabilities: list[str], capability: str) -> None:
    if capability not in capabilities:
        raise RangesNotSupported(
            f"the server does not support ranged fs calls ({capability} not in its "
            "capabilities); use fs_read_file/fs_write_file"
        )


class Caller(Protocol):
    """A client's ``call(method, params, result_type)``."""

    def __call__(self, method: str, params: object, result_type: type[T], /) -> Awaitable[T]: ...


def open_local(local_file: str | os.PathLike[str] | BinaryIO, write: bool) -> tuple[BinaryIO, bool]:
    """The file to use, and whether it was opened here (and so is closed here)."""
    if isinstance(local_file, str | os.PathLike):
        return (open(local_file, "wb") if write else open(local_file, "rb")), True
    return local_file, False


async def download(
    call: Caller,
    capabilities: list[str] | None,
    path: str,
    local_file: str | os.PathLike[str] | BinaryIO,
    *,
    chunk_bytes: int = TRANSFER_CHUNK_BYTES,
    progress: Progress | None = None,
) -> int:
    """Copy the remote file ``path`` into ``local_file`` in ranged ``fs/readFile`` calls.

    Reads ranges of ``chunk_bytes`` until the first short one or the end of
    the file; returns the bytes copied. ``capabilities``: the server's, checked
    for ``fs/readFile:range`` before anything is sent (None: not known, not
    checked).
    """
    if capabilities is not None:
        require_ranges(capabilities, RANGE_CAPABILITIES[0])
    offset = 0
    got = await call(p.FS_READ_FILE, RangedRead(path, offset, chunk_bytes), RangedReadResult)
    # Opened once the first range has arrived: a missing or unreadable
    # remote file leaves the local file as it was.
    out, owned = open_local(local_file, write=True)
    try:
        while True:
            data = got.data_base64
            out.write(data)
            offset += len(data)
            if progress is not None:
                progress(offset, got.size)
            if len(data) < chunk_bytes or offset >= got.size:
                return offset
            params = RangedRead(path, offset, chunk_bytes)
            got = await call(p.FS_READ_FILE, params, RangedReadResult)
    finally:
        if owned:
            out.close()


async def upload(
    call: Caller,
    capabilities: list[str] | None,
    path: str,
    local_file: str | os.PathLike[str] | BinaryIO,
    *,
    chunk_bytes: int = TRANSFER_CHUNK_BYTES,
    progress: Progress | None = None,
) -> int:
    """Copy ``local_file`` to the remote ``path``; returns the bytes copied.

    A file that fits in one chunk is written with one plain ``fs/writeFile``
    (an atomic replacement). A larger one is written in place, range by
    range: the first range truncates the remote file (``offset: 0,
    truncate: true``), each next one extends it. ``capabilities`` is checked
    for ``fs/writeFile:range`` only when more than one range is needed
    (None: not known, not checked).
    """
    source, owned = open_local(local_file, write=False)
    try:
        try:
            total: int | None = os.fstat(source.fileno()).st_size
        except (OSError, ValueError, AttributeError):
            total = None
        data = source.read(chunk_bytes)
        following = source.read(chunk_bytes) if len(data) == chunk_bytes else b""
        if not following:
            await call(p.FS_WRITE_FILE, p.FsWriteFileParams(path, data), p.Empty)
            if progress is not None:
                progress(len(data), len(data))
            return len(data)
        if capabilities is not None:
            require_ranges(capabilities, RANGE_CAPABILITIES[1])
        offset = 0
        while data:
            params = RangedWrite(path, data, offset, truncate=True if offset == 0 else None)
            await call(p.FS_WRITE_FILE, params, p.Empty)
            offset += len(data)
            if progress is not None:
                progress(offset, total)
            data, following = following, source.read(chunk_bytes) if following else b""
        return offset
    finally:
        if owned:
            source.close()
