"""The byte carriers of the asyncio client: a local server's stdio, a WebSocket.

- :func:`spawn_stdio` launches a server (by default ``python -m execserver``,
  the Twisted client's command, in a session of its own so a Ctrl-C at the
  terminal does not reach it) and speaks NDJSON over its stdin/stdout.
- :func:`open_websocket` connects to ``ws://``, ``wss://`` (CA file, client
  certificate) or ``unix:///PATH`` with the ``websockets`` library: one
  JSON-RPC message per text frame, the bearer token in ``Authorization``.

Each calls :meth:`AsyncRpc.message_received` per message and
:meth:`AsyncRpc.connection_lost` exactly once when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import socket
import ssl
import urllib.parse
from collections.abc import Sequence
from typing import Any

import websockets
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import InvalidStatus

from execserver.aio.rpc import AsyncRpc
from execserver.clientcore.defaults import default_server_command
from execserver.clientcore.errors import (
    HOST_NOT_FOUND_REASON,
    REFUSED_REASON,
    AuthRefused,
    ConnectFailed,
    ConnectTimeout,
    SpawnFailed,
    error_text,
)
from execserver.clientcore.framing import (
    MAX_MESSAGE_BYTES,
    STDOUT_CLOSED_REASON,
    LineInput,
    LocalServerLog,
    describe_exit,
    keep_stderr_tail,
    server_exited,
)
from execserver.clientcore.tlsprobe import (
    TLS_PROBE_SECONDS,
    answers_tls,
    speaks_tls_reason,
    tls_client_hello,
)

UNIX_SCHEME = "unix://"
_PIPE_BYTES = 1024 * 1024
log = logging.getLogger("execserver.aio")


# --- a local server over stdio ------------------------------------------------------


class _ServerPipes(asyncio.SubprocessProtocol):
    """stdout -> NDJSON frames -> rpc; stderr kept (its tail quoted in errors).

    The server's stdout is a pipe of ours (1 MiB, read up to 1 MiB per
    wakeup through ``loop.add_reader``): asyncio's own pipe transport reads
    256 KiB at a time, which halved the end-to-end rate of an output flood
    (bench/bench_aio_client.py).
    """

    def __init__(self, rpc: AsyncRpc, stderr: Any) -> None:
        self.rpc = rpc
        self._input = LineInput(rpc)
        self._stderr = stderr
        self.stderr_tail = b""
        self._log = LocalServerLog()
        self.transport: asyncio.SubprocessTransport | None = None
        self.exited = asyncio.Event()
        self._stdout_open = True
        self._stdout_fd = -1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.SubprocessTransport)
        self.transport = transport

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        if fd == 1:
            self._input.feed(data)
            return
        if fd != 2:
            return
        self.stderr_tail = keep_stderr_tail(self.stderr_tail, data)
        self._log.write(self.transport.get_pid() if self.transport else None, data)
        if self._stderr is not None:
            try:
                self._stderr(data)
            except Exception:
                log.exception("exec-server stderr callback failed")

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        if fd == 2:
            self._log.close()
        if fd == 1 and self._stdout_open:
            self._stdout_open = False
            self._input.finish()
            self.rpc.connection_lost(STDOUT_CLOSED_REASON)

    # --- the stdout pipe, read by us -----------------------------------------------------

    def read_stdout(self, fd: int) -> None:
        """Read ``fd`` whenever it is readable, until end of file."""
        self._stdout_fd = fd
        asyncio.get_running_loop().add_reader(fd, self._readable)

    def _readable(self) -> None:
        try:
            data = os.read(self._stdout_fd, _PIPE_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            self.pipe_data_received(1, data)
        else:
            self.close_stdout()
            self.pipe_connection_lost(1, None)

    def close_stdout(self) -> None:
        fd, self._stdout_fd = self._stdout_fd, -1
        if fd >= 0:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)

    def process_exited(self) -> None:
        self.rpc.connection_lost(server_exited(*self._exit_status()))
        self.exited.set()

    def _exit_status(self) -> tuple[int | None, int | None]:
        """(exit code, signal); asyncio's return code is -N for signal N."""
        code = self.transport.get_returncode() if self.transport is not None else None
        if code is not None and code < 0:
            return None, -code
        return code, None

    def describe_exit(self) -> str:
        return describe_exit(*self._exit_status())


class StdioChannel:
    """The stdin/stdout of a spawned server as a :class:`~execserver.aio.rpc.Channel`."""

    def __init__(self, pipes: _ServerPipes, argv: list[str], shutdown_grace: float) -> None:
        self._pipes = pipes
        self.argv = argv
        self.shutdown_grace = shutdown_grace
        assert pipes.transport is not None
        self._transport = pipes.transport
        stdin = self._transport.get_pipe_transport(0)
        assert isinstance(stdin, asyncio.WriteTransport)
        self._stdin = stdin

    @property
    def pid(self) -> int:
        return self._transport.get_pid()

    @property
    def stderr_tail(self) -> bytes:
        return self._pipes.stderr_tail

    def describe_exit(self) -> str:
        return self._pipes.describe_exit()

    async def send(self, data: bytes) -> None:
        if self._stdin.is_closing():
            raise ConnectionError("the server's stdin is closed")
        self._stdin.writelines((data, b"\n"))

    async def aclose(self) -> None:
        """Close stdin (the server then terminates its processes and exits);
        SIGKILL if it has not exited after ``shutdown_grace`` seconds."""
        with contextlib.suppress(Exception):
            self._stdin.close()
        try:
            if await self.wait_exited(self.shutdown_grace):
                return
            self.kill()
            await self.wait_exited(5.0)
        finally:
            self._pipes.close_stdout()
            self._pipes.rpc.connection_lost("closed by the client")

    async def wait_exited(self, seconds: float) -> bool:
        try:
            async with asyncio.timeout(seconds):
                await self._pipes.exited.wait()
        except TimeoutError:
            return False
        return True

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, OSError):
            self._transport.send_signal(signal.SIGKILL)

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._stdin.close()
        self.kill()
        self._pipes.close_stdout()


async def spawn_stdio(
    rpc: AsyncRpc,
    command: Sequence[str] | None = None,
    *,
    env: dict[str, str] | None = None,
    stderr: Any = None,
    shutdown_grace: float = 5.0,
    new_session: bool = True,
) -> StdioChannel:
    """Launch the server; ``stderr(bytes)`` sees its stderr (the last 8 KiB are kept)."""
    argv = list(command) if command is not None else default_server_command()
    loop = asyncio.get_running_loop()
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    # A notification is up to ~350 KiB of JSON: a 1 MiB pipe keeps the
    # server writing while this side decodes.
    with contextlib.suppress(OSError):
        fcntl.fcntl(read_end, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
    try:
        _transport, pipes = await loop.subprocess_exec(
            lambda: _ServerPipes(rpc, stderr),
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=write_end,
            stderr=asyncio.subprocess.PIPE,
            env=dict(os.environ) if env is None else env,
            start_new_session=new_session,
        )
    except OSError as exc:
        os.close(read_end)
        raise SpawnFailed(f"cannot launch {argv[0]}: {exc}") from None
    finally:
        os.close(write_end)
    pipes.read_stdout(read_end)
    channel = StdioChannel(pipes, argv, shutdown_grace)
    rpc.channel = channel
    return channel


# --- WebSocket ----------------------------------------------------------------------


class WebSocketChannel:
    """One JSON-RPC message per text frame over a ``websockets`` connection."""

    def __init__(self, ws: ClientConnection, rpc: AsyncRpc, url: str) -> None:
        self.ws = ws
        self.rpc = rpc
        self.url = url
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        reason = "connection closed"
        recv = self.ws.recv
        received = self.rpc.message_received
        try:
            while True:
                data = await recv(decode=False)
                if isinstance(data, str):  # pragma: no cover - decode=False gives bytes
                    data = data.encode()
                received(data)
        except websockets.ConnectionClosed as exc:
            reason = _close_reason(exc)
        except asyncio.CancelledError:
            reason = "closed by the client"
            raise
        except Exception as exc:
            # A bug of ours, not the peer's: nothing more is read, so the
            # connection must not stay open either.
            reason = f"{type(exc).__name__}: {exc}"
            log.exception("%s: reading the WebSocket failed", self.url)
            self.abort()
        finally:
            self.rpc.connection_lost(reason)

    async def send(self, data: bytes) -> None:
        await self.ws.send(data, text=True)

    async def aclose(self) -> None:
        """Close handshake (bounded), then drop; returns once the connection is gone."""
        try:
            async with asyncio.timeout(3.0):
                await self.ws.close()
        except (TimeoutError, OSError):
            self.abort()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            async with asyncio.timeout(3.0):
                await asyncio.shield(self.reader)
        if not self.reader.done():
            self.reader.cancel()

    def abort(self) -> None:
        transport = self.ws.transport
        if transport is not None:
            transport.abort()


def _close_reason(exc: websockets.ConnectionClosed) -> str:
    close = exc.rcvd or exc.sent
    if close is None:
        return "connection lost"
    if close.code == 1000 and exc.rcvd is not None:
        return "connection closed by the server"
    return f"connection closed ({close.code}{' ' + close.reason if close.reason else ''})"


def unix_socket_path(url: str) -> str:
    path = url[len(UNIX_SCHEME) :]
    if not path.startswith("/") or "\0" in path:
        raise ConnectFailed(url, "invalid unix socket URL: expected unix:///ABSOLUTE/PATH")
    return path


def ssl_context(
    ca_file: str | None, client_cert: str | None, client_key: str | None, url: str
) -> ssl.SSLContext:
    """TLS 1.2+; ``ca_file`` instead of the system's trust store; a client certificate."""
    try:
        context = ssl.create_default_context(cafile=ca_file)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if client_cert is not None:
            context.load_cert_chain(client_cert, client_key)
    except FileNotFoundError as exc:
        raise ConnectFailed(url, f"cannot read {exc.filename}: {exc.strerror}") from None
    except (ssl.SSLError, OSError) as exc:
        raise ConnectFailed(url, f"invalid TLS configuration: {exc}") from None
    return context


def _connect_error_text(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return REFUSED_REASON
    if isinstance(exc, socket.gaierror):
        return HOST_NOT_FOUND_REASON
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (
            f"TLS handshake failed: certificate verify failed ({exc.verify_message}): the server's "
            "certificate is not signed by a trusted CA (give the CA that signed it: ca_file)"
        )
    if isinstance(exc, ssl.SSLError):
        return f"TLS handshake failed: {exc.reason or exc}"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return error_text(exc)


async def _speaks_tls(url: str, timeout: float) -> bool:
    """Whether the ``ws://`` URL's port answers a TLS ClientHello within ``timeout``."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.hostname is None:
        return False
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(parsed.hostname, parsed.port or 80)
            try:
                writer.write(tls_client_hello())
                first = await reader.read(1)
            finally:
                writer.transport.abort()
    except (OSError, TimeoutError, ValueError):
        return False
    return answers_tls(first)


async def open_websocket(
    rpc: AsyncRpc,
    url: str,
    *,
    token: str | None = None,
    connect_timeout: float = 10.0,
    ca_file: str | None = None,
    client_cert: str | None = None,
    client_key: str | None = None,
) -> WebSocketChannel:
    """TCP (or Unix socket) connect, TLS, and the WebSocket upgrade within ``connect_timeout``."""
    headers = {"Authorization": f"Bearer {token}"} if token else None
    options: dict[str, Any] = {
        "additional_headers": headers,
        # The server's messages are already compact JSON; deflate costs CPU.
        "compression": None,
        # As the Twisted client: no environment proxy, no keepalive pings
        # (a busy reader must not be taken for a dead peer).
        "proxy": None,
        "ping_interval": None,
        "max_size": MAX_MESSAGE_BYTES,
        "open_timeout": None,
        "close_timeout": 3.0,
        "user_agent_header": None,
    }
    if url.startswith(UNIX_SCHEME):
        path = unix_socket_path(url)
        opener: Any = websockets.unix_connect(path, "ws://localhost/", **options)
    else:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("ws", "wss") or not parsed.hostname:
            raise ConnectFailed(url, "invalid WebSocket URL: expected ws://HOST:PORT or wss://")
        if parsed.scheme == "wss":
            options["ssl"] = ssl_context(ca_file, client_cert, client_key, url)
        opener = websockets.connect(url, **options)
    try:
        async with asyncio.timeout(connect_timeout):
            ws = await opener
    except TimeoutError:
        raise ConnectTimeout(url, connect_timeout) from None
    except InvalidStatus as exc:
        status = exc.response.status_code
        phrase = exc.response.reason_phrase
        if status in (401, 403):
            raise AuthRefused(
                url, status, f"authentication refused (HTTP {status} {phrase})"
            ) from None
        raise ConnectFailed(url, f"WebSocket upgrade failed (HTTP {status} {phrase})") from None
    except (OSError, websockets.InvalidHandshake, websockets.InvalidURI) as exc:
        if (
            url.startswith("ws://")
            and not isinstance(exc, ConnectionRefusedError | socket.gaierror)
            and await _speaks_tls(url, min(TLS_PROBE_SECONDS, connect_timeout))
        ):
            # No HTTP answer: a TLS port says nothing to a plain request, so
            # the reason alone would mislead (as the Twisted client says).
            raise ConnectFailed(url, speaks_tls_reason(url)) from exc
        # The cause stays: a resume tells a refused connection by it.
        raise ConnectFailed(url, _connect_error_text(exc)) from exc
    channel = WebSocketChannel(ws, rpc, url)
    rpc.channel = channel
    return channel
