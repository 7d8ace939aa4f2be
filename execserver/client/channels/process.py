"""NDJSON over the stdin/stdout of a server process this client launched.

The server's stdout is the bulk of what a local client reads: an output
notification is up to ~350 KiB of JSON (a 256 KiB chunk in base64).
Twisted's process transport reads its pipes 8 KiB per wakeup, dozens of
wakeups and a join per message, which halved the end-to-end rate. So
:func:`spawn_server` gives the server a stdout pipe of our own (a plain
``childFDs`` descriptor) of :data:`STDOUT_PIPE_BYTES`, and the reactor
watches its read end through the public ``addReader`` with the server's own
large-pipe reader (:func:`execserver.fdreads.read_into`), up to
:data:`STDOUT_READ_SIZE` per wakeup. Stdin and stderr stay Twisted's.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable
from typing import Any, Final

from twisted.internet import error
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReadDescriptor
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from execserver.client.channels.ndjson import DEFAULT_MAX_MESSAGE_BYTES
from execserver.client.rpc import RpcClient
from execserver.clientcore.framing import (
    STDOUT_CLOSED_REASON,
    LineInput,
    LocalServerLog,
    describe_exit,
    keep_stderr_tail,
    server_exited,
)
from execserver.exits import exit_status
from execserver.fdreads import read_into
from execserver.waiters import Latch

log = Logger()

#: The capacity asked for the server's stdout pipe, and the most read per wakeup.
STDOUT_PIPE_BYTES: Final = 1024 * 1024
STDOUT_READ_SIZE: Final = STDOUT_PIPE_BYTES


class ServerProcessProtocol(ProcessProtocol):
    """The stdin/stdout of a spawned server as an RPC channel."""

    def __init__(
        self,
        rpc: RpcClient,
        stderr: Callable[[bytes], None] | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.rpc = rpc
        self._input = LineInput(rpc, max_message_bytes)
        self._stderr = stderr
        self.stderr_tail = b""
        self._log = LocalServerLog()
        self.exit_code: int | None = None
        self.exit_signal: int | None = None
        self.ended = False
        self._ended: Latch[None] = Latch()
        self.pid: int | None = None
        #: Our own stdout pipe is open (spawn_server); Twisted does not wait for it.
        self._stdout_open = False
        self._exit: Failure | None = None

    def connectionMade(self) -> None:
        self.pid = getattr(self.transport, "pid", None)
        self.rpc.attach(self)

    def outReceived(self, data: bytes) -> None:
        self._input.feed(data)

    def errReceived(self, data: bytes) -> None:
        self.stderr_tail = keep_stderr_tail(self.stderr_tail, data)
        self._log.write(self.pid, data)
        if self._stderr is not None:
            try:
                self._stderr(data)
            except Exception:
                log.failure("exec-server stderr callback failed")

    def outConnectionLost(self) -> None:
        self._input.finish()
        self.rpc.connection_lost(STDOUT_CLOSED_REASON)

    def errConnectionLost(self) -> None:
        self._log.close()

    def processEnded(self, reason: Failure) -> None:
        if self._stdout_open:
            # As Twisted does for its own pipes: the end is reported once
            # stdout is closed too, so no output is cut off.
            self._exit = reason
            return
        status = exit_status(reason)
        self.exit_code = status.code
        self.exit_signal = status.signal
        self.ended = True
        self.rpc.connection_lost(server_exited(self.exit_code, self.exit_signal))
        self._ended.fire(None)

    def describe_exit(self) -> str:
        return describe_exit(self.exit_code, self.exit_signal)

    def when_ended(self) -> Deferred[None]:
        return self._ended.wait()

    # The stdout pipe of spawn_server.
    def stdout_opened(self) -> None:
        self._stdout_open = True

    def stdout_closed(self) -> None:
        self._stdout_open = False
        self.childConnectionLost(1)
        exit_reason, self._exit = self._exit, None
        if exit_reason is not None:
            self.processEnded(exit_reason)

    # MessageSink
    def send_message(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.writeSequence((data, b"\n"))

    def close(self) -> None:
        """Closing stdin asks the server to stop its processes and exit."""
        if self.transport is not None and not self.ended:
            self.transport.closeStdin()

    def kill(self) -> None:
        if self.transport is not None and not self.ended:
            with contextlib.suppress(error.ProcessExitedAlready, OSError):
                self.transport.signalProcess("KILL")


@implementer(IReadDescriptor)
class _StdoutReader:
    """The read end of the server's stdout pipe, watched by the reactor."""

    def __init__(self, fd: int, proto: ServerProcessProtocol) -> None:
        self._fd = fd
        self._proto = proto

    def fileno(self) -> int:
        return self._fd

    def logPrefix(self) -> str:
        return "exec-server stdout"

    # The reactor takes the exception instances Twisted's own readers return
    # (CONNECTION_DONE), which is what read_into gives, not the Failure the
    # interface's annotation names.
    def doRead(self) -> object:  # type: ignore[override]
        return read_into(self._fd, self._deliver, STDOUT_READ_SIZE)

    def _deliver(self, data: bytes) -> None:
        self._proto.childDataReceived(1, data)

    def connectionLost(self, reason: Failure) -> None:
        # The reactor has stopped watching the descriptor (end of stream).
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
        self._proto.stdout_closed()


def spawn_server(
    reactor: Any,
    proto: ServerProcessProtocol,
    argv: list[str],
    env: dict[str, str],
) -> Any:
    """Start ``argv`` talking to ``proto`` over its stdin and stdout; its process transport.

    Raises OSError when the process cannot be started (nothing is left open).
    """
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    try:
        # Refused (EPERM) past the user's pipe quota: the default 64 KiB still works.
        with contextlib.suppress(OSError):
            fcntl.fcntl(read_fd, fcntl.F_SETPIPE_SZ, STDOUT_PIPE_BYTES)
        os.set_blocking(read_fd, False)
        proto.stdout_opened()
        transport = reactor.spawnProcess(
            proto, argv[0], argv, env=env, childFDs={0: "w", 1: write_fd, 2: "r"}
        )
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        # The child has its copy; ours would keep the pipe from ever ending.
        os.close(write_fd)
    reactor.addReader(_StdoutReader(read_fd, proto))
    return transport
