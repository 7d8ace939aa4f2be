"""Client-side views of server messages, lenient where the baseline is lean.

Shared by every client (Twisted, asyncio, blocking); nothing here imports
Twisted.

Requests are encoded with the shared wire types of :mod:`execserver.protocol`.
A few *incoming* shapes are declared here instead because the shared types
describe what this server sends, with its extension fields required, while a
client must also accept a baseline server (``codex-exec-server``): its
``initialize`` result is only ``{"protocolVersion"}``, and its
``process/output`` carries no ``seq``. Unknown fields are ignored.
"""

from __future__ import annotations

import attrs
import msgspec

from execserver import protocol as p
from execserver.clientcore.errors import OutputGap


class InitializeResult(msgspec.Struct, rename="camel"):
    """The ``initialize`` result; extension fields are optional here."""

    protocol_version: str
    session_id: str | None = None
    server_info: p.ServerInfo | None = None
    capabilities: list[str] = msgspec.field(default_factory=list)
    #: The granted session lifetime after a disconnect (0: not resumable).
    session_ttl_ms: int = 0
    on_detached_full: str = "drop"
    retained_output_bytes: int | None = None


class OutputParams(msgspec.Struct, rename="camel"):
    process_id: str
    stream: p.OutputStream
    #: Base64 text; decoded with pybase64 (SIMD), several times faster than
    #: msgspec's own base64, so the client keeps up with the server.
    chunk: str
    seq: int | None = None


class ExitedParams(msgspec.Struct, rename="camel"):
    process_id: str
    exit_code: int
    signal: str | None = None
    seq: int | None = None
    timed_out: str | None = None
    #: The resource limit that ended or crippled the process, and its figure.
    limit_exceeded: str | None = None
    limit_value: int | None = None


class ClosedParams(msgspec.Struct, rename="camel"):
    process_id: str
    seq: int | None = None


# --- events an application sees ------------------------------------------------


@attrs.frozen
class OutputEvent:
    """One chunk of process output: which stream, the raw bytes, its seq (if sent)."""

    process_id: str
    stream: p.OutputStream
    chunk: bytes
    seq: int | None = None


@attrs.frozen
class GapEvent(OutputEvent):
    """Output seqs ``from_seq..to_seq`` (inclusive) are lost: the server
    dropped them before this client could read them (``chunk`` is empty).

    Delivered only to readers that asked for gaps (``gaps=True``); the
    others get :class:`~execserver.clientcore.errors.OutputGap` raised.
    ``delivered``: (stream, bytes) of the output delivered before the gap.
    """

    from_seq: int = 0
    to_seq: int = 0
    delivered: tuple[tuple[str, int], ...] = ()

    def error(self) -> OutputGap:
        """The exception a reader that did not ask for gaps gets in this event's place."""
        return OutputGap(self.process_id, self.from_seq, self.to_seq, dict(self.delivered))


@attrs.frozen
class ExitedEvent:
    """The process exited. ``exit_code`` is None when the connection was lost first."""

    process_id: str
    exit_code: int | None
    signal: str | None = None
    timed_out: str | None = None


@attrs.frozen
class ClosedEvent:
    """No more output will ever arrive for the process."""

    process_id: str


@attrs.frozen
class DisconnectedEvent:
    reason: str


ClientEvent = OutputEvent | ExitedEvent | ClosedEvent | DisconnectedEvent
