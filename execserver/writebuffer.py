"""What a Twisted write buffer holds, and when it pushes back, in one place.

Flow control needs two things Twisted's ``FileDescriptor`` keeps in
attributes rather than public API: how many bytes it holds unsent, and the
size (``bufferSize``) above which it pauses a registered streaming producer.
Every transport and the stdin writer of a process read them here only.
"""

from __future__ import annotations

from typing import Any


def unsent_bytes(writer: Any) -> int:
    """Bytes a Twisted FileDescriptor has accepted but not yet written."""
    try:
        return int(len(writer.dataBuffer) - writer.offset + writer._tempDataLen)
    except AttributeError:
        return 0


def set_high_water(transport: Any, limit: int) -> None:
    """Make the transport pause its producer once ``limit`` bytes are unsent.

    Twisted's FileDescriptor pauses a streaming producer above ``bufferSize``
    (64 KiB by default, less than one output notification) and resumes it
    once its buffer is empty. For StandardIO the buffer is its writer's.
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
