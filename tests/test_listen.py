"""``--listen`` URLs become Twisted endpoint descriptions in one place."""

from __future__ import annotations

import re

import pytest
from twisted.internet.endpoints import serverFromString
from twisted.internet.testing import MemoryReactor

from execserver.transports.listen import (
    ListenUrlError,
    StdioAddress,
    WebSocketAddress,
    parse_listen_url,
    server_endpoint,
)


@pytest.mark.parametrize(
    ("url", "description"),
    [
        ("ws://127.0.0.1:8080", "tcp:port=8080:interface=127.0.0.1:backlog=1024"),
        ("ws://[::1]:0", "tcp6:port=0:interface=\\:\\:1:backlog=1024"),
    ],
)
def test_websocket_urls_map_onto_endpoint_descriptions(url: str, description: str) -> None:
    address = parse_listen_url(url)
    assert isinstance(address, WebSocketAddress)
    assert address.endpoint_description() == description
    assert str(address) == url


@pytest.mark.parametrize("url", ["ws://127.0.0.1:8080", "ws://[::1]:9"])
def test_the_endpoint_listens_where_the_url_says(url: str) -> None:
    address = parse_listen_url(url)
    assert isinstance(address, WebSocketAddress)
    reactor = MemoryReactor()
    server_endpoint(reactor, address).listen(object())  # type: ignore[arg-type]
    port, _factory, backlog, interface = reactor.tcpServers[0]
    assert (port, backlog, interface) == (address.port, 1024, address.host)
    # The same description, parsed by Twisted itself, gives the same listener.
    serverFromString(reactor, address.endpoint_description()).listen(object())
    assert reactor.tcpServers[1][0::2] == reactor.tcpServers[0][0::2]


def test_stdio_and_refusals_keep_the_reference_texts() -> None:
    assert parse_listen_url("stdio://") == StdioAddress()
    with pytest.raises(ListenUrlError, match="invalid websocket --listen URL `ws://host:1`"):
        parse_listen_url("ws://host:1")
    with pytest.raises(
        ListenUrlError, match=re.escape("unsupported --listen URL `tcp://1.2.3.4:5`")
    ):
        parse_listen_url("tcp://1.2.3.4:5")
