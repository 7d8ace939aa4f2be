"""JSON-RPC errors raised by handlers and sent back to clients."""

from __future__ import annotations

from typing import Any

from execserver import protocol


class RpcError(Exception):
    """An error answered to the client as ``{"code", "message", "data"?}``.

    Codes follow the reference: -32600 for state and semantics, -32602 for
    params that do not decode or validate, -32603 for failures of the host
    (spawn, I/O). ``data`` carries machine-readable detail, e.g.
    ``{"kind": "spawnNotFound", "errno": 2}``.
    """

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data

    def __repr__(self) -> str:
        return f"RpcError({self.code}, {self.message!r}, {self.data!r})"

    def to_wire(self) -> protocol.ErrorObject:
        return protocol.ErrorObject(self.code, self.message, self.data)

    @classmethod
    def invalid_request(cls, message: str, data: Any = None) -> RpcError:
        return cls(protocol.INVALID_REQUEST, message, data)

    @classmethod
    def invalid_params(cls, message: str, data: Any = None) -> RpcError:
        return cls(protocol.INVALID_PARAMS, message, data)

    @classmethod
    def internal(cls, message: str, data: Any = None) -> RpcError:
        return cls(protocol.INTERNAL_ERROR, message, data)
