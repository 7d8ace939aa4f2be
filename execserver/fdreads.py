"""Reading a child's output: big reads, PTY coalescing, and the drain at exit."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Final

from twisted.internet.main import CONNECTION_DONE, CONNECTION_LOST

READ_SIZE: Final = 256 * 1024
# Capacity given to a child's stdout/stderr pipe once it fills the default
# 64 KiB (which caps every read at 64 KiB whatever READ_SIZE says); a pipe as
# large as one read lets each wakeup take a full READ_SIZE. Growing only busy
# pipes keeps unprivileged servers inside the kernel's per-user pipe quota
# (pipe-user-pages-soft) with hundreds of mostly quiet children.
PIPE_CAPACITY: Final = READ_SIZE
DEFAULT_PIPE_CAPACITY: Final = 64 * 1024
# A PTY master yields at most 4 KiB per read (the line discipline's buffer).
# Asking for READ_SIZE anyway costs an mmap-sized allocation per read (above
# malloc's 128 KiB threshold) that is shrunk to 4 KiB: ~45% more CPU per byte.
PTY_READ_SIZE: Final = 64 * 1024
# What is immediately available on a PTY is gathered, up to this much, into
# one chunk: one notification per 4 KiB would cost most of the PTY's speed.
PTY_COALESCE_BYTES: Final = 64 * 1024
# Bytes read synchronously from a stream when its process exits, so that all
# output written before the exit precedes the exit notification. Bounded so a
# grandchild that keeps writing cannot stall the reactor.
EXIT_DRAIN_LIMIT: Final = 8 * 1024 * 1024

Deliver = Callable[[bytes], object]


def read_into(
    fd: int, deliver: Deliver, size: int = READ_SIZE, filled: Callable[[], None] | None = None
) -> object:
    """One read for a reactor reader: None to go on, a reason when the stream ended.

    ``filled`` is called when a read took a whole default-size pipe's worth.
    """
    try:
        data = os.read(fd, size)
    except BlockingIOError:
        return None
    except OSError:
        # EIO: the PTY's slave side is closed and drained.
        return CONNECTION_LOST
    if not data:
        return CONNECTION_DONE
    if filled is not None and len(data) >= DEFAULT_PIPE_CAPACITY:
        filled()
    deliver(data)
    return None


def read_coalesced(fd: int, deliver: Deliver) -> object:
    """Read what a PTY has ready (up to PTY_COALESCE_BYTES) as one chunk."""
    pieces: list[bytes] = []
    total = 0
    ended: object = None
    while total < PTY_COALESCE_BYTES:
        try:
            data = os.read(fd, PTY_READ_SIZE)
        except BlockingIOError:
            break
        except OSError:
            ended = CONNECTION_LOST
            break
        if not data:
            ended = CONNECTION_DONE
            break
        pieces.append(data)
        total += len(data)
    if pieces:
        deliver(pieces[0] if len(pieces) == 1 else b"".join(pieces))
    return ended


def drain(fd: int, deliver: Deliver, size: int = READ_SIZE) -> None:
    """Deliver what ``fd`` holds now (up to EXIT_DRAIN_LIMIT), without blocking."""
    budget = EXIT_DRAIN_LIMIT
    while budget > 0:
        try:
            data = os.read(fd, size)
        except OSError:
            return
        if not data:
            return
        budget -= len(data)
        deliver(data)
