"""The seq-numbered, capped record of one process's output."""

from __future__ import annotations

from collections import deque
from itertools import islice
from typing import Final

import attrs

from execserver.protocol import OutputStream

# Each retained chunk costs a Python object and a deque slot besides its data.
# Counting that against the cap keeps memory bounded by the cap even for a
# process that writes one byte at a time.
CHUNK_OVERHEAD_BYTES: Final = 96


@attrs.frozen
class RetainedChunk:
    seq: int
    stream: OutputStream
    data: bytes


@attrs.define
class ReadResult:
    chunks: list[RetainedChunk]
    next_seq: int
    #: First seq the caller asked for that is no longer retained, with the
    #: end of that range (exclusive), or None when nothing was skipped.
    gap: tuple[int, int] | None


class RetainedOutput:
    """Output chunks numbered 1, 2, 3, ... across all streams of a process.

    Holds at most ``cap_bytes`` (data plus :data:`CHUNK_OVERHEAD_BYTES` per
    chunk); when a new chunk pushes it over, the oldest chunks are dropped.
    Retained chunks always form one contiguous seq range
    ``[first_seq, next_seq)``.
    """

    __slots__ = ("_cap", "_chunks", "_first_seq", "_next_seq", "_size")

    def __init__(self, cap_bytes: int) -> None:
        self._cap = cap_bytes
        self._chunks: deque[RetainedChunk] = deque()
        self._size = 0
        self._first_seq = 1
        self._next_seq = 1

    @property
    def next_seq(self) -> int:
        """The seq the next chunk will get."""
        return self._next_seq

    @property
    def first_seq(self) -> int:
        """The oldest seq still retained (== next_seq when empty)."""
        return self._first_seq

    @property
    def retained_bytes(self) -> int:
        return self._size

    def __len__(self) -> int:
        return len(self._chunks)

    def append(self, stream: OutputStream, data: bytes) -> int:
        seq = self._next_seq
        self._next_seq = seq + 1
        self._chunks.append(RetainedChunk(seq, stream, data))
        self._size += len(data) + CHUNK_OVERHEAD_BYTES
        chunks = self._chunks
        while self._size > self._cap and chunks:
            evicted = chunks.popleft()
            self._size -= len(evicted.data) + CHUNK_OVERHEAD_BYTES
        self._first_seq = chunks[0].seq if chunks else self._next_seq
        return seq

    def read(self, after_seq: int, max_bytes: int | None) -> ReadResult:
        """Chunks with seq > ``after_seq``, as the reference paginates them.

        The first available chunk is always returned, however large; further
        chunks are added while the total stays within ``max_bytes``.
        ``next_seq`` is one past the last returned chunk, or the process's
        next seq when nothing was returned, so ``afterSeq = nextSeq - 1``
        resumes without skipping a chunk.
        """
        start_seq = after_seq + 1
        gap = None
        if start_seq < self._first_seq:
            gap = (start_seq, self._first_seq)
            start_seq = self._first_seq
        out: list[RetainedChunk] = []
        next_seq = self._next_seq
        total = 0
        for chunk in islice(self._chunks, start_seq - self._first_seq, None):
            size = len(chunk.data)
            if max_bytes is not None and out and total + size > max_bytes:
                break
            total += size
            out.append(chunk)
            next_seq = chunk.seq + 1
            if max_bytes is not None and total >= max_bytes:
                break
        return ReadResult(out, next_seq, gap)
