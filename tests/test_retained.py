"""Unit tests of the seq-numbered, capped output buffer."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from execserver.retained import CHUNK_OVERHEAD_BYTES, RetainedChunk, RetainedOutput, RetainedTally

BIG = 1 << 30


def test_seq_numbers_start_at_one_and_span_all_streams() -> None:
    out = RetainedOutput(BIG)
    assert out.next_seq == 1
    assert out.first_seq == 1
    assert out.append("stdout", b"a") == 1
    assert out.append("stderr", b"b") == 2
    assert out.append("stdout", b"c") == 3
    assert out.next_seq == 4
    assert len(out) == 3
    assert [c.stream for c in out.read(0, None).chunks] == ["stdout", "stderr", "stdout"]


def test_empty_read_reports_the_next_seq() -> None:
    out = RetainedOutput(BIG)
    result = out.read(0, None)
    assert result.chunks == []
    assert result.next_seq == 1
    assert result.gap is None


def test_reference_pagination_never_skips_an_omitted_chunk() -> None:
    """``read_paginates_retained_output_without_skipping_omitted_chunks``."""
    out = RetainedOutput(BIG)
    out.append("stdout", b"abc")
    out.append("stderr", b"def")
    first = out.read(0, 3)
    assert first.chunks == [RetainedChunk(1, "stdout", b"abc")]
    assert first.next_seq == 2
    second = out.read(first.next_seq - 1, 3)
    assert second.chunks == [RetainedChunk(2, "stderr", b"def")]
    assert second.next_seq == 3
    third = out.read(second.next_seq - 1, 3)
    assert third.chunks == []
    assert third.next_seq == 3


def test_the_first_chunk_is_returned_even_when_larger_than_max_bytes() -> None:
    out = RetainedOutput(BIG)
    out.append("stdout", b"x" * 100)
    out.append("stdout", b"y")
    for max_bytes in (0, 1, 99):
        result = out.read(0, max_bytes)
        assert [c.seq for c in result.chunks] == [1]
        assert result.next_seq == 2


def test_max_bytes_adds_chunks_while_the_total_fits() -> None:
    out = RetainedOutput(BIG)
    for data in (b"aa", b"bb", b"cc", b"dd"):
        out.append("stdout", data)
    assert [c.seq for c in out.read(0, 5).chunks] == [1, 2]
    assert [c.seq for c in out.read(0, 6).chunks] == [1, 2, 3]
    assert [c.seq for c in out.read(1, None).chunks] == [2, 3, 4]
    assert out.read(0, 6).next_seq == 4
    assert out.read(4, None).next_seq == 5


def test_after_seq_beyond_the_end_returns_nothing() -> None:
    out = RetainedOutput(BIG)
    out.append("stdout", b"a")
    result = out.read(10, None)
    assert result.chunks == []
    assert result.next_seq == 2


def test_cap_evicts_oldest_first_counting_per_chunk_overhead() -> None:
    cap = 3 * (10 + CHUNK_OVERHEAD_BYTES)
    out = RetainedOutput(cap)
    for i in range(3):
        out.append("stdout", bytes([65 + i]) * 10)
    assert len(out) == 3
    assert out.retained_bytes == cap
    out.append("stderr", b"D" * 10)
    assert len(out) == 3
    assert out.first_seq == 2
    assert [c.seq for c in out.read(0, None).chunks] == [2, 3, 4]
    assert out.retained_bytes == cap


def test_tiny_chunks_are_bounded_by_their_overhead() -> None:
    out = RetainedOutput(10 * CHUNK_OVERHEAD_BYTES)
    for _ in range(1000):
        out.append("pty", b"")
    assert len(out) == 10
    assert out.first_seq == 991
    assert out.next_seq == 1001


def test_a_chunk_larger_than_the_cap_leaves_nothing_retained() -> None:
    out = RetainedOutput(100)
    out.append("stdout", b"small")
    assert out.append("stdout", b"x" * 1000) == 2
    assert len(out) == 0
    assert out.retained_bytes == 0
    assert out.first_seq == out.next_seq == 3
    result = out.read(0, None)
    assert result.chunks == []
    assert result.next_seq == 3
    assert result.gap == (1, 2)


def test_reading_evicted_output_reports_the_gap() -> None:
    out = RetainedOutput(2 * (4 + CHUNK_OVERHEAD_BYTES))
    for i in range(5):
        out.append("stdout", b"%04d" % i)
    assert out.first_seq == 4
    result = out.read(1, None)
    assert result.gap == (2, 3)
    assert [c.seq for c in result.chunks] == [4, 5]
    assert out.read(3, None).gap is None


appends = st.lists(
    st.tuples(st.sampled_from(["stdout", "stderr", "pty"]), st.binary(max_size=64)),
    max_size=60,
)


@given(appends, st.integers(min_value=0, max_value=4096), st.none() | st.integers(0, 200))
def test_paginating_never_skips_or_repeats_a_retained_chunk(
    writes: list[tuple[Any, bytes]], cap: int, max_bytes: int | None
) -> None:
    out = RetainedOutput(cap)
    for stream, data in writes:
        out.append(stream, data)
    expected = out.read(0, None).chunks
    # Retained chunks are a contiguous seq range ending at next_seq - 1.
    assert [c.seq for c in expected] == list(range(out.first_seq, out.next_seq))
    assert out.retained_bytes == sum(len(c.data) + CHUNK_OVERHEAD_BYTES for c in expected)
    assert out.retained_bytes <= cap

    seen: list[RetainedChunk] = []
    after = 0
    for _ in range(len(writes) + 2):
        page = out.read(after, max_bytes)
        if not page.chunks:
            assert page.next_seq == out.next_seq
            break
        assert page.chunks[0].seq == max(after + 1, out.first_seq)
        if max_bytes is not None and len(page.chunks) > 1:
            assert sum(len(c.data) for c in page.chunks) <= max_bytes
        assert page.next_seq == page.chunks[-1].seq + 1
        seen.extend(page.chunks)
        after = page.next_seq - 1
    assert seen == expected


@given(appends, st.integers(min_value=0, max_value=2048), st.integers(min_value=0, max_value=80))
def test_gap_is_exactly_the_evicted_part_of_the_requested_range(
    writes: list[tuple[Any, bytes]], cap: int, after: int
) -> None:
    out = RetainedOutput(cap)
    for stream, data in writes:
        out.append(stream, data)
    result = out.read(after, None)
    if after + 1 < out.first_seq:
        assert result.gap == (after + 1, out.first_seq - 1)
    else:
        assert result.gap is None


def test_exit_and_close_take_seqs_that_reads_skip_without_a_gap() -> None:
    out = RetainedOutput(1 << 20)
    assert out.append("stdout", b"a") == 1
    assert out.mark() == 2  # exit
    assert out.append("stdout", b"late") == 3  # a grandchild still writes
    assert out.mark() == 4  # close
    result = out.read(0, None)
    assert [(c.seq, c.data) for c in result.chunks] == [(1, b"a"), (3, b"late")]
    assert result.gap is None
    assert [c.seq for c in out.read(2, None).chunks] == [3]
    assert out.read(3, None).next_seq == 5


def test_a_gap_never_names_the_exit_or_close_seq_alone() -> None:
    out = RetainedOutput(2 * (4 + CHUNK_OVERHEAD_BYTES))
    out.append("stdout", b"aaaa")
    out.mark()
    for _ in range(3):
        out.append("stdout", b"bbbb")
    # seq 1 and 3 dropped, 2 is the exit: the gap is 1..3 (output 1 and 3).
    assert out.first_seq == 4
    assert out.read(0, None).gap == (1, 3)
    assert out.read(1, None).gap == (3, 3)
    assert out.read(2, None).gap == (3, 3)


def test_protected_output_is_dropped_only_once_acknowledged() -> None:
    chunk = 4 + CHUNK_OVERHEAD_BYTES
    out = RetainedOutput(2 * chunk)
    out.protect()
    for _ in range(4):
        out.append("stdout", b"cccc")
    assert out.full
    assert [c.seq for c in out.read(0, None).chunks] == [1, 2, 3, 4]
    assert out.dropped == 0
    out.acknowledge(3)
    # Acknowledged output is still kept while it fits.
    assert [c.seq for c in out.read(0, None).chunks] == [3, 4]
    assert out.read(0, None).gap == (1, 2)
    assert not out.full
    assert out.dropped == 2
    out.append("stdout", b"dddd")
    assert [c.seq for c in out.read(0, None).chunks] == [4, 5]
    assert out.full


class _Member:
    """A process counted by a tally: its output, and its shedding kept in the tally."""

    def __init__(self, tally: RetainedTally) -> None:
        self.output = RetainedOutput(BIG)
        self.tally = tally
        tally.members.add(self)

    def retain(self, data: bytes) -> None:
        before = self.output.retained_bytes
        self.output.append("stdout", data)
        self.tally.retained(self, self.output.retained_bytes - before)

    def shed_output(self, nbytes: int) -> None:
        before = self.output.retained_bytes
        self.output.shed(nbytes)
        self.tally.bytes += self.output.retained_bytes - before


def test_the_tally_enforces_its_cap_as_output_is_retained() -> None:
    # The one place the server-wide cap is checked as output arrives: the
    # reader drops its own oldest first, then the largest other member;
    # each keeps its newest chunk.
    chunk = 100 + CHUNK_OVERHEAD_BYTES
    tally = RetainedTally(cap=4 * chunk)
    big, reader = _Member(tally), _Member(tally)
    for _ in range(4):
        big.retain(b"b" * 100)
    assert tally.bytes == 4 * chunk and not tally.over
    reader.retain(b"r" * 100)  # over: the reader has nothing older, big sheds
    assert (len(reader.output), len(big.output)) == (1, 3)
    assert tally.bytes == 4 * chunk == sum(m.output.retained_bytes for m in (big, reader))
    reader.retain(b"r" * 100)  # the reader's own oldest goes first
    assert (len(reader.output), len(big.output)) == (1, 3)
    woken: list[int] = []
    tally.when_room(big, lambda: woken.append(1))
    assert woken == []  # within the cap: nothing to wait for
    assert RetainedTally().over is False  # no cap: never over
