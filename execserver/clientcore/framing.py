"""The byte-stream side of every client's stdio channel, free of any event loop.

:class:`LineInput` turns the bytes a server writes into NDJSON messages for
an RPC core (a message over the limit is a protocol error that ends the
connection); :func:`keep_stderr_tail` keeps the end of the server's stderr
to quote when it dies; the ``*_REASON`` texts and :func:`server_exited` say
why the connection to a local server ended.
"""

from __future__ import annotations

import contextlib
import os
from typing import IO, Any

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


#: Names a directory where every client that launches a local server
#: (``--stdio``, ``connect()`` without a URL, ``spawn_local``) also writes
#: that server's stderr, one file per server: ``exec-server-PID.log``.
LOCAL_SERVER_LOG_DIR_ENV = "EXEC_SERVER_LOCAL_LOG_DIR"


class LocalServerLog:
    """A copy of one local server's stderr in ``$EXEC_SERVER_LOCAL_LOG_DIR``, if set.

    The file is opened at the first stderr bytes; an unwritable directory
    only disables the copy (the client does not fail for its log).
    """

    def __init__(self) -> None:
        self._dir = os.environ.get(LOCAL_SERVER_LOG_DIR_ENV) or None
        self._file: IO[bytes] | None = None

    def write(self, pid: int | None, data: bytes) -> None:
        if self._dir is None:
            return
        if self._file is None:
            try:
                path = os.path.join(self._dir, f"exec-server-{pid}.log")
                self._file = open(path, "ab", buffering=0)  # noqa: SIM115 (closed by close())
            except OSError:
                self._dir = None
                return
        with contextlib.suppress(OSError):
            self._file.write(data)

    def close(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):
                file.close()


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
