"""An asyncio client for exec-server, with no Twisted import.

    import asyncio
    from execserver import aio

    async def main():
        async with aio.connect() as client:          # a local server over stdio
            result = await client.run(["sh", "-c", "echo hi; exit 3"])
            print(result.stdout, result.exit_code)   # b'hi\\n' 3
            proc = await client.start(["seq", "3"])
            async for event in proc.output():
                print(event.stream, event.chunk)
            print(await proc.wait())

    asyncio.run(main())

``connect(url)`` takes ``ws://``, ``wss://`` and ``unix:///PATH`` too, with
tokens and certificates, and resumes the session after a dropped
connection (see :mod:`execserver.aio.client`). Events and errors are the
classes of :mod:`execserver.clientcore`, the ones the Twisted client uses.
"""

from execserver.aio.client import Client, RunResult, connect
from execserver.aio.process import OutputStream, Process
from execserver.clientcore import errors as _errors
from execserver.clientcore.defaults import DEFAULT_PATH, default_server_command
from execserver.clientcore.errors import *  # noqa: F403  (the errors' own __all__)
from execserver.clientcore.types import (
    ClosedEvent,
    ExitedEvent,
    GapEvent,
    InitializeResult,
    OutputEvent,
)

__all__ = [
    "DEFAULT_PATH",
    "Client",
    "ClosedEvent",
    "ExitedEvent",
    "GapEvent",
    "InitializeResult",
    "OutputEvent",
    "OutputStream",
    "Process",
    "RunResult",
    "connect",
    "default_server_command",
]
__all__ += _errors.__all__
