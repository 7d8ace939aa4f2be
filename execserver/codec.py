"""Bytes <-> JSON-RPC messages, in one place for every transport.

- :class:`LineFramer` cuts a newline-delimited byte stream into lines. It
  keeps partial lines as a list of pieces and joins them once, so a large
  message arriving in many small reads costs linear time (Twisted's
  ``LineReceiver`` re-concatenates its whole buffer on every read, which is
  quadratic for multi-megabyte lines). An over-long line is reported as soon
  as it crosses the limit and then skipped up to its newline; the stream
  stays usable.
- :func:`decode_message` turns one message's bytes into a typed incoming
  message or raises :class:`FramingError` carrying the JSON-RPC error to
  send back (with ``"id": null`` unless an id could be read).
- :func:`decode_params` decodes a request's params into its wire type;
  :func:`decode_long_params` does it without parsing a long string value
  (``fs/writeFile``'s ``dataBase64``) a second time.
- :func:`encode` renders any wire value; output never carries ``"jsonrpc"``.
"""

from __future__ import annotations

import contextlib
import mmap
import re
import secrets
import sys
from collections.abc import Callable, Iterator
from typing import Any, Final, Protocol, TypeVar

import attrs
import msgspec
from pybase64 import b64encode

from execserver import protocol
from execserver.errors import RpcError

T = TypeVar("T")


class Oversized:
    """Marker yielded by :class:`LineFramer` for a line longer than the limit."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "OVERSIZED"


OVERSIZED: Final = Oversized()

_JSON_WHITESPACE: Final = b" \t\r\n"
# First bytes of a line that may be blank (checked fully only then).
_BLANK_STARTS: Final = (b"", b" ", b"\t", b"\r", b"\n")

#: One complete message as the framer hands it over (a ``memoryview`` only
#: from a framer given ``long_line_bytes``).
Line = bytes | bytearray | memoryview

_NOT_WHITESPACE: Final = re.compile(rb"[^ \t\r\n]")


#: An incoming message longer than this (an fs/writeFile) is gathered in a
#: :class:`MappedBuffer`, not on the heap.
LONG_MESSAGE_BYTES: Final = 256 * 1024
#: Up to this many bytes after the first newline a read's lines are cut with
#: one ``split``; past it with a find per line (no copy of the remainder).
_SPLIT_MAX_BYTES: Final = 64 * 1024


class MappedBuffer:
    """A growing byte buffer in an anonymous mapping, for one large message.

    It grows by remapping (no copy; pages not yet written are not resident)
    and :meth:`take` hands its content over as a ``memoryview``; the mapping
    is unmapped once the last reference to that view goes. A ``bytearray``
    grows on the heap up to glibc's mmap threshold (4 MiB in the server),
    and each move there leaves freed heap memory behind that stays resident:
    about 6 MiB for every message that long (0.4x of a 16 MiB file sent to
    fs/writeFile).

    The pages an append of at least :data:`POPULATE_BYTES` is about to fill
    are faulted in first with one ``madvise(MADV_POPULATE_WRITE)`` (Linux
    5.14): one call instead of a page-fault exception per 4 KiB page, which
    took 12 ms of a 22 MiB line's 256 KiB appends, 7.5 ms with it. Only the
    pages written are populated, so the mapping's resident size is what it
    was. (Transparent huge pages were measured too: 3 ms on an idle
    machine, but the kernel's direct compaction for them made a write
    after other memory churn cost 70 ms of CPU instead of 40.)
    """

    __slots__ = ("_map", "_populated", "_spare", "size")

    #: The first mapping's size at least (page-aligned; early growth is rare).
    INITIAL_BYTES: Final = 4 * 1024 * 1024

    def __init__(self, expected: int = 0, spare: SpareMapping | None = None) -> None:
        size = max(self.INITIAL_BYTES, expected)
        reused = spare.reuse(size) if spare is not None else None
        if reused is None:
            self._map: mmap.mmap | None = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
            #: Bytes from the start whose pages are resident already (populated, or reused).
            self._populated = 0
        else:
            self._map, self._populated = reused
        self._spare = spare
        self.size = 0

    def _room(self, size: int, populate: bool) -> mmap.mmap:
        """The mapping, grown to hold ``size`` bytes after the content; with
        ``populate``, their pages faulted in first (those resident already
        are not walked again: on a reused mapping that walk cost as much as
        the copy)."""
        buffer = self._map
        assert buffer is not None, "append or tail after take"
        end = self.size + size
        if end > len(buffer):
            buffer.resize(max(end, 2 * len(buffer)))
        if populate and end > self._populated:
            _populate(buffer, max(self.size, self._populated), end)
            self._populated = end
        return buffer

    def append(self, data: bytes | bytearray | memoryview) -> None:
        end = self.size + len(data)
        self._room(len(data), len(data) >= POPULATE_BYTES)[self.size : end] = data
        self.size = end

    def tail(self, size: int) -> memoryview:
        """A writable view of the ``size`` bytes after the content, its pages
        resident: read into it, release it, then :meth:`commit` what was read."""
        return memoryview(self._room(size, True))[self.size : self.size + size]

    def commit(self, size: int) -> None:
        """The next ``size`` bytes of :meth:`tail` are content now."""
        self.size += size

    def copy(self, start: int, stop: int) -> bytes:
        """A copy of the bytes ``start:stop`` (within the content)."""
        assert self._map is not None, "copy after take"
        return self._map[start : min(stop, self.size)]

    def truncate(self, size: int) -> None:
        """Forget the content from ``size`` on."""
        self.size = min(self.size, size)

    @property
    def taken(self) -> bool:
        """Whether :meth:`take` has handed the content over."""
        return self._map is None

    def head(self, size: int) -> bytes:
        """A copy of the first ``size`` bytes (fewer if it holds fewer)."""
        assert self._map is not None, "head after take"
        return self._map[: min(size, self.size)]

    def find(self, sub: bytes, start: int, end: int) -> int:
        """``mmap.find`` over the content (a ``memchr`` for one byte)."""
        assert self._map is not None, "find after take"
        return self._map.find(sub, start, min(end, self.size))

    @contextlib.contextmanager
    def view(self, start: int, stop: int) -> Iterator[memoryview]:
        """The content's bytes ``start:stop``, in place; released on exit
        (a view held would stop the mapping from growing)."""
        assert self._map is not None, "view after take"
        with memoryview(self._map) as whole, whole[start : min(stop, self.size)] as part:
            yield part

    def take(self) -> memoryview:
        """The content; the buffer is then empty and unusable."""
        buffer = self._map
        assert buffer is not None, "take twice"
        self._map = None
        if self._spare is not None:
            self._spare.keep(buffer, max(self.size, self._populated))
        return memoryview(buffer)[: self.size]


class SpareMapping:
    """The mapping of a framer's last long line, kept for its next one.

    A fresh mapping's pages are faulted in (zeroed, charged to the memory
    cgroup) as the line fills them, and released when it is unmapped:
    about 7 ms of a 16 MiB ``fs/writeFile``'s 22 MiB line, more than the
    pipe reads. The next long line reuses the mapping, already resident,
    once nothing refers to the last line's bytes any more (the
    ``mmap.resize`` that fits it to the new line is refused while a view
    of it exists: then a fresh mapping is made). Mappings larger than
    :data:`SPARE_MAX_BYTES` are not kept; the owner releases the spare a
    while after the line (:class:`execserver.transports.stdio.LineProtocol`,
    :data:`SPARE_KEEP_SECONDS`), so an idle server holds no more than before.
    """

    __slots__ = ("_filled", "_map", "kept")

    def __init__(self) -> None:
        self._map: mmap.mmap | None = None
        self._filled = 0
        #: How many mappings were kept so far (an owner's cue to time their release).
        self.kept = 0

    @property
    def held(self) -> bool:
        return self._map is not None

    def keep(self, mapping: mmap.mmap, filled: int) -> None:
        """Keep ``mapping``, whose first ``filled`` bytes' pages are resident."""
        if len(mapping) <= SPARE_MAX_BYTES:
            self._map = mapping
            self._filled = filled
            self.kept += 1

    def reuse(self, size: int) -> tuple[mmap.mmap, int] | None:
        """The kept mapping, at least ``size`` bytes long, if no view of it is left,
        and how many bytes from its start are resident."""
        mapping = self._map
        if mapping is None:
            return None
        try:
            mapping.resize(max(size, len(mapping)))  # BufferError while a view exists
        except (BufferError, OSError, ValueError):
            return None
        self._map = None
        return mapping, self._filled

    def release(self) -> None:
        """Drop the kept mapping (unmapped once no view of it is left)."""
        self._map = None


#: The largest mapping a :class:`SpareMapping` keeps (a 45 MiB line's, doubled in steps).
SPARE_MAX_BYTES: Final = 64 * 1024 * 1024
#: Seconds a line stream keeps its last long line's mapping for the next one.
SPARE_KEEP_SECONDS: Final = 5.0


#: An append to a :class:`MappedBuffer` at least this large populates its pages first.
POPULATE_BYTES: Final = 64 * 1024
_MADV_POPULATE_WRITE: Final = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_PAGE: Final = mmap.PAGESIZE
#: Whether ``MADV_POPULATE_WRITE`` may work here (cleared at its first refusal).
_populating = sys.platform == "linux"


def _populate(buffer: mmap.mmap, start: int, end: int) -> None:
    """Fault in the pages of ``buffer[start:end]`` with one call (a hint:
    where the kernel refuses, the copy faults them in one by one)."""
    global _populating
    if not _populating:
        return
    first = start - start % _PAGE
    try:
        buffer.madvise(_MADV_POPULATE_WRITE, first, end - first)
    except OSError:
        _populating = False  # an older kernel (EINVAL): not asked again


class LongLineSink(Protocol):
    """Consumes a long line's bytes as they arrive (the streamed ``fs/writeFile`` decode).

    :meth:`advance` is called after each append to the line's
    :class:`MappedBuffer` (never holding a view of it, which would stop the
    mapping from growing); :meth:`abort` when the line is dropped or the
    sink is not used. Neither raises.
    """

    #: The method of the requests this sink's lines are meant to be.
    method: str

    def advance(self, buffer: MappedBuffer) -> None: ...

    def abort(self) -> None: ...

    def span(self) -> tuple[int, int] | None:
        """Offsets of the quotes around the string consumed, once it ended validly."""


#: A line is offered to the sink factory when it turns long, and again
#: after each append while it was shorter than this (its head may have
#: been incomplete).
SINK_HEAD_BYTES: Final = 64 * 1024

#: Called when a line turns long, with its buffer so far: a sink, or None.
SinkFactory = Callable[[MappedBuffer], LongLineSink | None]


class StreamedLine:
    """A long line handed over with the sink that consumed it as it arrived.

    ``line`` is what the framer would have handed over without a sink.
    """

    __slots__ = ("line", "sink")

    def __init__(self, line: memoryview, sink: LongLineSink) -> None:
        self.line = line
        self.sink = sink


#: What :class:`LineFramer` hands over.
Framed = Line | Oversized | StreamedLine


class LineFramer:
    """Incremental NDJSON splitter.

    :meth:`feed` returns, in stream order, each complete non-blank line
    (without its ``\\n`` or a trailing ``\\r``) or :data:`OVERSIZED` once for
    every line whose length exceeds ``max_line_bytes``.

    A line that spans reads is gathered in one ``bytearray`` and handed over
    as is: growing it is amortised (and, above the allocator's mmap
    threshold, remapped rather than copied), so a message of N bytes costs
    about N bytes of memory, not the 2N of joining a list of pieces.

    With ``long_line_bytes``, a line that grows past it moves to a
    :class:`MappedBuffer` and is handed over as a ``memoryview`` of it.

    The lines of a read of up to ``split_max_bytes`` are cut with one
    ``split`` (many small requests); a larger read with a find per line.

    With ``sink_factory`` too, a line that turns long is offered to it; a
    sink it returns sees every later append (:class:`LongLineSink`) and the
    line is handed over as a :class:`StreamedLine`.
    """

    __slots__ = (
        "_discarding",
        "_long",
        "_long_after",
        "_max",
        "_partial",
        "_sink",
        "_sink_factory",
        "_split_max",
        "spare",
    )

    def __init__(
        self,
        max_line_bytes: int,
        long_line_bytes: int | None = None,
        split_max_bytes: int = _SPLIT_MAX_BYTES,
        sink_factory: SinkFactory | None = None,
    ) -> None:
        self._max = max_line_bytes
        self._split_max = split_max_bytes
        self._partial = bytearray()
        self._discarding = False
        self._long_after = long_line_bytes
        self._long: MappedBuffer | None = None
        self._sink_factory = sink_factory
        self._sink: LongLineSink | None = None
        #: The last long line's mapping, for the next (see :class:`SpareMapping`).
        self.spare = SpareMapping()

    @property
    def buffered_bytes(self) -> int:
        """Bytes of an incomplete line held in memory."""
        return self._long.size if self._long is not None else len(self._partial)

    def _append_long(self, data: bytes | bytearray | memoryview) -> None:
        """Append to the mapped line, moving the line there first if needed."""
        long = self._long
        if long is None:
            long = self._long = MappedBuffer(2 * (len(self._partial) + len(data)), self.spare)
            long.append(self._partial)
            self._partial = bytearray()
            long.append(data)
            if self._sink_factory is not None:
                self._sink = self._sink_factory(long)
                return  # (a new sink has seen all)
        else:
            long.append(data)
        self._appended(long, len(data))

    def _appended(self, long: MappedBuffer, added: int) -> None:
        """``added`` bytes were appended to the mapped line: its sink sees them."""
        if self._sink is not None:
            self._sink.advance(long)
        elif self._sink_factory is not None and long.size - added < SINK_HEAD_BYTES:
            # The head may have been incomplete at the last offer.
            self._sink = self._sink_factory(long)

    def read_target(self, size: int) -> memoryview | None:
        """Where the next read of up to ``size`` bytes may go: the tail of the
        mapped line being gathered (no copy of the read), else None (:meth:`feed`).

        Release the view after the read, then hand the count to :meth:`filled`.
        """
        if self._long is None or self._discarding:
            return None
        return self._long.tail(size)

    def filled(self, size: int) -> list[Framed]:
        """:meth:`feed` of the ``size`` bytes just read into :meth:`read_target`'s view."""
        long = self._long
        assert long is not None and not self._discarding
        start = long.size
        long.commit(size)
        nl = long.find(b"\n", start, start + size)
        out: list[Framed] = []
        if nl < 0:
            if long.size > self._max + 1:  # (as _hold would find)
                out.append(OVERSIZED)
                self._drop_partial()
                self._discarding = True
            else:
                self._appended(long, size)
            return out
        rest = long.copy(nl + 1, start + size)
        long.truncate(nl)
        self._appended(long, nl - start)
        self._emit(self._take_long(), out)
        if rest:
            out += self.feed(rest)
        return out

    def _take_long(self) -> memoryview | StreamedLine:
        assert self._long is not None
        line = self._long.take()
        self._long = None
        sink = self._sink
        if sink is None:
            return line
        self._sink = None
        return StreamedLine(line, sink)

    def _drop_partial(self) -> None:
        self._partial = bytearray()
        self._long = None
        if self._sink is not None:
            self._sink.abort()
            self._sink = None

    def feed(self, data: bytes) -> list[Framed]:
        out: list[Framed] = []
        start = 0
        if self._discarding or self._partial or self._long is not None:
            # The first newline ends the line begun in an earlier read.
            nl = data.find(b"\n")
            if nl < 0:
                self._hold(data, out)
                return out
            if self._discarding:
                self._discarding = False
            else:
                line: Line | StreamedLine
                if self._long is not None:
                    self._append_long(memoryview(data)[:nl])
                    line = self._take_long()
                else:
                    line = self._partial
                    line += memoryview(data)[:nl]
                    self._partial = bytearray()
                self._emit(line, out)
            start = nl + 1
        size = len(data)
        if size - start > self._split_max:
            # Big reads carry big lines (output chunks, file data): cut each
            # line once and hold the tail as a view, so no byte is copied
            # twice (a split would copy the remainder, then each line).
            find = data.find
            while (nl := find(b"\n", start)) >= 0:
                self._emit(data[start:nl], out)
                start = nl + 1
            if start < size:
                self._hold(memoryview(data)[start:] if start else data, out)
            return out
        # The complete lines of a small read (requests) are cut in one split:
        # a method call and a find per line cost more than the rest of their
        # framing. The last piece is what follows the last newline.
        lines = (data[start:] if start else data).split(b"\n")
        rest = lines.pop()
        limit = self._max
        for line in lines:
            if len(line) <= limit and line[:1] not in _BLANK_STARTS and line[-1:] != b"\r":
                out.append(line)  # what _emit would do, without the call
            else:
                self._emit(line, out)
        if rest:
            self._hold(rest, out)
        return out

    def _hold(self, rest: bytes | memoryview, out: list[Framed]) -> None:
        """Keep ``rest``, the start of a line whose newline has not arrived."""
        if self._discarding:
            return
        # One byte of slack: a line of exactly the limit may be followed by
        # the CR of its CRLF, which _emit strips. Without it, whether such a
        # line is accepted would depend on where the reads happen to split.
        held = self.buffered_bytes
        if held + len(rest) > self._max + 1:
            out.append(OVERSIZED)
            self._drop_partial()
            self._discarding = True
        elif self._long is not None or (
            self._long_after is not None and held + len(rest) > self._long_after
        ):
            self._append_long(rest)
        else:
            self._partial += rest

    def discard(self) -> None:
        """Drop the line still incomplete (the stream is gone): its sink is dropped too."""
        self._drop_partial()
        self._discarding = False

    def finish(self) -> list[Framed]:
        """End of stream: a final line without a newline still counts."""
        out: list[Framed] = []
        if not self._discarding:
            if self._long is not None:
                self._emit(self._take_long(), out)
            elif self._partial:
                self._emit(self._partial, out)
        self._drop_partial()
        self._discarding = False
        return out

    def _emit(self, line: Line | StreamedLine, out: list[Framed]) -> None:
        if isinstance(line, StreamedLine):
            view = line.line
            if len(view) and view[-1] == 13:  # \r
                line.line = view[:-1]
            if len(line.line) > self._max:
                line.sink.abort()
                out.append(OVERSIZED)
            else:
                out.append(line)  # a long line: never blank
            return
        if isinstance(line, memoryview):
            if len(line) and line[-1] == 13:  # \r
                line = line[:-1]
        elif line.endswith(b"\r"):
            if isinstance(line, bytearray):
                del line[-1]  # in place: no copy of a large line
            else:
                line = line[:-1]
        if len(line) > self._max:
            out.append(OVERSIZED)
        elif isinstance(line, memoryview):
            if _NOT_WHITESPACE.search(line) is not None:
                out.append(line)
        elif line[:1] not in _BLANK_STARTS or line.strip(_JSON_WHITESPACE):
            # Only JSON whitespace makes an empty message; bytes.isspace() also
            # accepts \x0b and \x0c, which must be answered as a parse error,
            # not dropped silently.
            out.append(line)


# --- incoming messages --------------------------------------------------------


# Built once per incoming message: msgspec structs, about five times cheaper
# to build than frozen attrs classes (whose __init__ goes through
# object.__setattr__ for every field).


class IncomingRequest(msgspec.Struct, frozen=True, gc=False):
    id: protocol.RequestId
    method: str
    params: msgspec.Raw | None


class IncomingNotification(msgspec.Struct, frozen=True, gc=False):
    method: str
    params: msgspec.Raw | None


class IncomingResponse(msgspec.Struct, frozen=True, gc=False):
    """A response or error sent by the client: always a protocol violation here."""

    id: protocol.RequestId | None
    is_error: bool


Incoming = IncomingRequest | IncomingNotification | IncomingResponse


class FramingError(Exception):
    """A message that cannot be interpreted; ``error`` is what to answer."""

    def __init__(self, error: RpcError, request_id: protocol.RequestId | None = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.request_id = request_id


class _Envelope(msgspec.Struct):
    id: int | str | msgspec.UnsetType | None = msgspec.UNSET
    method: str | msgspec.UnsetType = msgspec.UNSET
    params: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    result: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    error: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    jsonrpc: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


_envelope_decoder: Final = msgspec.json.Decoder(_Envelope)
_any_decoder: Final = msgspec.json.Decoder()


def _undecodable(exc: Exception) -> str:
    """Describe a decode failure msgspec reports outside DecodeError.

    Invalid UTF-8 inside a string surfaces as UnicodeDecodeError and nesting
    deeper than the interpreter's recursion limit as RecursionError; neither
    may escape, or one hostile line would end the whole connection.
    """
    if isinstance(exc, RecursionError):
        return "JSON nested too deeply"
    return f"invalid UTF-8: {exc}"


def _parse_error(detail: object) -> FramingError:
    return FramingError(RpcError(protocol.PARSE_ERROR, f"parse error: {detail}"))


def decode_message(data: bytes | bytearray | memoryview | str) -> Incoming:
    """Classify one JSON-RPC message the way the reference does."""
    try:
        env = _envelope_decoder.decode(data)
    except msgspec.ValidationError as exc:
        # msgspec checks types while it parses, so malformed JSON whose first
        # token already has the wrong type ("[", "1 2") lands here too. Decoding
        # as Raw validates the syntax without building Python objects.
        try:
            msgspec.json.decode(data, type=msgspec.Raw)
        except msgspec.DecodeError as parse_exc:
            raise _parse_error(parse_exc) from None
        except (UnicodeDecodeError, RecursionError) as parse_exc:
            raise _parse_error(_undecodable(parse_exc)) from None
        raise FramingError(RpcError.invalid_request(f"invalid JSON-RPC message: {exc}")) from None
    except msgspec.DecodeError as exc:
        raise _parse_error(exc) from None
    except (UnicodeDecodeError, RecursionError) as exc:
        raise _parse_error(_undecodable(exc)) from None

    has_id = env.id is not msgspec.UNSET
    msg_id = env.id if isinstance(env.id, int | str) else None
    if isinstance(env.method, str):
        params = env.params if isinstance(env.params, msgspec.Raw) else None
        if not has_id:
            return IncomingNotification(env.method, params)
        if msg_id is None:
            raise FramingError(
                RpcError.invalid_request(
                    "invalid JSON-RPC message: request id must be an integer or a string"
                )
            )
        return IncomingRequest(msg_id, env.method, params)
    if has_id and env.result is not msgspec.UNSET:
        return IncomingResponse(msg_id, is_error=False)
    if has_id and env.error is not msgspec.UNSET:
        return IncomingResponse(msg_id, is_error=True)
    raise FramingError(
        RpcError.invalid_request(
            "invalid JSON-RPC message: expected a request, a notification or a response"
        ),
        msg_id,
    )


#: One typed decoder per type: ``msgspec.json.decode(type=...)`` looks the
#: type's decoding plan up again on every call.
_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {}


def decode_as(raw: msgspec.Raw | bytes | None, value_type: type[T]) -> T:
    """Decode ``raw`` (``null`` if None) into ``value_type`` with its cached decoder.

    msgspec's errors propagate unchanged.
    """
    decoder = _decoders.get(value_type)
    if decoder is None:
        decoder = _decoders[value_type] = msgspec.json.Decoder(value_type)
    value: T = decoder.decode(raw if raw is not None else b"null")
    return value


def decode_params(raw: msgspec.Raw | None, params_type: type[T]) -> T:
    """Decode request params; a mismatch is ``-32602`` naming the field."""
    try:
        return decode_as(raw, params_type)
    except msgspec.DecodeError as exc:
        raise RpcError.invalid_params(str(exc)) from None
    except (UnicodeDecodeError, RecursionError) as exc:
        raise RpcError.invalid_params(_undecodable(exc)) from None


#: Params at least this long may skip the second parse of their long string.
LONG_PARAMS_BYTES: Final = LONG_MESSAGE_BYTES
#: Stands in for the long string in the copy of a line that is parsed
#: instead: random per process, so no client can send it to mislead the
#: check that the parser took the value where it was cut out.
_STAND_IN: Final = b'"' + secrets.token_hex(16).encode() + b'"'


def _searchable(line: Line) -> bytes | bytearray | mmap.mmap | None:
    """An object with C-speed ``find`` over ``line``'s bytes, at the same offsets.

    A ``memoryview`` line comes only from :meth:`LineFramer._take_long`:
    a view from the start of a :class:`MappedBuffer`'s mapping, whose
    ``find`` is a ``memchr``. Any other view is not searched.
    """
    if isinstance(line, bytes | bytearray):
        return line
    if isinstance(line, memoryview) and isinstance(line.obj, mmap.mmap):
        return line.obj
    return None


def long_string_span(line: Line, key: bytes) -> tuple[int, int] | None:
    """Offsets of the quotes around the value of the first ``"key":"`` in ``line``.

    None unless that value is a plain string (no backslash) found by a
    ``find`` (memchr speed, no copy); the caller checks that the parser
    takes the value from there (a nested or repeated key is someone else's).
    """
    found = _searchable(line)
    if found is None:
        return None
    size = len(line)
    needle = b'"' + key + b'":"'
    at = found.find(needle, 0, size)
    if at < 0:
        return None
    opening = at + len(needle) - 1
    closing = found.find(b'"', opening + 1, size)
    if closing < 0 or found.find(b"\\", opening + 1, closing) >= 0:
        return None
    return opening, closing


#: A long string cut out of a line's params: the params parsed from the
#: copy with the stand-in, and the offsets of the string's quotes in the line.
LongCut = tuple[msgspec.Raw, tuple[int, int]]


def cut_long_params(line: Line, raw: msgspec.Raw | None, key: str) -> LongCut | None:
    """The params of the already parsed ``line`` (``raw``) with the plain string
    value of ``key`` cut out, or None if there is none to cut (short params, no
    such plain string, or the copy does not parse: decode ``raw`` in full).

    One search for the string (its quotes, a ``memchr`` each) and one parse of
    the copy without it, done once per request: :func:`decode_long_params` and
    :func:`has_uri_value` both use the result. The first ``"key":"`` may lie
    outside the params (an unknown member before them): then there is no cut
    either (the stand-in, which no client can send, is not in the params).
    """
    if raw is None or len(raw) < LONG_PARAMS_BYTES:
        return None
    span = long_string_span(line, key.encode())
    if span is None:
        return None
    try:
        envelope = _envelope_decoder.decode(_cut(memoryview(line), span))
    except Exception:  # the full decode gives the exact answer
        return None
    if not isinstance(envelope.params, msgspec.Raw) or _STAND_IN not in bytes(envelope.params):
        return None  # (the string cut lies outside the params)
    return envelope.params, span


#: A JSON string value that is a file:// URI.
URI_VALUE: Final = b'"file://'


def has_uri_value(line: Line, cut: LongCut) -> bool:
    """Whether the params of ``cut`` (in ``line``) hold a string starting ``file://``.

    The same answer as searching the whole params (``raw``), without
    reading the long string: it holds no quote (it is a plain JSON string),
    so ``"file://`` can only be found there at its opening quote; the
    stand-in (hex) never matches.
    """
    cut_raw, (opening, _closing) = cut
    if bytes(memoryview(line)[opening : opening + len(URI_VALUE)]) == URI_VALUE:
        return True
    return URI_VALUE in bytes(cut_raw)


#: ``decode_long_params``'s default: cut the line there.
_UNCUT: Final = object()


def decode_long_params(
    line: Line | StreamedLine,
    raw: msgspec.Raw | None,
    params_type: type[T],
    key: str,
    attribute: str,
    cut: LongCut | object | None = _UNCUT,
) -> T:
    """:func:`decode_params` of ``raw`` (the params of the already parsed ``line``),
    without parsing the string value of ``key`` (field ``attribute``, a
    ``msgspec.Raw``) a second time.

    The envelope parse has validated the whole line; parsing the params
    again would scan the long string again (25 ms of a 16 MiB
    ``fs/writeFile``'s 22 MiB line). Instead a copy of the line with that
    string cut out is parsed (:func:`cut_long_params`, or ``cut`` if the
    caller made it already), and the field is set to the string in place
    (a view: no copy). The result, and any error, is what
    :func:`decode_params` gives: whenever the cut is not certainly the
    field's value (the parser did not take the stand-in from there), or
    the copy does not decode, ``raw`` is decoded in full.

    A :class:`StreamedLine` (``raw`` from :func:`decode_streamed`) is
    decoded from the copy already parsed, with the sink attached to the
    result as ``streamed`` (``params_type`` has ``dict=True``).
    """
    if isinstance(line, StreamedLine):
        return _streamed_params(line, raw, params_type, key, attribute)
    if cut is _UNCUT:
        cut = cut_long_params(line, raw, key)
    if not isinstance(cut, tuple):
        return decode_params(raw, params_type)
    cut_raw, (opening, closing) = cut
    params = _restored(cut_raw, params_type, attribute, memoryview(line)[opening : closing + 1])
    return decode_params(raw, params_type) if params is None else params


def _restored(
    cut_raw: msgspec.Raw | None, params_type: type[T], attribute: str, string: memoryview
) -> T | None:
    """``cut_raw`` (params with the stand-in) decoded, its field ``attribute`` set to
    ``string`` (a view: no copy); None if it does not decode or the stand-in is
    not that field's value (the full decode gives the exact answer)."""
    try:
        params = decode_as(cut_raw, params_type)
    except Exception:
        return None
    value = getattr(params, attribute, None)
    if not isinstance(value, msgspec.Raw) or bytes(value) != _STAND_IN:
        return None
    # (params is a Struct: params_type declares a long string only then.)
    return msgspec.structs.replace(params, **{attribute: msgspec.Raw(string)})  # type: ignore[type-var]


def _cut(line: memoryview, span: tuple[int, int]) -> bytes:
    opening, closing = span
    return b"".join((line[:opening], _STAND_IN, line[closing + 1 :]))


def decode_streamed(line: StreamedLine) -> IncomingRequest | None:
    """The request ``line`` is, parsed with its consumed string cut out; None if not usable.

    The sink checked that every byte between the quotes of :meth:`span` is
    base64 text (no quote, no backslash, ASCII): the line is valid JSON
    exactly when the copy with that string replaced by the stand-in is, so
    this parse of the copy validates the whole line. None (the caller then
    decodes ``line.line`` as any line, for the exact answer) when the sink
    did not end validly, the copy does not parse, or it is not a request
    for the sink's method.
    """
    span = line.sink.span()
    if span is None:
        return None
    try:
        env = _envelope_decoder.decode(_cut(line.line, span))
    except Exception:  # the full decode gives the exact error
        return None
    msg_id = env.id
    if (
        env.method != line.sink.method
        or not isinstance(msg_id, int | str)
        or (isinstance(msg_id, str) and _STAND_IN[1:-1].decode() in msg_id)
        or not isinstance(env.params, msgspec.Raw)
    ):
        return None
    return IncomingRequest(msg_id, env.method, env.params)


def _streamed_params(
    line: StreamedLine, raw: msgspec.Raw | None, params_type: type[T], key: str, attribute: str
) -> T:
    """:func:`decode_long_params` for a request from :func:`decode_streamed` (``raw``: the
    params of the copy). The result carries the sink as ``streamed``."""
    span = line.sink.span()
    params = None
    if span is not None:
        opening, closing = span
        params = _restored(raw, params_type, attribute, line.line[opening : closing + 1])
    if params is None:
        # Not the field, or the params do not decode: the line's own
        # params give the exact answer (the sink is not used).
        line.sink.abort()
        full = _envelope_decoder.decode(line.line)
        whole = full.params if isinstance(full.params, msgspec.Raw) else None
        return decode_long_params(line.line, whole, params_type, key, attribute)
    params.streamed = line.sink  # type: ignore[attr-defined]
    return params


_encoder: Final = msgspec.json.Encoder()
encode: Final = _encoder.encode


class OutputEncoder:
    """Renders the ``process/output`` notifications of one process, fast.

    Output is the bulk of what a server sends. msgspec's base64 runs at about
    1.3 GB/s here, pybase64's SIMD encoder at tens of GB/s. The message is
    assembled around the base64 text from pieces rendered once per process,
    byte for byte what :func:`encode` produces for
    ``Notification(PROCESS_OUTPUT, OutputNotification(...))``.
    """

    __slots__ = ("_heads",)

    def __init__(self, process_id: str) -> None:
        prefix = b'{"method":"process/output","params":{"processId":' + encode(process_id)
        self._heads = {
            stream: prefix + b',"stream":"' + stream.encode() + b'","chunk":"'
            for stream in ("stdout", "stderr", "pty")
        }

    def encode(self, stream: str, data: bytes, seq: int) -> bytes:
        return b"".join((self._heads[stream], b64encode(data), b'","seq":', b"%d" % seq, b"}}"))


def encode_line(value: object) -> bytes:
    """Encode one message followed by ``\\n``."""
    return _encoder.encode(value) + b"\n"


@attrs.frozen
class RenderedParts:
    """A result already rendered as JSON, as consecutive pieces.

    The dispatcher sends them around the response envelope without joining
    them (``fs/readFile`` results: the base64 text exists once, in pieces).
    """

    parts: tuple[bytes, ...]

    def __len__(self) -> int:
        return sum(len(part) for part in self.parts)
