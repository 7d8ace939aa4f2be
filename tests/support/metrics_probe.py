"""Probing a listening server's limits: idle TCP connections that never
upgrade, and waiting for a ``/metrics`` counter to reach a value.
"""

from __future__ import annotations

import re

from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ClientEndpoint

from tests.support.harness import DEFAULT_TIMEOUT
from tests.support.ws_harness import RawHttp, get_request, http_get


async def open_idle(host: str, port: int) -> RawHttp:
    """A TCP connection that sends what it is told and records when it ends."""
    endpoint = TCP4ClientEndpoint(reactor, host, port, timeout=DEFAULT_TIMEOUT)
    return await RawHttp.open_on(endpoint, DEFAULT_TIMEOUT, "TCP connect")


async def metric_at_least(host: str, port: int, name: str, value: int) -> bool:
    # (/metrics itself takes a slot: retried until the others are gone.)
    status, _, body = await http_get(host, port, get_request("/metrics"))
    if status != 200:
        return False
    found = re.search(re.escape(name.encode()) + rb" (\d+)\n", body)
    return found is not None and int(found.group(1)) >= value
