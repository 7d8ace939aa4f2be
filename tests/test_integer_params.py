"""Every integer request param is range-checked: ``-32602`` naming the field, never ``-32603``.

The integer fields are found by inspecting the params type of every route
the dispatcher serves (nested structs included), so a field added later is
covered without editing this test. Values go through the dispatcher as JSON
text, exactly as a client sends them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from execserver import protocol as p
from tests.support.fakes import Harness, exec_params

I64_MIN = -(1 << 63)

# A minimal valid params object per method; the process "proc-1" exists.
_BASE: dict[str, dict[str, Any]] = {
    p.PROCESS_START: exec_params("fresh", tty=True, size={"rows": 24, "cols": 80}),
    p.PROCESS_WRITE: {"processId": "proc-1", "chunk": ""},
    p.PROCESS_SIGNAL: {"processId": "proc-1", "signal": 15},
    p.PROCESS_RESIZE: {"processId": "proc-1", "rows": 24, "cols": 80},
    p.HTTP_REQUEST: {"method": "GET", "url": "http://127.0.0.1:9/", "requestId": "r"},
    # Its sandbox is decoded (and confines the scan) since capabilityDiscoverySandbox.
    "capabilities/discoverV2": {"cwd": "/"},
}


#: Methods whose handlers need a real reactor (tested through the real server
#: elsewhere: tests/test_codex_dialect.py, tests/test_http_request.py, whose
#: requests connect over TCP, which the fake reactor cannot).
NEEDS_A_REAL_REACTOR = frozenset({"fs/watchMissing", p.HTTP_REQUEST})


def _base(method: str, scratch: Path | None = None) -> dict[str, Any]:
    """Valid params for ``method``; fs methods work on a file in ``scratch``."""
    if method == p.INITIALIZE:
        return {"clientName": "test"}
    if method.startswith("fs/"):
        target = (scratch or Path("/nonexistent-dir")) / "file"
        if scratch is not None and not target.exists():
            target.write_bytes(b"content")
        params: dict[str, Any] = {
            "path": str(target),
            "dataBase64": "",
            "missing": [],
            "watchId": 1,
            "handleId": "h1",
            "offset": 0,
            "len": 1,
            "chunk": "AA==",
            "sourcePath": str(target),
            "destinationPath": f"{target}.copy",
        }
        if method == "fs/walk":
            params["options"] = {
                "maxDepth": 1,
                "maxDirectories": 1,
                "maxEntries": 1,
                "followDirectorySymlinks": False,
            }
        return params
    copy: dict[str, Any] = json.loads(json.dumps(_BASE.get(method, {"processId": "proc-1"})))
    return copy


def _int_fields(
    info: msgspec.inspect.Type, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], int | None, int | None]]:
    """(wire path, lowest allowed, highest allowed) of every integer field under ``info``."""
    if isinstance(info, msgspec.inspect.UnionType):
        return [found for member in info.types for found in _int_fields(member, path)]
    if isinstance(info, msgspec.inspect.IntType):
        low = info.ge if info.ge is not None else (info.gt + 1 if info.gt is not None else None)
        high = info.le if info.le is not None else (info.lt - 1 if info.lt is not None else None)
        return [(path, low, high)]
    if isinstance(info, msgspec.inspect.StructType):
        return [
            found
            for field in info.fields
            for found in _int_fields(field.type, (*path, field.encode_name))
        ]
    return []


def _upper_checked_after_decoding(params_type: Any, path: tuple[str, ...]) -> int | None:
    """The bound of a ``u64`` field, checked after decoding (msgspec stops at int64)."""
    u64_fields = getattr(params_type, "U64_FIELDS", ())
    names = {field.encode_name: field.name for field in msgspec.structs.fields(params_type)}
    return p.U64_MAX if len(path) == 1 and names.get(path[0]) in u64_fields else None


def _all_int_fields() -> list[tuple[str, tuple[str, ...], int | None, int | None]]:
    routes = Harness().dispatcher.routes
    return [
        (method, path, low, _upper_checked_after_decoding(route.params_type, path) or high)
        for method, route in sorted(routes.items())
        for path, low, high in _int_fields(msgspec.inspect.type_info(route.params_type))
    ]


INT_FIELDS = _all_int_fields()
FIELD_IDS = [f"{method}:{'.'.join(path)}" for method, path, _, _ in INT_FIELDS]


#: A profile that decodes and confines nothing (every path writable, the
#: network on), for the integer fields inside a sandbox.
_SANDBOX: dict[str, Any] = {
    "permissions": {
        "type": "managed",
        "file_system": {
            "type": "restricted",
            "entries": [
                {"path": {"type": "special", "value": {"kind": "root"}}, "access": "write"}
            ],
        },
        "network": "enabled",
    }
}


def _with(params: dict[str, Any], path: tuple[str, ...], value: int) -> dict[str, Any]:
    if path[0] == "sandbox" and "sandbox" not in params:
        params["sandbox"] = json.loads(json.dumps(_SANDBOX))
    target = params
    for key in path[:-1]:
        target = target.setdefault(key, {})
    target[path[-1]] = value
    return params


def _harness() -> Harness:
    h = Harness()
    h.handshake()
    h.start("proc-1", tty=True)
    # The fake PTY accepts any window size (TIOCSWINSZ is not under test).
    sizes: list[tuple[int, int]] = []
    setattr(h.process(), "set_window_size", lambda rows, cols: sizes.append((rows, cols)))  # noqa: B010
    return h


def test_the_known_integer_fields_are_all_found_and_bounded() -> None:
    found = {(method, ".".join(path)): (low, high) for method, path, low, high in INT_FIELDS}
    i64 = (0, p.I64_MAX)
    u64 = (0, p.U64_MAX)
    dims = (1, 65535)
    expected = {
        (p.PROCESS_START, "timeoutMs"): i64,
        (p.PROCESS_START, "idleTimeoutMs"): i64,
        (p.PROCESS_START, "size.rows"): dims,
        (p.PROCESS_START, "size.cols"): dims,
        (p.PROCESS_READ, "afterSeq"): u64,
        (p.PROCESS_READ, "maxBytes"): u64,
        (p.PROCESS_READ, "waitMs"): u64,
        (p.PROCESS_TERMINATE, "graceMs"): i64,
        (p.PROCESS_RESIZE, "rows"): dims,
        (p.PROCESS_RESIZE, "cols"): dims,
        (p.PROCESS_WAIT, "timeoutMs"): i64,
        ("fs/watchMissing", "watchId"): u64,
        ("fs/readBlock", "offset"): u64,
        ("fs/readBlock", "len"): u64,
        ("fs/writeBlock", "offset"): u64,
        (p.HTTP_REQUEST, "timeoutMs"): i64,
        # A signal number is checked against 1..NSIG-1 by the session.
        (p.PROCESS_SIGNAL, "signal"): (None, None),
    }
    for key, bounds in expected.items():
        assert found.get(key) == bounds, key
    # Any other integer field (added later) must carry both bounds.
    for key, (low, high) in found.items():
        if key != (p.PROCESS_SIGNAL, "signal"):
            assert low is not None and high is not None, key


def _out_of_range(low: int | None, high: int | None) -> st.SearchStrategy[int]:
    specials = [-1, I64_MIN, I64_MIN - 1, 1 << 63, 1 << 64, (1 << 64) + 1, 10**30, -(10**30)]
    options: list[st.SearchStrategy[int]] = []
    if low is not None:
        options.append(st.integers(max_value=low - 1))
    if high is not None:
        options.append(st.integers(min_value=high + 1))
    if low is None and high is None:
        # Checked by the handler (signal numbers): 1..NSIG-1 at most.
        options += [st.integers(max_value=0), st.integers(min_value=65)]
    candidates = [
        v
        for v in specials
        if (low is None and high is None and not 1 <= v <= 64)
        or (low is not None and v < low)
        or (high is not None and v > high)
    ]
    if candidates:
        options.append(st.sampled_from(candidates))
    return st.one_of(options)


@pytest.mark.parametrize(("method", "path", "low", "high"), INT_FIELDS, ids=FIELD_IDS)
def test_out_of_range_integers_are_invalid_params_naming_the_field(
    method: str, path: tuple[str, ...], low: int | None, high: int | None
) -> None:
    h = _harness()

    @given(value=_out_of_range(low, high))
    def check(value: int) -> None:
        error = h.error(method, _with(_base(method), path, value))
        assert error["code"] == -32602, error
        if low is None and high is None:
            assert path[-1] in error["message"], error
        else:
            assert f"$.{'.'.join(path)}`" in error["message"], error

    check()


@pytest.mark.parametrize(("method", "path", "low", "high"), INT_FIELDS, ids=FIELD_IDS)
def test_the_extremes_of_each_range_are_accepted_without_internal_errors(
    method: str, path: tuple[str, ...], low: int | None, high: int | None, tmp_path: Path
) -> None:
    for value in {v for v in (low, high) if v is not None}:
        h = _harness()
        if method in NEEDS_A_REAL_REACTOR:
            # Its handler watches with inotify, which the fake reactor
            # cannot: the value must decode, which is what is bounded.
            params_type = h.dispatcher.routes[method].params_type
            raw = json.dumps(_with(_base(method, tmp_path), path, value)).encode()
            msgspec.json.decode(raw, type=params_type)
            continue
        request_id = h.request(method, _with(_base(method, tmp_path), path, value))
        if h.response(request_id) is None:
            # A long poll or wait: the process's exit answers it.
            h.process().exit(0)
        response = h.response(request_id)
        assert response is not None, (method, path, value)
        # The value is valid: any error is about the request's meaning
        # (e.g. resizing an exited process), never a failure of the server.
        error = response.get("error", {})
        # An OS error (an fs call at offset 2^63-1 is EFBIG) is -32603 with
        # its errno, as the reference reports it; without one it would be a
        # failure of the server.
        assert error.get("code") != -32603 or "errno" in (error.get("data") or {}), response
        assert error.get("code") != -32602, response


def test_read_after_the_largest_seq_returns_nothing_and_the_next_seq() -> None:
    h = _harness()
    h.process().output(b"hello")
    result = h.result(p.PROCESS_READ, {"processId": "proc-1", "afterSeq": p.I64_MAX})
    assert result["chunks"] == []
    assert result["nextSeq"] == 2


def test_read_after_seq_two_to_the_63_reads_nothing_as_the_reference_does() -> None:
    # The reference's afterSeq is a u64: 2^63 (which once answered -32603
    # from islice) is a valid, if empty, read.
    h = _harness()
    h.process().output(b"hello")
    result = h.result(p.PROCESS_READ, {"processId": "proc-1", "afterSeq": 1 << 63})
    assert result["chunks"] == []
    assert result["nextSeq"] == 2


def test_read_after_seq_beyond_u64_is_invalid_params_naming_the_field() -> None:
    h = _harness()
    error = h.error(p.PROCESS_READ, {"processId": "proc-1", "afterSeq": 1 << 64})
    assert error == {
        "code": -32602,
        "message": "Expected `int` <= 18446744073709551615 - at `$.afterSeq`",
    }
