"""codec.decode_long_params: an fs/writeFile's params decoded without parsing its data twice.

The contract: whatever the line, the result (or the error) is exactly what
``codec.decode_params`` gives for the same params; only the cost differs.
Pure code, no reactor.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from execserver import codec
from execserver.codec import LineFramer
from execserver.errors import RpcError
from execserver.fs.handlers import WriteFileWire

KEY, ATTRIBUTE = WriteFileWire.long_string


@pytest.fixture(autouse=True)
def every_params_is_long(monkeypatch: pytest.MonkeyPatch) -> None:
    # The shortcut applies to long params only; small cases make the logic visible.
    monkeypatch.setattr(codec, "LONG_PARAMS_BYTES", 0)


def outcome(value: Any) -> Any:
    """A comparable form of a decoded WriteFileWire (Raw fields as bytes)."""
    return {
        field: bytes(v) if isinstance(v, msgspec.Raw) else v
        for field in WriteFileWire.__struct_fields__
        for v in [getattr(value, field)]
    }


def both(line: bytes | memoryview) -> tuple[Any, Any]:
    """(decode_params, decode_long_params) of ``line``'s params: outcomes or errors."""
    request = codec.decode_message(line)
    assert isinstance(request, codec.IncomingRequest)
    results = []
    for decode in (
        lambda: codec.decode_params(request.params, WriteFileWire),
        lambda: codec.decode_long_params(line, request.params, WriteFileWire, KEY, ATTRIBUTE),
    ):
        try:
            results.append(outcome(decode()))
        except RpcError as exc:
            results.append(("error", exc.code, exc.message, exc.data))
    return results[0], results[1]


def line_of(params: bytes) -> bytes:
    return b'{"id":1,"method":"fs/writeFile","params":' + params + b"}"


CASES = [
    # the usual shape, with and without extensions after the data
    b'{"path":"/a","dataBase64":"QUJD"}',
    b'{"path":"/a","dataBase64":"QUJD","offset":3,"append":false}',
    b'{"dataBase64":"QUJD","path":"file:///tmp/a"}',
    # the key first met in a nested object: the top-level value is another
    b'{"x":{"dataBase64":"AAAA"},"path":"/a","dataBase64":"QUJD"}',
    b'{"x":[{"dataBase64":"AAAA"}],"path":"/a"}',
    # repeated: the parser keeps the last one
    b'{"dataBase64":"AAAA","path":"/a","dataBase64":"QUJD"}',
    # escapes in the data (the exact decoder must see them), and an escaped quote
    b'{"path":"/a","dataBase64":"QU\\/J"}',
    b'{"path":"/a","dataBase64":"Q\\"UJ","x":"\\",\\"dataBase64\\":\\"AAAA"}',
    b'{"path":"/a","dataBase64":"\\"}","dataBase64":"QUJD"}',
    # the key's text inside another string
    b'{"path":"/\\"dataBase64\\":\\"x","dataBase64":"QUJD"}',
    # spaces around the colon: not the shortcut's needle
    b'{"path":"/a","dataBase64" : "QUJD"}',
    # not a string, empty, and invalid params: the same errors
    b'{"path":"/a","dataBase64":5}',
    b'{"path":"/a","dataBase64":""}',
    b'{"path":7,"dataBase64":"QUJD"}',
    b'{"dataBase64":"QUJD"}',
    b'{"path":"/a","dataBase64":"QUJD","offset":-1}',
    b'{"path":"/a","dataBase64":"QUJD","append":"yes"}',
    b'{"path":"/a","dataBase64":"QUJD","sandbox":{"mode":7}}',
    # not base64 at all (the fs layer's own errors follow, as before)
    b'{"path":"/a","dataBase64":"not base64!"}',
]


@pytest.mark.parametrize("params", CASES)
def test_the_same_params_or_error_as_the_full_decode(params: bytes) -> None:
    full, short = both(line_of(params))
    assert short == full


def test_the_data_is_the_string_in_the_line_itself() -> None:
    data = b"QUJD" * 1000
    line = line_of(b'{"path":"/a","dataBase64":"' + data + b'"}')
    request = codec.decode_message(line)
    assert isinstance(request, codec.IncomingRequest)
    params = codec.decode_long_params(line, request.params, WriteFileWire, KEY, ATTRIBUTE)
    assert bytes(params.data_base64) == b'"' + data + b'"'
    assert params.path == "/a"


def test_a_long_line_from_the_framers_mapping_is_decoded_alike() -> None:
    data = b"QUJD" * 100_000
    line = line_of(b'{"x":{"dataBase64":"AA=="},"path":"/a","dataBase64":"' + data + b'"}')
    framer = LineFramer(1 << 30, long_line_bytes=1024)
    lines = [*framer.feed(line[:5000]), *framer.feed(line[5000:] + b"\n")]
    assert len(lines) == 1 and isinstance(lines[0], memoryview)
    full, short = both(lines[0])
    assert short == full
    assert short["data_base64"] == b'"' + data + b'"'


def test_a_view_not_from_a_mapping_takes_the_full_decode() -> None:
    line = memoryview(bytearray(line_of(b'{"path":"/a","dataBase64":"QUJD"}')))[:]
    assert codec.long_string_span(memoryview(bytes(line)), KEY.encode()) is None
    full, short = both(line)
    assert short == full


keys = st.sampled_from(["path", "dataBase64", "offset", "append", "truncate", "x"])
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=2**64),
    st.text(alphabet='AB=+/"\\:{}, \x00é', max_size=12),
)
values = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
    max_leaves=8,
)


@given(
    st.lists(st.tuples(keys, values), max_size=6),
    st.sampled_from([(",", ":"), (", ", ": "), (",", ":  ")]),
    st.booleans(),
)
@example([("dataBase64", "AAAA"), ("path", "/a"), ("dataBase64", "QUJD")], (",", ":"), False)
@example([("x", {"dataBase64": "AA"}), ("path", "/a"), ("dataBase64", "QUJD")], (",", ":"), True)
def test_any_params_decode_as_the_full_decode(
    members: list[tuple[str, Any]], separators: tuple[str, str], plain: bool
) -> None:
    # json.dumps of a dict would drop repeated keys: render the members by hand.
    body = separators[0].join(
        json.dumps(k) + separators[1] + json.dumps(v, separators=separators, ensure_ascii=plain)
        for k, v in members
    )
    full, short = both(line_of(("{" + body + "}").encode()))
    assert short == full
