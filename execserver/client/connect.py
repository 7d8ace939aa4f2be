"""The three ways to connect: launch a local server, dial a WebSocket, or call
a dispatcher in this process.

Each function sets up a channel (:mod:`execserver.client.channels`), hands a
:class:`Link` -- the attached RPC client and how to release the channel --
to a ``handshake`` callable, and returns its Deferred. The handshake is
``ExecServerClient.connect_rpc`` (``ExecServerClient.spawn_local`` and the
other class methods pass it), so this module needs nothing of the client
class: :mod:`execserver.client.client` imports this one, never the reverse.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs
from autobahn.websocket.util import parse_url
from twisted.internet import error
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import (
    HostnameEndpoint,
    TCP4ClientEndpoint,
    TCP6ClientEndpoint,
    UNIXClientEndpoint,
    wrapClientTLS,
)
from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure

from execserver.client.channels.inprocess import InProcessChannel
from execserver.client.channels.process import ServerProcessProtocol, spawn_server
from execserver.client.channels.websocket import UNIX_SCHEME, ChannelFactory, WebSocketChannel
from execserver.client.errors import ConnectFailed, ConnectionClosed, ConnectTimeout, SpawnFailed
from execserver.client.rpc import RpcClient
from execserver.clientcore import defaults
from execserver.clientcore.errors import HOST_NOT_FOUND_REASON, REFUSED_REASON, error_text
from execserver.clientcore.tlsprobe import (
    TLS_PROBE_SECONDS,
    answers_tls,
    speaks_tls_reason,
    tls_client_hello,
)
from execserver.tls import ClientTls, TlsConfigError

log = Logger()
C = TypeVar("C")

Closer = Callable[[], Deferred[None]]


@attrs.frozen
class Link:
    """An attached channel, ready for the ``initialize`` handshake."""

    rpc: RpcClient
    #: Releases the channel; fires when it is gone.
    closer: Closer
    #: Runs if the client is garbage-collected unclosed; must not refer to it.
    on_collect: Callable[[], None]
    #: With :func:`spawn_local`: the server's channel (pid, stderr_tail).
    local_server: ServerProcessProtocol | None = None


#: Completes the handshake over a link (``ExecServerClient.connect_rpc``).
Handshake = Callable[[Link], Deferred[C]]


async def wait_at_most(d: Deferred[Any], seconds: float, clock: IReactorTime) -> bool:
    """True if ``d`` fired within ``seconds`` (it is cancelled otherwise)."""
    timed_out = False

    def on_timeout(result: object, timeout: float) -> None:
        nonlocal timed_out
        timed_out = True

    d.addTimeout(seconds, clock, onTimeoutCancel=on_timeout)
    await d
    return not timed_out


# --- a local server over stdio ------------------------------------------------------


#: The server ``spawn_local`` launches (shared by every client).
default_server_command = defaults.default_server_command


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
        if await wait_at_most(proto.when_ended(), grace, clock):
            return
        log.warn(
            "exec-server (pid {pid}) did not exit in {grace}s: killing it",
            pid=proto.pid,
            grace=grace,
        )
        proto.kill()
        await wait_at_most(proto.when_ended(), 5.0, clock)

    return Deferred.fromCoroutine(run())


def spawn_local(
    reactor: Any,
    handshake: Handshake[C],
    *,
    command: Sequence[str] | None = None,
    env: dict[str, str] | None = None,
    stderr: Callable[[bytes], None] | None = None,
    shutdown_grace: float = 5.0,
    new_session: bool = True,
) -> Deferred[C]:
    """Launch a server and connect to it over its stdin/stdout.

    The server's stderr goes to ``stderr`` (its last 8 KiB are quoted in
    errors). The link's closer closes the server's stdin (it then terminates
    its processes and exits) and kills it after ``shutdown_grace`` seconds;
    the same happens when the client is garbage-collected. With
    ``new_session`` (the default) the server leads a session of its own, so
    signals sent to this program's terminal (Ctrl-C) do not reach it.
    """
    argv = list(command) if command is not None else default_server_command()
    spawned = _in_new_session(argv) if new_session else argv
    rpc = RpcClient(label="exec-server stdio")
    proto = ServerProcessProtocol(rpc, stderr)
    try:
        spawn_server(reactor, proto, spawned, dict(os.environ) if env is None else env)
    except OSError as exc:
        return Deferred.fromCoroutine(_raise(SpawnFailed(f"cannot launch {argv[0]}: {exc}")))

    def on_collect() -> None:
        proto.close()
        if getattr(reactor, "running", False):
            reactor.callLater(shutdown_grace, proto.kill)

    async def connect() -> C:
        link = Link(
            rpc,
            closer=lambda: _shutdown_process(proto, reactor, shutdown_grace),
            on_collect=on_collect,
            local_server=proto,
        )
        try:
            return await handshake(link)
        except ConnectionClosed as exc:
            await wait_at_most(proto.when_ended(), shutdown_grace, reactor)
            tail = proto.stderr_tail.decode("utf-8", "replace").strip()
            detail = f" ({proto.describe_exit()})" if proto.ended else ""
            message = f"exec-server `{' '.join(argv)}` ended before the handshake{detail}"
            raise SpawnFailed(f"{message}: {tail}" if tail else message) from exc
        except BaseException:
            # Handshake refused or timed out: the server is not left behind.
            await _shutdown_process(proto, reactor, shutdown_grace)
            raise

    return Deferred.fromCoroutine(connect())


async def _raise(error: Exception) -> Any:
    raise error


# --- WebSocket ----------------------------------------------------------------------


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
    handshake: Handshake[C],
    *,
    token: str | None = None,
    connect_timeout: float = 10.0,
    tls: ClientTls | None = None,
) -> Deferred[C]:
    """Connect (TCP + WebSocket upgrade within ``connect_timeout``) and hand over.

    ``tls`` (``wss://``): a CA file instead of the system's trust store,
    and a client certificate to present.
    """

    async def connect() -> C:
        endpoint = websocket_endpoint(reactor, url, connect_timeout, tls)
        factory = ChannelFactory(url, reactor, token, open_timeout=connect_timeout)
        proto = await open_channel(endpoint, factory, url, connect_timeout, reactor)

        def on_collect() -> None:
            # A connection already lost is left alone: aborting a TLS one
            # again raises (seen at exit, in a finalizer, after a resume).
            if proto.transport is not None and not proto.rpc.is_closed:
                proto.transport.abortConnection()  # type: ignore[attr-defined]

        link = Link(proto.rpc, closer=lambda: close_channel(proto, reactor), on_collect=on_collect)
        return await handshake(link)

    return Deferred.fromCoroutine(connect())


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
            # The cause stays: a resume tells a refused connection by it.
            raise ConnectFailed(url, connect_error_text(exc)) from exc
        state["proto"] = proto
        try:
            await proto.opened
        except ConnectFailed:
            if state.get("timed_out"):
                raise ConnectTimeout(url, timeout) from None
            if (
                url.startswith("ws://")
                and getattr(proto, "http_status_line", None) is None
                and await speaks_tls(clock, url, min(TLS_PROBE_SECONDS, timeout))
            ):
                # Dropped without an HTTP answer: a TLS port says nothing to
                # a plain request, so the reason alone would mislead.
                raise ConnectFailed(url, speaks_tls_reason(url)) from None
            raise
        return proto
    finally:
        if timer.active():
            timer.cancel()


class _TlsProbe(Protocol):
    """Sends a ClientHello; ``answered`` fires True if a TLS record comes back."""

    def __init__(self) -> None:
        self.answered: Deferred[bool] = Deferred()

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.write(tls_client_hello())

    def dataReceived(self, data: bytes) -> None:
        if not self.answered.called:
            self.answered.callback(answers_tls(data))
        assert self.transport is not None
        self.transport.abortConnection()  # type: ignore[attr-defined]

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if not self.answered.called:
            self.answered.callback(False)


async def speaks_tls(reactor: Any, url: str, timeout: float) -> bool:
    """Whether the ``ws://`` URL's port answers a TLS ClientHello within ``timeout``."""
    probe = _TlsProbe()
    try:
        connecting = websocket_endpoint(reactor, url, timeout).connect(
            Factory.forProtocol(lambda: probe)
        )
        if not await wait_at_most(connecting, timeout, reactor):
            return False
    except Exception:
        return False
    answers: list[bool] = []
    probe.answered.addCallback(answers.append)
    if not await wait_at_most(probe.answered, timeout, reactor):
        if probe.transport is not None:
            probe.transport.abortConnection()  # type: ignore[attr-defined]
        return False
    return answers == [True]


def connect_error_text(exc: BaseException) -> str:
    if isinstance(exc, error.ConnectionRefusedError):
        return REFUSED_REASON
    if isinstance(exc, error.DNSLookupError):
        return HOST_NOT_FOUND_REASON
    return error_text(exc)


def close_channel(proto: WebSocketChannel, clock: IReactorTime) -> Deferred[None]:
    """WebSocket close handshake, then drop; fires when the connection is gone."""

    async def run() -> None:
        if proto.rpc.is_closed:
            return
        closed = proto.rpc.when_closed()
        proto.close()
        if not await wait_at_most(closed, 3.0, clock) and proto.transport is not None:
            proto.transport.abortConnection()  # type: ignore[attr-defined]
            proto.rpc.connection_lost("closed by the client")

    return Deferred.fromCoroutine(run())


# --- in process -----------------------------------------------------------------------


def connect_in_process(
    reactor: Any,
    handshake: Handshake[C],
    *,
    dispatcher: Any = None,
) -> Deferred[C]:
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

    return handshake(Link(rpc, closer=closer, on_collect=channel.close))


def default_dispatcher(reactor: Any) -> Any:
    from execserver.app import build_dispatcher
    from execserver.config import ServerConfig
    from execserver.spawn import PosixSpawner

    return build_dispatcher(ServerConfig(), reactor, PosixSpawner(reactor))
