"""The plain HTTP side of the WebSocket port: ``/readyz``, ``/metrics`` and refusals.

Pure functions from a request to an :class:`HttpReply`; the WebSocket
protocol sends the rendered reply and closes. No web framework sits in
front of the socket.
"""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING, Final

import attrs

from execserver import __version__, metrics

if TYPE_CHECKING:
    from execserver.dispatcher import Dispatcher

#: Default of ``--max-request-head-bytes``: largest accepted HTTP request
#: head (request line and headers).
MAX_REQUEST_HEAD_BYTES: Final = 16 * 1024

_STATUS_TEXT: Final = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    426: "Upgrade Required",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


@attrs.frozen
class HttpReply:
    status: int
    body: str | bytes
    headers: tuple[tuple[str, str], ...] = ()
    content_type: str = "text/plain; charset=utf-8"

    def render(self, head_only: bool = False) -> bytes:
        payload = self.body.encode() if isinstance(self.body, str) else self.body
        lines = [
            f"HTTP/1.1 {self.status} {_STATUS_TEXT[self.status]}",
            f"Server: exec-server/{__version__}",
            f"Content-Type: {self.content_type}",
            f"Content-Length: {len(payload)}",
            "Cache-Control: no-store",
            "Connection: close",
        ]
        lines += [f"{name}: {value}" for name, value in self.headers]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        return head if head_only else head + payload


def normalize_origin(origin: str) -> str:
    """Origins compare case-insensitively, without a trailing slash."""
    return origin.strip().rstrip("/").lower()


def origin_refused(origin: str) -> HttpReply:
    return HttpReply(
        403,
        f"origin {origin!r} is not allowed to connect; "
        "the server admits it only when started with --allow-origin for it\n",
    )


def unauthorized(what: str) -> HttpReply:
    """401 for a missing or wrong bearer token (the reply never says which, nor echoes it)."""
    return HttpReply(
        401,
        f"{what} needs a valid `Authorization: Bearer TOKEN` header\n",
        (("WWW-Authenticate", "Bearer"),),
    )


def host_refused(host: str) -> HttpReply:
    return HttpReply(
        403,
        f"Host {host[:200]!r} is not a loopback name or address; this loopback listener "
        "answers only requests addressed to localhost, 127.0.0.0/8 or [::1] "
        "(DNS rebinding protection)\n",
    )


def host_is_loopback(host: str) -> bool:
    """Whether a ``Host`` header names this machine's loopback (``localhost``, 127/8, ::1)."""
    host = host.strip().lower()
    if host.startswith("["):
        name, sep, rest = host[1:].partition("]")
        if not sep or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return False
    else:
        name, sep, port = host.partition(":")
        if sep and not port.isdigit():
            return False
    name = name.rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def plain_reply(
    method: str, path: str, dispatcher: Dispatcher, authorized: bool = True
) -> HttpReply:
    """The answer to a request without ``Upgrade`` (``authorized``: a valid token, or no auth)."""
    if path in ("/readyz", "/metrics"):
        if method not in ("GET", "HEAD"):
            return HttpReply(405, f"{path} answers GET and HEAD only\n", (("Allow", "GET, HEAD"),))
        if path == "/readyz":
            reason = dispatcher.not_ready_reason()
            return HttpReply(200, "") if reason is None else HttpReply(503, reason + "\n")
        if not authorized:
            return unauthorized("GET /metrics")
        return HttpReply(200, metrics.render(dispatcher), content_type=metrics.CONTENT_TYPE)
    if path == "/":
        return HttpReply(
            426,
            "this is an exec-server WebSocket endpoint: connect with a WebSocket client "
            "(ws://HOST:PORT); plain HTTP is served only at GET /readyz and GET /metrics\n",
            (("Upgrade", "websocket"),),
        )
    return HttpReply(
        404, f"no resource at {path}; plain HTTP is served at /readyz and /metrics only\n"
    )
