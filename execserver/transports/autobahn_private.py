"""Every private Autobahn corner the WebSocket transport still steps on, checked at import.

The upgrade itself runs on public API (a ``twisted.web`` site with
Autobahn's ``WebSocketResource``, ``transports/http.py``); three things
have no public equivalent, and each lives here with its reason, a check at
import that Autobahn still has the shape relied on, and a public fallback
used (after one warning) when the check fails:

- **Close codes 1013, 1008 and 1001.** The public ``sendClose`` accepts
  only 1000 and 3000-4999, so it cannot say "try again later" (the partial
  message cap), "policy violation" (a JSON-RPC protocol violation) or
  "going away" (server shutdown). ``sendCloseFrame`` sends any code.
  Fallback: ``sendClose`` with the private-use code ``4000 + (code - 1000)``
  (4013, 4008, 4001) and the same reason.
- **Exact timers.** Autobahn schedules its pings, ping timeouts and
  closing-handshake timeouts through ``factory._batched_timer``, which txaio batches into buckets of
  whole seconds: a 300 ms ping timeout fires at once or a second late.
  :class:`ClockTimers` puts them on the injected clock, exactly. Fallback:
  Autobahn's own batched timers (timeouts up to a second off).
- **The fast frame path** (``--no-fast-frames`` turns it off):
  :func:`fast_frames` decodes small complete masked frames without
  Autobahn's ~15 us of Python per frame, reading and updating the parser's
  state (``data``, ``state``, ``current_frame``, ``inside_message``,
  ``utf8validateIncoming``, the auto-ping timeout) and leaving everything
  else to Autobahn's ``processData``. ``tests/test_websocket_frames.py``
  feeds random frame streams to both and requires the same messages,
  replies and close codes. Fallback: Autobahn's parser for every frame.
  The same check covers skipping the adapter's ``dataReceived`` (a debug
  line formatted on every read) for ``_dataReceived``.
- **Autobahn's own frames behind a queued message.** Autobahn writes its
  frames (pong, close, ping) through ``sendFrame`` → ``sendData``; while a
  large message is still being fed to the socket by the connection's
  ``Outbox`` (``writebuffer.py``), ``ExecServerProtocol.sendData`` queues
  them behind it, or they would land inside its payload. Fallback: no
  ``Outbox`` (every message goes to Twisted's buffer whole, costing a copy
  of a large message in memory), so nothing can overtake anything.
- **Parser state read elsewhere.** ``failedByMe`` (Autobahn keeps parsing
  after it failed a connection, to read the close reply, and still delivers
  the offending message: :func:`failed_by_me`) and the unparsed input
  ``data``, emptied when a connection is lost so a half-received frame is
  freed at once (:func:`release_input`). Fallbacks: "not failed" (the
  protocol also requires the OPEN state before it delivers) and leaving the
  buffer to the garbage collector.

``tests/test_autobahn_private.py`` breaks each shape on purpose and checks
that the check notices and that the fallback serves a real connection.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import attrs
from autobahn.twisted.websocket import WebSocketServerFactory, WebSocketServerProtocol
from autobahn.websocket.protocol import WebSocketProtocol
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from execserver.private_api_checks import code_names, parameters

if TYPE_CHECKING:
    from collections.abc import Iterable

log = Logger()

#: Offset of the public fallback's private-use close codes (RFC 6455 7.4.2).
FALLBACK_CODE_OFFSET: Final = 3000


def _missing(checks: Iterable[tuple[bool, str]]) -> list[str]:
    return [what for ok, what in checks if not ok]


def close_frame_problems(cls: type = WebSocketProtocol) -> list[str]:
    """What is missing for :func:`send_close` (empty: the private path is usable)."""
    return _missing(
        [
            (
                parameters(getattr(cls, "sendCloseFrame", None))
                == ["self", "code", "reasonUtf8", "isReply"],
                "sendCloseFrame(self, code, reasonUtf8, isReply)",
            ),
        ]
    )


def timer_problems(
    factory_cls: type = WebSocketServerFactory, protocol_cls: type = WebSocketProtocol
) -> list[str]:
    """What is missing for :func:`install_exact_timers`."""
    init_names: set[str] = set()
    for klass in factory_cls.__mro__:
        init_names |= code_names(klass.__dict__.get("__init__"))
    return _missing(
        [
            ("_batched_timer" in init_names, "the factory's _batched_timer"),
            (
                # (The ping timeout: the timer whose precision matters.)
                {"_batched_timer", "call_later"}
                <= code_names(getattr(protocol_cls, "_sendAutoPing", None)),
                "_sendAutoPing scheduling through factory._batched_timer.call_later",
            ),
        ]
    )


def fast_frame_problems(cls: type = WebSocketProtocol) -> list[str]:
    """What is missing for :func:`fast_frames` and :func:`receive`."""
    parser = code_names(getattr(cls, "processData", None))
    receiver = code_names(getattr(cls, "_dataReceived", None))
    return _missing(
        [
            (
                {"data", "current_frame", "inside_message"} <= parser,
                "processData reading data, current_frame, inside_message",
            ),
            (
                {"state", "STATE_OPEN", "consumeData"} <= receiver,
                "_dataReceived(data) feeding consumeData",
            ),
            (parameters(getattr(cls, "_dataReceived", None)) == ["self", "data"], "_dataReceived"),
            (
                parameters(getattr(cls, "_cancelAutoPingTimeoutCall", None)) == ["self"],
                "_cancelAutoPingTimeoutCall(self)",
            ),
            (
                "autoPingTimeoutCall" in code_names(getattr(cls, "_connectionMade", None)),
                "_connectionMade setting autoPingTimeoutCall",
            ),
            (
                # Protocol options copied onto each protocol.
                {"utf8validateIncoming", "autoPingRestartOnAnyTraffic"}
                <= set(getattr(cls, "CONFIG_ATTRS_COMMON", ())),
                "utf8validateIncoming and autoPingRestartOnAnyTraffic protocol options",
            ),
            (hasattr(cls, "STATE_OPEN"), "STATE_OPEN"),
        ]
    )


def state_problems(cls: type = WebSocketProtocol) -> list[str]:
    """What is missing for :func:`failed_by_me` and :func:`release_input`."""
    return _missing(
        [
            (
                {"failedByMe", "data"} <= code_names(getattr(cls, "_connectionMade", None)),
                "_connectionMade setting failedByMe and data",
            ),
        ]
    )


def send_path_problems(cls: type = WebSocketProtocol) -> list[str]:
    """What is missing for queueing Autobahn's own frames behind a large message."""
    return _missing(
        [
            (
                parameters(getattr(cls, "sendData", None)) == ["self", "data", "sync", "chopsize"],
                "sendData(self, data, sync, chopsize)",
            ),
            (
                "sendData" in code_names(getattr(cls, "sendFrame", None)),
                "sendFrame writing through sendData",
            ),
        ]
    )


@attrs.define
class UsableCorners:
    """Which private Autobahn corners still have the shape we rely on (checked once, at import).

    Each False field means its public fallback is used instead (the module
    docstring names each corner and its fallback).
    """

    #: ``sendCloseFrame``: close codes 1013/1008/1001 (else 4013/4008/4001).
    close_frame: bool
    #: ``_batched_timer`` replaced by exact reactor timers (else Autobahn's whole seconds).
    exact_timers: bool
    #: The frame parser's state, for the fast path of small frames (else Autobahn's parser).
    fast_frames: bool
    #: ``failedByMe`` and the unparsed input (else only the OPEN state gates delivery).
    parser_state: bool
    #: Autobahn's own frames written through ``sendData`` (else no Outbox).
    send_path: bool


def _check() -> UsableCorners:
    found = {
        "sendCloseFrame": close_frame_problems(),
        "_batched_timer": timer_problems(),
        "the frame parser's state": fast_frame_problems(),
        "failedByMe and data": state_problems(),
        "sendData": send_path_problems(),
    }
    for corner, problems in found.items():
        if problems:
            log.warn(
                "Autobahn no longer has the shape exec-server relies on for {corner} "
                "({problems}); using the public path instead",
                corner=corner,
                problems="; ".join(problems),
            )
    return UsableCorners(
        close_frame=not found["sendCloseFrame"],
        exact_timers=not found["_batched_timer"],
        fast_frames=not found["the frame parser's state"],
        parser_state=not found["failedByMe and data"],
        send_path=not found["sendData"],
    )


#: The result of the import check (tests flip fields to exercise the fallbacks).
USABLE_CORNERS: Final = _check()


# --- close codes ----------------------------------------------------------------------------


def public_close_code(code: int) -> int:
    """The private-use code the public fallback sends for ``code`` (1013 -> 4013)."""
    return code + FALLBACK_CODE_OFFSET if 1000 <= code < 2000 else code


def send_close(proto: Any, code: int, reason: str) -> None:
    """Start the closing handshake with ``code`` (1001, 1008, 1013), whatever sendClose allows."""
    if USABLE_CORNERS.close_frame:
        proto.sendCloseFrame(code=code, reasonUtf8=reason.encode(), isReply=False)
    else:
        proto.sendClose(code=public_close_code(code), reason=reason)


# --- timers -----------------------------------------------------------------------------------


class _Timer:
    """A cancellable timer whose ``cancel`` is a no-op once it has run."""

    __slots__ = ("_call",)

    def __init__(self, call: IDelayedCall) -> None:
        self._call = call

    def cancel(self) -> None:
        if self._call.active():
            self._call.cancel()


@attrs.frozen
class ClockTimers:
    """Autobahn's timer hook (``factory._batched_timer``) on an injected clock.

    Autobahn's default batches timers through txaio into buckets computed
    from *whole seconds* (``int(now + delay) * 1000``), so a 300 ms ping
    timeout can fire at once or up to a second late. Exact timers are
    cheap in Twisted's heap, and an injected clock makes them testable.
    """

    clock: IReactorTime

    def call_later(
        self, delay: float, func: Callable[..., object], *args: Any, **kw: Any
    ) -> _Timer:
        return _Timer(self.clock.callLater(delay, func, *args, **kw))


def install_exact_timers(factory: Any, clock: IReactorTime) -> None:
    """Schedule ``factory``'s protocol timers on ``clock`` (see :class:`ClockTimers`)."""
    if USABLE_CORNERS.exact_timers:
        factory._batched_timer = ClockTimers(clock)


# --- the frame path ---------------------------------------------------------------------------


def receive(proto: Any, data: bytes) -> None:
    """Bytes from the transport to Autobahn, without formatting a debug line per read."""
    if USABLE_CORNERS.fast_frames:
        proto._dataReceived(data)
    else:
        WebSocketServerProtocol.dataReceived(proto, data)


def fast_frames(proto: Any, limit: int, deliver: Callable[[bytes], None]) -> bool | None:
    """Decode complete small masked frames at the head of ``proto.data``; None: not usable.

    Autobahn spends ~15 us of Python per frame (frame object, callbacks,
    masker and validator objects, one copy of the remaining buffer per
    frame). Requests are small single-frame messages, so a complete,
    unfragmented, masked text or binary frame of at most ``limit`` bytes,
    with no message in progress, is decoded here; anything else (control
    frames, fragments, big or partial frames, bad UTF-8, protocol errors)
    is left in the buffer for Autobahn's parser, which handles it with all
    its checks. Returns what ``processData`` returns, or None when nothing
    was decoded (the caller then runs Autobahn's ``processData``).
    """
    if not USABLE_CORNERS.fast_frames:
        return None
    data = proto.data
    end = len(data)
    offset = 0
    while (
        proto.state == WebSocketProtocol.STATE_OPEN
        and proto.current_frame is None
        and not proto.inside_message
        and end - offset >= 6
    ):
        b0 = data[offset]
        b1 = data[offset + 1]
        # FIN set, no RSV bits, text (1) or binary (2); masked.
        if b0 not in (0x81, 0x82) or not b1 & 0x80:
            break
        length = b1 & 0x7F
        if length < 126:
            start = offset + 6
        elif length == 126 and end - offset >= 8:
            length = (data[offset + 2] << 8) | data[offset + 3]
            start = offset + 8
        else:
            break
        if end < start + length or length > limit:
            break
        mask = data[start - 4 : start]
        payload = data[start : start + length]
        if mask != b"\0\0\0\0":
            key = int.from_bytes((mask * (length // 4 + 1))[:length], "little")
            payload = (int.from_bytes(payload, "little") ^ key).to_bytes(length, "little")
        if b0 == 0x81 and proto.utf8validateIncoming:
            try:
                payload.decode("utf-8")
            except UnicodeDecodeError:
                break  # Autobahn fails the connection with 1007
        offset = start + length
        if proto.autoPingTimeoutCall and proto.autoPingRestartOnAnyTraffic:
            proto._cancelAutoPingTimeoutCall()
        deliver(payload)
    if offset == 0:
        return None
    proto.data = data[offset:]
    return len(proto.data) > 0


# --- parser state -----------------------------------------------------------------------------


def failed_by_me(proto: Any) -> bool:
    """Whether Autobahn failed this connection itself (it may still deliver a message)."""
    return USABLE_CORNERS.parser_state and bool(proto.failedByMe)


def release_input(proto: Any) -> None:
    """Free the unparsed input of a lost connection now, not at a garbage collection."""
    if USABLE_CORNERS.parser_state:
        proto.data = b""
