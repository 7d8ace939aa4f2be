"""Unit tests of the NDJSON framer and the JSON-RPC codec (pure code, no reactor)."""

from __future__ import annotations

import base64
import json
import mmap
from typing import Any

import msgspec
import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from execserver import codec
from execserver import protocol as p
from execserver.codec import OVERSIZED, LineFramer, Oversized
from execserver.errors import RpcError

# --- LineFramer -------------------------------------------------------------------------------

JSON_BLANK = b" \t\r"


def model_lines(stream: bytes, max_line: int) -> list[codec.Line | Oversized]:
    """What the framer must produce for a whole stream, however it is chunked.

    A line is cut at ``\\n``; one trailing ``\\r`` is dropped; a line longer than
    the limit is reported once as OVERSIZED; a line holding only JSON whitespace
    carries no message and is skipped (anything else must reach the decoder).
    """
    out: list[codec.Line | Oversized] = []
    for raw_line in stream.split(b"\n"):
        line = raw_line[:-1] if raw_line.endswith(b"\r") else raw_line
        if len(line) > max_line:
            out.append(OVERSIZED)
        elif line.strip(JSON_BLANK):
            out.append(line)
    return out


def feed_in_pieces(framer: LineFramer, stream: bytes, cuts: list[int]) -> list[codec.Framed]:
    out: list[codec.Framed] = []
    last = 0
    for cut in [*sorted(set(cuts)), len(stream)]:
        out.extend(framer.feed(stream[last:cut]))
        last = cut
    out.extend(framer.finish())
    return out


line_bodies = st.one_of(
    st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")),
    st.sampled_from([b"", b"\r", b" ", b"\t \r", b"\x0b", b"\x0c", b"{}", b'{"id":1}']),
    st.integers(min_value=0, max_value=40).map(lambda n: b"x" * n),
    # Exactly at the limit, with and without a trailing CR.
    st.sampled_from([b"y" * 16, b"y" * 16 + b"\r", b"y" * 17, b"y" * 15 + b"\r"]),
)


@st.composite
def streams_and_cuts(draw: Any) -> tuple[bytes, list[int]]:
    lines = draw(st.lists(line_bodies, max_size=12))
    stream = b"\n".join(lines)
    if draw(st.booleans()):
        stream += b"\n"
    cuts = draw(st.lists(st.integers(min_value=0, max_value=max(0, len(stream))), max_size=20))
    return stream, cuts


@given(streams_and_cuts())
@example((b"y" * 16 + b"\r\n{}\n", [17]))  # CR of an at-limit line arriving before its LF
@example((b"\x0c\n{}\n", []))  # form feed is not JSON whitespace: it must be answered
def test_any_chunking_yields_the_messages_of_the_whole_stream(
    case: tuple[bytes, list[int]],
) -> None:
    stream, cuts = case
    framer = LineFramer(16)
    assert feed_in_pieces(framer, stream, cuts) == model_lines(stream, 16)
    assert framer.buffered_bytes == 0


@given(streams_and_cuts(), st.integers(min_value=0, max_value=40))
def test_reads_past_the_split_size_yield_the_same_messages(
    case: tuple[bytes, list[int]], split_max: int
) -> None:
    # Big reads (output chunks, file data) take the find-per-line path.
    stream, cuts = case
    framer = LineFramer(16, split_max_bytes=split_max)
    assert feed_in_pieces(framer, stream, cuts) == model_lines(stream, 16)
    assert framer.buffered_bytes == 0


@given(streams_and_cuts())
def test_one_byte_at_a_time_equals_all_at_once(case: tuple[bytes, list[int]]) -> None:
    stream, _ = case
    whole = LineFramer(16)
    all_at_once = whole.feed(stream) + whole.finish()
    bytewise = LineFramer(16)
    one_by_one = [m for i in range(len(stream)) for m in bytewise.feed(stream[i : i + 1])]
    one_by_one += bytewise.finish()
    assert one_by_one == all_at_once


@given(streams_and_cuts(), st.integers(min_value=0, max_value=20))
@example((b"y" * 16 + b"\r\n{}\n", [3, 17]), 2)  # CR of a long line arriving before its LF
@example((b" " * 10 + b"\n\t\r\n" + b"x" * 9 + b"\n", [1, 12, 15]), 0)  # long blank lines
def test_long_lines_in_a_mapping_yield_the_same_messages(
    case: tuple[bytes, list[int]], long_after: int
) -> None:
    stream, cuts = case
    for split_max in (0, 64 * 1024):  # both ways of cutting a read
        framer = LineFramer(16, long_line_bytes=long_after, split_max_bytes=split_max)
        out = feed_in_pieces(framer, stream, cuts)
        assert out == model_lines(stream, 16)
        assert framer.buffered_bytes == 0
    for line in out:
        if isinstance(line, memoryview):
            # Only a line gathered across reads past the threshold is mapped.
            assert isinstance(line.obj, mmap.mmap)
            assert len(line) > long_after - 1


def feed_into(framer: LineFramer, data: bytes, read: int) -> list[codec.Framed]:
    """``data`` as the stdio reader delivers it: into the mapped line's tail
    (reads of at most ``read`` bytes) while there is one, else fed."""
    out: list[codec.Framed] = []
    while data:
        target = framer.read_target(read)
        if target is None:
            out += framer.feed(data[:read])
            data = data[read:]
            continue
        count = min(len(target), len(data))
        target[:count] = data[:count]
        target.release()
        out += framer.filled(count)
        data = data[count:]
    return out


@given(streams_and_cuts(), st.integers(min_value=0, max_value=20), st.integers(1, 30))
@example((b"y" * 16 + b"\r\n{}\n", [3, 17]), 2, 5)
@example((b"x" * 30 + b"\n" + b"y" * 12 + b"\n{}\n", [5]), 3, 20)  # too long, then more
def test_reads_into_the_mapped_line_yield_the_same_messages(
    case: tuple[bytes, list[int]], long_after: int, read: int
) -> None:
    """The stdio reader's reads straight into the mapping (read_target/filled)."""
    stream, cuts = case
    framer = LineFramer(16, long_line_bytes=long_after)
    out: list[codec.Framed] = []
    last = 0
    for cut in [*sorted(set(cuts)), len(stream)]:
        out += feed_into(framer, stream[last:cut], read)
        last = cut
    out += framer.finish()
    assert out == model_lines(stream, 16)
    assert framer.buffered_bytes == 0


def test_a_long_line_across_reads_is_handed_over_from_a_mapping() -> None:
    framer = LineFramer(64 * 1024 * 1024, long_line_bytes=256 * 1024)
    body = bytes(range(256)).replace(b"\n", b"") * 40_000  # ~10 MiB: grows past 4 MiB
    read = 64 * 1024
    out: list[codec.Framed] = []
    stream = body + b"\r\n{}\n"
    for start in range(0, len(stream), read):
        out += framer.feed(stream[start : start + read])
    assert len(out) == 2
    line = out[0]
    assert isinstance(line, memoryview) and isinstance(line.obj, mmap.mmap)
    assert line == body
    assert out[1] == b"{}"


def test_a_mapped_buffer_grows_past_its_first_mapping() -> None:
    buffer = codec.MappedBuffer()
    chunk = bytes(range(256)) * 4096  # 1 MiB
    for _ in range(9):
        buffer.append(chunk)
    assert buffer.size == 9 * len(chunk)
    assert buffer.take() == chunk * 9


def test_large_appends_populate_their_pages_and_keep_every_byte() -> None:
    # Appends at unaligned offsets: the pages populated start at the page of
    # the first byte; what the buffer holds is exactly what was appended.
    assert codec._populating  # this kernel (>= 5.14) takes MADV_POPULATE_WRITE
    buffer = codec.MappedBuffer()
    pieces = [b"{", bytes(range(256)) * 1024, b"x" * (codec.POPULATE_BYTES + 3)] * 40
    for piece in pieces:
        buffer.append(piece)
    assert codec._populating
    assert buffer.take() == b"".join(pieces)


def test_a_kernel_that_refuses_to_populate_is_not_asked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(codec, "_MADV_POPULATE_WRITE", 0x7FFF)  # no such advice: EINVAL
    monkeypatch.setattr(codec, "_populating", True)
    buffer = codec.MappedBuffer()
    chunk = b"y" * (2 * codec.POPULATE_BYTES)
    for _ in range(40):
        buffer.append(chunk)
    assert not codec._populating
    assert buffer.take() == chunk * 40


def _long_lines(framer: LineFramer, *bodies: bytes) -> list[memoryview]:
    out = []
    for body in bodies:
        # (Held past the long size before the newline: mapped.)
        items = framer.feed(body[:1000]) + framer.feed(body[1000:-1])
        items += framer.feed(body[-1:] + b"\n")
        assert len(items) == 1 and isinstance(items[0], memoryview)
        out.append(items[0])
    return out


def test_the_next_long_line_reuses_the_last_ones_mapping_once_unused() -> None:
    framer = LineFramer(1 << 30, 4096)
    first = b'{"a":"' + b"x" * 3_000_000 + b'"}'
    second = b'{"b":"' + b"y" * 10_000 + b'"}'  # shorter: old bytes beyond it stay unseen
    (line,) = _long_lines(framer, first)
    mapping = line.obj
    assert line == first and framer.spare.held
    line.release()  # nothing refers to its bytes any more
    (line,) = _long_lines(framer, second)
    assert line.obj is mapping and line == second
    assert not framer.spare.held or framer.spare.reuse(1) is None  # in use again
    # While a view of the last line is held, the next one gets a fresh mapping.
    (again,) = _long_lines(framer, first)
    assert again.obj is not mapping and again == first
    assert line == second  # untouched
    framer.spare.release()
    assert not framer.spare.held


def test_a_mapping_larger_than_the_cap_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "SPARE_MAX_BYTES", codec.MappedBuffer.INITIAL_BYTES)
    framer = LineFramer(1 << 30, 4096)
    _long_lines(framer, b'"' + b"z" * (codec.MappedBuffer.INITIAL_BYTES + 1) + b'"')
    assert not framer.spare.held
    _long_lines(framer, b'"' + b"z" * 5000 + b'"')
    assert framer.spare.held


@given(st.lists(st.binary(min_size=1, max_size=200), max_size=30))
def test_memory_held_for_a_partial_line_is_bounded(pieces: list[bytes]) -> None:
    framer = LineFramer(64)
    for piece in pieces:
        framer.feed(piece)
        # One byte of slack: a CR that may still be followed by LF.
        assert framer.buffered_bytes <= 64 + 1


def test_blank_and_crlf_lines() -> None:
    framer = LineFramer(1024)
    assert framer.feed(b'\n\r\n  \n{"a":1}\r\n\t\n{"b":2}\n') == [b'{"a":1}', b'{"b":2}']


def test_oversized_line_is_reported_once_and_the_stream_resynchronises() -> None:
    framer = LineFramer(10)
    out: list[codec.Framed] = []
    out += framer.feed(b'{"ok":1}\n' + b"z" * 8)
    out += framer.feed(b"z" * 8)  # crosses the limit here
    out += framer.feed(b"z" * 1000)
    out += framer.feed(b"zz\n{}\n")
    assert out == [b'{"ok":1}', OVERSIZED, b"{}"]
    assert framer.buffered_bytes == 0


def test_oversized_line_in_one_read_is_reported_once() -> None:
    framer = LineFramer(10)
    assert framer.feed(b"a" * 11 + b"\nb\n") == [OVERSIZED, b"b"]


def test_finish_delivers_a_last_line_without_newline() -> None:
    framer = LineFramer(100)
    assert framer.feed(b'{"a":1}\n{"b"') == [b'{"a":1}']
    assert framer.feed(b":2}") == []
    assert framer.finish() == [b'{"b":2}']
    assert framer.finish() == []


def test_finish_after_an_unterminated_oversized_line_yields_nothing_more() -> None:
    framer = LineFramer(4)
    assert framer.feed(b"abcdefgh") == [OVERSIZED]
    assert framer.finish() == []
    # And the framer is usable again afterwards.
    assert framer.feed(b"ab\n") == [b"ab"]


# --- envelope classification ------------------------------------------------------------------


def framing_error(data: bytes) -> codec.FramingError:
    with pytest.raises(codec.FramingError) as info:
        codec.decode_message(data)
    return info.value


@pytest.mark.parametrize("request_id", [1, 0, -7, 2**53, "abc", ""])
def test_requests_with_int_and_string_ids(request_id: int | str) -> None:
    data = json.dumps({"id": request_id, "method": "process/read", "params": {"a": 1}}).encode()
    msg = codec.decode_message(data)
    assert isinstance(msg, codec.IncomingRequest)
    assert msg.id == request_id
    assert msg.method == "process/read"
    assert msg.params is not None
    assert json.loads(bytes(msg.params)) == {"a": 1}


def test_jsonrpc_field_is_accepted_on_input() -> None:
    msg = codec.decode_message(b'{"jsonrpc":"2.0","id":3,"method":"initialize","params":{}}')
    assert msg == codec.IncomingRequest(3, "initialize", msgspec.Raw(b"{}"))
    note = codec.decode_message(b'{"jsonrpc":"2.0","method":"initialized"}')
    assert note == codec.IncomingNotification("initialized", None)


def test_request_without_params() -> None:
    assert codec.decode_message(b'{"id":1,"method":"m"}') == codec.IncomingRequest(1, "m", None)


def test_notification_has_no_id() -> None:
    msg = codec.decode_message(b'{"method":"initialized","params":{}}')
    assert isinstance(msg, codec.IncomingNotification)
    assert msg.method == "initialized"


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b'{"id":1,"result":{}}', codec.IncomingResponse(1, is_error=False)),
        (b'{"id":"x","result":null}', codec.IncomingResponse("x", is_error=False)),
        (b'{"id":2,"error":{"code":1,"message":"m"}}', codec.IncomingResponse(2, is_error=True)),
        (b'{"id":null,"error":{"code":1,"message":"m"}}', codec.IncomingResponse(None, True)),
    ],
)
def test_client_responses_and_errors_are_classified(
    data: bytes, expected: codec.IncomingResponse
) -> None:
    assert codec.decode_message(data) == expected


@pytest.mark.parametrize(
    "data",
    [
        b"not-json",
        b"{",
        b'{"id":1',
        b'"abc',
        b"tru",
        b"\xff\xfe",
        b'{"id":1,"method":"x"} trailing',
        # Unparseable JSON whose first token already has the wrong type: still -32700.
        b"[",
        b"1 2",
        b'{"method":1',
        b'{"id":[1,',
    ],
)
def test_unparseable_json_is_a_parse_error(data: bytes) -> None:
    err = framing_error(data)
    assert err.error.code == p.PARSE_ERROR
    assert err.request_id is None


@pytest.mark.parametrize(
    "data",
    [
        b"[]",
        b"1",
        b'"text"',
        b"null",
        b"{}",
        b'{"params":{}}',
        b'{"method":1}',
        b'{"id":true,"method":"m"}',
        b'{"id":1.5,"method":"m"}',
        b'{"id":null,"method":"m"}',
        b'{"result":1}',
    ],
)
def test_json_that_is_not_a_message_is_an_invalid_request(data: bytes) -> None:
    err = framing_error(data)
    assert err.error.code == p.INVALID_REQUEST
    assert err.request_id is None


def test_invalid_message_with_a_readable_id_is_answered_with_that_id() -> None:
    err = framing_error(b'{"id":5}')
    assert err.error.code == p.INVALID_REQUEST
    assert err.request_id == 5


# --- params -----------------------------------------------------------------------------------


def params_error(raw: bytes | None, params_type: type[Any]) -> RpcError:
    with pytest.raises(RpcError) as info:
        codec.decode_params(msgspec.Raw(raw) if raw is not None else None, params_type)
    assert info.value.code == p.INVALID_PARAMS
    return info.value


def test_params_errors_name_the_field() -> None:
    assert "`argv`" in params_error(b'{"processId":"proc-1"}', p.ExecParams).message
    wrong = params_error(b'{"processId":1,"argv":[],"cwd":"/","env":{},"tty":false}', p.ExecParams)
    assert "$.processId" in wrong.message
    chunk = params_error(b'{"processId":"p","chunk":"***"}', p.WriteParams)
    assert "$.chunk" in chunk.message
    negative = params_error(b'{"processId":"p","afterSeq":-1}', p.ReadParams)
    assert "$.afterSeq" in negative.message
    sandbox = params_error(
        b'{"processId":"p","argv":["a"],"cwd":"/","env":{},"tty":false,"sandbox":{"mode":"bogus"}}',
        p.ExecParams,
    )
    assert "$.sandbox.mode" in sandbox.message


def test_missing_or_null_params_are_invalid_params() -> None:
    params_error(None, p.InitializeParams)
    params_error(b"null", p.ReadParams)
    params_error(b"[]", p.ReadParams)


def test_params_accept_the_reference_shapes() -> None:
    params = codec.decode_params(
        msgspec.Raw(
            b'{"processId":"proc-1","argv":["bash","-lc","true"],"cwd":"/tmp","env":{},'
            b'"tty":true,"arg0":null,"sandbox":{"mode":"none"},"unknownField":1}'
        ),
        p.ExecParams,
    )
    assert params == p.ExecParams(
        process_id="proc-1",
        argv=["bash", "-lc", "true"],
        cwd="/tmp",
        env={},
        tty=True,
        arg0=None,
        sandbox=p.SandboxConfig("none"),
    )
    read = codec.decode_params(msgspec.Raw(b'{"processId":"p"}'), p.ReadParams)
    assert read == p.ReadParams("p", None, None, None)


# --- encoding ---------------------------------------------------------------------------------

request_ids = st.one_of(st.integers(min_value=-(2**63), max_value=2**63 - 1), st.text())
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=10,
)


@given(request_ids, json_values)
def test_responses_never_carry_jsonrpc(request_id: int | str, result: Any) -> None:
    decoded = json.loads(codec.encode(p.Response(request_id, result)))
    assert decoded == {"id": request_id, "result": result}


@given(st.one_of(st.none(), request_ids), st.integers(), st.text())
def test_errors_never_carry_jsonrpc(request_id: int | str | None, code: int, text: str) -> None:
    decoded = json.loads(codec.encode(p.ErrorResponse(request_id, p.ErrorObject(code, text))))
    assert decoded == {"id": request_id, "error": {"code": code, "message": text}}


def test_error_data_is_included_only_when_set() -> None:
    err = RpcError.internal("boom", {"kind": "spawnNotFound", "errno": 2})
    decoded = json.loads(codec.encode(p.ErrorResponse(7, err.to_wire())))
    assert decoded == {
        "id": 7,
        "error": {"code": -32603, "message": "boom", "data": {"kind": "spawnNotFound", "errno": 2}},
    }


def test_encode_line_appends_one_newline() -> None:
    line = codec.encode_line(p.Notification("initialized"))
    assert line == b'{"method":"initialized"}\n'


def test_reference_shapes_of_results_and_notifications() -> None:
    """The routing tests of the reference, at the codec level."""
    exited = p.Notification(p.PROCESS_EXITED, p.ExitedNotification("proc-1", 0))
    assert json.loads(codec.encode(exited)) == {
        "method": "process/exited",
        "params": {"processId": "proc-1", "exitCode": 0},
    }
    assert json.loads(codec.encode(p.Response(3, p.ExecResponse("proc-1")))) == {
        "id": 3,
        "result": {"processId": "proc-1"},
    }
    read = p.ReadResponse(
        chunks=[p.ProcessOutputChunk(1, "pty", b"hello\n")],
        next_seq=2,
        exited=False,
        exit_code=None,
    )
    assert json.loads(codec.encode(read)) == {
        "chunks": [{"seq": 1, "stream": "pty", "chunk": "aGVsbG8K"}],
        "nextSeq": 2,
        "exited": False,
        "exitCode": None,
    }
    assert json.loads(codec.encode(p.WriteResponse(True))) == {"accepted": True}
    assert json.loads(codec.encode(p.TerminateResponse(False))) == {"running": False}
    output = p.OutputNotification("proc-1", "stdout", b"hello\n", 1)
    assert json.loads(codec.encode(output)) == {
        "processId": "proc-1",
        "stream": "stdout",
        "chunk": "aGVsbG8K",
        "seq": 1,
    }


# --- round trips ------------------------------------------------------------------------------

streams = st.sampled_from(["stdout", "stderr", "pty"])
output_chunks = st.builds(
    p.ProcessOutputChunk, st.integers(min_value=1, max_value=2**40), streams, st.binary()
)
wire_values = st.one_of(
    st.builds(p.OutputNotification, st.text(), streams, st.binary(), st.integers(1, 2**40)),
    st.builds(p.ExitedNotification, st.text(), st.integers(-1, 255)),
    st.builds(
        p.ReadResponse,
        st.lists(output_chunks, max_size=4),
        st.integers(1, 2**40),
        st.booleans(),
        st.none() | st.integers(-1, 255),
    ),
    st.builds(
        p.ExecParams,
        st.text(),
        st.lists(st.text(), max_size=4),
        st.text(),
        st.dictionaries(st.text(), st.text(), max_size=3),
        st.booleans(),
        st.none() | st.text(),
        st.none() | st.builds(p.SandboxConfig, st.sampled_from(["none", "hostDefault"])),
    ),
    st.builds(p.WriteParams, st.text(), st.binary()),
    st.builds(
        p.ReadParams,
        st.text(),
        st.none() | st.integers(0, 2**40),
        st.none() | st.integers(0, 2**40),
        st.none() | st.integers(0, 10**6),
    ),
)


@given(wire_values)
def test_wire_structs_round_trip(value: Any) -> None:
    encoded = codec.encode(value)
    assert msgspec.json.decode(encoded, type=type(value)) == value


@given(st.binary(max_size=4096))
def test_arbitrary_bytes_survive_as_standard_base64(data: bytes) -> None:
    note = p.Notification(p.PROCESS_OUTPUT, p.OutputNotification("p", "stdout", data, 1))
    decoded = json.loads(codec.encode_line(note))
    assert base64.b64decode(decoded["params"]["chunk"], validate=True) == data


@given(st.binary(max_size=1024), request_ids)
def test_a_request_encoded_by_a_client_decodes_to_the_same_request(
    chunk: bytes, request_id: int | str
) -> None:
    params = p.WriteParams("proc-1", chunk)
    line = codec.encode(p.Request(request_id, p.PROCESS_WRITE, params))
    msg = codec.decode_message(line)
    assert isinstance(msg, codec.IncomingRequest)
    assert msg.id == request_id
    assert codec.decode_params(msg.params, p.WriteParams) == params


@given(st.binary(max_size=200))
def test_decode_message_never_raises_anything_but_framing_error(data: bytes) -> None:
    assume(b"\n" not in data)
    try:
        codec.decode_message(data)
    except codec.FramingError as exc:
        assert exc.error.code in (p.PARSE_ERROR, p.INVALID_REQUEST)


# Invalid UTF-8 inside a string and nesting deeper than the interpreter's
# recursion limit make msgspec raise UnicodeDecodeError / RecursionError, not
# DecodeError; uncaught, one such line used to end the whole connection.
DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize(
    "data",
    [
        b'{"id":1,"method":"\xff"}',
        b'{"id":"\xc3\x28","method":"initialize"}',
        b'{"method":"\xed\xa0\x80"}',
        b"[" * 100_000,
        DEEP,
        b'{"id":1,"method":"process/start","params":' + DEEP + b"}",
    ],
    ids=["method", "id", "notification", "unclosed-deep", "deep", "deep-params"],
)
def test_invalid_utf8_and_deep_nesting_are_parse_errors(data: bytes) -> None:
    err = framing_error(data)
    assert err.error.code == p.PARSE_ERROR
    assert err.request_id is None


def test_invalid_utf8_in_params_is_invalid_params() -> None:
    msg = codec.decode_message(b'{"id":1,"method":"initialize","params":{"clientName":"\xff"}}')
    assert isinstance(msg, codec.IncomingRequest)
    error = params_error(bytes(msg.params) if msg.params is not None else None, p.InitializeParams)
    assert "UTF-8" in error.message


VALID_LINES = [
    b'{"id":1,"method":"initialize","params":{"clientName":"t"}}',
    b'{"method":"initialized","params":{}}',
    b'{"id":"a","method":"process/start","params":{"processId":"p","argv":["sh","-c","x"],'
    b'"cwd":"/","env":{"A":"1"},"tty":false,"arg0":null,"sandbox":{"mode":"none"}}}',
    b'{"id":2,"method":"process/write","params":{"processId":"p","chunk":"aGVsbG8K"}}',
    b'{"id":3,"method":"process/read","params":{"processId":"p","afterSeq":0,"maxBytes":9}}',
    b'{"id":4,"result":{"ok":true}}',
]
PARAMS_TYPES: dict[str, type[Any]] = {
    "initialize": p.InitializeParams,
    "process/start": p.ExecParams,
    "process/write": p.WriteParams,
    "process/read": p.ReadParams,
}


@st.composite
def mutated_lines(draw: Any) -> bytes:
    """A valid message with bytes replaced, inserted or deleted here and there."""
    line = bytearray(draw(st.sampled_from(VALID_LINES)))
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        position = draw(st.integers(min_value=0, max_value=len(line)))
        action = draw(st.sampled_from(["replace", "insert", "delete"]))
        byte = draw(st.integers(min_value=0, max_value=255).filter(lambda b: b != 10))
        if action == "insert" or position == len(line):
            line.insert(position, byte)
        elif action == "replace":
            line[position] = byte
        else:
            del line[position]
    return bytes(line)


@given(mutated_lines())
@example(b'{"id":1,"method":"initialize","params":{"clientName":"\xff"}}')
@example(b'{"id":1,"method":"initi\xc3alize","params":{"clientName":"t"}}')
def test_damaged_messages_only_ever_raise_protocol_errors(line: bytes) -> None:
    """Whatever a line holds, decoding ends in a message or a JSON-RPC error."""
    try:
        msg = codec.decode_message(line)
    except codec.FramingError as exc:
        assert exc.error.code in (p.PARSE_ERROR, p.INVALID_REQUEST)
        return
    if isinstance(msg, codec.IncomingRequest) and msg.method in PARAMS_TYPES:
        try:
            codec.decode_params(msg.params, PARAMS_TYPES[msg.method])
        except RpcError as exc:
            assert exc.code == p.INVALID_PARAMS


@given(
    process_id=st.text(),
    stream=st.sampled_from(["stdout", "stderr", "pty"]),
    data=st.binary(max_size=4096),
    seq=st.integers(min_value=0, max_value=2**63 - 1),
)
def test_output_encoder_matches_the_generic_encoding(
    process_id: str, stream: p.OutputStream, data: bytes, seq: int
) -> None:
    # The fast path must be byte-identical to msgspec's rendering of the wire type.
    fast = codec.OutputEncoder(process_id).encode(stream, data, seq)
    generic = codec.encode(
        p.Notification(p.PROCESS_OUTPUT, p.OutputNotification(process_id, stream, data, seq))
    )
    assert fast == generic


_URI_EXTRAS = [
    b"",
    b',"x":"file://y"',
    b',"x":"a\\"file://"',  # after an escaped quote: the whole-params search finds it too
    b',"x":{"file://":1}',
    b',"x":"file:/"',
    b',"x":"file//"',
]


@given(
    path=st.sampled_from([b'"/tmp/t"', b'"file:///tmp/t"', b'"file:/x"']),
    text=st.sampled_from([b"QUJD" * 8, b"file://" + b"A" * 30, b"file:/" + b"A" * 30]),
    extra=st.sampled_from(_URI_EXTRAS),
    data_first=st.booleans(),
)
def test_the_uri_check_on_the_cut_params_answers_as_on_the_whole_params(
    path: bytes, text: bytes, extra: bytes, data_first: bool
) -> None:
    """has_uri_value (the long string not read) == the dispatcher's search of all params."""
    from execserver.dispatcher import _has_uri_value

    fields = [b'"path":' + path, b'"dataBase64":"' + text + b'"']
    if data_first:
        fields.reverse()
    line = b'{"id":1,"method":"fs/writeFile","params":{' + b",".join(fields) + extra + b"}}"
    request = codec.decode_message(line)
    assert isinstance(request, codec.IncomingRequest) and request.params is not None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(codec, "LONG_PARAMS_BYTES", 16)
        cut = codec.cut_long_params(line, request.params, "dataBase64")
    assert cut is not None
    assert codec.has_uri_value(line, cut) == _has_uri_value(request.params)


@pytest.mark.parametrize("decoy", [b'"file://x"', b'"QUJD"'])
def test_the_uri_check_ignores_a_long_string_key_outside_the_params(decoy: bytes) -> None:
    """The first ``"dataBase64":"`` of the line may lie outside the params
    (an unknown top-level member before them): the cut then holds the whole
    params, and the check answers as the search of the whole params does,
    whatever that other string starts with."""
    from execserver.dispatcher import _has_uri_value

    line = (
        b'{"id":1,"method":"fs/writeFile","x":{"dataBase64":'
        + decoy
        + b'},"params":{"path":"/tmp/t","dataBase64":"'
        + b"QUJD" * 8
        + b'"}}'
    )
    request = codec.decode_message(line)
    assert isinstance(request, codec.IncomingRequest) and request.params is not None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(codec, "LONG_PARAMS_BYTES", 16)
        cut = codec.cut_long_params(line, request.params, "dataBase64")
    assert _has_uri_value(request.params) is False
    # (the dispatcher's choice: the check on the cut, else the whole params searched)
    assert (
        codec.has_uri_value(line, cut) if cut is not None else _has_uri_value(request.params)
    ) is False
