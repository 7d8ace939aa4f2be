"""The composition root of the JSON-RPC application: what a dispatcher serves.

:class:`~execserver.dispatcher.Dispatcher` knows no method and no session;
:func:`build_dispatcher` gives it both: the route table (``initialize``, the
current dialect's ``environment/*`` and ``fs/watchMissing``, ``process/*``,
``fs/*``, ``environmentConfig/read``,
``capabilities/discoverV2``), the factory of each connection's
:class:`~execserver.session.Session`, and the parts that hear of closed
connections (the fs pool and reply budget, the watches) or can make the
server not ready (a wedged fs pool). ``service.build_service`` and the
client's in-process server (``execserver.client.connect``) both build their
dispatcher here; nothing else imports the handlers' modules for the routes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from functools import partial

import attrs
import msgspec
from twisted.internet.interfaces import IReactorTime

from execserver import fs as filesystem
from execserver import handshake, http_request
from execserver import protocol as p
from execserver.codex import capability_discovery, environment_config, environment_info, watch
from execserver.codex.watch import WatchHub
from execserver.config import ServerConfig
from execserver.dispatcher import Connection, CurrentDialect, Dispatcher
from execserver.errors import RpcError
from execserver.fs import handles as fs_handles
from execserver.fs import walk as fs_walk
from execserver.fs.paths import RELATIVE_PATH_MESSAGE, absolute_path
from execserver.fs.pool import Runner
from execserver.reference_rules import reference_path_error
from execserver.retained import RetainedTally
from execserver.sandbox.engine import SandboxEngine, describe_sandbox
from execserver.sandbox.policy import SandboxPolicy
from execserver.session import Session, session_of
from execserver.spawn import Spawner

ENVIRONMENT_INFO = p.ENVIRONMENT_INFO
FS_WATCH_MISSING = p.FS_WATCH_MISSING
FS_MISSING_CHANGED = "fs/missingChanged"

#: The current dialect's code for an fs path that does not exist.
FS_NOT_FOUND = -32004


def _announces_current(method: str) -> bool:
    # Only the current dialect sends paths as file:// URIs (fs/*, a cwd).
    return method.startswith("fs/") or method == p.PROCESS_START


#: msgspec's text for a missing field (at the top or at ``- at `$.a.b```).
_MISSING_FIELD = re.compile(r"^Object missing required field `([^`]+)`(?: - at `[^`]*`)?$")


def _current_error(error: RpcError) -> RpcError:
    data = error.data
    if error.code == p.INVALID_PARAMS and (missing := _MISSING_FIELD.match(error.message)):
        # serde's text, as the reference words it (it names no path).
        return RpcError(error.code, f"missing field `{missing[1]}`", data)
    if (
        isinstance(data, dict)
        and data.get("kind") == "relativePath"
        and "path" in data
        and error.message == RELATIVE_PATH_MESSAGE
    ):
        # The current release's texts for a path that is not a file URI.
        return reference_path_error(data["path"], data.get("field", "path")) or error
    if isinstance(data, dict) and data.get("kind") == "notFound" and "errno" in data:
        # The current release reports a missing fs path as -32004 (same text).
        return RpcError(FS_NOT_FOUND, error.message, data)
    return error


CURRENT_DIALECT = CurrentDialect(_announces_current, _current_error)

#: The process-control extensions (docs/process-control.md), listed in
#: ``initialize``'s capabilities.
PROCESS_CONTROL = (
    p.PROCESS_SIGNAL,
    p.PROCESS_CLOSE_STDIN,
    p.PROCESS_RESIZE,
    p.PROCESS_WAIT,
    p.PROCESS_LIST,
)


def build_dispatcher(
    config: ServerConfig,
    clock: IReactorTime,
    spawner: Spawner,
    fs_runner: Runner | None = None,
    sandbox_floor: SandboxPolicy | None = None,
    *,
    sandbox: SandboxEngine | None = None,
) -> Dispatcher:
    """A dispatcher serving exec-server's methods, its sessions starting processes with ``spawner``.

    ``fs_runner`` (tests) replaces the fs thread pool; by default a real
    reactor gets the pool and a fake clock runs fs work inline.
    ``sandbox_floor`` confines every fs call at least that much (default:
    the floor of ``sandbox``, the server's process sandbox, which also
    confines every process at least to it).
    """
    if sandbox_floor is None and sandbox is not None:
        sandbox_floor = sandbox.floor

    retained = RetainedTally(config.max_total_retained_bytes)

    def new_session(conn: Connection) -> Session:
        return Session(
            config,
            clock,
            spawner,
            conn.send,
            stats=dispatcher.stats,
            retained=retained,
            sandbox=sandbox,
        )

    dispatcher = Dispatcher(config, clock, new_session, dialect=CURRENT_DIALECT)
    dispatcher.add_method(p.Initialize, partial(handshake.initialize, sandbox=sandbox))
    # Current dialect (docs/protocol.md, "Dialects"); its params are null.
    dispatcher.add_method(p.EnvironmentInfoMethod, lambda c, a: _environment_info(sandbox))
    dispatcher.add_method(p.EnvironmentStatusMethod, lambda c, a: _environment_status(a))
    watches = WatchHub(clock)
    dispatcher.closed_hooks.append(watches.owner_closed)
    if watch.available():
        dispatcher.add_method(p.FsWatchMissing, lambda c, a: _watch_missing(watches, c, a))
    _add_process_routes(dispatcher)
    fs = filesystem.register(dispatcher, fs_runner, sandbox_floor=sandbox_floor)
    dispatcher.application = Application(fs, sandbox)
    dispatcher.closed_hooks.append(fs.connection_closed)
    dispatcher.readiness_checks.append(fs.stall_reason)
    environment_config.register(dispatcher, fs.run)
    capability_discovery.register(dispatcher, fs.run, fs.guard)
    fs_walk.register(dispatcher, fs.run)
    fs_handles.register(dispatcher, fs.run, fs.guard)
    http_request.register(
        dispatcher, clock, floor_network=sandbox_floor is None or sandbox_floor.network
    )
    return dispatcher


def _environment_info(sandbox: SandboxEngine | None) -> p.EnvironmentInfo:
    return describe_sandbox(environment_info.environment_info(), sandbox)


def _environment_status(params: object) -> p.EnvironmentStatusResponse:
    """``{"status": "ready"}``; params must be the reference's unit (null, absent or ``{}``)."""
    if params is not None and params != {}:
        raise RpcError.invalid_params(f"invalid type: {_serde_kind(params)}, expected unit")
    return p.EnvironmentStatusResponse()


def _serde_kind(value: object) -> str:
    """How serde names an unexpected JSON value in ``invalid type: ...``."""
    if isinstance(value, dict):
        return "map"
    if isinstance(value, list):
        return "sequence"
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    return f"string {msgspec.json.encode(value).decode()}"


def _add_process_routes(dispatcher: Dispatcher) -> None:
    route = dispatcher.add_method
    route(p.ProcessStart, lambda c, a: session_of(c).start(a))
    route(p.ProcessRead, lambda c, a: session_of(c).read(a))
    route(p.ProcessWrite, lambda c, a: session_of(c).write(a))
    route(p.ProcessTerminate, lambda c, a: session_of(c).terminate(a))
    route(p.ProcessSignal, lambda c, a: session_of(c).signal(a))
    route(p.ProcessCloseStdin, lambda c, a: session_of(c).close_stdin(a))
    route(p.ProcessResize, lambda c, a: session_of(c).resize(a))
    route(p.ProcessWait, lambda c, a: session_of(c).wait(a))
    route(p.ProcessList, lambda c, a: session_of(c).list(a))
    dispatcher.capabilities.extend(
        method for method in PROCESS_CONTROL if method not in dispatcher.capabilities
    )


def _watch_missing(
    watches: WatchHub, conn: Connection, params: p.FsWatchMissingParams
) -> p.FsWatchMissingResponse:
    """As the reference: a watch on the ``missing`` paths that are missing now.

    ``present`` (one path, or a list) must exist. The answer is
    ``{"watching": false}``, and nothing is watched, when a present path
    does not exist, when no missing path is missing, or when the watchId is
    already watching; missing paths that exist are ignored.
    """
    missing = [absolute_path(path, "missing") for path in params.missing]
    raw_present = [params.present] if isinstance(params.present, str) else params.present or ()
    present = [absolute_path(path, "present") for path in raw_present]
    missing = [path for path in missing if not os.path.lexists(path)]
    if (
        not missing
        or not all(os.path.lexists(path) for path in present)
        or watches.watching(conn, params.watch_id)
    ):
        return p.FsWatchMissingResponse(watching=False)
    note = p.Notification(FS_MISSING_CHANGED, p.FsMissingChangedNotification(params.watch_id))
    watches.add(conn, params.watch_id, missing, present, lambda: conn.send(note))
    return p.FsWatchMissingResponse(watching=True)


def process_sessions(dispatcher: Dispatcher) -> Iterator[Session]:
    """Every live process session of ``dispatcher`` (attached or detached)."""
    for session in dispatcher.all_sessions():
        if isinstance(session, Session):
            yield session


@attrs.frozen
class Application:
    """What :func:`build_dispatcher` built around a dispatcher, for what reports on it."""

    #: The fs/* handlers' state (pool, reply budget).
    fs: filesystem.FileSystem
    #: The sandbox engine (None: built without one).
    sandbox: SandboxEngine | None


def application_of(dispatcher: Dispatcher) -> Application:
    found = dispatcher.application
    if not isinstance(found, Application):
        raise LookupError("this dispatcher was not built by execserver.app.build_dispatcher")
    return found


def file_system(dispatcher: Dispatcher) -> filesystem.FileSystem:
    """The fs/* handlers' state (pool, reply budget) of ``dispatcher``."""
    return application_of(dispatcher).fs


def sandbox_of(dispatcher: Dispatcher) -> SandboxEngine | None:
    """The sandbox ``dispatcher`` was built with (None: built without one)."""
    return application_of(dispatcher).sandbox


__all__ = [
    "ENVIRONMENT_INFO",
    "FS_MISSING_CHANGED",
    "FS_WATCH_MISSING",
    "Application",
    "application_of",
    "build_dispatcher",
    "file_system",
    "process_sessions",
    "sandbox_of",
]
