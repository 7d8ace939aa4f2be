"""The channels a client can speak over, and the three ways to connect.

- :class:`NdjsonProtocol`: newline-delimited JSON over any Twisted stream
  transport (a TCP or UNIX socket, ``StringTransport`` and ``iosim`` in tests).
- :class:`ServerProcessProtocol`: the same framing over the stdin/stdout of a
  server process this client launched (:func:`spawn_local`).
- :class:`WebSocketChannel`: one JSON-RPC message per text frame, Autobahn
  (:func:`connect_websocket`).
- :class:`InProcessChannel`: bytes handed straight to a dispatcher
  :class:`~execserver.dispatcher.Connection` (:func:`connect_in_process`).

Each one calls :meth:`RpcClient.attach` when it can send,
:meth:`RpcClient.message_received` per message, and
:meth:`RpcClient.connection_lost` exactly once when it ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, cast

from autobahn.twisted.websocket import WebSocketClientFactory, WebSocketClientProtocol
from autobahn.websocket.util import parse_url
from twisted.internet import error as _error
from twisted.internet import main as _main
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import (
    HostnameEndpoint,
    TCP4ClientEndpoint,
    TCP6ClientEndpoint,
    UNIXClientEndpoint,
    wrapClientTLS,
)
from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import ProcessProtocol, Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure

from execserver.client.client import ConnectOptions, ExecServerClient
from execserver.client.errors import (
    AuthRefused,
    ConnectFailed,
    ConnectionClosed,
    ConnectTimeout,
    SpawnFailed,
)
from execserver.client.rpc import RpcClient
from execserver.codec import OVERSIZED, LineFramer
from execserver.tls import ClientTls, TlsConfigError, tls_error_text
from execserver.waiters import Latch

log = Logger()

#: Largest message the client accepts from a server.
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
_STDERR_TAIL_BYTES = 8192
#: ``unix:///PATH``: the WebSocket protocol over a Unix-domain socket.
UNIX_SCHEME = "unix://"
UNIX_WS_URL = "ws://localhost/"


def _describe(reason: Failure | None) -> str:
    if reason is None:
        return "connection closed"
    if reason.check(_error.ConnectionDone):
        return "connection closed by the server"
    return reason.getErrorMessage()


# --- NDJSON over a byte stream ------------------------------------------------------


class _LineInput:
    """NDJSON input side shared by the stream and process channels."""

    def __init__(self, rpc: RpcClient, max_message_bytes: int) -> None:
        self.rpc = rpc
        self._framer = LineFramer(max_message_bytes)
        self._max = max_message_bytes

    def feed(self, data: bytes) -> None:
        self._deliver(self._framer.feed(data))

    def finish(self) -> None:
        self._deliver(self._framer.finish())

    def _deliver(self, items: list[Any]) -> None:
        for item in items:
            if self.rpc.is_closed:
                return
            if item is OVERSIZED:
                self.rpc.protocol_error(f"message larger than {self._max} bytes")
            else:
                self.rpc.message_received(item)


class NdjsonProtocol(Protocol):
    """An RPC channel over any stream transport."""

    def __init__(self, rpc: RpcClient, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.rpc = rpc
        self._input = _LineInput(rpc, max_message_bytes)

    def connectionMade(self) -> None:
        self.rpc.attach(self)

    def dataReceived(self, data: bytes) -> None:
        self._input.feed(data)

    def connectionLost(self, reason: Failure | None = None) -> None:
        self._input.finish()
        self.rpc.connection_lost(_describe(reason))

    def send_message(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.writeSequence((data, b"\n"))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.loseConnection()


# --- a local server over stdio ------------------------------------------------------


class ServerProcessProtocol(ProcessProtocol):
    """The stdin/stdout of a spawned server as an RPC channel."""

    def __init__(
        self,
        rpc: RpcClient,
        stderr: Callable[[bytes], None] | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.rpc = rpc
        self._input = _LineInput(rpc, max_message_bytes)
        self._stderr = stderr
        self.stderr_tail = b""
        self.exit_code: int | None = None
        self.exit_signal: int | None = None
        self.ended = False
        self._ended: Latch[None] = Latch()
        self.pid: int | None = None

    def connectionMade(self) -> None:
        self.pid = getattr(self.transport, "pid", None)
        self.rpc.attach(self)

    def outReceived(self, data: bytes) -> None:
        self._input.feed(data)

    def errReceived(self, data: bytes) -> None:
        self.stderr_tail = (self.stderr_tail + data)[-_STDERR_TAIL_BYTES:]
        if self._stderr is not None:
            try:
                self._stderr(data)
            except Exception:
                log.failure("exec-server stderr callback failed")

    def outConnectionLost(self) -> None:
        self._input.finish()
        self.rpc.connection_lost("exec-server closed its stdout")

    def processEnded(self, reason: Failure) -> None:
        self.exit_code = getattr(reason.value, "exitCode", None)
        self.exit_signal = getattr(reason.value, "signal", None)
        self.ended = True
        self.rpc.connection_lost(f"exec-server exited ({self.describe_exit()})")
        self._ended.fire(None)

    def describe_exit(self) -> str:
        if self.exit_signal is not None:
            return f"killed by signal {self.exit_signal}"
        return f"exit code {self.exit_code}"

    def when_ended(self) -> Deferred[None]:
        return self._ended.wait()

    # MessageSink
    def send_message(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.writeSequence((data, b"\n"))

    def close(self) -> None:
        """Closing stdin asks the server to stop its processes and exit."""
        if self.transport is not None and not self.ended:
            self.transport.closeStdin()

    def kill(self) -> None:
        if self.transport is not None and not self.ended:
            with contextlib.suppress(_error.ProcessExitedAlready, OSError):
                self.transport.signalProcess("KILL")


_READ_SIZE = 1024 * 1024


def _read_larger_chunks(transport: Any) -> None:
    """Read the server's stdout up to 1 MiB per wakeup, not Twisted's 8 KiB.

    An output notification is up to ~350 KiB of JSON (a 256 KiB chunk in
    base64): 8 KiB reads cost dozens of reactor wakeups and a join per
    message. With a 1 MiB pipe and 1 MiB reads the end-to-end rate went from
    ~0.5x to ~0.9x the benchmarks' lean blocking client (bench_client.py).
    """
    reader = getattr(transport, "pipes", {}).get(1)
    if reader is None:
        return
    with contextlib.suppress(OSError):
        fcntl.fcntl(reader.fileno(), fcntl.F_SETPIPE_SZ, _READ_SIZE)
    fd = reader.fileno()

    def do_read() -> object:
        try:
            data = os.read(fd, _READ_SIZE)
        except BlockingIOError:
            return None
        except OSError:
            return _main.CONNECTION_LOST
        if not data:
            return _main.CONNECTION_DONE
        reader.dataReceived(data)
        return None

    reader.doRead = do_read


def default_server_command() -> list[str]:
    return [sys.executable, "-m", "execserver"]


# Starts the server as the leader of a new session: a Ctrl-C at the terminal
# signals the terminal's foreground process group, and the server must not
# take it as a request to shut down (and terminate everything) while the
# program that launched it decides what the Ctrl-C means. The server still
# ends when its stdin closes, so it never outlives this process.
_NEW_SESSION = (
    "import os, sys\n"
    "os.setsid()\n"
    "try:\n"
    "    os.execvp(sys.argv[1], sys.argv[1:])\n"
    "except OSError as e:\n"
    "    sys.stderr.write(f'cannot run {sys.argv[1]}: {e.strerror}\\n')\n"
    "    os._exit(127)\n"
)


def _in_new_session(argv: list[str]) -> list[str]:
    return [sys.executable, "-S", "-c", _NEW_SESSION, *argv]


def _shutdown_process(
    proto: ServerProcessProtocol, clock: IReactorTime, grace: float
) -> Deferred[None]:
    """Close stdin; SIGKILL if the server has not exited after ``grace`` seconds."""

    async def run() -> None:
        proto.close()
        if await _wait(proto.when_ended(), grace, clock):
            return
        log.warn(
            "exec-server (pid {pid}) did not exit in {grace}s: killing it",
            pid=proto.pid,
            grace=grace,
        )
        proto.kill()
        await _wait(proto.when_ended(), 5.0, clock)

    return Deferred.fromCoroutine(run())


async def _wait(d: Deferred[Any], seconds: float, clock: IReactorTime) -> bool:
    """True if ``d`` fired within ``seconds`` (it is cancelled otherwise)."""
    timed_out = False

    def on_timeout(result: object, timeout: float) -> None:
        nonlocal timed_out
        timed_out = True

    d.addTimeout(seconds, clock, onTimeoutCancel=on_timeout)
    await d
    return not timed_out


def spawn_local(
    reactor: Any,
    options: ConnectOptions | None = None,
    *,
    command: Sequence[str] | None = None,
    env: dict[str, str] | None = None,
    stderr: Callable[[bytes], None] | None = None,
    shutdown_grace: float = 5.0,
    new_session: bool = True,
) -> Deferred[ExecServerClient]:
    """Launch a server and connect to it over its stdin/stdout.

    The server's stderr goes to ``stderr`` (its last 8 KiB are quoted in
    errors). ``close()`` closes the server's stdin (it then terminates its
    processes and exits) and kills it after ``shutdown_grace`` seconds; the
    same happens when the client is garbage-collected. With ``new_session``
    (the default) the server leads a session of its own, so signals sent to
    this program's terminal (Ctrl-C) do not reach it.
    """
    argv = list(command) if command is not None else default_server_command()
    spawned = _in_new_session(argv) if new_session else argv
    rpc = RpcClient(label="exec-server stdio")
    proto = ServerProcessProtocol(rpc, stderr)
    try:
        transport = reactor.spawnProcess(
            proto,
            spawned[0],
            spawned,
            env=dict(os.environ) if env is None else env,
            childFDs={0: "w", 1: "r", 2: "r"},
        )
        _read_larger_chunks(transport)
    except OSError as exc:
        return Deferred.fromCoroutine(_raise(SpawnFailed(f"cannot launch {argv[0]}: {exc}")))

    def on_collect() -> None:
        proto.close()
        if getattr(reactor, "running", False):
            reactor.callLater(shutdown_grace, proto.kill)

    async def connect() -> ExecServerClient:
        try:
            client = await ExecServerClient.connect_rpc(
                rpc,
                reactor,
                options,
                closer=lambda: _shutdown_process(proto, reactor, shutdown_grace),
                on_collect=on_collect,
            )
            client.local_server = proto
            return client
        except ConnectionClosed as exc:
            await _wait(proto.when_ended(), shutdown_grace, reactor)
            tail = proto.stderr_tail.decode("utf-8", "replace").strip()
            detail = f" ({proto.describe_exit()})" if proto.ended else ""
            message = f"exec-server `{' '.join(argv)}` ended before the handshake{detail}"
            raise SpawnFailed(f"{message}: {tail}" if tail else message) from exc
        except BaseException:
            # Handshake refused or timed out: the server is not left behind.
            await _shutdown_process(proto, reactor, shutdown_grace)
            raise

    return Deferred.fromCoroutine(connect())


async def _raise(error: Exception) -> ExecServerClient:
    raise error


# --- WebSocket ----------------------------------------------------------------------

_UPGRADE_FAILED = re.compile(r"upgrade failed \[(\d+)\]: ?(.*)")


class WebSocketChannel(WebSocketClientProtocol):
    """One JSON-RPC message per WebSocket text frame."""

    rpc: RpcClient
    opened: Deferred[None]
    url: str

    def onConnect(self, response: Any) -> None:
        pass

    def onOpen(self) -> None:
        self.rpc.attach(self)
        if not self.opened.called:
            self.opened.callback(None)

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        self.rpc.message_received(payload)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        why = tls_error_text(reason.value)
        if why is not None:
            # Reported as this connection's failure (ConnectFailed), not
            # logged as an error by Autobahn.
            hint = (
                ": the server's certificate is not signed by a trusted CA "
                "(give the CA that signed it: --ca-file)"
                if "certificate verify failed" in why
                else ""
            )
            self.tls_failure = f"TLS handshake failed: {why}{hint}"
            reason = Failure(_error.ConnectionLost(self.tls_failure))
        super().connectionLost(reason)

    def onClose(self, wasClean: bool, code: int | None, reason: str | None) -> None:
        text = (
            getattr(self, "tls_failure", None)
            or self.wasNotCleanReason
            or reason
            or "connection closed"
        )
        if not self.opened.called:
            match = _UPGRADE_FAILED.search(text)
            error: ConnectFailed
            if "opening handshake timeout" in text:
                error = ConnectTimeout(self.url, self.factory.open_timeout)
            elif match and int(match.group(1)) in (401, 403):
                status = int(match.group(1))
                error = AuthRefused(
                    self.url, status, f"authentication refused (HTTP {status} {match.group(2)})"
                )
            else:
                error = ConnectFailed(self.url, text)
            self.opened.errback(error)
        self.rpc.connection_lost(text)

    # MessageSink
    def send_message(self, data: bytes) -> None:
        self.sendMessage(data, isBinary=False)

    def close(self) -> None:
        self.sendClose()


class ChannelFactory(WebSocketClientFactory):
    """Builds a :class:`WebSocketChannel` with a fresh RpcClient per connection."""

    protocol = WebSocketChannel

    def __init__(
        self,
        url: str,
        reactor: Any,
        token: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        open_timeout: float = 10.0,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else None
        # Over a Unix socket the WebSocket handshake still needs an http URL
        # (its Host is localhost); errors name the socket's URL.
        super().__init__(
            UNIX_WS_URL if url.startswith(UNIX_SCHEME) else url, headers=headers, reactor=reactor
        )
        self.display_url = url
        self.open_timeout = open_timeout
        self.setProtocolOptions(
            maxMessagePayloadSize=max_message_bytes,
            maxFramePayloadSize=max_message_bytes,
            # msgspec rejects invalid UTF-8 itself; Autobahn's check is slow.
            utf8validateIncoming=False,
            # A backstop: connect_websocket's own timer (same length, started
            # before the TCP connect) normally fires first.
            openHandshakeTimeout=open_timeout + 0.5,
            closeHandshakeTimeout=2,
        )

    def buildProtocol(self, addr: Any) -> WebSocketChannel:
        proto = cast(WebSocketChannel, super().buildProtocol(addr))
        proto.rpc = RpcClient(label=f"exec-server {self.display_url}")
        proto.opened = Deferred()
        proto.url = self.display_url
        self.last_built = proto
        return proto


def parse_ws_url(url: str) -> tuple[bool, str, int]:
    """(is_secure, host, port) of a ``ws://`` / ``wss://`` URL, or ConnectFailed."""
    try:
        secure, host, port, _resource, _path, _params = parse_url(url)
    except Exception as exc:
        raise ConnectFailed(url, f"invalid WebSocket URL: {exc}") from None
    return bool(secure), str(host), int(port)


def unix_socket_path(url: str) -> str:
    """The socket path of a ``unix:///PATH`` URL, or ConnectFailed."""
    path = url[len(UNIX_SCHEME) :]
    if not path.startswith("/") or "\0" in path:
        raise ConnectFailed(url, "invalid unix socket URL: expected unix:///ABSOLUTE/PATH")
    return path


def websocket_endpoint(reactor: Any, url: str, timeout: float, tls: ClientTls | None = None) -> Any:
    if url.startswith(UNIX_SCHEME):
        return UNIXClientEndpoint(reactor, unix_socket_path(url), timeout=timeout)
    secure, host, port = parse_ws_url(url)
    host = host.strip("[]")
    endpoint: Any
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        endpoint = HostnameEndpoint(reactor, host, port, timeout=timeout)
    else:
        # An IP literal needs no resolver (HostnameEndpoint would use a thread).
        tcp = TCP6ClientEndpoint if address.version == 6 else TCP4ClientEndpoint
        endpoint = tcp(reactor, host, port, timeout=timeout)
    if secure:
        try:
            options = (tls or ClientTls()).options(host)
        except TlsConfigError as exc:
            raise ConnectFailed(url, str(exc)) from None
        endpoint = wrapClientTLS(options, endpoint)
    return endpoint


def connect_websocket(
    reactor: Any,
    url: str,
    options: ConnectOptions | None = None,
    *,
    token: str | None = None,
    connect_timeout: float = 10.0,
    tls: ClientTls | None = None,
) -> Deferred[ExecServerClient]:
    """Connect (TCP + WebSocket upgrade within ``connect_timeout``) and initialize.

    ``tls`` (``wss://``): a CA file instead of the system's trust store,
    and a client certificate to present.
    """
    return Deferred.fromCoroutine(
        _connect_websocket(reactor, url, options, token, connect_timeout, tls)
    )


async def _connect_websocket(
    reactor: Any,
    url: str,
    options: ConnectOptions | None,
    token: str | None,
    connect_timeout: float,
    tls: ClientTls | None = None,
) -> ExecServerClient:
    endpoint = websocket_endpoint(reactor, url, connect_timeout, tls)
    factory = ChannelFactory(url, reactor, token, open_timeout=connect_timeout)
    proto = await open_channel(endpoint, factory, url, connect_timeout, reactor)

    def closer() -> Deferred[None]:
        return close_channel(proto, reactor)

    def on_collect() -> None:
        if proto.transport is not None:
            proto.transport.abortConnection()  # type: ignore[attr-defined]

    return await ExecServerClient.connect_rpc(
        proto.rpc, reactor, options, closer=closer, on_collect=on_collect
    )


async def open_channel(
    endpoint: Any, factory: ChannelFactory, url: str, timeout: float, clock: IReactorTime
) -> WebSocketChannel:
    """TCP connect and WebSocket upgrade, both within ``timeout`` seconds."""
    state: dict[str, Any] = {}

    def expire() -> None:
        state["timed_out"] = True
        proto = state.get("proto")
        if proto is not None and proto.transport is not None:
            proto.transport.abortConnection()
        connecting = state.get("connecting")
        if connecting is not None and not connecting.called:
            connecting.cancel()

    timer = clock.callLater(timeout, expire)
    try:
        connecting: Deferred[WebSocketChannel] = endpoint.connect(factory)
        state["connecting"] = connecting
        try:
            proto = await connecting
        except Exception as exc:
            if state.get("timed_out"):
                raise ConnectTimeout(url, timeout) from None
            raise ConnectFailed(url, connect_error_text(exc)) from None
        state["proto"] = proto
        try:
            await proto.opened
        except ConnectFailed:
            if state.get("timed_out"):
                raise ConnectTimeout(url, timeout) from None
            raise
        return proto
    finally:
        if timer.active():
            timer.cancel()


def connect_error_text(exc: BaseException) -> str:
    if isinstance(exc, _error.ConnectionRefusedError):
        return "connection refused (is the server running?)"
    if isinstance(exc, _error.DNSLookupError):
        return "host name not found"
    text = str(exc).strip()
    return text or type(exc).__name__


def close_channel(proto: WebSocketChannel, clock: IReactorTime) -> Deferred[None]:
    """WebSocket close handshake, then drop; fires when the connection is gone."""

    async def run() -> None:
        if proto.rpc.is_closed:
            return
        closed = proto.rpc.when_closed()
        proto.close()
        if not await _wait(closed, 3.0, clock) and proto.transport is not None:
            proto.transport.abortConnection()  # type: ignore[attr-defined]
            proto.rpc.connection_lost("closed by the client")

    return Deferred.fromCoroutine(run())


# --- in process -----------------------------------------------------------------------


class InProcessChannel:
    """Bytes between an RpcClient and a dispatcher Connection, with no transport.

    It is the dispatcher's ``Outbound`` (server -> client) and the RpcClient's
    ``MessageSink`` (client -> server); messages are delivered synchronously.
    """

    def __init__(self, rpc: RpcClient) -> None:
        self.rpc = rpc
        self.connection: Any = None
        self._shutdown: Deferred[None] | None = None

    # Outbound (dispatcher side)
    def write_message(self, data: bytes) -> None:
        self.rpc.message_received(data)

    def close_connection(self) -> None:
        self.rpc.connection_lost("the server closed the connection")
        self.shutdown().addErrback(lambda f: log.failure("in-process shutdown failed", f))

    # MessageSink (client side)
    def send_message(self, data: bytes) -> None:
        self.connection.message_received(data)

    def close(self) -> None:
        self.rpc.connection_lost("closed by the client")
        self.shutdown().addErrback(lambda f: log.failure("in-process shutdown failed", f))

    def shutdown(self) -> Deferred[None]:
        """Terminate the session's processes; fires when they are all closed."""
        if self._shutdown is None:
            self.connection.transport_closed()
            self._shutdown = self.connection.shutdown()
        result: Deferred[None] = Deferred()

        def forward(outcome: object) -> object:
            result.callback(None)
            return outcome

        self._shutdown.addBoth(forward)
        return result


def connect_in_process(
    reactor: Any,
    options: ConnectOptions | None = None,
    *,
    dispatcher: Any = None,
) -> Deferred[ExecServerClient]:
    """Connect to ``dispatcher`` (a new one for this server's defaults if None)."""
    if dispatcher is None:
        dispatcher = default_dispatcher(reactor)
    rpc = RpcClient(label="exec-server in-process")
    channel = InProcessChannel(rpc)
    channel.connection = dispatcher.connect(channel, "in-process")
    rpc.attach(channel)

    def closer() -> Deferred[None]:
        rpc.connection_lost("closed by the client")
        return channel.shutdown()

    def on_collect() -> None:
        channel.close()

    return ExecServerClient.connect_rpc(rpc, reactor, options, closer=closer, on_collect=on_collect)


def default_dispatcher(reactor: Any) -> Any:
    from execserver.config import ServerConfig
    from execserver.dispatcher import Dispatcher
    from execserver.spawn import PosixSpawner

    return Dispatcher(ServerConfig(), reactor, PosixSpawner(reactor))
