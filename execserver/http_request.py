"""``http/request``: an HTTP request made by the executor, for Codex.

Codex reaches remote MCP servers (Streamable HTTP) from the machine its
commands run on: it asks the executor for the request, and gets either the
whole response (buffered) or the status and headers at once and then the
body as ordered ``http/request/bodyDelta`` notifications (``streamResponse``),
so server-sent events arrive before the response ends.

Built on Twisted's public HTTP client (:class:`twisted.web.client.Agent`, one
connection per request, closed at its end; HTTPS verified against the
system's trust roots by :class:`~twisted.web.client.BrowserLikePolicyForHTTPS`).
Beyond the reference (docs/protocol.md, "http/request"):

- a buffered body is capped at :data:`MAX_BUFFERED_BODY_BYTES`, and the
  buffered bodies of the whole server at :data:`MAX_BUFFERED_TOTAL_BYTES`;
- a streamed body follows the connection's flow control: its HTTP
  connection is paused while the connection's outbound buffer is over its
  high-water mark, and resumed when it drains;
- a connection holds at most :data:`MAX_IN_FLIGHT` requests (a streamed one
  until its last notification);
- a request still running when its connection goes away, or when the
  server shuts down, is cancelled (its HTTP connection closed; at shutdown
  it is answered with an error first);
- ``timeoutMs`` covers the whole request, body included, as reqwest's does.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import re
from collections.abc import Callable, Mapping
from io import BytesIO
from typing import Any, Final
from urllib.parse import quote, unquote

import attrs
from twisted.internet.defer import CancelledError, Deferred, maybeDeferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import (
    Agent,
    BrowserLikeRedirectAgent,
    FileBodyProducer,
    HTTPConnectionPool,
    ResponseDone,
)
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH, IAgent, IResponse
from zope.interface import implementer

from execserver import codec
from execserver import protocol as p
from execserver.errors import RpcError
from execserver.replies import Charged

#: Requests a connection may have in flight (a streamed one until its last
#: notification); one more is refused with ``-32600``.
MAX_IN_FLIGHT: Final = 32
#: Bytes a buffered (not streamed) response body may hold: 8 MiB (11 MiB of
#: base64 in the reply). A larger body fails the request (``-32603``); a
#: caller that expects more streams it.
MAX_BUFFERED_BODY_BYTES: Final = 8 * 1024 * 1024
#: Bytes the buffered bodies being read hold on the whole server at most: one
#: connection's worth (32 x 8 MiB). A body that would go past it fails the
#: request (``-32603``), so many connections cannot hold 256 MiB each.
MAX_BUFFERED_TOTAL_BYTES: Final = MAX_IN_FLIGHT * MAX_BUFFERED_BODY_BYTES
#: Bytes of body one notification carries at most (the reference's client
#: refuses more than 1 MiB).
MAX_DELTA_BYTES: Final = 64 * 1024

#: RFC 9110 ``token``: an HTTP method and a header name.
_TOKEN: Final = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: What the ``http`` crate refuses in a header value: controls but tab, and DEL.
_BAD_VALUE: Final = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
#: A header value reqwest's ``to_str`` reads back: visible ASCII, space, tab.
_VISIBLE: Final = re.compile(rb"[\t\x20-\x7e]*")
_SCHEME: Final = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*):(.*)", re.DOTALL)
#: Code points the WHATWG URL parser forbids in a domain.
_FORBIDDEN_HOST: Final = re.compile(r"[\x00-\x20#%/:<>?@\[\\\]^|\x7f]")
#: Characters kept as they are in a path or query (others percent-encoded).
_URL_SAFE: Final = "!$&'()*+,;=:@/?%-._~"
#: Server variables a header may not carry (``valueEnvVar``): the
#: reference's list, compared without regard to case.
HEADER_ENV_DENYLIST: Final = frozenset(
    {
        "CODEX_EXEC_SERVER_NOISE_AUTH_TOKEN",
        "OPENAI_FEDERATION_RULE_ID",
        "OPENAI_IDENTITY_TOKEN_FILE",
        "OPENAI_WORKLOAD_IDENTITY_CONTEXT",
        "OPENAI_API_KEY",
        "CODEX_API_KEY",
        "CODEX_ACCESS_TOKEN",
        "CODEX_CONNECTORS_TOKEN",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AZURE_CLIENT_SECRET",
        "AZURE_FEDERATED_TOKEN_FILE",
        "GOOGLE_APPLICATION_CREDENTIALS",
    }
)
#: Redirects followed at most with ``redirectPolicy`` ``follow`` (reqwest's default).
MAX_REDIRECTS: Final = 10

TIMED_OUT: Final = "operation timed out"
CANCELLED: Final = "request cancelled"
SHUTTING_DOWN: Final = "the server is shutting down"
BODY_ERROR: Final = "error decoding response body"
BODY_CUT: Final = "the connection closed before the end of the body"


@attrs.frozen
class Target:
    """A request's URL, checked: what is sent and how errors name it."""

    url: str
    scheme: str
    #: ``Basic ...`` from the URL's user and password (reqwest takes them out
    #: of the URL it sends and names), None without them.
    basic: bytes | None = None


def _url_error(reason: str) -> RpcError:
    return RpcError.invalid_params(f"http/request url is invalid: {reason}")


def parse_url(text: str) -> Target:
    """``text`` as the reference's ``url`` crate reads an absolute URL (-32602 if not).

    Only http and https are taken; the URL is normalised as the crate
    serialises it (lower-case scheme and host, ``/`` for an empty path,
    no fragment, non-ASCII percent-encoded), without the user and password,
    which become :attr:`Target.basic`.
    """
    text = re.sub(r"[\t\n\r]", "", text.strip("\x00- "))
    match = _SCHEME.fullmatch(text)
    if match is None:
        raise _url_error("relative URL without a base")
    scheme, rest = match[1].lower(), match[2]
    if scheme not in ("http", "https"):
        raise RpcError.invalid_params(
            f"http/request only supports http and https URLs, got {scheme}"
        )
    rest = rest.lstrip("/\\")
    end = len(rest)
    for stop in "/\\?#":
        at = rest.find(stop)
        if at != -1:
            end = min(end, at)
    authority, tail = rest[:end], rest[end:].split("#", 1)[0]
    path, mark, query = tail.partition("?")
    tail = path.replace("\\", "/") + mark + query
    userinfo, _, hostport = authority.rpartition("@")
    host, port = _split_port(hostport)
    host = _host(host)
    path_query = tail if tail.startswith("/") else "/" + tail
    path_query = quote(path_query, safe=_URL_SAFE)
    default = {"http": 80, "https": 443}[scheme]
    netloc = host if port is None or port == default else f"{host}:{port}"
    basic = None
    if userinfo:
        user, _, password = userinfo.partition(":")
        if user or password:  # (the url crate drops an empty user and password)
            credentials = f"{unquote(user)}:{unquote(password)}".encode()
            basic = b"Basic " + base64.b64encode(credentials)
    return Target(f"{scheme}://{netloc}{path_query}", scheme, basic)


def _split_port(hostport: str) -> tuple[str, int | None]:
    if hostport.startswith("["):
        close = hostport.find("]")
        if close == -1:
            raise _url_error("invalid IPv6 address")
        host, after = hostport[: close + 1], hostport[close + 1 :]
        if after and not after.startswith(":"):
            raise _url_error("invalid IPv6 address")
        digits = after[1:] if after else None
    else:
        host, colon, digits_text = hostport.partition(":")
        digits = digits_text if colon else None
    if not digits:
        return host, None
    if not digits.isascii() or not digits.isdigit() or int(digits) > 65535:
        raise _url_error("invalid port number")
    return host, int(digits)


def _host(host: str) -> str:
    if not host:
        raise _url_error("empty host")
    if host.startswith("["):
        try:
            return f"[{ipaddress.IPv6Address(host[1:-1]).compressed}]"
        except ValueError:
            raise _url_error("invalid IPv6 address") from None
    host = unquote(host, errors="strict") if "%" in host else host
    idn = _url_error("invalid international domain name")
    if _FORBIDDEN_HOST.search(host):
        raise idn
    if not host.isascii():
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError:
            raise idn from None
    host = host.lower()
    for label in host.split("."):
        if label.startswith("xn--"):
            try:
                if not label[4:] or not label[4:].encode("ascii").decode("punycode"):
                    raise idn
            except UnicodeError:
                raise idn from None
    last = host[:-1] if host.endswith(".") else host
    last = last.rsplit(".", 1)[-1]
    if last and (last.isdigit() or re.fullmatch(r"0x[0-9a-f]*", last)):
        return _ipv4(host)
    return host


def _ipv4(host: str) -> str:
    """The WHATWG IPv4 parser (``1.2.3`` is 1.2.0.3; hex and octal parts)."""
    failure = _url_error("invalid IPv4 address")
    parts = host.split(".")
    if parts[-1] == "" and len(parts) > 1:
        parts.pop()
    if len(parts) > 4:
        raise failure
    numbers = []
    for part in parts:
        if re.fullmatch(r"0[xX][0-9a-fA-F]*", part):
            numbers.append(int(part[2:] or "0", 16))
        elif re.fullmatch(r"0[0-7]+", part):
            numbers.append(int(part, 8))
        elif re.fullmatch(r"[0-9]+", part):
            numbers.append(int(part))
        else:
            raise failure
    if any(n > 255 for n in numbers[:-1]) or numbers[-1] >= 256 ** (5 - len(numbers)):
        raise failure
    value = numbers[-1]
    for index, number in enumerate(numbers[:-1]):
        value += number * 256 ** (3 - index)
    return str(ipaddress.IPv4Address(value))


def _header_value(header: p.HttpHeader, environ: Mapping[str, str]) -> str:
    """``value``, and after it the server's ``valueEnvVar`` (-32602 if refused or unset)."""
    variable = header.value_env_var
    if not isinstance(variable, str):
        return header.value
    if variable.upper() in HEADER_ENV_DENYLIST:
        raise RpcError.invalid_params(
            f"http/request header {header.name} cannot use executor environment variable {variable}"
        )
    found = environ.get(variable) if variable and "=" not in variable else None
    if found is None:
        raise RpcError.invalid_params(
            f"http/request header {header.name} requires executor environment variable {variable}"
        )
    if not found:
        raise RpcError.invalid_params(
            f"http/request header {header.name} requires a non-empty executor environment "
            f"variable {variable}"
        )
    return header.value + found


def request_headers(
    headers: list[p.HttpHeader], environ: Mapping[str, str] = os.environ
) -> Headers:
    """The request's headers, repeats kept (-32602 naming the first bad one)."""
    result = Headers()
    for header in headers:
        name = header.name.encode("utf-8")
        if _TOKEN.fullmatch(name) is None:
            raise RpcError.invalid_params(
                "http/request header name is invalid: invalid HTTP header name"
            )
        value = _header_value(header, environ)
        if _BAD_VALUE.search(value):
            raise RpcError.invalid_params(
                f"http/request header value is invalid for {header.name}: "
                "failed to parse header value"
            )
        result.addRawHeader(name, value.encode("utf-8"))
    if not result.hasHeader(b"accept"):
        result.addRawHeader(b"accept", b"*/*")  # (as reqwest)
    return result


def response_headers(response: IResponse) -> list[p.HttpHeader]:
    """The response's headers, lower-case names, as the reference reports them.

    A value that is not visible ASCII is dropped (the reference's
    ``HeaderValue::to_str``). Twisted keeps the connection-control headers
    to itself; ``content-length`` is reported, last, when the response has one.
    """
    result = []
    for name, values in response.headers.getAllRawHeaders():
        lower = name.decode("latin-1").lower()
        for value in values:
            if _VISIBLE.fullmatch(value):
                result.append(p.HttpHeader(lower, value.decode("ascii")))
    if response.length is not UNKNOWN_LENGTH:
        result.append(p.HttpHeader("content-length", str(response.length)))
    return result


def redirect_policy(value: str | dict[str, None]) -> str:
    """``follow`` or ``stop``, from serde's string or map form (-32602 otherwise)."""
    if isinstance(value, dict):
        if len(value) != 1:
            raise RpcError.invalid_params(
                f"invalid length {len(value)}, expected map with a single key"
            )
        [value] = value
    if value not in ("follow", "stop"):
        raise RpcError.invalid_params(f"unknown variant `{value}`, expected `follow` or `stop`")
    return value


def check_params(params: p.HttpRequestParams) -> tuple[Target, Headers]:
    """The reference's checks, in its order: method, url, headers."""
    if _TOKEN.fullmatch(params.method.encode("utf-8")) is None:
        raise RpcError.invalid_params("http/request method is invalid: invalid HTTP method")
    target = parse_url(params.url)
    headers = request_headers(params.headers)
    if target.basic is not None and not headers.hasHeader(b"authorization"):
        headers.addRawHeader(b"authorization", target.basic)  # (a header's own wins)
    return target, headers


def _reason(failure: Failure) -> str:
    """A Twisted failure as a short cause, for the text after the reference's."""
    value = failure.value
    reasons = getattr(value, "reasons", None)
    if reasons:
        return "; ".join(_reason(reason) for reason in reasons)
    text = str(value).strip()
    return text or type(value).__name__


Notify = Callable[[p.HttpRequestBodyDeltaNotification], None]


class _Exchange:
    """One request: from its send to its reply (and its last notification)."""

    def __init__(
        self,
        owner: HttpRequests,
        conn: Any,
        params: p.HttpRequestParams,
        target: Target,
    ) -> None:
        self.owner = owner
        self.conn = conn
        self.params = params
        self.target = target
        self.reply: Deferred[Any] = Deferred()
        self.sending: Deferred[IResponse] | None = None
        self.body: _Body | None = None
        self.timer: IDelayedCall | None = None
        self.timed_out = False
        #: Why the request was cancelled, once it is.
        self.cancelled: str | None = None
        self.finished = False

    def start(self, agent: IAgent, headers: Headers) -> None:
        params = self.params
        producer = (
            None if params.body_base64 is None else FileBodyProducer(BytesIO(params.body_base64))
        )
        if producer is not None and headers.hasHeader(b"content-length"):
            # Twisted writes the body's own length: one Content-Length, not two.
            headers.removeHeader(b"content-length")
        if params.timeout_ms is not None:
            self.timer = self.owner.clock.callLater(params.timeout_ms / 1000.0, self._time_out)
        # (maybeDeferred: the TLS client refuses some hosts, an empty label
        # say, by raising before it connects; that is a send failure too.)
        self.sending = maybeDeferred(
            agent.request,
            params.method.encode("ascii"),
            self.target.url.encode("ascii"),
            headers,
            producer,
        )
        self.sending.addCallbacks(self._response, self._send_failed)

    def _send_error(self, cause: str) -> RpcError:
        return RpcError.internal(
            f"http/request failed: error sending request for url ({self.target.url}): {cause}"
        )

    def _response(self, response: IResponse) -> None:
        self.sending = None
        if self.finished:
            return
        result = p.HttpRequestResponse(response.code, response_headers(response), b"")
        if self.params.stream_response:
            body: _Body = _StreamedBody(self)
            reply, self.reply = self.reply, Deferred()
            reply.callback(result)  # the reply is written before any notification
        else:
            body = _BufferedBody(self, result)
        self.body = body
        response.deliverBody(body)

    def _send_failed(self, failure: Failure) -> None:
        self.sending = None
        if self.finished:
            return
        cause = self.stopped_by()
        if cause is None:
            cause = CANCELLED if failure.check(CancelledError) else _reason(failure)
        self.fail(self._send_error(cause))

    def _time_out(self) -> None:
        self.timer = None
        self.timed_out = True
        self.abort()

    def cancel(self, reason: str) -> None:
        """The connection is gone or shutting down: stop (closing the HTTP connection)."""
        if self.finished:
            return  # (answered, its reply not yet sent: nothing runs)
        self.cancelled = reason
        self.abort()

    def abort(self) -> None:
        if self.sending is not None:
            self.sending.cancel()
        elif self.body is not None:
            self.body.stop()

    def stopped_by(self) -> str | None:
        """Why the request was stopped (its timeout, or a cancel), None if it was not."""
        return TIMED_OUT if self.timed_out else self.cancelled

    def body_error(self) -> str:
        cause = self.stopped_by()
        return f"{BODY_ERROR}: {BODY_CUT if cause is None else cause}"

    def succeed(self, result: object, held: bool = False) -> None:
        """Answer ``result``; ``held``: the request stays in flight until
        :meth:`let_go` (a buffered reply, until the transport has sent it)."""
        self._end(forget=not held)
        self.reply.callback(result)

    def let_go(self) -> None:
        self.owner.forget(self)

    def fail(self, error: RpcError) -> None:
        self._end()
        self.reply.errback(error)

    def _end(self, forget: bool = True) -> None:
        self.finished = True
        if self.timer is not None:
            if self.timer.active():
                self.timer.cancel()
            self.timer = None
        if forget:
            self.owner.forget(self)


class _Body(Protocol):
    def __init__(self, exchange: _Exchange) -> None:
        self.exchange = exchange
        self.stopped = False

    def stop(self) -> None:
        if not self.stopped and self.transport is not None:
            self.stopped = True
            self.transport.stopProducing()  # type: ignore[attr-defined]


def _clean_end(reason: Failure) -> bool:
    # PotentialDataLoss: a body without a length ended by the server's close.
    return reason.check(ResponseDone, PotentialDataLoss) is not None


class _BufferedBody(_Body):
    def __init__(self, exchange: _Exchange, result: p.HttpRequestResponse) -> None:
        super().__init__(exchange)
        self.result = result
        self.parts: list[bytes] = []
        #: Bytes held, counted in the server's :attr:`HttpRequests.buffered`.
        self.size = 0
        self.too_large = False
        #: The server's buffered bodies held :data:`MAX_BUFFERED_TOTAL_BYTES` (with this one's).
        self.server_full: int | None = None

    def dataReceived(self, data: bytes) -> None:
        if self.too_large or self.server_full is not None:
            return
        owner = self.exchange.owner
        if self.size + len(data) > MAX_BUFFERED_BODY_BYTES:
            self.too_large = True
        elif owner.buffered + len(data) > owner.max_buffered_total:
            self.server_full = owner.buffered + len(data)
        else:
            self.size += len(data)
            owner.buffered += len(data)
            self.parts.append(data)
            return
        self._let_go()
        self.stop()

    def _let_go(self) -> None:
        self.exchange.owner.buffered -= self.size
        self.size = 0
        self.parts = []

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:  # noqa: B008
        exchange = self.exchange
        if (
            not exchange.finished
            and self.server_full is None
            and not self.too_large
            and _clean_end(reason)
            and exchange.stopped_by() is None
        ):
            # (A body without a length ends at its connection's close: the
            # close a cancel makes is not its end.)
            self.result.body_base64 = b"".join(self.parts)
            self.parts = []
            rendered = codec.RenderedParts((codec.encode(self.result),))
            self.result.body_base64 = b""
            # Its bytes and its place among the connection's requests are
            # held until the reply has been sent: a client that does not
            # read holds 32 replies at most, not one per request it sends.
            exchange.succeed(Charged(rendered, _Sent(self)), held=True)
            return
        self._let_go()
        if exchange.finished:
            return
        if self.server_full is not None:
            owner = exchange.owner
            exchange.fail(
                RpcError.internal(
                    "failed to read http/request response body: the buffered bodies being "
                    f"read on this server would hold {self.server_full} bytes, the limit is "
                    f"{owner.max_buffered_total} (stream the body with streamResponse, or "
                    "retry later)"
                )
            )
        elif self.too_large:
            exchange.fail(
                RpcError.internal(
                    "failed to read http/request response body: the body exceeds "
                    f"{MAX_BUFFERED_BODY_BYTES} bytes, the limit of a buffered body "
                    "(stream larger ones with streamResponse)"
                )
            )
        else:
            exchange.fail(
                RpcError.internal(
                    f"failed to read http/request response body: {exchange.body_error()}"
                )
            )


@attrs.define
class _Sent:
    """Lets a buffered body's bytes and request go once its reply is sent."""

    body: _BufferedBody
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.body._let_go()
            self.body.exchange.let_go()


class _StreamedBody(_Body):
    """Sends the body as notifications, following the connection's flow control."""

    def __init__(self, exchange: _Exchange) -> None:
        super().__init__(exchange)
        self.seq = 1
        self.session = exchange.conn.session

    def connectionMade(self) -> None:
        self.session.flow_listeners.append(self)
        if self.session.paused:
            self.pauseProducing()

    # (IPushProducer, as told by the session)
    def pauseProducing(self) -> None:
        if not self.stopped and self.transport is not None:
            self.transport.pauseProducing()  # type: ignore[attr-defined]

    def resumeProducing(self) -> None:
        if not self.stopped and self.transport is not None:
            self.transport.resumeProducing()  # type: ignore[attr-defined]

    def stopProducing(self) -> None:
        self.stop()

    def _notify(self, delta: bytes, done: bool = False, error: str | None = None) -> None:
        exchange = self.exchange
        note = p.HttpRequestBodyDeltaNotification(
            exchange.params.request_id, self.seq, delta, done, error
        )
        self.seq += 1
        exchange.conn.send(p.Notification(p.HTTP_REQUEST_BODY_DELTA, note))

    def dataReceived(self, data: bytes) -> None:
        if self.exchange.finished:
            return
        view = memoryview(data)
        for start in range(0, len(data), MAX_DELTA_BYTES):
            self._notify(bytes(view[start : start + MAX_DELTA_BYTES]))

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:  # noqa: B008
        if self in self.session.flow_listeners:
            self.session.flow_listeners.remove(self)
        exchange = self.exchange
        if exchange.finished:
            return
        # (Sent only while the connection is open: not after it closed.)
        if _clean_end(reason) and exchange.stopped_by() is None:
            self._notify(b"", done=True)
        else:
            self._notify(b"", done=True, error=exchange.body_error())
        exchange.succeed(None)


#: The codes BrowserLikeRedirectAgent follows (or fails on): such a response
#: from the agent beneath it never reaches the caller.
_REDIRECTS: Final = frozenset({301, 302, 303, 307, 308})


class _Discard(Protocol):
    """Reads nothing: closes the body's connection at once."""

    def makeConnection(self, transport: Any) -> None:
        transport.stopProducing()


@implementer(IAgent)
@attrs.frozen
class _ClosingRedirects:
    """``agent``, but a redirect's connection is closed when it arrives.

    The redirect agent neither reads nor closes a redirect's body: its
    connection stayed open, buffering what came, after the request ended.
    """

    agent: IAgent

    def request(
        self,
        method: bytes,
        uri: bytes,
        headers: Headers | None = None,
        bodyProducer: Any = None,
    ) -> Deferred[IResponse]:
        def closed(response: IResponse) -> IResponse:
            if response.code in _REDIRECTS:
                response.deliverBody(_Discard())
            return response

        return self.agent.request(method, uri, headers, bodyProducer).addCallback(closed)


class HttpRequests:
    """The server's ``http/request`` calls: the agent and each connection's requests."""

    def __init__(
        self,
        clock: IReactorTime,
        floor_network: bool = True,
        max_buffered_total: int = MAX_BUFFERED_TOTAL_BYTES,
    ) -> None:
        self.clock = clock
        #: Bytes the buffered bodies being read hold now, on the whole server.
        self.buffered = 0
        self.max_buffered_total = max_buffered_total
        #: False under ``--sandbox-floor ... --floor-no-network``: no
        #: process may reach the network, so neither may the server for a client.
        self.floor_network = floor_network
        # A connection per request, closed at its end (no idle sockets).
        self.agent = Agent(clock, pool=HTTPConnectionPool(clock, persistent=False))
        # (strips credentials on a redirect to another origin)
        self.following = BrowserLikeRedirectAgent(
            _ClosingRedirects(self.agent), redirectLimit=MAX_REDIRECTS
        )
        self.in_flight: dict[Any, set[_Exchange]] = {}

    def handle(self, conn: Any, params: p.HttpRequestParams) -> Deferred[Any]:
        if not self.floor_network:
            raise RpcError.invalid_params(FLOOR_REFUSAL)
        follow = redirect_policy(params.redirect_policy) == "follow"
        target, headers = check_params(params)
        held = self.in_flight.setdefault(conn, set())
        if len(held) >= MAX_IN_FLIGHT:
            raise RpcError.invalid_request(
                f"too many http/request calls in flight on this connection: {len(held)}, "
                f"the limit is {MAX_IN_FLIGHT}"
            )
        exchange = _Exchange(self, conn, params, target)
        held.add(exchange)
        reply = exchange.reply
        agent = self.following if follow else self.agent
        exchange.start(agent, headers)
        return reply

    def forget(self, exchange: _Exchange) -> None:
        held = self.in_flight.get(exchange.conn)
        if held is not None:
            held.discard(exchange)
            if not held:
                del self.in_flight[exchange.conn]

    def _cancel_all(self, conn: Any, reason: str) -> None:
        for exchange in list(self.in_flight.get(conn, ())):
            exchange.cancel(reason)

    def connection_closed(self, conn: Any) -> None:
        """Cancel every request of ``conn`` still running (its sockets closed)."""
        self._cancel_all(conn, CANCELLED)

    def connection_shutting_down(self, conn: Any) -> None:
        """End ``conn``'s requests, answered with an error, so its shutdown does not wait."""
        self._cancel_all(conn, SHUTTING_DOWN)


#: The answer to every ``http/request`` under a floor without network.
FLOOR_REFUSAL: Final = (
    "http/request is refused: this server's sandbox floor allows no network "
    "(--floor-no-network) for any process or request"
)


def register(router: Any, clock: IReactorTime, floor_network: bool = True) -> HttpRequests:
    """Add ``http/request`` to ``router``; cancel a closed connection's requests.

    ``floor_network`` False (the operator's ``--floor-no-network``) refuses
    every request: the server would otherwise reach the network for a
    client whose every command the floor keeps off it.
    """
    requests = HttpRequests(clock, floor_network)
    router.add_method(p.HttpRequest, requests.handle)
    router.closed_hooks.append(requests.connection_closed)
    router.shutdown_hooks.append(requests.connection_shutting_down)
    return requests
