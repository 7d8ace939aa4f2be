"""``http/request`` and ``http/request/bodyDelta``: the real server over stdio
and WebSocket against a twisted.web server on 127.0.0.1 (and the reference).
"""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest_twisted
from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from execserver.http_request import FLOOR_REFUSAL, MAX_BUFFERED_BODY_BYTES, MAX_IN_FLIGHT
from tests.codex.fetch_codex import fetch
from tests.support import codex_session
from tests.support.harness import b64, reactor, unb64, with_timeout
from tests.support.polling import until
from tests.support.stdio_server import ServerProcess
from tests.support.ws_harness import WsServerProcess, connect

TIMEOUT = 20.0


#: Bytes /flood sends: far more than the flow-control bound below.
FLOOD_BYTES = 96 * 1024 * 1024
FLOOD_CHUNK = 256 * 1024


class _Flood:
    """Writes FLOOD_BYTES as fast as its client takes them (an IPushProducer)."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.written = 0
        self.paused = False
        self.done = False
        request.registerProducer(self, True)
        reactor.callLater(0, self._write)

    def _write(self) -> None:
        while not self.paused and not self.done:
            if self.written >= FLOOD_BYTES:
                self.done = True
                self.request.unregisterProducer()
                self.request.finish()
                return
            # Each chunk names its offset: order and loss show in the bytes.
            self.request.write(self.written.to_bytes(8, "big") * (FLOOD_CHUNK // 8))
            self.written += FLOOD_CHUNK
            if self.written % (4 * 1024 * 1024) == 0:
                reactor.callLater(0, self._write)  # let the reactor breathe
                return

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        if self.paused:
            self.paused = False
            reactor.callLater(0, self._write)

    def stopProducing(self) -> None:
        self.done = True


class _Web(Resource):
    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.sse: list[Request] = []
        self.hanging: list[Request] = []
        self.flood: _Flood | None = None
        #: Fires for each hanging request whose client went away.
        self.gone: list[Deferred[None]] = []

    def render(self, request: Request) -> Any:
        path = request.path
        if path == b"/echo":
            headers = request.requestHeaders
            body = json.dumps(
                {
                    "method": request.method.decode(),
                    "body": request.content.read().decode() if request.content else "",
                    "x-r": [v.decode() for v in headers.getRawHeaders(b"x-r", [])],
                    "authorization": [
                        v.decode() for v in headers.getRawHeaders(b"authorization", [])
                    ],
                }
            ).encode()
            request.responseHeaders.addRawHeader(b"x-a", b"1")
            request.responseHeaders.addRawHeader(b"x-a", b"2")
            request.responseHeaders.addRawHeader(b"x-bin", b"caf\xe9")
            request.setHeader(b"content-length", str(len(body)).encode())
            return body
        if path == b"/sse":
            request.setHeader(b"content-type", b"text/event-stream")
            request.write(b"data: 0\n\n")
            self.sse.append(request)
            self._watch(request)
            return NOT_DONE_YET
        if path == b"/drop":
            request.setHeader(b"content-length", b"100")
            request.write(b"12345")
            reactor.callLater(0.05, _abort, request)
            return NOT_DONE_YET
        if path == b"/redir-endless":
            # A redirect whose body never ends: only its close ends it.
            request.setResponseCode(302)
            request.setHeader(b"location", b"/echo")
            request.write(b"moved " * 1000)
            self._watch(request)
            self.hanging.append(request)
            return NOT_DONE_YET
        if path == b"/redir":
            request.setResponseCode(302)
            request.setHeader(b"location", b"/echo")
            return b""
        if path == b"/flood":
            self.flood = _Flood(request)
            return NOT_DONE_YET
        if path == b"/big":
            return b"x" * (MAX_BUFFERED_BODY_BYTES + 1)
        # /hang: never answers; tells when its client is gone.
        self._watch(request)
        self.hanging.append(request)
        return NOT_DONE_YET

    def _watch(self, request: Request) -> None:
        """``gone`` gets a Deferred that fires if the client goes before the end."""
        gone: Deferred[None] = Deferred()
        request.notifyFinish().addErrback(lambda _: gone.callback(None))
        self.gone.append(gone)


def _abort(request: Request) -> None:
    """Drop the request's TCP connection at once (no clean end)."""
    transport: Any = request.channel.transport if request.channel is not None else None
    if transport is not None:
        transport.abortConnection()


@asynccontextmanager
async def web() -> AsyncIterator[tuple[_Web, str]]:
    root = _Web()
    port = reactor.listenTCP(0, Site(root), interface="127.0.0.1")
    try:
        yield root, f"http://127.0.0.1:{port.getHost().port}"
    finally:
        for request in root.sse + root.hanging:
            if not request.finished and request.channel is not None:
                _abort(request)
        await port.stopListening()


#: Server variables the valueEnvVar tests name (given to both servers).
HEADER_ENV = {"MCP_TOKEN": "tok", "EMPTY_VAR": "", "OPENAI_API_KEY": "sk-test"}


def serving() -> Any:
    return codex_session.serving(codex_session.CODEX_INIT, HEADER_ENV)


def _deltas(server: Any, request_id: str) -> list[dict[str, Any]]:
    return [
        m["params"]
        for m in server.notifications
        if m.get("method") == "http/request/bodyDelta" and m["params"]["requestId"] == request_id
    ]


async def _done(server: Any, request_id: str) -> list[dict[str, Any]]:
    await server.wait_for(
        lambda m: (
            m.get("method") == "http/request/bodyDelta"
            and m["params"]["requestId"] == request_id
            and m["params"]["done"]
        ),
        TIMEOUT,
        f"the last bodyDelta of {request_id}",
    )
    return _deltas(server, request_id)


@pytest_twisted.ensureDeferred
async def test_buffered_get_and_post_with_headers_and_body() -> None:
    async with web() as (_, base), serving() as server:
        got = await server.call(
            "http/request", {"method": "GET", "url": base + "/echo", "requestId": "a"}
        )
        assert got["status"] == 200
        names = [h["name"] for h in got["headers"]]
        # Lower-case names, repeats kept in order, the non-ASCII value dropped.
        assert [h["value"] for h in got["headers"] if h["name"] == "x-a"] == ["1", "2"]
        assert "x-bin" not in names
        assert all(name == name.lower() for name in names)
        assert json.loads(unb64(got["bodyBase64"]))["method"] == "GET"
        params = {
            "method": "POST",
            "url": base + "/echo",
            "requestId": "b",
            "headers": [{"name": "X-R", "value": "1"}, {"name": "x-r", "value": "2"}],
            "bodyBase64": b64(b"hi there"),
            "timeoutMs": 10000,
        }
        posted = await server.call("http/request", params)
        assert json.loads(unb64(posted["bodyBase64"])) == {
            "method": "POST",
            "body": "hi there",
            "x-r": ["1", "2"],
            "authorization": [],
        }
        assert {"name": "content-length", "value": str(len(unb64(posted["bodyBase64"])))} in (
            posted["headers"]
        )


@pytest_twisted.ensureDeferred
async def test_streamed_events_arrive_in_order_before_the_end() -> None:
    async with web() as (site, base), serving() as server:
        params = {"method": "GET", "url": base + "/sse", "requestId": "s", "streamResponse": True}
        got = await server.call("http/request", params)
        assert got["bodyBase64"] == "" and got["status"] == 200
        await server.wait_notification("http/request/bodyDelta", timeout=TIMEOUT)
        [sse] = site.sse
        assert _deltas(server, "s") == [
            {
                "requestId": "s",
                "seq": 1,
                "deltaBase64": b64(b"data: 0\n\n"),
                "done": False,
                "error": None,
            }
        ]
        sse.write(b"data: 1\n\n")
        sse.finish()
        deltas = await _done(server, "s")
        assert [d["seq"] for d in deltas] == list(range(1, len(deltas) + 1))
        assert b"".join(unb64(d["deltaBase64"]) for d in deltas) == b"data: 0\n\ndata: 1\n\n"
        assert deltas[-1]["done"] and deltas[-1]["error"] is None
        assert deltas[-1]["deltaBase64"] == ""


@pytest_twisted.ensureDeferred
async def test_a_body_cut_short_ends_the_stream_with_an_error() -> None:
    async with web() as (_, base), serving() as server:
        params = {"method": "GET", "url": base + "/drop", "requestId": "d", "streamResponse": True}
        await server.call("http/request", params)
        deltas = await _done(server, "d")
        assert unb64(deltas[0]["deltaBase64"]) == b"12345"
        assert deltas[-1]["error"] == (
            "error decoding response body: the connection closed before the end of the body"
        )
        buffered = await server.request("http/request", {**params, "streamResponse": False})
        assert buffered["error"]["code"] == -32603
        assert buffered["error"]["message"].startswith(
            "failed to read http/request response body: error decoding response body"
        )


@pytest_twisted.ensureDeferred
async def test_the_timeout_covers_the_request_and_closes_its_connection() -> None:
    async with web() as (site, base), serving() as server:
        url = base + "/hang"
        reply = await server.request(
            "http/request", {"method": "GET", "url": url, "requestId": "t", "timeoutMs": 200}
        )
        assert reply["error"] == {
            "code": -32603,
            "message": f"http/request failed: error sending request for url ({url}): "
            "operation timed out",
        }
        await with_timeout(site.gone[0], TIMEOUT, "the HTTP server to see the disconnect")


@pytest_twisted.ensureDeferred
async def test_invalid_params_get_the_reference_texts() -> None:
    async with web() as (_, base), serving() as server:
        for params, message in _INVALID(base):
            reply = await server.request("http/request", params)
            assert reply["error"] == {"code": -32602, "message": message}, params


def _INVALID(base: str) -> list[tuple[dict[str, Any], str]]:
    ok = {"method": "GET", "url": base + "/echo", "requestId": "x"}
    return [
        ({**ok, "method": "G ET"}, "http/request method is invalid: invalid HTTP method"),
        ({**ok, "method": ""}, "http/request method is invalid: invalid HTTP method"),
        ({**ok, "url": "not a url"}, "http/request url is invalid: relative URL without a base"),
        ({**ok, "url": "http://"}, "http/request url is invalid: empty host"),
        ({**ok, "url": "http://h:99999/"}, "http/request url is invalid: invalid port number"),
        ({**ok, "url": "ftp://x/"}, "http/request only supports http and https URLs, got ftp"),
        ({**ok, "url": "mailto:x"}, "http/request only supports http and https URLs, got mailto"),
        ({**ok, "url": "http://[::1/"}, "http/request url is invalid: invalid IPv6 address"),
        ({**ok, "url": "http://1.2.3.999/"}, "http/request url is invalid: invalid IPv4 address"),
        (
            {**ok, "url": "http://999999999999/"},
            "http/request url is invalid: invalid IPv4 address",
        ),
        ({**ok, "url": "http://0x1g.1/"}, "http/request url is invalid: invalid IPv4 address"),
        (
            {**ok, "url": "http://a%20b/"},
            "http/request url is invalid: invalid international domain name",
        ),
        (
            {**ok, "url": "http://xn--/"},
            "http/request url is invalid: invalid international domain name",
        ),
        ({**ok, "url": "http://h:-1/"}, "http/request url is invalid: invalid port number"),
        ({**ok, "url": "http://u@/"}, "http/request url is invalid: empty host"),
        (
            {**ok, "url": "file:///etc/passwd"},
            "http/request only supports http and https URLs, got file",
        ),
        (
            {**ok, "headers": [{"name": "bad name", "value": "v"}]},
            "http/request header name is invalid: invalid HTTP header name",
        ),
        (
            {**ok, "headers": [{"name": "X", "value": "a\nb"}]},
            "http/request header value is invalid for X: failed to parse header value",
        ),
        ({"method": "GET", "url": base, "streamResponse": True}, "missing field `requestId`"),
        ({"url": base, "requestId": "x"}, "missing field `method`"),
        (
            {**ok, "redirectPolicy": "none"},
            "unknown variant `none`, expected `follow` or `stop`",
        ),
        (
            {**ok, "redirectPolicy": {"limited": None}},
            "unknown variant `limited`, expected `follow` or `stop`",
        ),
        (
            {**ok, "headers": [{"name": "Authorization", "value": "", "valueEnvVar": "NOPE"}]},
            "http/request header Authorization requires executor environment variable NOPE",
        ),
        (
            {**ok, "headers": [{"name": "A", "value": "", "valueEnvVar": "EMPTY_VAR"}]},
            "http/request header A requires a non-empty executor environment variable EMPTY_VAR",
        ),
        (
            {**ok, "headers": [{"name": "A", "value": "", "valueEnvVar": "openai_api_key"}]},
            "http/request header A cannot use executor environment variable openai_api_key",
        ),
    ]


@pytest_twisted.ensureDeferred
async def test_a_header_takes_its_value_from_the_server_environment() -> None:
    async with web() as (_, base), serving() as server:
        header = {"name": "Authorization", "value": "Bearer ", "valueEnvVar": "MCP_TOKEN"}
        params = {"method": "GET", "url": base + "/echo", "requestId": "e", "headers": [header]}
        got = await server.call("http/request", params)
        assert json.loads(unb64(got["bodyBase64"]))["authorization"] == ["Bearer tok"]
        # Response headers carry no valueEnvVar.
        assert all(set(h) == {"name", "value"} for h in got["headers"])


@pytest_twisted.ensureDeferred
async def test_redirects_are_followed_unless_told_to_stop() -> None:
    async with web() as (_, base), serving() as server:
        params = {"method": "GET", "url": base + "/redir", "requestId": "r"}
        followed = await server.call("http/request", params)
        assert followed["status"] == 200
        assert json.loads(unb64(followed["bodyBase64"]))["method"] == "GET"
        stopped = await server.call("http/request", {**params, "redirectPolicy": "stop"})
        assert stopped["status"] == 302
        assert {"name": "location", "value": "/echo"} in stopped["headers"]


@pytest_twisted.ensureDeferred
async def test_a_followed_redirect_closes_its_connection() -> None:
    # The redirect's body is not read: its connection is closed, not left
    # open (buffering what comes) after the request ends.
    async with web() as (site, base), serving() as server:
        params = {"method": "GET", "url": base + "/redir-endless", "requestId": "r"}
        followed = await server.call("http/request", params)
        assert followed["status"] == 200
        assert json.loads(unb64(followed["bodyBase64"]))["method"] == "GET"
        await with_timeout(site.gone[0], TIMEOUT, "the redirect's connection to close")


@pytest_twisted.ensureDeferred
async def test_a_buffered_body_over_the_cap_is_refused() -> None:
    async with web() as (_, base), serving() as server:
        reply = await server.request(
            "http/request", {"method": "GET", "url": base + "/big", "requestId": "b"}
        )
        assert reply["error"] == {
            "code": -32603,
            "message": "failed to read http/request response body: the body exceeds "
            f"{MAX_BUFFERED_BODY_BYTES} bytes, the limit of a buffered body "
            "(stream larger ones with streamResponse)",
        }


@pytest_twisted.ensureDeferred
async def test_a_floor_without_network_refuses_every_request() -> None:
    # --floor-no-network keeps every process off the network, whatever the
    # client asks: the server must not reach it for the client either.
    async with web() as (site, base):
        server = ServerProcess.start("--sandbox-floor", "read-only", "--floor-no-network")
        try:
            await server.call("initialize", codex_session.CODEX_INIT)
            server.notify("initialized", {})
            for params in (
                {"method": "GET", "url": base + "/hang", "requestId": "f"},
                {"method": "GET", "url": base + "/sse", "requestId": "g", "streamResponse": True},
            ):
                reply = await server.request("http/request", params)
                assert reply["error"] == {"code": -32602, "message": FLOOR_REFUSAL}
            assert site.hanging == [] and site.sse == []
            # A floor that allows the network leaves the method alone.
        finally:
            await server.stop()
        server = ServerProcess.start("--sandbox-floor", "read-only")
        try:
            await server.call("initialize", codex_session.CODEX_INIT)
            server.notify("initialized", {})
            got = await server.call(
                "http/request", {"method": "GET", "url": base + "/echo", "requestId": "e"}
            )
            assert got["status"] == 200
        finally:
            await server.stop()


@pytest_twisted.ensureDeferred
async def test_an_https_host_tls_refuses_is_answered_and_holds_nothing() -> None:
    # An empty or over-long label passes the URL parser but not IDNA, which the
    # TLS client applies before it connects: a precise answer, no slot kept.
    async with web() as (_, base), serving() as server:
        for n in range(MAX_IN_FLIGHT + 1):
            for host, cause in (("a..b", "Empty Label"), ("a" * 64 + ".com", "Label too long")):
                params = {
                    "method": "GET",
                    "url": f"https://{host}/",
                    "requestId": f"t{n}",
                    "timeoutMs": 60_000,
                }
                reply = await server.request("http/request", params)
                assert reply["error"] == {
                    "code": -32603,
                    "message": "http/request failed: error sending request for url "
                    f"(https://{host}/): {cause}",
                }
        echo = {"method": "GET", "url": base + "/echo", "requestId": "e"}
        assert (await server.call("http/request", echo))["status"] == 200


@pytest_twisted.ensureDeferred
async def test_requests_in_flight_are_capped_per_connection() -> None:
    async with web() as (site, base), serving() as server:
        params = {"method": "GET", "url": base + "/hang", "requestId": "h"}
        pending = [
            ensureDeferred(server.request("http/request", params)) for _ in range(MAX_IN_FLIGHT)
        ]
        await until(lambda: len(site.hanging) == MAX_IN_FLIGHT, "32 requests", timeout=TIMEOUT)
        reply = await server.request("http/request", params)
        assert reply["error"] == {
            "code": -32600,
            "message": f"too many http/request calls in flight on this connection: "
            f"{MAX_IN_FLIGHT}, the limit is {MAX_IN_FLIGHT}",
        }
        for request in site.hanging:
            request.setResponseCode(204)
            request.finish()
        for answer in pending:
            assert (await answer)["result"]["status"] == 204


@pytest_twisted.ensureDeferred
async def test_a_closed_connection_cancels_its_stream() -> None:
    async with web() as (site, base):
        server = await WsServerProcess.start()
        try:
            client = await connect(server.url)
            await client.handshake()
            params = {
                "method": "GET",
                "url": base + "/sse",
                "requestId": "s",
                "streamResponse": True,
            }
            await client.call("http/request", params)
            await client.wait_notification("http/request/bodyDelta", timeout=TIMEOUT)
            client.abort()
            await with_timeout(site.gone[0], TIMEOUT, "the HTTP server to see the disconnect")
        finally:
            await server.stop()


@pytest_twisted.ensureDeferred
async def test_the_same_answers_as_the_reference(tmp_path: Path) -> None:
    codex = fetch()
    (tmp_path / "codex-home").mkdir()
    (tmp_path / "tmp").mkdir()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),
        "CODEX_HOME": str(tmp_path / "codex-home"),
        "TMPDIR": str(tmp_path / "tmp"),
        **HEADER_ENV,
    }
    async with web() as (_, base):
        cases = [params for params, _ in _INVALID(base)]
        header = {"name": "Authorization", "value": "Bearer ", "valueEnvVar": "MCP_TOKEN"}
        cases += [
            {"method": "POST", "url": base + "/echo", "requestId": "p", "bodyBase64": b64(b"x")},
            {"method": "GET", "url": base + "/echo", "requestId": "e", "headers": [header]},
            {
                "method": "POST",
                "url": base + "/echo",
                "requestId": "l",
                "headers": [{"name": "Content-Length", "value": "2"}],
                "bodyBase64": b64(b"hi"),
            },
            {"method": "GET", "url": base + "/redir", "requestId": "r", "redirectPolicy": "stop"},
            {
                "method": "GET",
                "url": base + "/redir",
                "requestId": "r",
                "redirectPolicy": {"stop": None},
            },
            {"method": "GET", "url": base + "/redir", "requestId": "r", "redirectPolicy": "follow"},
        ]
        # Credentials in the URL: sent as Basic authorization, unless a header names one.
        with_user = base.replace("://", "://us%20er:p%3Ass@") + "/echo"
        cases += [
            {"method": "GET", "url": with_user, "requestId": "u"},
            {"method": "GET", "url": base.replace("://", "://user@") + "/echo", "requestId": "u"},
            {"method": "GET", "url": with_user, "requestId": "u", "headers": [header]},
        ]
        argv = [str(codex), "exec-server", "--listen", "stdio"]
        reference = ServerProcess().launch(argv, env=env, description="codex exec-server (stdio)")
        reference.allow_stderr(".")
        try:
            await reference.call("initialize", codex_session.CODEX_INIT)
            reference.notify("initialized", {})
            expected = [await reference.request("http/request", c) for c in cases]
        finally:
            await reference.stop()
        async with serving() as server:
            answers = [await server.request("http/request", c) for c in cases]
    for want, got in zip(expected, answers, strict=True):
        if "result" in want:
            drop = {"date", "server"}
            for reply in (want, got):
                # (the same headers; content-length is last in ours)
                reply["result"]["headers"] = sorted(
                    (h for h in reply["result"]["headers"] if h["name"] not in drop),
                    key=lambda h: (h["name"], h["value"]),
                )
        assert got == want


# --- flow control, driven by hand ------------------------------------------------------


class _FakeTransport:
    def __init__(self) -> None:
        self.paused = False
        self.stopped = False

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False

    def stopProducing(self) -> None:
        self.stopped = True


def _streamed_body(session_paused: bool) -> tuple[Any, Any, list[Any], _FakeTransport]:
    from execserver import protocol as p
    from execserver.http_request import HttpRequests, _Exchange, _StreamedBody

    sent: list[Any] = []
    session = type("S", (), {"flow_listeners": [], "paused": session_paused})()
    conn = type("C", (), {"session": session, "send": staticmethod(sent.append)})()
    params = p.HttpRequestParams("GET", "http://127.0.0.1/", "f", stream_response=True)
    exchange = _Exchange(HttpRequests(reactor), conn, params, None)  # type: ignore[arg-type]
    body = _StreamedBody(exchange)
    transport = _FakeTransport()
    body.makeConnection(transport)
    return body, session, sent, transport


def test_a_streamed_body_pauses_and_resumes_with_the_connection() -> None:
    from twisted.python.failure import Failure
    from twisted.web.client import ResponseDone

    body, session, sent, transport = _streamed_body(session_paused=False)
    assert session.flow_listeners == [body] and not transport.paused
    for listener in session.flow_listeners:  # the transport's buffer is over its mark
        listener.pauseProducing()
    assert transport.paused
    for listener in session.flow_listeners:  # ... and has drained
        listener.resumeProducing()
    assert not transport.paused
    body.dataReceived(b"x" * (64 * 1024 + 1))  # split into notifications of 64 KiB at most
    body.connectionLost(Failure(ResponseDone()))
    assert [len(m.params.delta_base64) for m in sent] == [64 * 1024, 1, 0]
    assert [m.params.seq for m in sent] == [1, 2, 3] and sent[-1].params.done
    assert session.flow_listeners == []  # it let go at its end


def test_a_stream_starting_on_a_paused_connection_starts_paused() -> None:
    _, _, _, transport = _streamed_body(session_paused=True)
    assert transport.paused


def test_buffered_bodies_are_capped_on_the_whole_server() -> None:
    """Beyond the per-body 8 MiB: the bodies being buffered on the server hold at
    most 256 MiB together (32 x 8 MiB), whatever the number of connections."""
    from twisted.python.failure import Failure
    from twisted.web.client import ResponseDone

    from execserver import protocol as p
    from execserver.errors import RpcError
    from execserver.http_request import (
        MAX_BUFFERED_TOTAL_BYTES,
        HttpRequests,
        _BufferedBody,
        _Exchange,
    )

    assert MAX_BUFFERED_TOTAL_BYTES == 32 * MAX_BUFFERED_BODY_BYTES
    requests = HttpRequests(reactor, max_buffered_total=10)
    params = p.HttpRequestParams("GET", "http://127.0.0.1/", "b")
    bodies, replies, transports = [], [], []
    for _ in range(3):
        exchange = _Exchange(requests, object(), params, None)  # type: ignore[arg-type]
        result = p.HttpRequestResponse(200, [], b"")
        body = _BufferedBody(exchange, result)
        transport = _FakeTransport()
        body.makeConnection(transport)
        got: list[Any] = []
        exchange.reply.addBoth(got.append)
        bodies.append(body)
        replies.append(got)
        transports.append(transport)
    bodies[0].dataReceived(b"x" * 6)
    bodies[1].dataReceived(b"y" * 4)
    assert requests.buffered == 10
    bodies[2].dataReceived(b"z")  # one byte past the server's cap: refused, its HTTP closed
    assert transports[2].stopped and not transports[0].stopped and requests.buffered == 10
    bodies[2].connectionLost(Failure(ResponseDone()))
    [refused] = replies[2]
    assert isinstance(refused.value, RpcError)
    assert (refused.value.code, refused.value.message) == (
        -32603,
        "failed to read http/request response body: the buffered bodies being read on "
        "this server would hold 11 bytes, the limit is 10 (stream the body with "
        "streamResponse, or retry later)",
    )
    bodies[0].connectionLost(Failure(ResponseDone()))
    [charged] = replies[0]  # its bytes are held until its reply has been sent
    assert json.loads(b"".join(charged.result.parts))["bodyBase64"] == b64(b"x" * 6)
    assert requests.buffered == 10
    charged.charge.release()  # (the transport sent it): room made
    assert requests.buffered == 4
    bodies[1].connectionLost(Failure(RuntimeError("cut")))  # so does a failure
    assert isinstance(replies[1][0].value, RpcError) and requests.buffered == 0


def test_a_buffered_reply_holds_its_place_until_sent() -> None:
    """A client that sends requests and reads nothing holds 32 replies at most:
    a buffered request stays in flight until the transport has sent its reply."""
    from twisted.python.failure import Failure
    from twisted.web.client import ResponseDone

    from execserver import protocol as p
    from execserver.errors import RpcError
    from execserver.http_request import HttpRequests, _BufferedBody, _Exchange

    requests = HttpRequests(reactor)
    conn = object()
    params = p.HttpRequestParams("GET", "http://127.0.0.1/", "b")
    exchange = _Exchange(requests, conn, params, None)  # type: ignore[arg-type]
    requests.in_flight[conn] = {exchange}
    body = _BufferedBody(exchange, p.HttpRequestResponse(200, [], b""))
    body.makeConnection(_FakeTransport())
    got: list[Any] = []
    exchange.reply.addBoth(got.append)
    body.dataReceived(b"x" * 10)
    body.connectionLost(Failure(ResponseDone()))
    [charged] = got
    assert requests.in_flight == {conn: {exchange}} and requests.buffered == 10
    requests.connection_shutting_down(conn)  # answered: nothing is cancelled
    assert exchange.cancelled is None
    charged.charge.release()
    charged.charge.release()  # (once)
    assert requests.in_flight == {} and requests.buffered == 0
    assert not isinstance(charged, RpcError)


@pytest_twisted.ensureDeferred
async def test_server_shutdown_answers_and_closes_requests_in_flight() -> None:
    # Without a timeout a request could wait forever: SIGTERM must not.
    async with web() as (site, base):
        server = await WsServerProcess.start()
        try:
            client = await connect(server.url)
            await client.handshake()
            params = {"method": "GET", "url": base + "/hang", "requestId": "h"}
            pending = ensureDeferred(client.request("http/request", params))
            await until(lambda: site.hanging, "the request to arrive", timeout=TIMEOUT)
            assert server.transport is not None
            server.transport.signalProcess("TERM")
            reply = await with_timeout(pending, TIMEOUT, "the reply at shutdown")
            assert reply["error"] == {
                "code": -32603,
                "message": f"http/request failed: error sending request for url ({base}/hang): "
                "the server is shutting down",
            }
            await with_timeout(site.gone[0], TIMEOUT, "the HTTP server to see the disconnect")
            await with_timeout(server.exited(), TIMEOUT, "the server to exit")
        finally:
            await server.stop()


class _Unsized(Protocol):
    """Answers any request with a body that has no length (it ends at the close), cut short."""

    def __init__(self, seen: list[_Unsized]) -> None:
        self.seen = seen
        self.gone: Deferred[None] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        if self not in self.seen:
            self.seen.append(self)
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\npartial")

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.gone.callback(None)


@pytest_twisted.ensureDeferred
async def test_shutdown_while_an_unsized_body_is_read_is_an_error_not_a_short_body() -> None:
    # A body without a length ends when its connection closes: the close the
    # shutdown makes must not read as its end (a truncated body answered as whole).
    seen: list[_Unsized] = []
    port = reactor.listenTCP(0, Factory.forProtocol(lambda: _Unsized(seen)), interface="127.0.0.1")
    url = f"http://127.0.0.1:{port.getHost().port}/unsized"
    server = await WsServerProcess.start()
    try:
        client = await connect(server.url)
        await client.handshake()
        params = {"method": "GET", "url": url, "requestId": "u"}
        pending = ensureDeferred(client.request("http/request", params))
        await until(lambda: seen, "the request to arrive", timeout=TIMEOUT)
        assert server.transport is not None
        server.transport.signalProcess("TERM")
        reply = await with_timeout(pending, TIMEOUT, "the reply at shutdown")
        assert reply.get("error") == {
            "code": -32603,
            "message": "failed to read http/request response body: error decoding response "
            "body: the server is shutting down",
        }
        await with_timeout(seen[0].gone, TIMEOUT, "the HTTP server to see the disconnect")
        await with_timeout(server.exited(), TIMEOUT, "the server to exit")
    finally:
        await server.stop()
        await port.stopListening()


#: Body bytes a stalled client may leave in flight: the connection's 2 MiB
#: outbound mark (as base64) plus the kernel's socket buffers on both sides
#: of both connections (a few MiB each on loopback), with a margin.
FLOW_BOUND = 32 * 1024 * 1024


@pytest_twisted.ensureDeferred
async def test_a_stalled_client_holds_the_http_server_back() -> None:
    async with web() as (site, base):
        server = await WsServerProcess.start()
        try:
            client = await connect(server.url)
            await client.handshake()
            params = {
                "method": "GET",
                "url": base + "/flood",
                "requestId": "f",
                "streamResponse": True,
            }
            await client.call("http/request", params)
            assert client.transport is not None
            client.transport.pauseProducing()  # type: ignore[attr-defined]
            flood = site.flood
            assert flood is not None
            seen: list[int] = []

            def settled() -> bool:
                # Paused, and nothing more written over five polls.
                seen.append(flood.written)
                return flood.done or (flood.paused and len(set(seen[-5:])) == 1 < len(seen) - 4)

            await until(settled, "the HTTP server to be held back", timeout=TIMEOUT)
            held = flood.written
            assert not flood.done, "the whole body was read while the client read nothing"
            assert held <= FLOW_BOUND, held
            client.transport.resumeProducing()  # type: ignore[attr-defined]
            deltas = await _done(client, "f")
            body = b"".join(unb64(d["deltaBase64"]) for d in deltas)
            assert deltas[-1]["error"] is None and len(body) == FLOOD_BYTES
            offsets = [
                int.from_bytes(body[at : at + 8], "big") for at in range(0, len(body), FLOOD_CHUNK)
            ]
            assert offsets == list(range(0, FLOOD_BYTES, FLOOD_CHUNK))
        finally:
            await server.stop()


@pytest_twisted.ensureDeferred
async def test_https_is_verified_against_the_trusted_roots(tmp_path: Path) -> None:
    from twisted.internet import ssl

    from tests.support.tls import Pki

    pki = Pki(tmp_path)
    pem = Path(pki.server_cert).read_text() + Path(pki.server_key).read_text()
    certificate = ssl.PrivateCertificate.loadPEM(pem)
    root = _Web()
    port = reactor.listenSSL(0, Site(root), certificate.options(), interface="127.0.0.1")
    url = f"https://127.0.0.1:{port.getHost().port}/echo"
    params = {"method": "GET", "url": url, "requestId": "s"}
    try:
        # The server trusts the test CA (OpenSSL's SSL_CERT_FILE): verified.
        trusted = {**HEADER_ENV, "SSL_CERT_FILE": pki.ca_file}
        async with codex_session.serving(codex_session.CODEX_INIT, trusted) as server:
            assert (await server.call("http/request", params))["status"] == 200
        # Another CA: the certificate is refused, the request fails.
        other = {**HEADER_ENV, "SSL_CERT_FILE": pki.other_ca_file}
        async with codex_session.serving(codex_session.CODEX_INIT, other) as server:
            reply = await server.request("http/request", params)
            assert reply["error"]["code"] == -32603
            assert reply["error"]["message"].startswith(
                f"http/request failed: error sending request for url ({url}): "
            )
    finally:
        await port.stopListening()


@given(st.integers(min_value=0, max_value=2**32 - 1))
def test_ipv4_hosts_read_as_the_whatwg_parser_reads_them(value: int) -> None:
    from execserver.http_request import parse_url

    dotted = str(ipaddress.IPv4Address(value))
    a, b, c, d = (int(part) for part in dotted.split("."))
    for host in (
        dotted,
        str(value),
        hex(value),
        f"{a}.{b}.{c * 256 + d}",
        f"0x{a:x}.{b}.{c}.0{d:o}",
    ):
        assert parse_url(f"http://{host}/x").url == f"http://{dotted}/x", host


@pytest_twisted.ensureDeferred
async def test_the_timeout_covers_a_streamed_body() -> None:
    async with web() as (site, base), serving() as server:
        params = {
            "method": "GET",
            "url": base + "/sse",
            "requestId": "t",
            "streamResponse": True,
            "timeoutMs": 500,
        }
        assert (await server.call("http/request", params))["status"] == 200
        deltas = await _done(server, "t")
        assert unb64(deltas[0]["deltaBase64"]) == b"data: 0\n\n"
        assert deltas[-1]["error"] == "error decoding response body: operation timed out"
        await with_timeout(site.gone[0], TIMEOUT, "the HTTP server to see the disconnect")
