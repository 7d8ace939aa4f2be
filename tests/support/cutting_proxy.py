"""A test-only TCP proxy that can cut or stall a live connection.

Listens on 127.0.0.1 (an ephemeral port) and forwards every accepted
connection to ``target``. :meth:`CuttingProxy.cut` aborts every proxied
connection on both sides (as a network failure would: no close frame, no
FIN first); :meth:`CuttingProxy.cut_after` arms a cut that happens once the
server-to-client direction has carried a given number of further bytes, so
a test (or hypothesis) can choose where in a stream the cut falls. The
count is of bytes handed to the client side's transport: the abort discards
what its write buffer still holds (Twisted sends it on a later turn), as a real drop
loses what is in flight, so on a loaded machine a cut "after N bytes" may
leave the client with far fewer -- even before a reply written ahead of
them (a ``process/start`` answer: the start is then sent again on the
resumed session, and its catch-up may be cut by the next cut).
A side that closes cleanly (a FIN: a server's ``Connection: close`` after
its reply) closes the other once what was forwarded is written, as a real
network does: only a cut (or a reset side) discards bytes in flight.
:meth:`stall` stops forwarding without closing (a dead peer) until
:meth:`unstall`; :meth:`stall_replies` stops only the server-to-client
direction (requests arrive, answers are lost with the next cut).
:meth:`hold` keeps new connections waiting (accepted, not yet forwarded to
the server) until :meth:`release`: a client that lost its connection is
kept away from its session for as long as a test needs.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import reactor as _reactor
from twisted.internet.endpoints import (
    TCP4ClientEndpoint,
    TCP4ServerEndpoint,
    UNIXClientEndpoint,
    UNIXServerEndpoint,
)
from twisted.internet.error import ConnectionDone
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.python.failure import Failure

from execserver.waiters import Waiters

reactor: Any = _reactor


class _Upstream(Protocol):
    def __init__(self, pair: _Pair) -> None:
        self.pair = pair

    def connectionMade(self) -> None:
        self.pair.upstream_ready(self)

    def dataReceived(self, data: bytes) -> None:
        self.pair.from_server(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.pair.lost(reason)


class _Pair(Protocol):
    """The client side of one proxied connection, with its server side."""

    def __init__(self, proxy: CuttingProxy) -> None:
        self.proxy = proxy
        self.upstream: _Upstream | None = None
        self.buffered: list[bytes] = []
        self.closed = False

    def connectionMade(self) -> None:
        self.proxy.accepted += 1
        self.proxy.pairs.add(self)
        assert self.transport is not None
        self.transport.pauseProducing()  # type: ignore[attr-defined]
        proxy = self.proxy
        if proxy.holding or (proxy.hold_after is not None and proxy.accepted > proxy.hold_after):
            proxy.held.append(self)
        else:
            self.dial()

    def dial(self) -> None:
        if self.closed:
            return
        target = self.proxy.target
        endpoint: Any
        if isinstance(target, str):
            endpoint = UNIXClientEndpoint(reactor, target, timeout=10)
        else:
            endpoint = TCP4ClientEndpoint(reactor, target[0], target[1], timeout=10)
        d = endpoint.connect(Factory.forProtocol(lambda: _Upstream(self)))
        d.addErrback(lambda _: self.abort())

    def upstream_ready(self, upstream: _Upstream) -> None:
        self.upstream = upstream
        if self.closed:
            self.abort()
            return
        for data in self.buffered:
            upstream.transport.write(data)  # type: ignore[union-attr]
        self.buffered.clear()
        if not self.proxy.stalled:
            self.transport.resumeProducing()  # type: ignore[union-attr]

    def dataReceived(self, data: bytes) -> None:
        if self.upstream is None:
            self.buffered.append(data)
        else:
            self.upstream.transport.write(data)  # type: ignore[union-attr]

    def from_server(self, data: bytes) -> None:
        proxy = self.proxy
        if proxy.cut_at is not None and proxy.s2c_bytes + len(data) >= proxy.cut_at:
            keep = proxy.cut_at - proxy.s2c_bytes
            if keep > 0:
                self.transport.write(data[:keep])  # type: ignore[union-attr]
            proxy.s2c_bytes += max(keep, 0)
            proxy.cut()
            return
        proxy.s2c_bytes += len(data)
        self.transport.write(data)  # type: ignore[union-attr]

    def set_paused(self, paused: bool) -> None:
        for side in (self.transport, self.upstream.transport if self.upstream else None):
            if side is not None:
                if paused:
                    side.pauseProducing()  # type: ignore[attr-defined]
                else:
                    side.resumeProducing()  # type: ignore[attr-defined]

    def abort(self) -> None:
        self.closed = True
        for side in (self.transport, self.upstream.transport if self.upstream else None):
            if side is not None:
                side.abortConnection()  # type: ignore[attr-defined]

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.lost(reason)

    def close(self) -> None:
        """Close both sides once what was forwarded to them is written (a FIN)."""
        self.closed = True
        for side in (self.transport, self.upstream.transport if self.upstream else None):
            if side is not None:
                side.loseConnection()

    def lost(self, reason: Failure) -> None:
        if self in self.proxy.pairs:
            self.proxy.pairs.discard(self)
            # One side closed cleanly (the server's FIN after its 401 and
            # ``Connection: close``): the other side gets what was forwarded
            # first, as through a real network. An abort here would discard
            # the reply still in the write buffer (Twisted writes it on a
            # later turn): a client would see a connection closed without an
            # answer instead of the refusal. A side that was reset or aborted
            # is aborted on the other side too.
            if reason.check(ConnectionDone):
                self.close()
            else:
                self.abort()
            self.proxy.cuts_done.fire(None)


class CuttingProxy:
    """Forwards 127.0.0.1:``port`` to ``target``; cuts and stalls on demand.

    ``target`` is (host, port) or the path of a Unix socket; with
    ``listen_unix`` the proxy listens on that Unix socket path instead.
    """

    def __init__(self, target: tuple[str, int] | str, listen_unix: str | None = None) -> None:
        self.target = target
        self.listen_unix = listen_unix
        self.pairs: set[_Pair] = set()
        self.port: Any = None
        self.stalled = False
        #: Server-to-client bytes forwarded so far (over all connections).
        self.s2c_bytes = 0
        #: Cut once ``s2c_bytes`` reaches this (then disarmed).
        self.cut_at: int | None = None
        self.cuts = 0
        self.cuts_done: Waiters[None] = Waiters()
        #: New connections wait in ``held`` (not forwarded) while set.
        self.holding = False
        self.held: list[_Pair] = []
        #: Hold every connection after this many were accepted (None: no).
        self.hold_after: int | None = None
        #: Connections accepted so far.
        self.accepted = 0

    async def start(self) -> CuttingProxy:
        endpoint: Any = TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1")
        if self.listen_unix is not None:
            endpoint = UNIXServerEndpoint(reactor, self.listen_unix)
        self.port = await endpoint.listen(Factory.forProtocol(lambda: _Pair(self)))
        return self

    @property
    def url(self) -> str:
        if self.listen_unix is not None:
            return f"unix://{self.listen_unix}"
        return f"ws://127.0.0.1:{self.port.getHost().port}"

    def cut(self) -> None:
        """Abort every proxied connection, both sides, at once."""
        self.cut_at = None
        self.cuts += 1
        for pair in list(self.pairs):
            pair.abort()

    def cut_after(self, s2c_bytes: int) -> None:
        """Cut once ``s2c_bytes`` more server-to-client bytes have been forwarded."""
        self.cut_at = self.s2c_bytes + max(1, s2c_bytes)

    def stall_replies(self) -> None:
        """Stop forwarding server-to-client only (requests still get through)."""
        self.stalled = True
        for pair in self.pairs:
            if pair.upstream is not None:
                pair.upstream.transport.pauseProducing()  # type: ignore[union-attr]

    def stall(self) -> None:
        self.stalled = True
        for pair in self.pairs:
            pair.set_paused(True)

    def unstall(self) -> None:
        self.stalled = False
        for pair in self.pairs:
            pair.set_paused(False)

    def hold(self) -> None:
        """Accept new connections but forward nothing until :meth:`release`."""
        self.holding = True

    def release(self) -> None:
        """Forward the held connections (and new ones) to the server."""
        self.holding = False
        self.hold_after = None
        held, self.held = self.held, []
        for pair in held:
            pair.dial()

    async def stop(self) -> None:
        self.release()
        self.cut()
        if self.port is not None:
            await self.port.stopListening()
