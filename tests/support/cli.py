"""``exec-server-client`` run by the tests: the installed script as a child
process (optionally on a PTY), its output and exit status collected.
"""

from __future__ import annotations

import contextlib
import fcntl
import re
import struct
import termios
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

from tests.support.client_fakes import wait
from tests.support.harness import (
    NEUTRAL_CWD,
    console_script,
    reactor,
    server_env,
)

TIMEOUT = 15.0


class Cli(ProcessProtocol):
    """One ``exec-server-client`` run; output collected, waits bounded."""

    def __init__(self) -> None:
        self.out = b""
        self.err = b""
        self.exit_code: int | None = None
        self.ended: Deferred[int | None] = Deferred()
        self._watchers: list[tuple[re.Pattern[bytes], bool, Deferred[None]]] = []

    @classmethod
    def start(
        cls,
        *args: str,
        pty: bool = False,
        size: tuple[int, int] | None = None,
        stdin: bytes | None = None,
        raw: bool = False,
        show_terminal: bool = True,
        cwd: Path = NEUTRAL_CWD,
    ) -> Cli:
        proto = cls()
        argv = list(args) if raw else [console_script("exec-server-client"), *args]
        if pty and show_terminal:
            # After the client exits, show the terminal settings it left.
            argv = ["/bin/sh", "-c", '"$@"; rc=$?; stty -a; exit $rc', "sh", *argv]
        reactor.spawnProcess(proto, argv[0], argv, env=server_env(), path=str(cwd), usePTY=pty)
        if pty and size is not None:
            proto.resize(*size)
        if stdin is not None:
            proto.write(stdin)
            assert proto.transport is not None
            proto.transport.closeStdin()
        return proto

    def resize(self, rows: int, cols: int) -> None:
        """Set the PTY's window size (the client gets SIGWINCH)."""
        transport: Any = self.transport
        fcntl.ioctl(transport.fileno(), termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def outReceived(self, data: bytes) -> None:
        self.out += data
        self._check()

    def errReceived(self, data: bytes) -> None:
        self.err += data
        self._check()

    def _check(self) -> None:
        for watcher in list(self._watchers):
            pattern, on_stderr, d = watcher
            if pattern.search(self.err if on_stderr else self.out):
                self._watchers.remove(watcher)
                d.callback(None)

    async def output(self, pattern: bytes, what: str, stderr: bool = False) -> None:
        """Wait until stdout (or stderr) matches ``pattern``.

        The two pipes are read independently: a line the client wrote to
        stderr before the remote output can still arrive after it.
        """
        d: Deferred[None] = Deferred()
        self._watchers.append((re.compile(pattern, re.DOTALL), stderr, d))
        self._check()
        await wait(d, f"{what} (output so far: {self.out[-500:]!r}, {self.err[-500:]!r})", TIMEOUT)

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def signal(self, name: str) -> None:
        with contextlib.suppress(ProcessExitedAlready):
            assert self.transport is not None
            self.transport.signalProcess(name)

    def processEnded(self, reason: Failure) -> None:
        self.exit_code = getattr(reason.value, "exitCode", None)
        self.ended.callback(self.exit_code)

    async def finish(self) -> int | None:
        """The exit code; the client is killed if it does not end in time."""
        try:
            code: int | None = await wait(_copy(self.ended), "client exit", TIMEOUT)
        except TimeoutError:
            self.signal("KILL")
            raise
        return code


def _copy(d: Deferred[Any]) -> Deferred[Any]:
    out: Deferred[Any] = Deferred()

    def forward(result: Any) -> Any:
        out.callback(result)
        return result

    d.addBoth(forward)
    return out


async def run(*args: str, cwd: Path = NEUTRAL_CWD) -> Cli:
    cli = Cli.start(*args, cwd=cwd)
    await cli.finish()
    return cli
