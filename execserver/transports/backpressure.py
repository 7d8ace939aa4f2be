"""Backpressure of one WebSocket connection, both ways, through the producer API.

Output: the session is paused while the transport holds more than its
high-water mark unsent (Twisted calls ``pauseProducing`` on the producer
registered here). Input: a client that sends requests without reading the
replies (which can be large, e.g. ``process/read``) must not grow server
memory, so requests stop being read while far more than that is unsent,
and are read again once the buffer has drained.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from twisted.internet.interfaces import IPushProducer
from zope.interface import implementer

#: Requests stop being read from a connection whose unsent output exceeds
#: max(READ_PAUSE_MIN_BYTES, READ_PAUSE_FACTOR * output_high_water_bytes).
#: Far above the high-water mark, so notifications alone never reach it.
READ_PAUSE_MIN_BYTES: Final = 16 * 1024 * 1024
READ_PAUSE_FACTOR: Final = 8


@implementer(IPushProducer)
class RequestBackpressure:
    """The producer registered on a WebSocket's TCP transport.

    Pausing pauses the session (its children's output); resuming, once the
    transport's buffer is empty, resumes the session and, if the protocol
    had stopped reading requests, reading too.
    """

    def __init__(self, session: IPushProducer, transport: Any, release: Callable[[], None]) -> None:
        self.session = session
        self._transport = transport
        self._release = release
        self.reads_paused = False

    def pause_reads(self) -> None:
        self.reads_paused = True
        self._transport.pauseProducing()

    def pauseProducing(self) -> None:
        self.session.pauseProducing()

    def resumeProducing(self) -> None:
        self.session.resumeProducing()
        if self.reads_paused:
            self.reads_paused = False
            self._transport.resumeProducing()
            self._release()

    def stopProducing(self) -> None:
        self.session.stopProducing()


def read_pause_bytes(high_water: int) -> int:
    """Unsent bytes above which a connection's requests stop being read."""
    return max(READ_PAUSE_MIN_BYTES, READ_PAUSE_FACTOR * high_water)
