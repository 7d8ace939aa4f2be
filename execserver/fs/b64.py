"""Base64 of ``fs/readFile`` results and ``fs/writeFile`` params, in pieces.

Results are produced as a sequence of ``bytes`` pieces (SIMD base64 from
pybase64, a slice of the file at a time), so the text never exists twice
and the transports send the pieces without joining them. Params are
decoded a slice at a time straight from the request line, with the error
texts of the reference's Rust ``base64`` STANDARD engine.
"""

from __future__ import annotations

import binascii
from collections.abc import Iterator
from typing import Final

import msgspec
import pybase64

from execserver.errors import RpcError
from execserver.fs.paths import invalid

#: Slice of a large payload base64-encoded or decoded per C call; a multiple of
#: 3 and 4 so slices join seamlessly. Small enough that other threads (the
#: reactor) get the GIL between slices, and that the one slice held besides
#: the text (the read buffer, a decoded piece) weighs little next to it: at
#: 3 MiB it alone took 0.19x of a 16 MiB file (peak RSS over idle).
B64_SLICE: Final = 3 * 256 * 1024

# --- base64 -------------------------------------------------------------------


_ALPHABET: Final = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")
_PAD: Final = ord("=")


def rust_base64_error(text: bytes) -> str | None:
    """The message Rust's ``base64`` STANDARD engine gives for ``text``, or None.

    Mirrors its order of checks (an invalid trailing byte first, then the
    body quad by quad, then padding and trailing bits of the last quad) so
    ``fs/writeFile`` errors read exactly like the reference's.
    """
    size = len(text)
    rem = size % 4
    if rem == 1 and text[-1] != _PAD and text[-1] not in _ALPHABET:
        return f"Invalid symbol {text[-1]}, offset {size - 1}."
    body = max(0, size - rem - 4) if rem else max(0, size - 4)
    for index in range(body):
        if text[index] not in _ALPHABET:
            return f"Invalid symbol {text[index]}, offset {index}."
    padding = 0
    first_pad = 0
    morsels: list[int] = []
    last_symbol = 0
    for i, byte in enumerate(text[body:]):
        if byte == _PAD:
            if i % 4 < 2:
                where = first_pad if padding else i
                return f"Invalid symbol {byte}, offset {body + where}."
            if not padding:
                first_pad = i
            padding += 1
            continue
        if padding:
            return f"Invalid symbol {_PAD}, offset {body + first_pad}."
        if byte not in _ALPHABET:
            return f"Invalid symbol {byte}, offset {body + i}."
        last_symbol = byte
        morsels.append(_B64_VALUES[byte])
    if (padding + len(morsels)) % 4:
        return "Invalid padding"
    if len(morsels) % 4 in (2, 3):
        used_bits = (len(morsels) * 6) // 8 * 8
        bits = 0
        for morsel in morsels:
            bits = (bits << 6) | morsel
        spare = len(morsels) * 6 - used_bits
        if bits & ((1 << spare) - 1):
            return f"Invalid last symbol {last_symbol}, offset {body + len(morsels) - 1}."
    return None


_B64_VALUES: Final = {
    byte: value
    for value, byte in enumerate(
        b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    )
}


def noncanonical_tail(tail: bytes, decoded: bytes | bytearray) -> bool:
    """Whether a padded last quad carries set bits that decoding drops (``YR==``)."""
    leftover = len(decoded) % 3
    if not tail.endswith(b"=") or not leftover:
        return False
    return binascii.b2a_base64(decoded[-leftover:], newline=False) != tail


def invalid_base64(detail: str) -> RpcError:
    return invalid(f"fs/writeFile requires valid base64 dataBase64: {detail}", "invalidBase64")


class NotFast(Exception):
    """The text needs the exact, slow path (JSON escapes, or invalid base64)."""


#: Base64 text decoded per C call (B64_SLICE bytes of output).
_TEXT_SLICE: Final = B64_SLICE // 3 * 4


def decoded_pieces(raw: msgspec.Raw) -> Iterator[bytes]:
    """Decode the JSON string ``raw`` (quotes included) a slice at a time.

    Yields the decoded bytes in pieces of at most :data:`B64_SLICE`, straight
    from the request line (no copy of the text). Raises :class:`NotFast`,
    possibly after some pieces, when the text is not plain canonical base64:
    the caller then discards what it wrote and uses :func:`decode_slow`,
    which either decodes a JSON-escaped string or raises the reference's
    error.
    """
    view = memoryview(raw).cast("B")
    if len(view) < 2 or view[0] != ord('"') or view[-1] != ord('"'):
        raise NotFast
    text = view[1:-1]
    size = len(text)
    if size % 4:
        raise NotFast
    for start in range(0, size, _TEXT_SLICE):
        chunk = text[start : start + _TEXT_SLICE]
        last = start + _TEXT_SLICE >= size
        if not last and chunk[-1] == _PAD:
            raise NotFast  # padding before the end
        try:
            piece = pybase64.b64decode(chunk, validate=True)
        except (binascii.Error, ValueError):
            raise NotFast from None
        if last and noncanonical_tail(bytes(chunk[-4:]), piece):
            raise NotFast  # non-canonical trailing bits: the slow path names them
        yield piece
        # Not held while the next slice is decoded (nor by the caller's loop
        # variable, see ops._write_pieces): one decoded piece at a time.
        del piece


def decode_slow(raw: msgspec.Raw) -> bytes:
    """Decode ``raw`` exactly, or raise the reference's error for it."""
    try:
        value = msgspec.json.decode(raw, type=str)
    except msgspec.ValidationError as exc:
        raise RpcError.invalid_params(f"{exc} - at `$.dataBase64`") from None
    except msgspec.DecodeError as exc:
        # Invalid UTF-8 in the string (the envelope's parse leaves params
        # raw): what a typed decode of the params says (codec.decode_params).
        raise RpcError.invalid_params(str(exc)) from None
    encoded = value.encode("utf-8")
    problem = rust_base64_error(encoded)
    if problem is not None:
        raise invalid_base64(problem)
    return binascii.a2b_base64(encoded, strict_mode=True)


def validate(raw: msgspec.Raw) -> bytes | None:
    """Check ``raw`` before anything is written in place.

    None if the fast path decodes it (decoding it again costs less than
    holding it); else its bytes from :func:`decode_slow` (or its error).
    """
    try:
        for _ in decoded_pieces(raw):
            pass
    except NotFast:
        return decode_slow(raw)
    return None


def decode_whole(raw: msgspec.Raw) -> bytes:
    """The bytes of the JSON string ``raw`` in one C call (or :func:`decode_slow`'s answer).

    For text small enough to hold decoded beside it: one decode both
    checks and decodes (:func:`validate` and then a second, streaming,
    decode cost twice as much).
    """
    view = memoryview(raw).cast("B")
    if len(view) >= 2 and view[0] == ord('"') and view[-1] == ord('"') and len(view) % 4 == 2:
        text = view[1:-1]
        try:
            data = pybase64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            pass
        else:
            if not text or not noncanonical_tail(bytes(text[-4:]), data):
                return data
    return decode_slow(raw)


def encode_pieces(data: bytes | bytearray | memoryview) -> list[bytes]:
    """The base64 text of ``data``, one ``bytes`` piece per slice."""
    view = memoryview(data)
    return [pybase64.b64encode(view[i : i + B64_SLICE]) for i in range(0, len(view), B64_SLICE)]
