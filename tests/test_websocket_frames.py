"""The WebSocket transport's own frame path against Autobahn's parser.

``ExecServerProtocol.processData`` decodes small complete masked frames
itself and leaves everything else to Autobahn. Both are fed the same random
frame streams (fragments, control frames, masks, sizes around every length
boundary and the message limit, bad UTF-8, reserved bits and opcodes,
unmasked frames), cut into random reads; the messages handed to the
dispatcher, every byte sent back (pongs, close frames with their codes) and
the final state must be identical.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import pytest
import txaio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.task import Clock

from execserver.transports.websocket import ExecServerProtocol
from tests.support.ws_wire import LIMIT, make_factory, open_raw, server_frames

OPCODES = [0, 1, 2, 8, 9, 10, 3, 11]
SIZES = st.one_of(
    st.integers(0, 40),
    st.sampled_from([125, 126, 127, 1000, LIMIT - 1, LIMIT, LIMIT + 1, 65535, 65536]),
    st.sampled_from([LIMIT, LIMIT + 1]),
)


@st.composite
def frame(draw: st.DrawFn) -> bytes:
    opcode = draw(st.sampled_from(OPCODES))
    size = draw(SIZES)
    if opcode >= 8:
        size = min(size, draw(st.sampled_from([size, 125, 126])))
    if opcode in (1, 0) and draw(st.booleans()):
        # Cut to size: sometimes in the middle of a character (invalid UTF-8).
        payload = (draw(st.text(max_size=40)).encode() * (size + 1) + b"a" * size)[:size]
    else:
        payload = draw(st.binary(min_size=min(size, 40), max_size=min(size, 40)))
        payload = (payload * (size // max(len(payload), 1) + 1))[:size] if payload else bytes(size)
    fin = draw(st.booleans()) if opcode < 8 else True
    rsv = draw(st.sampled_from([0, 0, 0, 0x40]))
    masked = draw(st.sampled_from([True, True, True, False]))
    mask = draw(st.binary(min_size=4, max_size=4)) if masked else b""
    n = len(payload)
    first = (0x80 if fin else 0) | rsv | opcode
    flag = 0x80 if masked else 0
    if n < 126:
        head = bytes([first, flag | n])
    elif n < 1 << 16:
        head = bytes([first, flag | 126]) + struct.pack(">H", n)
    else:
        head = bytes([first, flag | 127]) + struct.pack(">Q", n)
    if masked:
        key = (mask * (n // 4 + 1))[:n]
        payload = (int.from_bytes(payload, "big") ^ int.from_bytes(key, "big")).to_bytes(n, "big")
    return head + mask + payload


@st.composite
def stream(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    data = b"".join(draw(st.lists(frame(), min_size=1, max_size=8)))
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=4)))
    return data, cuts


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    clock = Clock()
    monkeypatch.setattr(txaio.config, "loop", clock)  # type: ignore[attr-defined]
    yield clock


def run(clock: Clock, fast: bool, data: bytes, cuts: list[int]) -> tuple[Any, ...]:
    proto, transport = open_raw(make_factory(clock, fast_frames=fast))
    delivered: list[bytes | None] = []
    proto._dispatch = delivered.append  # type: ignore[method-assign,assignment]
    start = 0
    for cut in [*cuts, len(data)]:
        if cut > start and proto.transport is not None:
            proto.dataReceived(data[start:cut])
        start = max(start, cut)
    return delivered, server_frames(transport.value()), proto.state, proto.wasClean


@settings(
    max_examples=300,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(stream())
def test_the_fast_path_and_autobahn_agree(clock: Clock, case: tuple[bytes, list[int]]) -> None:
    data, cuts = case
    assert run(clock, True, data, cuts) == run(clock, False, data, cuts)


def test_the_switch_really_bypasses_the_fast_path(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A text frame of 5 bytes, masked: the fast path's case.
    data = b"\x81\x85" + b"\x00\x00\x00\x00" + b"hello"
    calls: list[str] = []
    original = ExecServerProtocol._deliver

    def spy(self: ExecServerProtocol, message: bytes | None) -> None:
        calls.append("fast" if self.current_frame is None else "autobahn")
        original(self, message)

    monkeypatch.setattr(ExecServerProtocol, "_deliver", spy)
    run(clock, True, data, [])
    run(clock, False, data, [])
    assert calls == ["fast", "autobahn"]
