"""``fs/watchMissing``: tell a client when a path it found missing appears.

The current reference client (Codex) looks for project files that are
usually absent (``AGENTS.md``, ``.git``, skill directories) and caches the
answer; it asks the server to watch those paths and drops its cache on the
``fs/missingChanged`` notification. A watch is one-shot: it fires once, when
any ``missing`` path exists again or any ``present`` path no longer does,
and is then gone (its ``watchId`` may be used again).

Each watch has its own inotify instance (``twisted.internet.inotify``),
watching the nearest existing ancestor directory of each missing path and
the parent of each present path. Twisted closes an INotify whose watched
directory is deleted, so after any event the watch is checked afresh and
re-armed on a new instance; it is checked again after arming, so a change
between two instances is not missed. A watch ends with its connection.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any, Final

from twisted.internet import inotify
from twisted.internet.interfaces import IReactorFDSet, IReactorTime
from twisted.logger import Logger
from twisted.python.filepath import FilePath

from execserver.errors import RpcError

log = Logger()

#: Directory events that can make a missing path appear or a present one vanish.
_MASK: Final = (
    inotify.IN_CREATE
    | inotify.IN_MOVED_TO
    | inotify.IN_DELETE
    | inotify.IN_MOVED_FROM
    | inotify.IN_DELETE_SELF
    | inotify.IN_MOVE_SELF
)
#: Paths one fs/watchMissing may name (missing and present together).
MAX_PATHS: Final = 1024
#: Watches one connection may hold at once (each holds an inotify descriptor).
MAX_WATCHES: Final = 64

WatchId = int | str


def available() -> bool:
    """Whether this platform has inotify (only then is the method advertised)."""
    return hasattr(inotify, "INotify") and os.path.exists("/proc/sys/fs/inotify")


def _exists(path: str) -> bool:
    return os.path.lexists(path)


def _nearest_existing_dir(path: str) -> str:
    parent = os.path.dirname(path)
    while parent != "/" and not os.path.isdir(parent):
        parent = os.path.dirname(parent)
    return parent


class _Watch:
    def __init__(
        self,
        hub: WatchHub,
        key: tuple[object, WatchId],
        missing: list[str],
        present: list[str],
        fire: Callable[[], None],
    ) -> None:
        self.hub = hub
        self.key = key
        self.missing = missing
        self.present = present
        self._fire = fire
        self._notifier: Any = None
        self.done = False

    def changed(self) -> bool:
        return any(_exists(p) for p in self.missing) or not all(_exists(p) for p in self.present)

    def arm(self) -> None:
        self._close()
        notifier = inotify.INotify(IReactorFDSet(self.hub.reactor))
        notifier.startReading()
        self._notifier = notifier
        directories = {_nearest_existing_dir(p) for p in self.missing}
        directories.update(os.path.dirname(p) or "/" for p in self.present)
        for directory in sorted(directories):
            # One that vanished since it was found: the check below sees it.
            with contextlib.suppress(inotify.INotifyError):
                notifier.watch(FilePath(directory), mask=_MASK, callbacks=[self._event])
        if self.changed():
            # Not from here: the notification must follow the request's answer.
            self.hub.reactor.callLater(0, self._recheck)

    def _event(self, _ignored: object, _path: FilePath[Any], _mask: int) -> None:
        if self.done:
            return
        # Called from the notifier's read loop: re-arm after it has returned.
        self.hub.reactor.callLater(0, self._recheck)

    def _recheck(self) -> None:
        if self.done:
            return
        if self.changed():
            self.finish(notify=True)
        else:
            self.arm()

    def finish(self, notify: bool) -> None:
        if self.done:
            return
        self.done = True
        self._close()
        self.hub.forget(self)
        if notify:
            self._fire()

    def _close(self) -> None:
        notifier, self._notifier = self._notifier, None
        if notifier is not None and notifier.connected:
            notifier.loseConnection()


class WatchHub:
    """The live ``fs/watchMissing`` watches of a server, by (connection, watchId)."""

    def __init__(self, reactor: IReactorTime) -> None:
        #: The reactor's clock, and (a real reactor) what inotify reads through.
        self.reactor = reactor
        self._watches: dict[tuple[object, WatchId], _Watch] = {}
        self._per_owner: dict[object, int] = {}

    def add(
        self,
        owner: object,
        watch_id: WatchId,
        missing: list[str],
        present: list[str],
        fire: Callable[[], None],
    ) -> None:
        key = (owner, watch_id)
        if key in self._watches:
            raise RpcError.invalid_request(f"watchId already exists: {watch_id}")
        if len(missing) + len(present) > MAX_PATHS:
            raise RpcError.invalid_params(
                f"fs/watchMissing watches at most {MAX_PATHS} paths, got "
                f"{len(missing) + len(present)}"
            )
        if self._per_owner.get(owner, 0) >= MAX_WATCHES:
            raise RpcError.invalid_request(
                f"too many fs/watchMissing watches on this connection (limit {MAX_WATCHES})"
            )
        watch = _Watch(self, key, missing, present, fire)
        self._watches[key] = watch
        self._per_owner[owner] = self._per_owner.get(owner, 0) + 1
        try:
            watch.arm()
        except (OSError, inotify.INotifyError) as exc:
            watch.finish(notify=False)
            raise RpcError.internal(
                f"cannot watch the paths: {exc}", {"kind": "watchFailed"}
            ) from None

    def watching(self, owner: object, watch_id: WatchId) -> bool:
        """Whether ``owner`` has a live watch ``watch_id``."""
        return (owner, watch_id) in self._watches

    def forget(self, watch: _Watch) -> None:
        if self._watches.get(watch.key) is watch:
            del self._watches[watch.key]
            owner = watch.key[0]
            left = self._per_owner.get(owner, 1) - 1
            if left:
                self._per_owner[owner] = left
            else:
                self._per_owner.pop(owner, None)

    def owner_closed(self, owner: object) -> None:
        for key, watch in list(self._watches.items()):
            if key[0] is owner:
                watch.finish(notify=False)

    def count(self) -> int:
        return len(self._watches)
