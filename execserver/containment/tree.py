"""What every kind of tree is: the :class:`ProcessTree` protocol and its owner's bookkeeping."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

from execserver.cgroups import Usage
from execserver.limits import Kind

if TYPE_CHECKING:
    from execserver.containment.core import Containment, Tree


class ContainmentError(Exception):
    """The requested containment mode cannot be used, or a process cannot be contained."""

    def __init__(self, message: str, errno: int = 0) -> None:
        super().__init__(message)
        self.errno = errno


class ProcessTree(Protocol):
    """Every process of one supervised child (faked in unit tests)."""

    def signal(self, signum: int) -> None:
        """Send ``signum`` to every member (and to the leader's process group)."""

    def kill(self) -> None:
        """SIGKILL every member."""

    def alive(self) -> bool:
        """True while a member is running (zombies do not count)."""

    def when_empty(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, when a periodic check finds no member left.

        Used for trees that outlive their leader's output (a daemon).
        """

    def release(self) -> None:
        """The tree is empty and no longer needed: free what tracks it."""

    def exceeded(self) -> tuple[Kind, int] | None:
        """The cgroup limit that ended or crippled the tree (and its figure), if any."""

    def usage(self) -> Usage:
        """What the tree uses now (fields it cannot measure are None)."""


class _Owned:
    """What both kinds of tree share: their owner's bookkeeping."""

    _owner: Containment
    _on_empty: Callable[[], None] | None

    def when_empty(self, callback: Callable[[], None]) -> None:
        self._on_empty = callback
        self._owner._linger(cast("Tree", self))

    def emptied(self) -> None:
        callback, self._on_empty = self._on_empty, None
        if callback is not None:
            callback()

    def release(self) -> None:
        self._owner._release(cast("Tree", self))

    def exceeded(self) -> tuple[Kind, int] | None:
        return None

    def usage(self) -> Usage:
        return Usage()
