"""The test proxy itself: a clean close is passed on, not turned into a cut.

A CI run of ``test_a_withdrawn_token_ends_the_session_at_the_next_resume``
hung: the server answered the resume's upgrade with 401 and closed (a FIN),
and the proxy aborted the client side while the 401 still sat in its write
buffer (Twisted writes on a later reactor turn; on a loaded machine the
server's FIN is read in the same turn). The client saw a connection closed
before any HTTP answer, a failure worth retrying, not the refusal, and
re-dialled until its 30 s TTL. The fake transport below keeps writes in a
buffer, as Twisted's TCP transport does, until ``flush`` (the reactor's
write turn) -- an abort discards them, a ``loseConnection`` writes them first.
"""

from __future__ import annotations

from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from tests.support.cutting_proxy import CuttingProxy, _Pair, _Upstream

REFUSAL = b"HTTP/1.1 401 Unauthorized\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"


class BufferedTransport(StringTransport):
    """Writes reach the peer (``value()``) only on a write turn, as over TCP."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: list[bytes] = []
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.pending.append(data)

    def flush(self) -> None:
        for data in self.pending:
            super().write(data)
        self.pending.clear()

    def loseConnection(self) -> None:
        self.flush()  # Twisted writes what is buffered, then sends the FIN
        super().loseConnection()

    def abortConnection(self) -> None:
        self.pending.clear()  # gone with the reset
        self.aborted = True
        super().loseConnection()


def proxied_pair() -> tuple[CuttingProxy, _Pair, BufferedTransport, BufferedTransport]:
    proxy = CuttingProxy(("127.0.0.1", 9))
    proxy.holding = True  # no real dial: the upstream side is connected by hand
    pair = _Pair(proxy)
    client_side = BufferedTransport()
    pair.makeConnection(client_side)
    upstream = _Upstream(pair)
    server_side = BufferedTransport()
    upstream.makeConnection(server_side)
    return proxy, pair, client_side, server_side


def test_a_reply_followed_by_the_servers_clean_close_reaches_the_client() -> None:
    proxy, pair, client_side, _ = proxied_pair()
    assert pair.upstream is not None
    # The 401 and the server's FIN are read in the same reactor turn, before
    # the proxy's write turn for the client side.
    pair.upstream.dataReceived(REFUSAL)
    pair.upstream.connectionLost(Failure(ConnectionDone()))
    assert client_side.value() == REFUSAL
    assert not client_side.aborted and client_side.disconnecting
    assert pair not in proxy.pairs


def test_a_reset_side_and_a_cut_still_discard_what_is_in_flight() -> None:
    _, pair, client_side, _ = proxied_pair()
    assert pair.upstream is not None
    pair.upstream.dataReceived(REFUSAL)
    pair.upstream.connectionLost(Failure(ConnectionLost()))
    assert client_side.value() == b"" and client_side.aborted

    proxy, pair, client_side, server_side = proxied_pair()
    assert pair.upstream is not None
    pair.upstream.dataReceived(b"an answer")
    pair.dataReceived(b"a request")
    proxy.cut()
    assert client_side.value() == b"" and client_side.aborted
    assert server_side.value() == b"" and server_side.aborted
    assert proxy.cuts == 1
