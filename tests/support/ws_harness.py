"""WebSocket test helpers: the real server on ``ws://127.0.0.1:0`` and a small client.

:class:`WsServerProcess` runs the installed ``exec-server --listen
ws://127.0.0.1:0`` (or ``twistd -n exec-server``) and reads the ``exec-server
listening on ws://IP:PORT`` lines from its stderr; at teardown its stderr and
exit status are checked like every harness server's (``tests/support/server_checks.py``).
:class:`WsClient` is a test-only JSON-RPC client on Autobahn's Twisted
WebSocket client (``onMessage`` stays synchronous; size limits set).
Every wait has a timeout; ``stop`` always leaves no process behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from typing import Any

from autobahn.twisted.websocket import WebSocketClientFactory, WebSocketClientProtocol
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, wrapClientTLS
from twisted.internet.protocol import Factory, ProcessProtocol, Protocol, connectionDone
from twisted.python.failure import Failure

from execserver.tls import ClientTls
from tests.support.harness import (
    BIN as BIN_DIR,
)
from tests.support.harness import (
    DEFAULT_TIMEOUT,
    REPO_ROOT,
    RpcTestClient,
    console_script,
    observe,
    reactor,
    server_env,
    with_timeout,
)
from tests.support.server_process import ServerProcessBase

BANNER = re.compile(rb"exec-server listening on ((?:ws|wss|unix)://\S+)")


def tcp_address(url: str) -> tuple[str, int]:
    """(host, port) of a ``ws://`` or ``wss://`` URL (an IPv6 host without its brackets)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("ws", "wss"):
        raise ValueError(f"not a ws:// or wss:// URL: {url}")
    host, port = rest.split("/", 1)[0].rsplit(":", 1)
    return host.strip("[]"), int(port)


class WsServerProcess(ServerProcessBase):
    """The real server listening on WebSocket addresses."""

    def __init__(self, expected_urls: int) -> None:
        super().__init__()
        self.urls: list[str] = []
        self._expected = expected_urls
        self.listening: Deferred[list[str]] = Deferred()
        #: What the server wrote to stdout: ``twistd -n`` logs there.
        self.stdout = b""

    @classmethod
    async def start(
        cls,
        *args: str,
        listeners: int = 1,
        timeout: float = DEFAULT_TIMEOUT,
        twistd: bool = False,
        env: dict[str, str] | None = None,
    ) -> WsServerProcess:
        """Start ``exec-server`` (or ``twistd -n exec-server``) with ``args``."""
        if not any(a.startswith("--listen") for a in args):
            args = ("--listen", "ws://127.0.0.1:0", *args)
        if twistd:
            argv = [console_script("twistd"), "-n", "--pidfile=", "exec-server", *args]
        else:
            argv = [console_script("exec-server"), *args]
        proto = cls(listeners).launch(argv, env=server_env(env))
        try:
            await with_timeout(observe(proto.listening), timeout, "the listening banner")
        except BaseException:
            await proto.stop()
            raise
        return proto

    @property
    def url(self) -> str:
        return self.urls[0]

    @property
    def host_port(self) -> tuple[str, int]:
        """The address of its first TCP listener (``ws://`` or ``wss://``)."""
        for url in self.urls:
            if url.startswith(("ws://", "wss://")):
                return tcp_address(url)
        raise AssertionError(f"the server has no ws:// or wss:// listener: {self.urls}")

    def outReceived(self, data: bytes) -> None:
        self.stdout += data

    def stderr_bytes(self) -> bytes:
        # The teardown checks read the log wherever it goes (twistd -n: stdout).
        return self.stderr + self.stdout

    def errReceived(self, data: bytes) -> None:
        super().errReceived(data)
        if not self.listening.called:
            self.urls = [m.decode() for m in BANNER.findall(self.stderr)]
            if len(self.urls) >= self._expected:
                self.listening.callback(self.urls)

    def _process_ended(self) -> None:
        if not self.listening.called:
            self.listening.errback(
                RuntimeError(f"server exited before listening: {self.stderr.decode()}")
            )

    def _request_stop(self) -> None:
        """SIGTERM: the server closes its listeners and sessions, then exits 0."""
        self._signal("TERM")


# (mypy flags Autobahn's own base classes as mutually inconsistent once a
# second base is added.)
class WsClientProtocol(RpcTestClient, WebSocketClientProtocol):  # type: ignore[misc]
    """Collects messages; correlates responses by id."""

    #: Count bytes only (for floods): skip JSON decoding of process/output.
    count_only = False
    client_name = "ws-test"

    def __init__(self) -> None:
        super().__init__()
        self.opened: Deferred[None] = Deferred()
        self.closed: Deferred[tuple[bool, int | None, str | None]] = Deferred()
        self._init_rpc()
        self.bytes_received = 0
        self.binary_frames = 0

    def onOpen(self) -> None:
        self.opened.callback(None)

    def onClose(self, wasClean: bool, code: int | None, reason: str | None) -> None:
        self._fail_pending(f"connection closed: {code} {reason}")
        if not self.opened.called:
            self.opened.errback(ConnectionError(f"handshake failed: {reason}"))
        if not self.closed.called:
            self.closed.callback((wasClean, code, reason))

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        self.bytes_received += len(payload)
        if isBinary:
            self.binary_frames += 1
        if self.count_only and payload.startswith(b'{"method":"process/output"'):
            return
        self._received(json.loads(payload))

    # --- requests -------------------------------------------------------------------

    def send(self, message: dict[str, Any], binary: bool = False) -> None:
        self.sendMessage(json.dumps(message).encode(), isBinary=binary)

    send_json = send

    async def wait_output_contains(
        self, process_id: str, needle: bytes, timeout: float = DEFAULT_TIMEOUT
    ) -> bytes:
        def match(_: dict[str, Any]) -> bool:
            return needle in self.output_of(process_id)

        await self.wait_for(match, timeout, f"{needle!r} from {process_id}")
        return self.output_of(process_id)

    # --- closing --------------------------------------------------------------------

    async def close(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        if not self.closed.called:
            self.sendClose(1000)
            await with_timeout(observe(self.closed), timeout, "the close handshake")

    def abort(self) -> None:
        """Drop TCP without a close frame (as if the client died)."""
        self.transport.abortConnection()  # type: ignore[union-attr]


async def connect(
    url: str,
    timeout: float = DEFAULT_TIMEOUT,
    protocol: type[WsClientProtocol] = WsClientProtocol,
    headers: dict[str, str] | None = None,
    max_message_bytes: int = 256 * 1024 * 1024,
    **options: Any,
) -> WsClientProtocol:
    """Open a WebSocket to ``url`` and wait for the handshake to finish."""
    factory = WebSocketClientFactory(url, headers=headers, reactor=reactor)
    factory.protocol = protocol
    factory.noisy = False
    factory.setProtocolOptions(
        maxFramePayloadSize=max_message_bytes,
        maxMessagePayloadSize=max_message_bytes,
        openHandshakeTimeout=timeout,
        **options,
    )
    host, port = tcp_address(url)
    endpoint = TCP4ClientEndpoint(reactor, host, port, timeout=timeout)
    proto: WsClientProtocol = await with_timeout(
        endpoint.connect(factory), timeout, f"TCP connect to {url}"
    )
    await with_timeout(observe(proto.opened), timeout, f"WebSocket handshake with {url}")
    return proto


class RawHttp(Protocol):
    """One TCP connection written by hand: its bytes, its end."""

    def __init__(self) -> None:
        self.data = b""
        self.lost: Deferred[bytes] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        self.data += data

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.lost.callback(self.data)

    @classmethod
    async def open(cls, host: str, port: int, ca_file: str | None = None) -> RawHttp:
        """Connect (with ``ca_file``: TLS, the server checked against that CA)."""
        endpoint: Any = TCP4ClientEndpoint(reactor, host, port, timeout=5)
        if ca_file is not None:
            endpoint = wrapClientTLS(ClientTls(ca_file).options(host), endpoint)
        return await cls.open_on(endpoint)

    @classmethod
    async def open_on(
        cls, endpoint: Any, timeout: float = 5, what: str = "HTTP connect"
    ) -> RawHttp:
        proto: RawHttp = await with_timeout(
            endpoint.connect(Factory.forProtocol(cls)), timeout, what
        )
        return proto

    def write(self, data: bytes) -> None:
        self.transport.write(data)  # type: ignore[union-attr]

    async def answer(self, timeout: float, what: str = "the server's close") -> bytes:
        """Everything the server sent until it closed the connection."""
        try:
            data: bytes = await with_timeout(observe(self.lost), timeout, what)
            return data
        finally:
            if not self.lost.called:
                self.transport.abortConnection()  # type: ignore[union-attr]


async def http_get(
    host: str, port: int, request: bytes, timeout: float = DEFAULT_TIMEOUT
) -> tuple[int, dict[str, str], bytes]:
    """Send one raw HTTP request; return status, headers and body (read to EOF)."""
    proto = await RawHttp.open_on(TCP4ClientEndpoint(reactor, host, port, timeout=timeout), timeout)
    proto.write(request)
    raw = await proto.answer(timeout, "the HTTP response")
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, body


def get_request(path: str, extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}\r\n".encode()


# --- another client's output, timed in processes of its own ---------------------------------

#: A remote child printing a line every 2 ms until the file named by argv[1] exists.
TICKER = (
    "import os, sys, time\n"
    "while not os.path.exists(sys.argv[1]):\n"
    "    print(time.monotonic(), flush=True)\n"
    "    time.sleep(0.002)\n"
)

#: Reads stdin, prints "flowing" once output arrives steadily, then at EOF one
#: JSON line: every pause between two reads longer than 20 ms, as (start, end)
#: in CLOCK_MONOTONIC seconds (the same clock in every process).
GAP_METER = (
    "import json, os, sys, time\n"
    "last = None; reads = 0; gaps = []\n"
    "while True:\n"
    "    data = os.read(0, 1 << 16)\n"
    "    now = time.monotonic()\n"
    "    if not data:\n"
    "        break\n"
    "    if last is not None and now - last > 0.02:\n"
    "        gaps.append((last, now))\n"
    "    last = now; reads += 1\n"
    "    if reads == 20:\n"
    "        print('flowing', flush=True)\n"
    "print(json.dumps({'gaps': gaps, 'last': last, 'reads': reads}), flush=True)\n"
)


class OutputGapObserver(ProcessProtocol):
    """Another client, timed apart from the test process.

    ``exec-server-client run`` (the installed script) runs :data:`TICKER` on
    the server; its output is piped into :data:`GAP_METER`. Both run in their
    own processes, so a busy test reactor (say, receiving a 266 MiB response)
    cannot show up as a pause of the server.
    """

    def __init__(self, stop_file: str) -> None:
        self.stop_file = stop_file
        self.pid: int | None = None
        self.err = b""
        self.out = b""
        self.flowing: Deferred[None] = Deferred()
        self.ended: Deferred[Any] = Deferred()

    @classmethod
    async def start(
        cls, url: str, stop_file: str, timeout: float = DEFAULT_TIMEOUT
    ) -> OutputGapObserver:
        proto = cls(stop_file)
        pipeline = 'exec-server-client run --url "$1" -- python3 -u -c "$2" "$3" | python3 -c "$4"'
        # setsid: the pipeline is one process group, killed whole on failure.
        argv = ["setsid", "/bin/sh", "-c", pipeline, "sh", url, TICKER, stop_file, GAP_METER]
        env = server_env()
        env["PATH"] = f"{BIN_DIR}{os.pathsep}{env.get('PATH', '')}"
        transport = reactor.spawnProcess(
            proto, "/usr/bin/setsid", argv, env=env, path=str(REPO_ROOT)
        )
        proto.pid = transport.pid
        try:
            # (Awaited directly: an early end's error is consumed here.)
            await with_timeout(proto.flowing, timeout, "the other client's output to flow")
        except Exception as exc:
            await proto.kill()
            raise RuntimeError(f"{exc}; its stderr: {proto.err[-2000:]!r}") from exc
        return proto

    async def kill(self) -> None:
        """Kill the whole pipeline and wait for it."""
        if not self.ended.called and self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            await with_timeout(observe(self.ended), DEFAULT_TIMEOUT, "the observer to die")

    def errReceived(self, data: bytes) -> None:
        self.err += data

    def outReceived(self, data: bytes) -> None:
        self.out += data
        if b"flowing\n" in self.out and not self.flowing.called:
            self.flowing.callback(None)

    def processEnded(self, reason: Failure) -> None:
        if not self.flowing.called:
            self.flowing.errback(RuntimeError(f"observer ended early: {self.out!r}"))
        self.ended.callback(None)

    async def finish(self, timeout: float = 30.0) -> dict[str, Any]:
        """Stop the ticker; the meter's report."""
        with open(self.stop_file, "w"):
            pass
        try:
            await with_timeout(observe(self.ended), timeout, "the observer to finish")
        except TimeoutError:
            await self.kill()
            raise
        report: dict[str, Any] = json.loads(self.out.splitlines()[-1])
        return report

    @staticmethod
    def longest_pause(report: dict[str, Any], start: float, end: float) -> float:
        """Longest pause overlapping [start, end]; the whole window if nothing arrived in it."""
        longest = 0.0
        for a, b in report["gaps"]:
            if b >= start and a <= end:
                longest = max(longest, b - a)
        if report["last"] is None or report["last"] < end:
            longest = max(longest, end - (report["last"] or start))
        return longest
