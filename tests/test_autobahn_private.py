"""The private Autobahn corners (``transports/autobahn_private.py``): their checks and fallbacks.

Each check is run against a copy of Autobahn's class with the relied-on
shape broken, and must name what is missing; then the corner is switched
off the way a failed import check switches it off, and a WebSocket
connection must still be served by the public path: close codes through
``sendClose`` (private-use 4013/4008/4001), Autobahn's own timers, every
frame through Autobahn's parser.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from collections.abc import Iterator
from typing import Any, cast

import attrs
import pytest
import txaio
from autobahn.twisted.websocket import WebSocketServerFactory
from autobahn.websocket.protocol import WebSocketProtocol
from twisted.internet.error import ConnectionLost
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from execserver.transports import autobahn_private
from execserver.transports.autobahn_private import (
    USABLE_CORNERS,
    ClockTimers,
    close_frame_problems,
    fast_frame_problems,
    send_path_problems,
    state_problems,
    timer_problems,
)
from execserver.transports.websocket import ExecServerProtocol
from tests.support.ws_wire import client_frame, make_factory, open_raw, server_frames


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    clock = Clock()
    monkeypatch.setattr(txaio.config, "loop", clock)  # type: ignore[attr-defined]
    yield clock


def test_the_installed_autobahn_has_every_shape_relied_on() -> None:
    problems = (
        close_frame_problems(),
        timer_problems(),
        fast_frame_problems(),
        state_problems(),
        send_path_problems(),
    )
    assert problems == ([], [], [], [], [])
    assert attrs.astuple(USABLE_CORNERS) == (True, True, True, True, True)


def _broken(base: type, **attrs: Any) -> type:
    return type("Broken", (base,), attrs)


def test_each_check_notices_a_changed_shape() -> None:
    def close_frame(self: Any, code: int, reason: bytes, isReply: bool = False) -> None:
        pass

    assert close_frame_problems(_broken(WebSocketProtocol, sendCloseFrame=close_frame)) == [
        "sendCloseFrame(self, code, reasonUtf8, isReply)"
    ]

    def init(self: Any) -> None:
        self.timers = None

    # (A factory whose __init__ no longer creates _batched_timer anywhere in its MRO.)
    bare_factory = type("Bare", (), {"__init__": init})
    assert timer_problems(bare_factory) == ["the factory's _batched_timer"]

    def made(self: Any) -> None:
        self.timer = self.factory.timers.schedule()

    assert timer_problems(
        WebSocketServerFactory, _broken(WebSocketProtocol, _sendAutoPing=made)
    ) == ["_sendAutoPing scheduling through factory._batched_timer.call_later"]

    def process(self: Any) -> bool:
        return bool(self.buffer)

    problems = fast_frame_problems(_broken(WebSocketProtocol, processData=process))
    assert problems == ["processData reading data, current_frame, inside_message"]
    renamed = _broken(WebSocketProtocol, _cancelAutoPingTimeoutCall=None)
    assert fast_frame_problems(renamed) == ["_cancelAutoPingTimeoutCall(self)"]
    optionless = _broken(WebSocketProtocol, CONFIG_ATTRS_COMMON=["utf8validateIncoming"])
    assert fast_frame_problems(optionless) == [
        "utf8validateIncoming and autoPingRestartOnAnyTraffic protocol options"
    ]
    assert state_problems(_broken(WebSocketProtocol, _connectionMade=made)) == [
        "_connectionMade setting failedByMe and data"
    ]

    def send_frame(self: Any, opcode: int, payload: bytes = b"") -> None:
        self.transport.write(payload)

    assert send_path_problems(_broken(WebSocketProtocol, sendFrame=send_frame)) == [
        "sendFrame writing through sendData"
    ]


@pytest.mark.parametrize(
    ("code", "expected"), [(1013, 4013), (1008, 4008), (1001, 4001), (4000, 4000)]
)
def test_the_public_close_codes(code: int, expected: int) -> None:
    assert autobahn_private.public_close_code(code) == expected


def _close_code(transport: Any) -> int:
    opcode, payload = server_frames(transport.value())[-1]
    assert opcode == 8
    code: int = struct.unpack(">H", payload[:2])[0]
    return code


def test_close_codes_fall_back_to_public_send_close(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The private path: a JSON-RPC protocol violation closes with 1008.
    proto, transport = open_raw(make_factory(clock))
    proto.dataReceived(client_frame(1, b'{"id":1,"result":{}}'))
    assert _close_code(transport) == 1008
    # sendCloseFrame's shape changed: sendClose with 4008, same reason.
    monkeypatch.setattr(USABLE_CORNERS, "close_frame", False)
    proto, transport = open_raw(make_factory(clock))
    proto.dataReceived(client_frame(1, b'{"id":1,"result":{}}'))
    assert _close_code(transport) == 4008
    assert server_frames(transport.value())[-1][1][2:] == b"JSON-RPC protocol violation"
    # ...and a server shutdown says "going away" as 4001.
    factory = make_factory(clock)
    proto, transport = open_raw(factory)
    factory.shut_down()
    assert _close_code(transport) == 4001


def test_timers_fall_back_to_autobahns_own(clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(make_factory(clock)._batched_timer, ClockTimers)
    monkeypatch.setattr(USABLE_CORNERS, "exact_timers", False)
    factory = make_factory(clock, ping_interval=10.0, ping_timeout=5.0)
    assert not isinstance(factory._batched_timer, ClockTimers)
    # Autobahn's batched timers (on txaio's loop, the fake clock here) still
    # ping and drop a dead peer, to within their whole-second buckets.
    _proto, transport = open_raw(factory)
    clock.advance(11.0)
    assert [op for op, _ in server_frames(transport.value())] == [9]
    clock.advance(6.0)
    assert transport.disconnecting


def test_frames_fall_back_to_autobahns_parser(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(USABLE_CORNERS, "fast_frames", False)
    paths: list[str] = []
    original = ExecServerProtocol._deliver

    def spy(self: ExecServerProtocol, message: bytes | None) -> None:
        paths.append("fast" if self.current_frame is None else "autobahn")
        original(self, message)

    monkeypatch.setattr(ExecServerProtocol, "_deliver", spy)
    proto, transport = open_raw(make_factory(clock, fast_frames=True))
    proto.dataReceived(
        client_frame(1, b'{"id":1,"method":"initialize","params":{"clientName":"t"}}')
        + client_frame(2, b'{"id":2,"method":"nope"}')
    )
    replies = [json.loads(p) for _, p in server_frames(transport.value())]
    assert [r["id"] for r in replies] == [1, 2]
    assert paths == ["autobahn", "autobahn"]


def test_parser_state_falls_back_to_public_checks(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(USABLE_CORNERS, "parser_state", False)
    # A message whose text is invalid UTF-8 fails the connection (1007) and
    # is not delivered, without reading failedByMe.
    delivered: list[bytes | None] = []
    proto, transport = open_raw(make_factory(clock, fast_frames=False))
    proto._dispatch = delivered.append  # type: ignore[method-assign,assignment]
    proto.dataReceived(client_frame(1, b'{"id":1,"method":"\xff"}'))
    assert _close_code(transport) == 1007
    assert delivered == []
    # A lost connection is still torn down (its input is left to the collector).
    proto.dataReceived(b"\x81")
    proto.connectionLost(Failure(ConnectionLost()))
    assert proto.connection is None


BROKEN_IMPORT = """
import json
from twisted.logger import globalLogPublisher
import autobahn.websocket.protocol as ab

warnings = []
def observe(event):
    if event["log_level"].name == "warn":
        warnings.append(event["log_format"].format(**event))
globalLogPublisher.addObserver(observe)
def close_frame(self, code=None, reason=None):
    pass
ab.WebSocketProtocol.sendCloseFrame = close_frame
del ab.WebSocketProtocol._cancelAutoPingTimeoutCall
from execserver.transports import autobahn_private
import attrs
print(json.dumps([attrs.astuple(autobahn_private.USABLE_CORNERS), warnings]))
"""


def test_a_broken_shape_at_import_warns_and_takes_the_public_path() -> None:
    # In a fresh interpreter: Autobahn changed before the module is imported.
    done = subprocess.run(
        [sys.executable, "-c", BROKEN_IMPORT],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    corners, warnings = json.loads(done.stdout)
    assert corners == [False, True, False, True, True]
    assert len(warnings) == 2
    assert "sendCloseFrame(self, code, reasonUtf8, isReply)" in warnings[0]
    assert "using the public path instead" in warnings[0]
    assert "_cancelAutoPingTimeoutCall(self)" in warnings[1]


def test_without_the_send_path_messages_go_whole_to_twisteds_buffer(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(USABLE_CORNERS, "send_path", False)
    proto, transport = open_raw(make_factory(clock))
    producer: Any = transport.producer
    assert producer is cast(Any, proto._flow)  # no Outbox in front of the backpressure
    assert proto.connection is not None
    session: Any = proto.connection.session
    producer.pauseProducing()  # TCP's buffer above the mark: the session pauses
    assert session.paused
    payload = b"x" * (2 * 1024 * 1024)
    proto.write_message_parts((b'{"id":1,"result":"', payload, b'"}'))
    proto.sendPong(b"late")
    proto.write_message(b'{"id":2,"result":{}}')
    frames = server_frames(transport.value())
    assert [opcode for opcode, _ in frames] == [1, 10, 1]
    assert frames[0][1] == b'{"id":1,"result":"' + payload + b'"}'
    producer.resumeProducing()
    assert not session.paused
