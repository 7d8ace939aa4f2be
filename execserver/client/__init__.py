"""Python client for exec-server: stdio, WebSocket or in-process; reconnecting.

Quick start (see docs/client.md)::

    from twisted.internet import defer, task
    from execserver.client import ExecServerClient

    async def main(reactor):
        client = await ExecServerClient.spawn_local(reactor)
        proc = await client.start_process(["echo", "hi"])
        proc.add_output_listener(lambda ev: print(ev.stream, ev.chunk))
        print("exit code", await proc.exited())
        await client.close()

    task.react(lambda r: defer.Deferred.fromCoroutine(main(r)))
"""

from execserver.client.client import (
    ConnectOptions,
    ExecServerClient,
    connect_in_process,
    connect_websocket,
    spawn_local,
)
from execserver.client.errors import (
    AuthRefused,
    ConnectFailed,
    ConnectionClosed,
    ConnectTimeout,
    ExecServerError,
    InitializeTimeout,
    NotConnected,
    OutcomeUnknown,
    OutputGap,
    OutputLagged,
    ProtocolViolation,
    RangesNotSupported,
    ServerError,
    SessionLost,
    SpawnFailed,
)
from execserver.client.process import OutputSubscription, RemoteProcess
from execserver.client.reconnect import ReconnectingClient, ResumingClient
from execserver.client.rpc import RpcClient
from execserver.client.types import (
    ClientEvent,
    ClosedEvent,
    DisconnectedEvent,
    ExitedEvent,
    GapEvent,
    InitializeResult,
    OutputEvent,
)

__all__ = [
    "AuthRefused",
    "ClientEvent",
    "ClosedEvent",
    "ConnectFailed",
    "ConnectOptions",
    "ConnectTimeout",
    "ConnectionClosed",
    "DisconnectedEvent",
    "ExecServerClient",
    "ExecServerError",
    "ExitedEvent",
    "GapEvent",
    "InitializeResult",
    "InitializeTimeout",
    "NotConnected",
    "OutcomeUnknown",
    "OutputEvent",
    "OutputGap",
    "OutputLagged",
    "OutputSubscription",
    "ProtocolViolation",
    "RangesNotSupported",
    "ReconnectingClient",
    "RemoteProcess",
    "ResumingClient",
    "RpcClient",
    "ServerError",
    "SessionLost",
    "SpawnFailed",
    "connect_in_process",
    "connect_websocket",
    "spawn_local",
]
