"""The byte-stream side of every client's stdio channel, free of any event loop.

:class:`LineInput` turns the bytes a server writes into NDJSON messages for
an RPC core (a message over the limit is a protocol error that ends the
connection); :func:`keep_stderr_tail` keeps the end of the server's stderr
to quote when it dies; the ``*_REASON`` texts and :func:`server_exited` say
why the connection to a local server ended.
"""

from __future__ import annotations

from typing import Any

from execserver.clientcore.rpc import RpcCore
from execserver.codec import OVERSIZED, LineFramer

#: Largest message a client accepts from a server.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
#: How much of a local server's stderr a client keeps (quoted in errors).
STDERR_TAIL_BYTES = 8192
#: The connection's closed reason when the local server closes its stdout.
STDOUT_CLOSED_REASON = "exec-server closed its stdout"


class LineInput:
    """NDJSON lines in, one ``message_received`` per line."""

    def __init__(self, rpc: RpcCore[Any], max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.rpc = rpc
        self._framer = LineFramer(max_message_bytes)
        self._max = max_message_bytes

    def feed(self, data: bytes) -> None:
        self._deliver(self._framer.feed(data))

    def finish(self) -> None:
        """End of stream: a last line without its newline still counts."""
        self._deliver(self._framer.finish())

    def _deliver(self, items: list[Any]) -> None:
        for item in items:
            if self.rpc.is_closed:
                return
            if item is OVERSIZED:
                self.rpc.protocol_error(f"message larger than {self._max} bytes")
            else:
                self.rpc.message_received(item)


def keep_stderr_tail(tail: bytes, data: bytes) -> bytes:
    """``tail`` followed by ``data``, cut to the last :data:`STDERR_TAIL_BYTES`."""
    return (tail + data)[-STDERR_TAIL_BYTES:]


def describe_exit(exit_code: int | None, signal: int | None) -> str:
    """How a local server ended: ``killed by signal N`` or ``exit code N``."""
    if signal is not None:
        return f"killed by signal {signal}"
    return f"exit code {exit_code}"


def server_exited(exit_code: int | None, signal: int | None) -> str:
    """The connection's closed reason when the local server has exited."""
    return f"exec-server exited ({describe_exit(exit_code, signal)})"
