"""Whole-file transfers in ranges.

:func:`upload` and :func:`download` move a file of any size as a sequence
of ranged ``fs/writeFile`` / ``fs/readFile`` calls (8 MiB each by default),
so neither side ever holds more than one range; :class:`FileTransfers`
offers them as client methods. The transfer loops and the wire shapes are
:mod:`execserver.clientcore.transfer`, shared with the asyncio client.

The ``fs`` subcommands of ``exec-server-client`` are
:mod:`execserver.client.cli.fs`.
"""

from __future__ import annotations

import os
from typing import BinaryIO

from twisted.internet.defer import Deferred

from execserver.client.api import ClientApi
from execserver.clientcore import transfer
from execserver.clientcore.errors import RangesNotSupported
from execserver.clientcore.transfer import RANGE_CAPABILITIES, TRANSFER_CHUNK_BYTES, Progress

__all__ = [
    "RANGE_CAPABILITIES",
    "TRANSFER_CHUNK_BYTES",
    "FileTransfers",
    "Progress",
    "RangesNotSupported",
    "download",
    "upload",
]


def _capabilities(client: ClientApi) -> list[str] | None:
    # A client that knows the server's capabilities checks them: a baseline
    # server would ignore `offset` and replace the whole file with each range.
    known = getattr(client, "capabilities", None)
    return known if isinstance(known, list) else None


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
    return await transfer.download(
        client._call,
        _capabilities(client),
        path,
        local_file,
        chunk_bytes=chunk_bytes,
        progress=progress,
    )


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
    return await transfer.upload(
        client._call,
        _capabilities(client),
        path,
        local_file,
        chunk_bytes=chunk_bytes,
        progress=progress,
    )


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
