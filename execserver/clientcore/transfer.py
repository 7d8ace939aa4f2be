"""Wire shapes of ranged ``fs/readFile`` / ``fs/writeFile`` (docs/filesystem.md).

The offset/length/truncate fields and the ``size`` of a ranged read are
extensions of this server, listed in its ``capabilities`` as
:data:`RANGE_CAPABILITIES`; :func:`require_ranges` refuses before anything
is sent when a server does not list them (a baseline server would ignore
``offset`` and replace the whole file with each range).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from execserver.clientcore.errors import RangesNotSupported

#: Bytes per ranged call of ``upload`` and ``download``.
TRANSFER_CHUNK_BYTES = 8 * 1024 * 1024

#: ``progress(done, total)``: bytes moved so far, and the file's size when known.
Progress = Callable[[int, "int | None"], None]

#: What a server lists in ``capabilities`` when it takes ranged fs calls.
RANGE_CAPABILITIES = ("fs/readFile:range", "fs/writeFile:range")


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
