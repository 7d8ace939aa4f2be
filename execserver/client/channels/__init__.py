"""The channels a client can speak over; each carries whole JSON-RPC messages.

- :class:`~execserver.client.channels.ndjson.NdjsonProtocol`: newline-delimited
  JSON over any Twisted stream transport (a TCP or UNIX socket,
  ``StringTransport`` and ``iosim`` in tests).
- :class:`~execserver.client.channels.process.ServerProcessProtocol`: the same
  framing over the stdin/stdout of a server process this client launched.
- :class:`~execserver.client.channels.websocket.WebSocketChannel`: one message
  per text frame, Autobahn (built by ``ChannelFactory``).
- :class:`~execserver.client.channels.inprocess.InProcessChannel`: bytes handed
  straight to a dispatcher ``Connection``.

Each one calls :meth:`RpcClient.attach` when it can send,
:meth:`RpcClient.message_received` per message, and
:meth:`RpcClient.connection_lost` exactly once when it ends. How a client
gets one (launching, dialling, the handshake) is
:mod:`execserver.client.connect`.
"""

from execserver.client.channels.inprocess import InProcessChannel
from execserver.client.channels.ndjson import DEFAULT_MAX_MESSAGE_BYTES, NdjsonProtocol
from execserver.client.channels.process import ServerProcessProtocol
from execserver.client.channels.websocket import ChannelFactory, WebSocketChannel

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "ChannelFactory",
    "InProcessChannel",
    "NdjsonProtocol",
    "ServerProcessProtocol",
    "WebSocketChannel",
]
