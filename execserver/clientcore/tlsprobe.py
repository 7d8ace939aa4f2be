"""Telling a ``ws://`` URL that points at a TLS port, for every client.

A plain HTTP upgrade sent to a TLS server gets no HTTP answer (the server
waits for a ClientHello, or answers with an alert and closes), so the
connection error alone would mislead. Each client then probes the port
with a ClientHello of its own (its way to dial: Twisted's endpoint, asyncio's
``open_connection``) and, when a TLS record comes back, says so with
:func:`speaks_tls_reason`. The bytes and the verdict are here, once.
"""

from __future__ import annotations

import contextlib
import ssl

#: What a ``ws://`` connection to a TLS port is told (then ``HOST:PORT``).
SPEAKS_TLS = "the server speaks TLS here: use wss://"
#: How long the TLS probe of such a port may take, at most.
TLS_PROBE_SECONDS = 2.0


def tls_client_hello() -> bytes:
    """The first bytes a TLS client sends (a ClientHello), made without a socket."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    session = context.wrap_bio(incoming, outgoing)
    with contextlib.suppress(ssl.SSLWantReadError):
        session.do_handshake()
    return outgoing.read()


def answers_tls(first: bytes) -> bool:
    """Whether the first bytes answering a ClientHello are a TLS record:
    0x16 a handshake record (the ServerHello), 0x15 an alert."""
    return first[:1] in (b"\x16", b"\x15")


def speaks_tls_reason(url: str) -> str:
    """The connect error's reason for ``ws://HOST:PORT`` whose port speaks TLS."""
    return f"{SPEAKS_TLS}{url.removeprefix('ws://')}"
