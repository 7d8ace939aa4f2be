"""Client-side views of server messages and the events a client delivers.

Defined once, Twisted-free, in :mod:`execserver.clientcore.types` (shared
with the asyncio and blocking clients); this module keeps their historical
import path.
"""

from __future__ import annotations

from execserver.clientcore.types import (
    ClientEvent,
    ClosedEvent,
    ClosedParams,
    DisconnectedEvent,
    ExitedEvent,
    ExitedParams,
    GapEvent,
    InitializeResult,
    OutputEvent,
    OutputParams,
)

__all__ = [
    "ClientEvent",
    "ClosedEvent",
    "ClosedParams",
    "DisconnectedEvent",
    "ExitedEvent",
    "ExitedParams",
    "GapEvent",
    "InitializeResult",
    "OutputEvent",
    "OutputParams",
]
