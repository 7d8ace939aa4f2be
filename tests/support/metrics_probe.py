"""Probing a listening server's limits: idle TCP connections that never
upgrade, and waiting for a ``/metrics`` counter to reach a value.
"""

from __future__ import annotations

import re

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.protocol import Factory, Protocol
from twisted.python.failure import Failure

from tests.support.harness import DEFAULT_TIMEOUT, with_timeout
from tests.support.ws_harness import get_request, http_get


class Idle(Protocol):
    """A TCP connection that sends what it is told and records when it ends."""

    def __init__(self) -> None:
        self.received = b""
        self.lost: Deferred[None] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        self.received += data

    def connectionLost(self, reason: Failure | None = None) -> None:
        self.lost.callback(None)


async def open_idle(host: str, port: int) -> Idle:
    endpoint = TCP4ClientEndpoint(reactor, host, port, timeout=DEFAULT_TIMEOUT)
    proto: Idle = await with_timeout(
        endpoint.connect(Factory.forProtocol(Idle)), DEFAULT_TIMEOUT, "TCP connect"
    )
    return proto


async def metric_at_least(host: str, port: int, name: str, value: int) -> bool:
    # (/metrics itself takes a slot: retried until the others are gone.)
    status, _, body = await http_get(host, port, get_request("/metrics"))
    if status != 200:
        return False
    found = re.search(re.escape(name.encode()) + rb" (\d+)\n", body)
    return found is not None and int(found.group(1)) >= value
