"""The real server as a subprocess over real stdio, and a JSON-RPC client for it.

``ServerProcess.start()`` runs the installed ``exec-server`` console script
and speaks NDJSON to it. Every wait has a timeout; :meth:`ServerProcess.stop`
(close stdin, then SIGKILL) always leaves no process behind. At teardown the
fixtures in ``conftest.py`` fail the test on a traceback in the server's
stderr or an exit status it did not declare (``tests/support/server_checks.py``).
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.defer import Deferred

from tests.support.harness import RpcTestClient, console_script, server_env
from tests.support.server_process import ServerProcessBase


class ServerProcess(RpcTestClient, ServerProcessBase):
    """A running ``exec-server`` child and a minimal JSON-RPC client for it."""

    def __init__(self) -> None:
        super().__init__()
        # Pieces of an incomplete line: joined once its newline arrives, so a
        # large line costs linear time, not a re-copy on every read.
        self.partial: list[bytes] = []
        self.raw_lines: list[bytes] = []
        self._init_rpc()
        self.stdout_closed: Deferred[None] = Deferred()

    @classmethod
    def start(cls, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
        """The installed ``exec-server ARGS`` over stdio (``env`` added to the test's)."""
        return cls().launch(
            [console_script("exec-server"), *args],
            env=server_env(env),
            description=f"exec-server {' '.join(args)} (stdio)",
        )

    def connectionMade(self) -> None:
        pass

    def outReceived(self, data: bytes) -> None:
        if b"\n" not in data:
            self.partial.append(data)
            return
        if self.partial:
            data = b"".join([*self.partial, data])
            self.partial = []
        *lines, rest = data.split(b"\n")
        if rest:
            self.partial.append(rest)
        for line in lines:
            if not line:
                continue
            self.raw_lines.append(line)
            self._received(json.loads(line))

    def outConnectionLost(self) -> None:
        self.stdout_closed.callback(None)

    def _process_ended(self) -> None:
        self._fail_pending("server exited")

    def _request_stop(self) -> None:
        """Close stdin: the server ends once its input does."""
        self.transport.closeStdin()  # type: ignore[union-attr]

    # --- protocol -------------------------------------------------------------------

    def send_raw(self, data: bytes) -> None:
        self.transport.write(data)  # type: ignore[union-attr]

    def send(self, message: dict[str, Any], binary: bool = False) -> None:
        self.send_raw(json.dumps(message).encode() + b"\n")
