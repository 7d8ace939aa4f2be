"""Whole-file transfers in ranges.

:func:`upload` and :func:`download` move a file of any size as a sequence
of ranged ``fs/writeFile`` / ``fs/readFile`` calls (8 MiB each by default),
so neither side ever holds more than one range; :class:`FileTransfers`
offers them as client methods. The wire shapes are
:mod:`execserver.clientcore.transfer`, shared with the asyncio client.

The ``fs`` subcommands of ``exec-server-client`` are
:mod:`execserver.client.cli.fs`.
"""

from __future__ import annotations

import os
from typing import BinaryIO

from twisted.internet.defer import Deferred

from execserver import protocol as p
from execserver.client.api import ClientApi
from execserver.clientcore.errors import RangesNotSupported
from execserver.clientcore.transfer import (
    RANGE_CAPABILITIES,
    TRANSFER_CHUNK_BYTES,
    Progress,
    RangedRead,
    RangedReadResult,
    RangedWrite,
    require_ranges,
)

__all__ = [
    "RANGE_CAPABILITIES",
    "TRANSFER_CHUNK_BYTES",
    "FileTransfers",
    "Progress",
    "RangesNotSupported",
    "download",
    "upload",
]


def _require_ranges(client: ClientApi, capability: str) -> None:
    # A client that knows the server's capabilities checks them: a baseline
    # server would ignore `offset` and replace the whole file with each range.
    known = getattr(client, "capabilities", None)
    if isinstance(known, list):
        require_ranges(known, capability)


def _open_local(
    local_file: str | os.PathLike[str] | BinaryIO, write: bool
) -> tuple[BinaryIO, bool]:
    """The file to use, and whether it was opened here (and so is closed here)."""
    if isinstance(local_file, str | os.PathLike):
        return (open(local_file, "wb") if write else open(local_file, "rb")), True
    return local_file, False


async def download(
    client: ClientApi,
    path: str,
    local_file: str | os.PathLike[str] | BinaryIO,
    *,
    chunk_bytes: int = TRANSFER_CHUNK_BYTES,
    progress: Progress | None = None,
) -> int:
    """Copy the remote file ``path`` into ``local_file`` (a path or a binary file).

    Reads ranges of ``chunk_bytes`` until the end of the file; returns the
    bytes copied. Each range is read when asked for: a file that changes
    meanwhile is copied as the ranges found it.
    """
    _require_ranges(client, RANGE_CAPABILITIES[0])
    offset = 0
    got = await client._call(
        p.FS_READ_FILE, RangedRead(path, offset, chunk_bytes), RangedReadResult
    )
    # Opened once the first range has arrived: a missing or unreadable
    # remote file leaves the local file as it was.
    out, owned = _open_local(local_file, write=True)
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
            got = await client._call(p.FS_READ_FILE, params, RangedReadResult)
    finally:
        if owned:
            out.close()


async def upload(
    client: ClientApi,
    path: str,
    local_file: str | os.PathLike[str] | BinaryIO,
    *,
    chunk_bytes: int = TRANSFER_CHUNK_BYTES,
    progress: Progress | None = None,
) -> int:
    """Copy ``local_file`` (a path or a binary file, e.g. stdin) to the remote ``path``.

    A file that fits in one chunk is written with one plain ``fs/writeFile``
    (an atomic replacement). A larger one is written in place, range by
    range: the first range truncates the remote file (``offset: 0,
    truncate: true``), each next one extends it; until the last range
    arrives, readers see a partial file. Returns the bytes copied.
    """
    source, owned = _open_local(local_file, write=False)
    try:
        try:
            total: int | None = os.fstat(source.fileno()).st_size
        except (OSError, ValueError, AttributeError):
            total = None
        data = source.read(chunk_bytes)
        following = source.read(chunk_bytes) if len(data) == chunk_bytes else b""
        if not following:
            await client._call(p.FS_WRITE_FILE, p.FsWriteFileParams(path, data), p.Empty)
            if progress is not None:
                progress(len(data), len(data))
            return len(data)
        _require_ranges(client, RANGE_CAPABILITIES[1])
        offset = 0
        while data:
            params = RangedWrite(path, data, offset, truncate=True if offset == 0 else None)
            await client._call(p.FS_WRITE_FILE, params, p.Empty)
            offset += len(data)
            if progress is not None:
                progress(offset, total)
            data, following = following, source.read(chunk_bytes) if following else b""
        return offset
    finally:
        if owned:
            source.close()


class FileTransfers:
    """:func:`upload` and :func:`download` as methods of a client."""

    def upload(
        self,
        path: str,
        local_file: str | os.PathLike[str] | BinaryIO,
        *,
        chunk_bytes: int = TRANSFER_CHUNK_BYTES,
        progress: Progress | None = None,
    ) -> Deferred[int]:
        assert isinstance(self, ClientApi)
        return Deferred.fromCoroutine(
            upload(self, path, local_file, chunk_bytes=chunk_bytes, progress=progress)
        )

    def download(
        self,
        path: str,
        local_file: str | os.PathLike[str] | BinaryIO,
        *,
        chunk_bytes: int = TRANSFER_CHUNK_BYTES,
        progress: Progress | None = None,
    ) -> Deferred[int]:
        assert isinstance(self, ClientApi)
        return Deferred.fromCoroutine(
            download(self, path, local_file, chunk_bytes=chunk_bytes, progress=progress)
        )
