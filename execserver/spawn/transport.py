"""The shape of the process transport both spawn paths give a child's protocol."""

from __future__ import annotations

from typing import Protocol


class ChildTransport(Protocol):
    """The process transport both spawn paths give a child's protocol.

    Twisted's ``Process``/``PTYProcess`` (the fast path's subclasses, or the
    stock path's, with ``drain_output``, ``tree`` and a PTY's
    ``set_window_size``/``eof_char`` attached). A pipe process's stdin is its
    ``pipes[0]``; a PTY's is the transport itself.
    """

    @property
    def pid(self) -> int | None: ...

    def write(self, data: bytes) -> None: ...

    def closeStdin(self) -> None: ...

    def pauseProducing(self) -> None: ...

    def resumeProducing(self) -> None: ...

    def loseConnection(self) -> None: ...


class TerminalTransport(ChildTransport, Protocol):
    """A PTY process's transport: the terminal behind its master."""

    def set_window_size(self, rows: int, cols: int) -> None: ...

    def eof_char(self) -> bytes: ...
