"""``fs/watchMissing``: tell a client when a path it found missing appears.

The current reference client (Codex) looks for project files that are
usually absent (``AGENTS.md``, ``.git``, skill directories) and caches the
answer; it asks the server to watch those paths and drops its cache on the
``fs/missingChanged`` notification. A watch is one-shot: it fires once, when
any ``missing`` path exists again or any ``present`` path no longer does,
and is then gone (its ``watchId`` may be used again).

All watches of a server share one inotify instance (``_SharedInotify``
over ``twisted.internet.inotify``), so a client cannot use up the user's
inotify instances (``fs.inotify.max_user_instances``, 128 by default) and
leave other programs of that user ``EMFILE``. Each watched directory (the
nearest existing ancestor of each missing path, the parent of each present
path) is one kernel watch, shared by every watch that needs it. After any
event in one of its directories a watch is checked afresh and its set of
directories updated; it is checked again after that, so a change in
between is not missed. When the kernel drops a directory's watch (the
directory deleted, its filesystem unmounted) the instance is replaced, every
directory still needed is watched again and every watch is checked afresh
(see :data:`_GONE` for why the instance cannot be kept). A watch ends with
its connection.

Bounds: :data:`MAX_PATHS` paths per request, :data:`MAX_WATCHES` watches
per connection, :data:`MAX_SERVER_WATCHES` per server (``-32600`` beyond
either), and a kernel that refuses a directory (``max_user_watches``
reached) fails the request with ``data.kind`` ``watchFailed``.
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

#: Directory events that can make a missing path appear or a present one
#: vanish. (Twisted adds IN_DELETE_SELF to every watch: see :data:`_GONE`.)
_MASK: Final = (
    inotify.IN_CREATE
    | inotify.IN_MOVED_TO
    | inotify.IN_DELETE
    | inotify.IN_MOVED_FROM
    | inotify.IN_MOVE_SELF
)
#: A directory's kernel watch is gone. On IN_DELETE_SELF Twisted's INotify
#: forgets that watch and closes the whole instance (so IN_IGNORED never
#: follows, and every other directory's kernel watch goes with it); an
#: IN_IGNORED that does arrive (IN_UNMOUNT) leaves Twisted mapping the path to
#: the dead watch, which it would hand back for the path. Either way the
#: instance is replaced (:meth:`_SharedInotify._renew`).
_GONE: Final = inotify.IN_DELETE_SELF | inotify.IN_IGNORED | inotify.IN_UNMOUNT
#: Paths one fs/watchMissing may name (missing and present together).
MAX_PATHS: Final = 1024
#: Watches one connection may hold at once.
MAX_WATCHES: Final = 64
#: Watches the whole server may hold at once (all share one inotify instance).
MAX_SERVER_WATCHES: Final = 1024

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


class _SharedInotify:
    """The server's one inotify instance: a kernel watch per directory, shared by watches."""

    def __init__(self, reactor: IReactorTime) -> None:
        self._reactor = reactor
        self._notifier: Any = None
        #: Directory -> the watches that need it, and the token of its kernel watch.
        self._users: dict[str, set[_Watch]] = {}
        self._tokens: dict[str, object] = {}
        #: The instance a replacement is scheduled for.
        self._renewing: Any = None

    def _instance(self) -> Any:
        notifier = self._notifier
        if notifier is None or not notifier.connected:
            notifier = inotify.INotify(IReactorFDSet(self._reactor))
            notifier.startReading()
            self._notifier = notifier
            # (A new instance knows no directory: each is added again.)
            self._tokens.clear()
            self._restore()
        return notifier

    def _restore(self) -> None:
        """Watch again, on a new instance, every directory still needed.

        The old instance closed under them, so what happened since is not
        known: each of their watches is checked afresh.
        """
        watches: set[_Watch] = set()
        for directory, users in list(self._users.items()):
            watches.update(users)
            try:
                self._add(directory)
            except inotify.INotifyError:
                # Gone (or refused): its watches find their directories again.
                del self._users[directory]
                for watch in users:
                    watch.lost(directory)
        for watch in watches:
            watch.event()

    def directories(self) -> int:
        return len(self._users)

    def use(self, directory: str, watch: _Watch) -> None:
        """``watch`` needs ``directory`` watched (raises INotifyError if the kernel refuses)."""
        self._instance()
        if directory not in self._tokens:
            self._add(directory)
        self._users.setdefault(directory, set()).add(watch)

    def _add(self, directory: str) -> None:
        token = object()
        self._notifier.watch(
            FilePath(directory),
            mask=_MASK,
            callbacks=[lambda _i, _p, mask: self._event(directory, token, mask)],
        )
        self._tokens[directory] = token

    def release(self, directory: str, watch: _Watch) -> None:
        users = self._users.get(directory)
        if users is None:
            return
        users.discard(watch)
        if users:
            return
        del self._users[directory]
        if self._tokens.pop(directory, None) is not None:
            self._unwatch(directory)

    def _unwatch(self, directory: str) -> None:
        notifier = self._notifier
        if notifier is not None and notifier.connected:
            with contextlib.suppress(KeyError):
                notifier.ignore(FilePath(directory))
        if not self._users and not self._tokens and notifier is not None:
            # Nothing watched: the descriptor is not kept open for nothing.
            self._notifier = None
            if notifier.connected:
                notifier.loseConnection()

    def _event(self, directory: str, token: object, mask: int) -> None:
        if self._tokens.get(directory) is not token:
            return  # a kernel watch replaced since
        users = list(self._users.get(directory, ()))
        if mask & _GONE:
            # The kernel dropped the watch (the directory is gone): forget
            # it; each of its watches finds its directories again.
            del self._tokens[directory]
            self._users.pop(directory, None)
            for watch in users:
                watch.lost(directory)
            self._renew()
        for watch in users:
            watch.event()

    def _renew(self) -> None:
        """Replace the instance once its read loop has returned (see :data:`_GONE`)."""
        notifier = self._notifier
        if notifier is None or self._renewing is notifier:
            return
        self._renewing = notifier
        self._reactor.callLater(0, self._renewed, notifier)

    def _renewed(self, notifier: Any) -> None:
        if self._renewing is notifier:
            self._renewing = None
        if self._notifier is not notifier:
            return  # replaced already (a watch needed a directory since)
        self._notifier = None
        if notifier.connected:
            notifier.loseConnection()
        if self._users:
            self._instance()


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
        #: The directories this watch has registered with the shared instance.
        self._directories: set[str] = set()
        self._recheck_pending = False
        self.done = False

    def changed(self) -> bool:
        return any(_exists(p) for p in self.missing) or not all(_exists(p) for p in self.present)

    def _wanted(self) -> set[str]:
        wanted = {_nearest_existing_dir(p) for p in self.missing}
        wanted.update(os.path.dirname(p) or "/" for p in self.present)
        return wanted

    def arm(self) -> None:
        shared = self.hub.inotify
        wanted = self._wanted()
        unneeded = self._directories - wanted
        # The new directories first: the instance is not closed in between
        # for want of a directory.
        for directory in sorted(wanted - self._directories):
            try:
                shared.use(directory, self)
            except inotify.INotifyError:
                if os.path.isdir(directory):
                    # The kernel refused (e.g. max_user_watches reached).
                    raise
                # One that vanished since it was found: the checks below see it.
                continue
            self._directories.add(directory)
        for directory in unneeded:
            shared.release(directory, self)
            self._directories.discard(directory)
        # Not from here: the notification must follow the request's answer.
        if self.changed():
            self.event()
        elif self._wanted() != wanted:
            # A directory appeared or vanished before its parent's kernel
            # watch was in place (no event will tell): armed again.
            self.event()

    def lost(self, directory: str) -> None:
        self._directories.discard(directory)

    def event(self) -> None:
        if self.done or self._recheck_pending:
            return
        # Called from the notifier's read loop: re-arm after it has returned.
        self._recheck_pending = True
        self.hub.reactor.callLater(0, self._recheck)

    def _recheck(self) -> None:
        self._recheck_pending = False
        if self.done:
            return
        if self.changed():
            self.finish(notify=True)
            return
        try:
            self.arm()
        except inotify.INotifyError as exc:
            # Nothing to answer any more: the watch ends without a notification.
            log.warn("fs/watchMissing watch {key} ended: {error}", key=self.key[1], error=exc)
            self.finish(notify=False)

    def finish(self, notify: bool) -> None:
        if self.done:
            return
        self.done = True
        self._close()
        self.hub.forget(self)
        if notify:
            self._fire()

    def _close(self) -> None:
        for directory in self._directories:
            self.hub.inotify.release(directory, self)
        self._directories.clear()


class WatchHub:
    """The live ``fs/watchMissing`` watches of a server, by (connection, watchId)."""

    def __init__(self, reactor: IReactorTime) -> None:
        #: The reactor's clock, and (a real reactor) what inotify reads through.
        self.reactor = reactor
        #: The one inotify instance all watches share.
        self.inotify = _SharedInotify(reactor)
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
        if len(self._watches) >= MAX_SERVER_WATCHES:
            raise RpcError.invalid_request(
                f"too many fs/watchMissing watches on this server (limit {MAX_SERVER_WATCHES}); "
                "retry once others have fired or their connections have closed"
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
