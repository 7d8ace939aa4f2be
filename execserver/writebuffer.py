"""What a Twisted write buffer holds, and when it pushes back, in one place.

Flow control itself uses the public producer/consumer API: each transport
gets a streaming producer (``registerProducer``) that Twisted pauses above
the buffer's high-water mark and resumes once the buffer is empty. Three
figures have no public API, and this adapter is the only code that reads or
writes them:

- the bytes a ``FileDescriptor`` holds unsent (``dataBuffer``, ``offset``,
  ``_tempDataLen``): the fs reply budget (when a reply has left), the stdin
  bound of ``process/write``, and when a connection stops reading requests;
- the high-water mark itself (``bufferSize``, 64 KiB by default, less than
  one output notification);
- dropping what a closed descriptor still holds;
- ``StandardIO``'s writer (``_writer``), which holds its buffer.

:data:`PROBLEM` is None when ``FileDescriptor`` still keeps these fields as
relied on, checked at import (the service logs it as a warning otherwise);
``tests/test_writebuffer.py`` breaks if the unsent figure stops moving with
a real socket.
"""

from __future__ import annotations

from typing import Any, Final

from twisted.internet.abstract import FileDescriptor
from twisted.internet.stdio import StandardIO


class _NotAReactor:
    """Stands in for a reactor while a FileDescriptor is built only to be inspected."""


def check_fields(cls: Any = FileDescriptor) -> str | None:
    """None if ``cls`` keeps its write buffer in the fields read here, else what changed."""
    missing = [name for name in ("dataBuffer", "offset", "bufferSize") if not hasattr(cls, name)]
    try:
        probe = cls.__new__(cls)
        # Any reactor but the global one, which must not be installed by an import.
        cls.__init__(probe, reactor=_NotAReactor())
    except Exception as exc:
        return f"FileDescriptor() failed: {exc}"
    missing += [name for name in ("_tempDataBuffer", "_tempDataLen") if not hasattr(probe, name)]
    if missing:
        return f"FileDescriptor has no {', '.join(missing)}"
    if not hasattr(StandardIO, "_writer"):
        return "StandardIO keeps its writer elsewhere than _writer"
    return None


#: Why the unsent figure cannot be read with this Twisted, or None.
PROBLEM: Final = check_fields()


def unsent_bytes(writer: Any) -> int:
    """Bytes a Twisted FileDescriptor has accepted but not yet written."""
    try:
        return int(len(writer.dataBuffer) - writer.offset + writer._tempDataLen)
    except AttributeError:
        return 0


def set_high_water(transport: Any, limit: int) -> None:
    """Make the transport pause its producer once ``limit`` bytes are unsent.

    Twisted's FileDescriptor pauses a streaming producer above ``bufferSize``
    and resumes it once its buffer is empty. For StandardIO the buffer is
    its writer's.
    """
    target = getattr(transport, "_writer", None) or transport
    if hasattr(target, "bufferSize"):
        target.bufferSize = limit


def discard_unsent(writer: Any) -> None:
    """Drop what a closed FileDescriptor still holds: it will never be sent.

    Twisted keeps a lost connection's buffer until the transport object is
    collected; a client that stopped reading can leave hundreds of MiB there.
    Does nothing while the descriptor is still connected.
    """
    if writer is None or getattr(writer, "connected", False):
        return
    if hasattr(writer, "dataBuffer"):
        writer.dataBuffer = b""
        writer.offset = 0
        writer._tempDataBuffer = []
        writer._tempDataLen = 0
