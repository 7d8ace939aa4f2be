"""fs/readFile's text, produced slice by slice: bulk slices, then a tail of small ones.

Whatever the file's size, whatever size the reader was told to expect (a
file may grow or shrink while read, or report 0 like /proc), and however
the reads are cut short, the pieces join into the base64 of exactly the
bytes read. Large pieces are ``bytes`` of a whole bulk slice's text (so the
allocator maps them, and unmaps them once sent); the last bulk slice's
worth is read in small slices (docs/filesystem.md, "Memory and throughput").
"""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from execserver.fs import ops

BULK = ops.BULK_SLICE_BYTES
TAIL = ops.TAIL_SLICE_BYTES
SIZES = [0, 1, 2, 3, 4, TAIL - 1, TAIL + 1, BULK, 2 * BULK - 1, 2 * BULK + 2, 4 * BULK + TAIL + 1]


def _read(path: Path, want: int, expected: int) -> tuple[list[bytes], int]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return ops._read_encoded(fd, want, expected)
    finally:
        os.close(fd)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("expected_shift", [0, -BULK - 7, BULK + 5])
def test_pieces_join_into_the_base64_of_the_file(
    tmp_path: Path, size: int, expected_shift: int
) -> None:
    data = os.urandom(size)
    path = tmp_path / "f"
    path.write_bytes(data)
    pieces, total = _read(path, size + 1, max(0, size + expected_shift))
    assert total == size
    assert b"".join(pieces) == base64.b64encode(data)
    assert all(type(piece) is bytes for piece in pieces)
    # Only whole multiples of 3 bytes are encoded before the last piece.
    assert all(len(piece) % 4 == 0 for piece in pieces)
    if expected_shift == 0 and size >= 2 * BULK:
        # Bulk pieces first, then the tail in small ones.
        assert len(pieces[0]) == BULK // 3 * 4
        assert max(len(piece) for piece in pieces[-3:]) <= TAIL // 3 * 4


@pytest.mark.parametrize("want", [1, 2, 5, TAIL, BULK + 1, 2 * BULK + 4])
def test_a_range_stops_at_its_length(tmp_path: Path, want: int) -> None:
    data = os.urandom(3 * BULK)
    path = tmp_path / "f"
    path.write_bytes(data)
    pieces, total = _read(path, want, want)
    assert total == want
    assert b"".join(pieces) == base64.b64encode(data[:want])


@settings(max_examples=30, deadline=None)
@given(cuts=st.lists(st.integers(1, 4 * 1024 * 1024), min_size=1, max_size=12))
def test_short_reads_anywhere_give_the_same_text(cuts: list[int], monkeypatch_reads: Any) -> None:
    """``readv`` returning fewer bytes than asked (a pipe-like file) changes nothing."""
    path, data = monkeypatch_reads.file
    limits = iter(cuts)
    real_readv = os.readv

    def short_readv(fd: int, buffers: list[Any]) -> int:
        (view,) = buffers
        cut = next(limits, None)
        return real_readv(fd, [view[:cut] if cut is not None else view])

    monkeypatch_reads.setattr(os, "readv", short_readv)
    try:
        pieces, total = _read(path, len(data) + 1, len(data))
    finally:
        monkeypatch_reads.undo()
    assert total == len(data)
    assert b"".join(pieces) == base64.b64encode(data)


@pytest.fixture(scope="module")
def monkeypatch_reads(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("reads") / "f"
    data = os.urandom(2 * BULK + TAIL + 2)
    path.write_bytes(data)
    patcher = pytest.MonkeyPatch()
    patcher.file = (path, data)  # type: ignore[attr-defined]
    yield patcher
    patcher.undo()
