"""``--listen`` addresses: parsed in one place, and mapped onto Twisted endpoint descriptions.

``stdio://`` is served by :class:`~execserver.transports.stdio.StdioService`;
``ws://IP:PORT`` becomes the endpoint description ``tcp:PORT:interface=IP``
(``tcp6`` for IPv6) for :func:`twisted.internet.endpoints.serverFromString`,
so another scheme (``wss://`` over ``ssl:``, ``unix://`` over ``unix:``) is
one more case here.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import stat
from typing import Any, Final

import attrs
from twisted.internet.endpoints import SSL4ServerEndpoint, serverFromString
from twisted.internet.interfaces import IReactorTCP, IStreamServerEndpoint

STDIO_URL: Final = "stdio://"

#: Pending TCP connections the kernel queues (many clients may connect at once).
LISTEN_BACKLOG: Final = 1024


@attrs.frozen
class StdioAddress:
    def __str__(self) -> str:
        return STDIO_URL


@attrs.frozen
class WebSocketAddress:
    host: str
    port: int
    #: ``wss://``: TLS (``--tls-cert``/``--tls-key``) under the WebSocket.
    secure: bool = False

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'wss' if self.secure else 'ws'}://{host}:{self.port}"

    def endpoint_description(self) -> str:
        """The ``serverFromString`` description of this address's TCP listener."""
        kind = "tcp6" if ":" in self.host else "tcp"
        # Colons inside a description value are escaped with a backslash.
        interface = self.host.replace(":", "\\:")
        return f"{kind}:port={self.port}:interface={interface}:backlog={LISTEN_BACKLOG}"

    @property
    def is_loopback(self) -> bool:
        return ipaddress.ip_address(self.host).is_loopback

    def with_port(self, port: int) -> WebSocketAddress:
        return WebSocketAddress(self.host, port, self.secure)


#: Default permissions of a Unix-domain socket listener (``--socket-mode``).
DEFAULT_SOCKET_MODE: Final = 0o600


@attrs.frozen
class UnixAddress:
    """``unix:///absolute/path.sock``: WebSocket over a Unix-domain socket."""

    path: str

    def __str__(self) -> str:
        return f"unix://{self.path}"

    def endpoint_description(self, mode: int = DEFAULT_SOCKET_MODE) -> str:
        """The ``serverFromString`` description (Twisted applies ``mode`` before ``listen()``)."""
        path = self.path.replace("\\", "\\\\").replace(":", "\\:")
        return f"unix:address={path}:mode={mode:o}:lockfile=0:backlog={LISTEN_BACKLOG}"

    def remove_stale_socket(self) -> None:
        """Remove a socket file nobody listens on (a server that died left it).

        Anything else at the path is left alone and stops the start with a
        :class:`UnixPathInUse` that says what is there: a socket a live
        server listens on, or a file that is not a socket (a regular file,
        a symbolic link, a directory...), which is never removed.
        """
        try:
            mode = os.lstat(self.path).st_mode
        except OSError:
            return
        if not stat.S_ISSOCK(mode):
            raise UnixPathInUse(
                f"cannot listen on {self}: {self.path} is {_file_kind(mode)}, not a socket; "
                "it is left alone: remove it or choose another path"
            )
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(self.path)
        except ConnectionRefusedError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            return
        except OSError:
            return
        finally:
            probe.close()
        raise UnixPathInUse(
            f"cannot listen on {self}: Address already in use: another server listens "
            "on this socket"
        )


class UnixPathInUse(OSError):
    """Something that is not a stale socket holds a ``unix://`` listener's path."""


def _file_kind(mode: int) -> str:
    kinds = (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    return next((name for test, name in kinds if test(mode)), "a special file")


ListenAddress = StdioAddress | WebSocketAddress | UnixAddress


class ListenUrlError(ValueError):
    pass


def parse_listen_url(url: str) -> ListenAddress:
    """Parse a ``--listen`` URL with the reference's rules and messages."""
    if url == STDIO_URL:
        return StdioAddress()
    if url.startswith("unix://"):
        path = url[len("unix://") :]
        if not path.startswith("/") or path.endswith("/") or "\0" in path:
            raise ListenUrlError(
                f"invalid unix --listen URL `{url}`; expected `unix:///ABSOLUTE/PATH`"
            )
        return UnixAddress(path)
    if url.startswith("ws://"):
        address = _parse_socket_address(url[len("ws://") :])
        if address is None:
            raise ListenUrlError(f"invalid websocket --listen URL `{url}`; expected `ws://IP:PORT`")
        return address
    if url.startswith("wss://"):
        address = _parse_socket_address(url[len("wss://") :])
        if address is None:
            raise ListenUrlError(
                f"invalid secure websocket --listen URL `{url}`; expected `wss://IP:PORT`"
            )
        return attrs.evolve(address, secure=True)
    # The reference's text, with every form we accept (it knows only the first two).
    raise ListenUrlError(
        f"unsupported --listen URL `{url}`; expected `stdio://` or `ws://IP:PORT` "
        "(or `wss://IP:PORT`, `unix:///ABSOLUTE/PATH`)"
    )


def _parse_socket_address(text: str) -> WebSocketAddress | None:
    # Rust's SocketAddr syntax: "1.2.3.4:80" or "[::1]:80"; no host names.
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isascii() or not port_text.isdigit():
        return None
    port = int(port_text)
    if port > 65535 or (len(port_text) > 1 and port_text.startswith("0")):
        return None
    if host.startswith("[") and host.endswith("]"):
        try:
            return WebSocketAddress(str(ipaddress.IPv6Address(host[1:-1])), port)
        except ValueError:
            return None
    try:
        return WebSocketAddress(str(ipaddress.IPv4Address(host)), port)
    except ValueError:
        return None


def server_endpoint(
    reactor: IReactorTCP,
    address: WebSocketAddress | UnixAddress,
    socket_mode: int = DEFAULT_SOCKET_MODE,
    tls_options: Any = None,
) -> IStreamServerEndpoint:
    """The endpoint a listener of ``address`` listens on (``tls_options``: a ``wss://`` one's)."""
    if isinstance(address, WebSocketAddress) and address.secure:
        # A description cannot carry CA certificates or a minimum TLS
        # version: the TLS endpoint is built from Twisted's options object.
        if tls_options is None:
            raise ValueError(f"{address} needs TLS options (--tls-cert and --tls-key)")
        return SSL4ServerEndpoint(
            reactor,
            address.port,
            tls_options,
            backlog=LISTEN_BACKLOG,
            interface=address.host,
        )
    description = (
        address.endpoint_description(socket_mode)
        if isinstance(address, UnixAddress)
        else address.endpoint_description()
    )
    endpoint: IStreamServerEndpoint = serverFromString(reactor, description)
    return endpoint
