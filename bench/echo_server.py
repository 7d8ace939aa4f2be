"""The RTT baseline: a bare Twisted ``LineOnlyReceiver`` echo-RPC over stdio.

Each line is a JSON-RPC request; the reply is ``{"id": ID, "result": PARAMS}``.
It decodes and encodes with msgspec, as the server does, so the comparison
isolates what the server adds (dispatch, handshake gate, handler, typed
params and results) from the cost of JSON itself.

    python bench/echo_server.py   # speaks on stdin/stdout
"""

from __future__ import annotations

from typing import Any, Final

import msgspec
from twisted.internet.protocol import connectionDone
from twisted.protocols.basic import LineOnlyReceiver
from twisted.python.failure import Failure


class _Request(msgspec.Struct):
    id: int | str
    method: str
    params: msgspec.Raw = msgspec.Raw(b"null")


class _Response(msgspec.Struct):
    id: int | str
    result: msgspec.Raw


_decode: Final = msgspec.json.Decoder(_Request).decode
_encode: Final = msgspec.json.Encoder().encode


class EchoRpc(LineOnlyReceiver):
    delimiter = b"\n"
    MAX_LENGTH = 1 << 24

    def lineReceived(self, line: bytes) -> None:
        request = _decode(line)
        assert self.transport is not None
        self.transport.write(_encode(_Response(request.id, request.params)) + b"\n")

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        from twisted.internet import reactor

        reactor_: Any = reactor
        if reactor_.running:
            reactor_.stop()


def main() -> None:
    from twisted.internet import reactor, stdio

    stdio.StandardIO(EchoRpc())
    reactor_: Any = reactor
    reactor_.run()


if __name__ == "__main__":
    main()
