"""A server over stdio past the Codex dialect's handshake (``codex-
environment`` as the client name).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from tests.support.stdio_server import ServerProcess

CODEX_INIT = {"clientName": "codex-environment", "resumeSessionId": None}


@asynccontextmanager
async def serving(
    init: dict[str, Any] | None, env: dict[str, str] | None = None
) -> AsyncIterator[ServerProcess]:
    """A server over stdio, past the handshake with ``init`` (none if None)."""
    server = ServerProcess.start(env=env)
    try:
        if init is not None:
            server.last_init = await server.call("initialize", init)  # type: ignore[attr-defined]
            server.notify("initialized", {})
        yield server
    finally:
        await server.stop()
