"""The streamed fs/writeFile decode (execserver/fs/stream.py): same answers as the whole line.

A long line's data is decoded into an unnamed file as it arrives; the
contract is that, whatever the line and however it is split into reads,
the replies and what is left on disk are exactly those of the same line
handled whole. The dispatchers here run on a fake clock (fs work inline)
with the streaming sink switched on over a directory the test trusts.
"""

from __future__ import annotations

import base64
import errno
import functools
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from twisted.internet.defer import Deferred
from twisted.internet.testing import StringTransport

from execserver import codec
from execserver.codec import LineFramer, MappedBuffer, Oversized, StreamedLine
from execserver.fs import ops, stream
from execserver.fs.local import Locality
from execserver.fs.pool import inline_runner
from execserver.transports.stdio import LineProtocol
from tests.support.fakes import Harness

#: Lines past this many bytes go long (and may stream) in these tests.
LONG = 64


class TrustAll(Locality):
    """The inline rule's check passes for every directory (the test's own)."""

    def trusted(self, directory: str) -> bool:
        return True

    def verify(self, directory: str) -> None:
        pass

    def is_remote_mount(self, path: str) -> bool:
        return False


class Run:
    """One connection of a fresh dispatcher; lines fed through a framer."""

    def __init__(self, streaming: bool, into: bool = False) -> None:
        self.harness = Harness()
        self.harness.handshake()
        self.harness.outbound.take()
        factory = None
        if streaming:
            factory = functools.partial(stream.start, inline_runner, TrustAll())
        self.framer = LineFramer(1 << 30, LONG, sink_factory=factory)
        self.streamed = 0
        #: Read into the mapped line's tail, as the stdio reader does.
        self.into = into

    def feed(self, chunks: list[bytes], eof: bool) -> list[dict[str, Any]]:
        items: list[codec.Framed] = []
        for chunk in chunks:
            target = self.framer.read_target(len(chunk)) if self.into else None
            if target is None:
                items += self.framer.feed(chunk)
                continue
            target[: len(chunk)] = chunk
            target.release()
            items += self.framer.filled(len(chunk))
        if eof:
            items += self.framer.finish()
        for item in items:
            assert not isinstance(item, Oversized)
            self.streamed += isinstance(item, StreamedLine)
            self.harness.conn.message_received(item)
        return self.harness.outbound.take()


@pytest.fixture
def adoptions(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each streamed file was used (True) or the line was written whole."""
    seen: list[bool] = []
    original = stream.StreamedWrite.adopt

    def adopt(self: stream.StreamedWrite, *args: Any) -> int | None:
        fd = original(self, *args)
        seen.append(fd is not None)
        return fd

    monkeypatch.setattr(stream.StreamedWrite, "adopt", adopt)
    return seen


def state(directory: Path) -> dict[str, tuple[int, bytes]]:
    """Every name in ``directory`` with its mode and contents."""
    out = {}
    for entry in sorted(directory.iterdir()):
        out[entry.name] = (stat.S_IMODE(entry.stat().st_mode), entry.read_bytes())
    return out


def reset(directory: Path, existing: bytes | None) -> None:
    for entry in directory.iterdir():
        entry.unlink()
    if existing is not None:
        target = directory / "t"
        target.write_bytes(existing)
        target.chmod(0o640)


def split(line: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(line) + 1) for c in cuts})
    pieces, last = [], 0
    for point in [*points, len(line)]:
        pieces.append(line[last:point])
        last = point
    return [p for p in pieces if p]


def both(
    line: bytes, cuts: list[int], existing: bytes | None, eof: bool = False, into: bool = False
) -> tuple[tuple[Any, Any], tuple[Any, Any], int]:
    """(whole-line outcome, streamed outcome, lines streamed): replies and the directory."""
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        outcomes = []
        streamed = 0
        for streaming in (False, True):
            reset(directory, existing)
            run = Run(streaming, into=streaming and into)
            body = line.replace(b"@DIR@", str(directory).encode())
            # (Cut near the end too, so that the line is held long.)
            chunks = [body] if not streaming else split(body, [*cuts, len(body) - 2])
            replies = run.feed(chunks, eof)
            outcomes.append((replies, state(directory)))
            streamed += run.streamed
        return outcomes[0], outcomes[1], streamed


_B64_INSERTS = [
    b"\\/",
    b"\\\\",
    b"=",
    b"==",
    b"A",
    b" ",
    b"\\u0041",
    "\u00e9".encode(),
    b'"',
    b"*",
    b"QQ==",  # a padded quad: valid only at the end
    b"AB==",  # non-canonical trailing bits
    b"AAB=",
]


def sometimes(draw: st.DrawFn, one_in: int) -> bool:
    return draw(st.integers(0, one_in - 1)) == 0


@st.composite
def texts(draw: st.DrawFn) -> bytes:
    data = draw(st.binary(max_size=600))
    text = base64.b64encode(data)
    if sometimes(draw, 4):
        for _ in range(draw(st.integers(1, 3))):
            at = draw(st.integers(0, len(text)))
            if draw(st.booleans()):
                at -= at % 4  # between quads
            text = text[:at] + draw(st.sampled_from(_B64_INSERTS)) + text[at:]
    if sometimes(draw, 5):
        text = text.replace(b"/", b"\\/")  # JSON's escaped solidus: legal, same string
    return text


_EXTRAS = [
    b'"sandbox":null',
    b'"sandbox":{"mode":"none"}',
    b'"offset":0',
    b'"append":false',
    b'"truncate":true',
    b'"x":{"dataBase64":"AAAA"}',
    b'"dataBase64":"QUJD"',
    b'"path":5',
]

_ENDINGS = [b"}} ", b"}}x", b"},}", b"}]", b"}", b',"id":2}}', b',"method":"fs/remove"}}']


@st.composite
def lines(draw: st.DrawFn) -> bytes:
    """fs/writeFile lines, mostly streamable, with every kind of doubt now and then."""
    path = draw(st.sampled_from([b'"path":"@DIR@/t"', b'"path":"file://@DIR@/t"']))
    data = b'"dataBase64":"' + draw(texts()) + b'"'
    extras = draw(st.lists(st.sampled_from(_EXTRAS), max_size=2))
    if sometimes(draw, 3):
        fields = draw(st.permutations([path, data, *extras]))
    else:
        fields = [path, data, *extras]
    params = b"{" + b",".join(fields)
    method = b"fs/readFile" if sometimes(draw, 10) else b"fs/writeFile"
    # (Or the method after the params.)
    first = not sometimes(draw, 5)
    head = b'{"id":1,"method":"' + method + b'","params":' if first else b'{"params":'
    ending = b"}}" if not sometimes(draw, 3) else draw(st.sampled_from(_ENDINGS))
    if not first:
        ending = ending.replace(b"}}", b'},"id":1,"method":"' + method + b'"}', 1)
    return head + params + ending + b"\n"


@given(
    line=lines(),
    cuts=st.lists(st.integers(0, 1 << 16), min_size=1, max_size=6),
    existing=st.none() | st.just(b"old"),
    truncate_at=st.none() | st.integers(1, 1 << 16),
    into=st.booleans(),
)
@example(
    line=b'{"id":1,"method":"fs/writeFile","params":{"path":"@DIR@/t","dataBase64":"'
    + base64.b64encode(bytes(range(256)) * 3).replace(b"/", b"\\/")
    + b'"}}\n',
    cuts=[100, 200],
    existing=None,
    truncate_at=None,
    into=True,
)
@example(
    line=b'{"id":1,"method":"fs/writeFile","params":{"path":"@DIR@/t","dataBase64":"'
    + base64.b64encode(bytes(range(256)) * 3)
    + b'"}}x\n',
    cuts=[90, 500],
    existing=b"old",
    truncate_at=None,
    into=True,
)
@example(
    # padding that ends a read's text before the end: invalid
    line=b'{"id":1,"method":"fs/writeFile","params":{"path":"@DIR@/t","dataBase64":"'
    + b"QUJD" * 40
    + b"QQ=="
    + b"QUJD" * 40
    + b'"}}\n',
    cuts=[-161],  # (from the end) one quad after the padding
    existing=None,
    truncate_at=None,
    into=True,
)
@example(
    # set trailing bits in the last quad: non-canonical, invalid
    line=b'{"id":1,"method":"fs/writeFile","params":{"path":"@DIR@/t","dataBase64":"'
    + b"QUJD" * 40
    + b'AB=="}}\n',
    cuts=[120],
    existing=None,
    truncate_at=None,
    into=True,
)
def test_any_line_any_split_gives_the_whole_line_answer(
    line: bytes, cuts: list[int], existing: bytes | None, truncate_at: int | None, into: bool
) -> None:
    eof = False
    if truncate_at is not None:
        # A line cut short by the end of input (no newline).
        line = line[: truncate_at % len(line)]
        eof = True
    whole, streamed, _ = both(line, cuts, existing, eof, into)
    assert streamed == whole


def test_a_valid_long_write_is_streamed_and_its_file_adopted(
    adoptions: list[bool], tmp_path: Path
) -> None:
    data = os.urandom(300_000)
    line = (
        b'{"id":7,"method":"fs/writeFile","params":{"path":"@DIR@/t","dataBase64":"'
        + base64.b64encode(data)
        + b'","sandbox":null}}\n'
    )
    whole, streamed, count = both(line, list(range(0, len(line), 4093)), None)
    assert count == 1
    assert adoptions == [True]
    assert streamed == whole
    replies, files = streamed
    assert replies == [{"id": 7, "result": {}}]
    assert list(files) == ["t"] and files["t"][1] == data


def test_an_existing_target_keeps_its_mode_and_no_temporary_file_is_left(
    adoptions: list[bool],
) -> None:
    line = (
        b'{"id":1,"method":"fs/writeFile","params":{"path":"@DIR@/t","dataBase64":"'
        + base64.b64encode(b"n" * 3000)
        + b'"}}\n'
    )
    whole, streamed, _ = both(line, [80, 81, 2000], b"old")
    assert adoptions == [True]
    assert streamed == whole
    assert streamed[1] == {"t": (0o640, b"n" * 3000)}


@pytest.mark.parametrize(
    "tail",
    [
        b'"}}x',  # malformed JSON after the data
        b'"},"x":}',
        b'"}',  # the envelope never closed
        b'","sandbox":{"mode":"workspace-write"}}}',  # a sandbox after the data
        b'","path":"@DIR@/sub/u"}}',  # another path (the last one counts), elsewhere
    ],
)
def test_what_only_the_end_of_the_line_shows_gives_the_whole_line_answer(
    adoptions: list[bool], tail: bytes
) -> None:
    line = (
        b'{"id":1,"method":"fs/writeFile","params":{"path":"@DIR@/t","dataBase64":"'
        + base64.b64encode(b"z" * 3000)
        + tail
        + b"\n"
    )
    whole, streamed, count = both(line, [70, 1000, 3000], None)
    assert count == 1  # it was streamed...
    assert streamed == whole  # ...and answered as the whole line is
    assert adoptions in ([], [False])  # ...without the streamed file


@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize("extra", [b'"offset":2', b'"offset":5,"truncate":true', b'"append":true'])
def test_a_ranged_write_copies_the_streamed_bytes(
    monkeypatch: pytest.MonkeyPatch, where: str, extra: bytes
) -> None:
    copied: list[int] = []
    original = ops._copy_from

    def copy_from(source: tuple[int, int], fd: int, offset: int | None) -> int:
        copied.append(source[1])
        return original(source, fd, offset)

    monkeypatch.setattr(ops, "_copy_from", copy_from)
    text = base64.b64encode(b"r" * 3000)
    data = b'"dataBase64":"' + text + b'"'
    fields = (
        [b'"path":"@DIR@/t"', extra, data]
        if where == "before"
        else [b'"path":"@DIR@/t"', data, extra]
    )
    line = b'{"id":1,"method":"fs/writeFile","params":{' + b",".join(fields) + b"}}\n"
    whole, streamed, count = both(line, [90, 2000], b"old")
    assert count == 1
    assert copied == [3000]  # the streamed bytes, not the text decoded again
    assert streamed == whole
    assert streamed[0] == [{"id": 1, "result": {}}]


@pytest.mark.parametrize(
    "params",
    [
        b'{"path":"@DIR@/t","sandbox":{"mode":"workspace-write"},"dataBase64":"',
        b'{"dataBase64":"',  # no path before the data
        b'{"path":"@DIR@/../t","dataBase64":"',
    ],
)
def test_a_head_that_forbids_streaming_starts_nothing(params: bytes) -> None:
    line = b'{"id":1,"method":"fs/writeFile","params":' + params + b"QUJD" * 100 + b'"}}'
    buffer = MappedBuffer()
    buffer.append(line.replace(b"@DIR@", b"/tmp"))
    opened: list[Any] = []

    def run(func: Any, *args: Any, owner: object = None) -> Any:
        opened.append(func)
        return inline_runner(func, *args)

    assert stream.start(run, TrustAll(), buffer) is None
    assert opened == []


def test_a_dropped_line_closes_its_unnamed_file(tmp_path: Path) -> None:
    before = set(os.listdir("/proc/self/fd"))
    framer = LineFramer(
        1000, LONG, sink_factory=functools.partial(stream.start, inline_runner, TrustAll())
    )
    head = b'{"id":1,"method":"fs/writeFile","params":{"path":"%s/t","dataBase64":"' % (
        str(tmp_path).encode()
    )
    assert framer.feed(head + b"QUJD" * 50) == []
    assert len(set(os.listdir("/proc/self/fd")) - before) == 1  # the unnamed file
    assert framer.feed(b"QUJD" * 300) == [codec.OVERSIZED]  # past the limit: dropped
    assert set(os.listdir("/proc/self/fd")) - before == set()
    assert list(tmp_path.iterdir()) == []


def _long_line(directory: Path, data: bytes) -> bytes:
    return b'{"id":1,"method":"fs/writeFile","params":{"path":"%s/t","dataBase64":"%s"}}\n' % (
        str(directory).encode(),
        base64.b64encode(data),
    )


def test_a_line_cut_off_by_the_connection_ends_its_thread_and_file(tmp_path: Path) -> None:
    """The stdio protocol's connectionLost mid-line: the unnamed file is closed at
    once (before, it stayed open until the framer was collected)."""
    harness = Harness()
    harness.dispatcher.long_line_sink = functools.partial(stream.start, inline_runner, TrustAll())
    proto = LineProtocol(harness.dispatcher)
    proto.makeConnection(StringTransport())
    before = set(os.listdir("/proc/self/fd"))
    line = _long_line(tmp_path, os.urandom(1 << 20))
    proto.dataReceived(line[: len(line) // 2])
    assert len(set(os.listdir("/proc/self/fd")) - before) == 1  # the unnamed file
    proto.connectionLost(None)
    assert set(os.listdir("/proc/self/fd")) - before == set()
    assert list(tmp_path.iterdir()) == []


class _FailingWrites:
    """``os`` for the stream module, whose second ``write`` fails (a full disk)."""

    def __init__(self) -> None:
        self.writes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def write(self, fd: int, data: Any) -> int:
        self.writes += 1
        if self.writes == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return os.write(fd, data)


def test_an_error_mid_write_gives_the_whole_line_answer(
    adoptions: list[bool], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed write drops the stream: its file is closed, and the line is
    answered (and written) as a whole line."""
    failing = _FailingWrites()
    monkeypatch.setattr(stream, "os", failing)
    before = set(os.listdir("/proc/self/fd"))
    run = Run(streaming=True)
    data = os.urandom(3 * stream.TEXT_SLICE)
    replies = run.feed(list(_chunks(_long_line(tmp_path, data), 64 * 1024)), eof=False)
    assert failing.writes >= 2
    assert replies == [{"id": 1, "result": {}}]
    assert adoptions == []  # (the stream was dropped before the line ended)
    assert (tmp_path / "t").read_bytes() == data
    assert list(tmp_path.iterdir()) == [tmp_path / "t"]
    assert set(os.listdir("/proc/self/fd")) - before == set()


def _chunks(data: bytes, size: int) -> Iterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


def test_replies_keep_their_order_around_a_streamed_write(adoptions: list[bool]) -> None:
    with tempfile.TemporaryDirectory() as name:
        run = Run(streaming=True)
        text = base64.b64encode(b"q" * 5000)
        stream_bytes = (
            b'{"id":1,"method":"fs/getMetadata","params":{"path":"%s"}}\n'
            b'{"id":2,"method":"fs/writeFile","params":{"path":"%s/t","dataBase64":"%s"}}\n'
            b'{"id":3,"method":"fs/readFile","params":{"path":"%s/t"}}\n'
        ) % (name.encode(), name.encode(), text, name.encode())
        replies = run.feed(list(_chunks(stream_bytes, 999)), eof=False)
        assert [r["id"] for r in replies] == [1, 2, 3]
        assert replies[2]["result"]["dataBase64"] == text.decode()
        assert adoptions == [True]


def test_a_file_opened_late_catches_up_a_slice_at_a_time(
    adoptions: list[bool], tmp_path: Path
) -> None:
    """What arrived before the pool opened the file is decoded in slices, each checked."""
    pending: list[tuple[Deferred[Any], Any, tuple[Any, ...]]] = []

    def later(func: Any, *args: Any, owner: object = None) -> Deferred[Any]:
        d: Deferred[Any] = Deferred()
        pending.append((d, func, args))
        return d

    harness = Harness()
    harness.handshake()
    harness.outbound.take()
    framer = LineFramer(
        1 << 30, LONG, sink_factory=functools.partial(stream.start, later, TrustAll())
    )
    data = os.urandom(3 * stream.TEXT_SLICE)  # 3/4 of it arrives before the file opens
    line = b'{"id":1,"method":"fs/writeFile","params":{"path":"%s/t","dataBase64":"%s"}}\n' % (
        str(tmp_path).encode(),
        base64.b64encode(data),
    )
    three_quarters = len(line) * 3 // 4
    assert framer.feed(line[:three_quarters]) == []
    assert len(pending) == 1
    d, func, args = pending.pop()
    d.callback(func(*args))  # opened: the catch-up, 3 slices
    items = framer.feed(line[three_quarters:])
    assert len(items) == 1 and isinstance(items[0], StreamedLine)
    harness.conn.message_received(items[0])
    assert harness.outbound.take() == [{"id": 1, "result": {}}]
    assert adoptions == [True]
    assert (tmp_path / "t").read_bytes() == data
    assert list(tmp_path.iterdir()) == [tmp_path / "t"]


@pytest.mark.parametrize("cuts", [[], [90, 200]])
def test_invalid_utf8_in_the_data_is_invalid_params_not_an_internal_error(cuts: list[int]) -> None:
    """Found by the property test above: the exact decoder's msgspec.DecodeError escaped
    (an internal error, logged) on both paths."""
    text = base64.b64encode(b"x" * 300)
    line = (
        b'{"id":1,"method":"fs/writeFile","params":{"path":"@DIR@/t","dataBase64":"'
        + text[:100]
        + b"\xc3"
        + text[100:]
        + b'"}}\n'
    )
    whole, streamed, _ = both(line, cuts, None)
    assert streamed == whole
    replies, files = whole
    assert files == {}
    assert [r["error"]["code"] for r in replies] == [-32602]


def test_a_stream_keeps_its_last_long_lines_mapping_for_a_while() -> None:
    """The spare mapping (codec.SpareMapping) is released SPARE_KEEP_SECONDS after
    the last long line: an idle server holds no more than before."""
    harness = Harness()
    proto = LineProtocol(harness.dispatcher)
    proto.makeConnection(StringTransport())
    harness.handshake()
    line = (
        b'{"id":%d,"method":"fs/getMetadata","params":{"path":"/","pad":"'
        + b"p" * (1 << 19)
        + b'"}}\n'
    )
    spare = proto._framer.spare

    def send(request_id: int) -> None:
        data = line % request_id
        # (Only a line held past LONG_MESSAGE_BYTES before its end is mapped.)
        for start in range(0, len(data), 300_000):
            proto.dataReceived(data[start : start + 300_000])

    send(1)
    assert spare.held
    harness.clock.advance(codec.SPARE_KEEP_SECONDS - 1)
    send(2)  # reused and kept again: the wait starts over
    assert spare.held
    harness.clock.advance(codec.SPARE_KEEP_SECONDS - 0.5)
    assert spare.held
    harness.clock.advance(1)
    assert not spare.held
    send(3)
    assert spare.held
    proto.connectionLost(None)
    assert not spare.held
    assert not harness.clock.getDelayedCalls()


def test_a_long_write_line_given_whole_is_searched_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long fs/writeFile that arrives whole (WebSocket): its long string is found
    once, and the URI check does not copy and search the 11 MiB of params again
    (before, _has_uri_value copied them in 256 KiB windows)."""
    from execserver import dispatcher

    searches: list[bytes] = []
    original = codec.long_string_span

    def span(line: Any, key: bytes) -> Any:
        searches.append(key)
        return original(line, key)

    def whole_search(params: Any) -> bool:
        raise AssertionError("the params were searched whole")

    monkeypatch.setattr(codec, "long_string_span", span)
    monkeypatch.setattr(dispatcher, "_has_uri_value", whole_search)
    harness = Harness()
    harness.handshake()
    harness.outbound.take()
    data = os.urandom(1 << 20)
    line = b'{"id":1,"method":"fs/writeFile","params":{"path":"file://%s/t","dataBase64":"%s"}}' % (
        str(tmp_path).encode(),
        base64.b64encode(data),
    )
    harness.conn.message_received(line)
    assert harness.outbound.take() == [{"id": 1, "result": {}}]
    assert (tmp_path / "t").read_bytes() == data
    assert searches == [b"dataBase64"]
    assert harness.conn.speaks_current_dialect  # (its path is a URI)
