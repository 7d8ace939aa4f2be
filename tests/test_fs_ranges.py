"""Ranged and chunked fs/readFile and fs/writeFile (issue 13, item 3), over the
in-memory dispatcher (fake clock: the operations run at once).

- hypothesis: for any initial content and any sequence of ranged writes
  (offset, append, truncate) and ranged reads, the file and every read agree
  with a model bytearray, and a read reports the file's size;
- a path replaced between ranged writes: each call writes whatever file the
  path names when it runs (docs/filesystem.md, "Ranged writes");
- the errors of bad ranges, and that unranged calls are exactly as before.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from execserver.config import ServerConfig
from tests.support.fakes import ready
from tests.support.harness import b64


@pytest.fixture
def target(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "f"


# One operation: ("write", offset | None, append, truncate, data) or ("read", offset, length).
_writes = st.tuples(
    st.just("write"),
    st.one_of(st.none(), st.integers(0, 300)),
    st.booleans(),
    st.booleans(),
    st.binary(max_size=200),
)
_reads = st.tuples(st.just("read"), st.integers(0, 400), st.one_of(st.none(), st.integers(0, 300)))


@settings(max_examples=150, deadline=None)
@given(
    initial=st.binary(max_size=300), operations=st.lists(st.one_of(_writes, _reads), max_size=12)
)
def test_ranged_writes_and_reads_agree_with_a_model(
    tmp_path_factory: Any, initial: bytes, operations: list[tuple[Any, ...]]
) -> None:
    path = str(tmp_path_factory.mktemp("ranges") / "f")
    h = ready()
    assert h.result("fs/writeFile", {"path": path, "dataBase64": b64(initial)}) == {}
    model = bytearray(initial)
    for operation in operations:
        if operation[0] == "write":
            _, offset, append, truncate, data = operation
            if offset is not None and append:
                offset = None  # both together are refused (tested below)
            params: dict[str, Any] = {"path": path, "dataBase64": b64(data)}
            if offset is not None:
                params["offset"] = offset
            if append:
                params["append"] = True
            if truncate:
                params["truncate"] = True
            assert h.result("fs/writeFile", params) == {}
            if append:
                model += data
            elif offset is not None:
                if offset > len(model):
                    model += bytes(offset - len(model))
                model[offset : offset + len(data)] = data
                if truncate:
                    del model[offset + len(data) :]
            else:
                model[:] = data  # the atomic replacement
        else:
            _, offset, length = operation
            params = {"path": path, "offset": offset}
            if length is not None:
                params["length"] = length
            result = h.result("fs/readFile", params)
            end = len(model) if length is None else offset + length
            assert base64.b64decode(result["dataBase64"]) == bytes(model[offset:end])
            assert result["size"] == len(model)
        with open(path, "rb") as f:
            assert f.read() == bytes(model)


def test_a_read_with_only_a_length_starts_at_zero_and_reports_the_size(target: Path) -> None:
    target.write_bytes(b"0123456789")
    h = ready()
    assert h.result("fs/readFile", {"path": str(target), "length": 4}) == {
        "dataBase64": b64(b"0123"),
        "size": 10,
    }
    # Past the end: no data, the size.
    assert h.result("fs/readFile", {"path": str(target), "offset": 50}) == {
        "dataBase64": "",
        "size": 10,
    }


def test_unranged_calls_answer_exactly_as_before(target: Path) -> None:
    h = ready()
    assert h.result("fs/writeFile", {"path": str(target), "dataBase64": b64(b"abc")}) == {}
    # No size field without a range: what a baseline client has always seen.
    assert h.result("fs/readFile", {"path": str(target)}) == {"dataBase64": b64(b"abc")}


def test_the_read_limit_applies_to_the_range_not_the_file(target: Path) -> None:
    target.write_bytes(b"x" * 100)
    h = ready(ServerConfig(max_read_file_bytes=10))
    assert h.error("fs/readFile", {"path": str(target)})["data"] == {"kind": "fileTooLarge"}
    for offset in range(0, 100, 10):
        got = h.result("fs/readFile", {"path": str(target), "offset": offset, "length": 10})
        assert got == {"dataBase64": b64(b"x" * 10), "size": 100}
    error = h.error("fs/readFile", {"path": str(target), "offset": 0, "length": 11})
    assert error["code"] == -32600
    assert error["message"] == "file is too large to read: limit is 10 bytes"


def test_bad_ranges_are_precise_errors(target: Path) -> None:
    h = ready()
    error = h.error(
        "fs/writeFile", {"path": str(target), "dataBase64": "", "offset": 0, "append": True}
    )
    assert (error["code"], error["message"], error["data"]) == (
        -32600,
        "fs/writeFile takes either offset or append: true, not both",
        {"kind": "invalidRange"},
    )
    assert not target.exists()
    for params in ({"offset": -1}, {"length": -5}, {"offset": 2**63}):
        error = h.error("fs/readFile", {"path": str(target), **params})
        assert error["code"] == -32602
        assert next(iter(params)) in error["message"]
    error = h.error("fs/writeFile", {"path": str(target), "dataBase64": "", "offset": "1"})
    assert error["code"] == -32602 and "offset" in error["message"]


def test_invalid_base64_in_a_ranged_write_writes_nothing(target: Path) -> None:
    target.write_bytes(b"keep me")
    h = ready()
    error = h.error("fs/writeFile", {"path": str(target), "dataBase64": "AAAA!AAA", "offset": 2})
    assert error["data"] == {"kind": "invalidBase64"}
    assert target.read_bytes() == b"keep me"


def test_ranged_writes_refuse_what_is_not_a_regular_file(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    h = ready()
    for params in ({"offset": 0}, {"append": True}):
        error = h.error("fs/writeFile", {"path": str(fifo), "dataBase64": "", **params})
        assert error["data"] == {"kind": "notRegularFile"}
    error = h.error("fs/readFile", {"path": str(fifo), "offset": 0})
    assert error["data"] == {"kind": "notRegularFile"}
    error = h.error("fs/writeFile", {"path": str(tmp_path), "dataBase64": "", "offset": 0})
    assert error["data"]["kind"] == "isADirectory"


def test_ranged_writes_follow_the_path_when_it_is_replaced(tmp_path: Path) -> None:
    """Each ranged call opens the path anew: after a replacement (a rename
    over it), later ranges go to the new file and the old one keeps what it
    had; nothing is written to a file the path no longer names."""
    path = tmp_path / "f"
    h = ready()
    h.result("fs/writeFile", {"path": str(path), "dataBase64": b64(b"AAAA"), "offset": 0})
    old = os.open(path, os.O_RDONLY)  # keeps the first inode readable
    try:
        replacement = tmp_path / "other"
        replacement.write_bytes(b"zzzzzzzz")
        os.replace(replacement, path)
        h.result("fs/writeFile", {"path": str(path), "dataBase64": b64(b"BBBB"), "offset": 4})
        assert path.read_bytes() == b"zzzzBBBB"
        assert os.pread(old, 100, 0) == b"AAAA"
        # Removed meanwhile: the next range creates a new file (a gap reads as zeros).
        path.unlink()
        h.result("fs/writeFile", {"path": str(path), "dataBase64": b64(b"CC"), "offset": 2})
        assert path.read_bytes() == b"\0\0CC"
        assert os.pread(old, 100, 0) == b"AAAA"
    finally:
        os.close(old)
