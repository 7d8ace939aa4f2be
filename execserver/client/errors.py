"""Typed exceptions raised by the exec-server client.

The classes are defined once, Twisted-free, in :mod:`execserver.clientcore.errors`
(the asyncio and blocking clients raise the same ones); this module keeps
their historical import path.
"""

from __future__ import annotations

from execserver.clientcore.errors import (
    AuthRefused,
    ConnectFailed,
    ConnectionClosed,
    ConnectTimeout,
    ExecServerError,
    InitializeTimeout,
    NotConnected,
    OutcomeUnknown,
    OutputLagged,
    ProtocolViolation,
    RangesNotSupported,
    ServerError,
    SessionLost,
    SpawnFailed,
)

__all__ = [
    "AuthRefused",
    "ConnectFailed",
    "ConnectTimeout",
    "ConnectionClosed",
    "ExecServerError",
    "InitializeTimeout",
    "NotConnected",
    "OutcomeUnknown",
    "OutputLagged",
    "ProtocolViolation",
    "RangesNotSupported",
    "ServerError",
    "SessionLost",
    "SpawnFailed",
]
