"""The seq-numbered, capped record of one process's output, and the server-wide tally of them."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from itertools import islice
from typing import Final, Protocol

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
    #: The output seqs the caller asked for that are no longer retained
    #: (first and last, inclusive), or None when nothing was skipped.
    gap: tuple[int, int] | None


class RetainedOutput:
    """Output chunks numbered 1, 2, 3, ... across all streams of a process.

    One counter per process, as the reference numbers it: output chunks, the
    exit and the close each take the next seq (:meth:`mark` takes one for an
    event that is not output). Holds at most ``cap_bytes`` (data plus
    :data:`CHUNK_OVERHEAD_BYTES` per chunk); when a new chunk pushes it over,
    the oldest chunks are dropped -- unless :meth:`protect` was called: then
    only chunks at or below the acknowledged seq are dropped, and
    :attr:`full` tells the owner to stop reading until an acknowledgement
    frees room. Retained chunks cover the seq range ``[first_seq, next_seq)``
    minus the marked seqs.
    """

    __slots__ = (
        "_acked",
        "_cap",
        "_chunks",
        "_first_seq",
        "_last_output_seq",
        "_marks",
        "_next_seq",
        "_size",
        "dropped",
    )

    def __init__(self, cap_bytes: int) -> None:
        self._cap = cap_bytes
        self._chunks: deque[RetainedChunk] = deque()
        self._size = 0
        self._first_seq = 1
        self._next_seq = 1
        #: The seq of the newest output chunk (0: none yet), retained or not.
        self._last_output_seq = 0
        #: Seqs taken by exit and close (at most two).
        self._marks: list[int] = []
        #: None: drop the oldest when over the cap; else the highest seq the
        #: client acknowledged (only chunks up to it may be dropped).
        self._acked: int | None = None
        #: Chunks dropped so far (reported as gaps).
        self.dropped = 0

    @property
    def next_seq(self) -> int:
        """The seq the next chunk will get."""
        return self._next_seq

    @property
    def last_output_seq(self) -> int:
        """The seq of the newest output chunk, 0 before any (exit and close are not output)."""
        return self._last_output_seq

    @property
    def first_seq(self) -> int:
        """The oldest seq still retained (== next_seq when empty)."""
        return self._first_seq

    @property
    def retained_bytes(self) -> int:
        return self._size

    def __len__(self) -> int:
        return len(self._chunks)

    @property
    def full(self) -> bool:
        """Protected, and unacknowledged output fills the cap."""
        acked = self._acked
        return (
            acked is not None
            and self._size >= self._cap
            and bool(self._chunks)
            and self._chunks[0].seq > acked
        )

    @property
    def protected(self) -> bool:
        return self._acked is not None

    def protect(self) -> None:
        """From now on drop only acknowledged chunks (``onDetachedFull: pause``)."""
        if self._acked is None:
            self._acked = self._first_seq - 1

    def acknowledge(self, seq: int) -> None:
        """The client has every seq up to ``seq``: those chunks may be dropped."""
        if self._acked is not None and seq > self._acked:
            self._acked = min(seq, self._next_seq - 1)
            self._evict()

    def mark(self) -> int:
        """Take the next seq for an event that is not output (exit, close)."""
        seq = self._next_seq
        self._next_seq = seq + 1
        self._marks.append(seq)
        if not self._chunks:
            self._first_seq = self._next_seq
        return seq

    def append(self, stream: OutputStream, data: bytes) -> int:
        seq = self._next_seq
        self._next_seq = seq + 1
        self._last_output_seq = seq
        self._chunks.append(RetainedChunk(seq, stream, data))
        self._size += len(data) + CHUNK_OVERHEAD_BYTES
        self._evict()
        return seq

    def shed(self, nbytes: int) -> None:
        """Drop the oldest chunks (only acknowledged ones if protected) to free ``nbytes``.

        The newest chunk is kept. Dropped chunks are gaps, as for the cap.
        """
        chunks = self._chunks
        acked = self._acked
        target = self._size - nbytes
        while self._size > target and len(chunks) > 1 and (acked is None or chunks[0].seq <= acked):
            evicted = chunks.popleft()
            self._size -= len(evicted.data) + CHUNK_OVERHEAD_BYTES
            self.dropped += 1
        self._first_seq = chunks[0].seq if chunks else self._next_seq

    def _evict(self) -> None:
        chunks = self._chunks
        acked = self._acked
        while self._size > self._cap and chunks and (acked is None or chunks[0].seq <= acked):
            evicted = chunks.popleft()
            self._size -= len(evicted.data) + CHUNK_OVERHEAD_BYTES
            self.dropped += 1
        self._first_seq = chunks[0].seq if chunks else self._next_seq

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
        first = self._first_seq
        if start_seq < first:
            # Seqs of the exit and close are events, not lost output.
            low, high = start_seq, first - 1
            while low <= high and low in self._marks:
                low += 1
            while high >= low and high in self._marks:
                high -= 1
            if low <= high:
                gap = (low, high)
            start_seq = first
        # A marked seq between retained chunks has no slot in the deque.
        skip = start_seq - first - sum(1 for m in self._marks if first <= m < start_seq)
        out: list[RetainedChunk] = []
        next_seq = self._next_seq
        total = 0
        for chunk in islice(self._chunks, skip, None):
            size = len(chunk.data)
            if max_bytes is not None and out and total + size > max_bytes:
                break
            total += size
            out.append(chunk)
            next_seq = chunk.seq + 1
            if max_bytes is not None and total >= max_bytes:
                break
        return ReadResult(out, next_seq, gap)


class Retainer(Protocol):
    """What :class:`RetainedTally` needs of a process it counts (``processes.ManagedProcess``)."""

    @property
    def output(self) -> RetainedOutput: ...

    def shed_output(self, nbytes: int) -> None:
        """Drop at least ``nbytes`` of the oldest retained output (keeping the newest chunk)."""


class RetainedTally:
    """Output bytes retained by the processes of every session of a server.

    Kept up to date where output is retained and released (each process adds
    what it retains and takes it back when acknowledged output is dropped or
    the process is forgotten), so ``--max-total-retained-bytes`` is checked
    without summing every process of every session on each ``process/start``.

    ``cap`` (0: none) is also enforced as output arrives (docs/operations.md,
    "Limits a peer cannot exceed"): when a chunk takes the total over it,
    the process that read it drops its own oldest chunks, then, if that is
    not enough, the process retaining the most does (:meth:`shed`); each
    keeps at least its newest chunk, and what is dropped is a gap, as for
    the per-process cap. A process whose session chose ``onDetachedFull:
    "pause"`` never loses unacknowledged output: it is not read while the
    total stays over the cap (:meth:`when_room`).
    """

    __slots__ = ("_waiting", "bytes", "cap", "members")

    def __init__(self, cap: int = 0) -> None:
        self.bytes = 0
        self.cap = cap
        #: Callbacks of paused processes, run once the total is within the cap.
        self._waiting: dict[object, Callable[[], None]] = {}
        #: Every process counted here.
        self.members: set[Retainer] = set()

    def retained(self, reader: Retainer, nbytes: int) -> None:
        """``reader`` retained ``nbytes`` more (a new chunk): the cap, enforced as it arrives."""
        self.bytes += nbytes
        if self.over:
            self.shed(reader)
            # (What others dropped may make room for a paused one.)
            self.released()

    def shed(self, reader: Retainer) -> None:
        """The total is over the cap after ``reader`` retained a chunk: drop the oldest output."""
        reader.shed_output(self.bytes - self.cap)
        while self.bytes > self.cap:
            victim = max(
                (m for m in self.members if not m.output.protected and len(m.output) > 1),
                key=lambda m: m.output.retained_bytes,
                default=None,
            )
            if victim is None:
                return
            victim.shed_output(self.bytes - self.cap)

    @property
    def over(self) -> bool:
        return bool(self.cap) and self.bytes > self.cap

    def when_room(self, key: object, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the total is back within the cap (nothing if it is now)."""
        if self.over:
            self._waiting[key] = callback

    def released(self) -> None:
        """Retained output went down: wake the paused processes if there is room."""
        if self._waiting and not self.over:
            waiting, self._waiting = self._waiting, {}
            for callback in waiting.values():
                callback()

    def forget(self, key: object) -> None:
        self._waiting.pop(key, None)
