"""The RTT baseline: a bare Twisted ``LineOnlyReceiver`` echo-RPC over stdio.

Each line is a JSON-RPC request; the reply is ``{"id": ID, "result": PARAMS}``,
except ``fs/getMetadata``, answered with the ``os.stat`` of ``params.path``
as the server's result fields. It decodes and encodes with msgspec, and it
batches like the server's stdio transport: the replies to the requests of
one read are written with one transport write. So the comparison isolates
what the server adds (dispatch, handshake gate, handler, typed params and
results, the thread-pool hop for fs/*) from the cost of JSON and writes.

    python bench/echo_server.py   # speaks on stdin/stdout
"""

from __future__ import annotations

import os
import stat as stat_module
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


class _PathParams(msgspec.Struct):
    path: str


class _Metadata(msgspec.Struct, rename="camel"):
    is_directory: bool
    is_file: bool
    created_at_ms: int
    modified_at_ms: int


class _MetadataResponse(msgspec.Struct):
    id: int | str
    result: _Metadata


_decode: Final = msgspec.json.Decoder(_Request).decode
_decode_path: Final = msgspec.json.Decoder(_PathParams).decode
_encode: Final = msgspec.json.Encoder().encode


def _metadata(path: str) -> _Metadata:
    st = os.stat(path)
    return _Metadata(
        stat_module.S_ISDIR(st.st_mode),
        stat_module.S_ISREG(st.st_mode),
        int(st.st_ctime * 1000),
        int(st.st_mtime * 1000),
    )


class EchoRpc(LineOnlyReceiver):
    delimiter = b"\n"
    MAX_LENGTH = 1 << 24

    def __init__(self) -> None:
        self._batch: list[bytes] = []

    def dataReceived(self, data: bytes) -> None:
        # As the server: replies to the requests of one read, one write.
        super().dataReceived(data)
        if self._batch:
            assert self.transport is not None
            self.transport.write(b"".join(self._batch))
            self._batch = []

    def lineReceived(self, line: bytes) -> None:
        request = _decode(line)
        if request.method == "fs/getMetadata":
            path = _decode_path(request.params).path
            reply = _encode(_MetadataResponse(request.id, _metadata(path)))
        else:
            reply = _encode(_Response(request.id, request.params))
        self._batch += (reply, b"\n")

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
