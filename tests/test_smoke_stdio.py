"""The installed server's shortest path over stdio: ``initialize``, one
``process/start``, its output and exit notifications, a clean exit at EOF.
"""

from __future__ import annotations

import pytest_twisted

from tests.support.harness import unb64
from tests.support.stdio_server import ServerProcess


@pytest_twisted.ensureDeferred
async def test_initialize_start_and_stream_over_stdio() -> None:
    server = ServerProcess.start()
    try:
        init = await server.handshake()
        assert init["protocolVersion"] == "exec-server.v0"
        await server.start_process("p1", ["printf", "hello"])
        output = await server.wait_notification("process/output", "p1")
        assert output["stream"] == "stdout"
        assert unb64(output["chunk"]) == b"hello"
        exited = await server.wait_notification("process/exited", "p1")
        assert exited["exitCode"] == 0
    finally:
        assert await server.stop() == 0
