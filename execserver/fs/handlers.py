"""The ``fs/*`` handlers and their registration with a dispatcher.

This module knows the dispatcher only through :class:`Router` (what it
needs: ``add_route``, the clock, the config), so the dispatcher can import
the fs package without an import cycle.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar, Protocol

import attrs
import msgspec
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure

from execserver import protocol as p
from execserver.codec import RenderedParts
from execserver.config import ServerConfig
from execserver.errors import RpcError
from execserver.fs import handles, journal, local, ops, stream
from execserver.fs.budget import Charge, Charged, ReplyBudget
from execserver.fs.local import Locality
from execserver.fs.paths import absolute_path, invalid
from execserver.fs.pool import PoolRunner, Runner, inline_runner, runs_threads, thread_pool_runner
from execserver.sandbox import fsguard
from execserver.sandbox.policy import SandboxPolicy

# --- wire types -------------------------------------------------------------------


class ReadFileWire(msgspec.Struct, rename="camel"):
    """fs/readFile params: the reference's ``path``, plus an optional range (extension)."""

    path: str
    offset: p.NonNegative | None = None
    length: p.NonNegative | None = None
    sandbox: p.SandboxConfig | None = None


class WriteFileWire(msgspec.Struct, rename="camel", dict=True):
    """fs/writeFile params as received: ``dataBase64`` stays raw until decoded on the pool.

    ``offset``, ``append`` and ``truncate`` are extensions (in-place writes).
    A streamed line's params carry its sink as the attribute ``streamed``
    (:mod:`execserver.fs.stream`; not a wire field).
    """

    #: (key, field) of the long string the dispatcher does not parse twice
    #: (codec.decode_long_params).
    long_string: ClassVar[tuple[str, str]] = ("dataBase64", "data_base64")

    path: str
    data_base64: msgspec.Raw
    offset: p.NonNegative | None = None
    append: bool | None = None
    truncate: bool | None = None
    sandbox: p.SandboxConfig | None = None


#: Listed in ``initialize``'s ``capabilities``: fs/readFile and fs/writeFile
#: take ranges (a client must not send ranged writes to a server without them:
#: it would ignore ``offset`` and replace the whole file each time).
RANGE_CAPABILITIES = ("fs/readFile:range", "fs/writeFile:range")


class Router(Protocol):
    """What :func:`register` needs of a dispatcher."""

    capabilities: list[str]

    @property
    def clock(self) -> IReactorTime: ...

    @property
    def config(self) -> ServerConfig: ...

    def add_method(
        self, method: p.Method[Any, Any], handler: Any, *, decode: type[Any] | None = ...
    ) -> None: ...


# --- the handlers ---------------------------------------------------------------


def _maybe_dangling(entry: p.FsReadDirectoryEntry) -> bool:
    # A symlink to neither a file nor a directory: dangling, looping, or to a FIFO or device.
    return entry.is_symlink is True and not entry.is_file and not entry.is_directory


def _not_a_file(path: str, error: RpcError) -> RpcError:
    """Current dialect: fs/readFile of a directory or non-regular file, in the reference's text."""
    kind = error.data.get("kind") if isinstance(error.data, dict) else None
    if kind in ("isADirectory", "notRegularFile"):
        return handles.not_a_file(absolute_path(path), kind)
    return error


def _verified(locality: Locality, directory: str, func: Any, *args: Any) -> Any:
    """Run ``func`` (on the pool), then consider ``directory`` for inline calls."""
    result = func(*args)
    locality.verify(directory)
    return result


@attrs.define
class FileSystem:
    """The fs/* handlers; ``run(f, *args, owner=conn)`` runs blocking work off the reactor.

    With ``locality`` set (a real pool), small calls that the inline rule
    allows run on the reactor thread (:mod:`execserver.fs.local`).
    """

    max_read_file_bytes: int
    run: Runner
    budget: ReplyBudget
    pool: PoolRunner | None = None
    locality: Locality | None = None
    #: Confines calls that carry a ``sandbox`` (or all, under a floor).
    # (A lambda: fsguard may still be importing when this class is defined.)
    guard: fsguard.Guard = attrs.field(factory=lambda: fsguard.Guard())  # noqa: PLW0108

    def _guarded(
        self,
        conn: object,
        sandbox: p.SandboxConfig | None,
        reads: tuple[tuple[str, bool], ...],
        writes: tuple[tuple[str, bool], ...],
        func: Any,
        *args: Any,
    ) -> Deferred[Any]:
        """``func(*args)`` on the pool, on a thread confined to ``sandbox``'s policy."""
        return self.run(self.guard.run, sandbox, reads, writes, func, *args, owner=conn)

    def read_file(self, conn: object, params: ReadFileWire) -> Deferred[Any] | Charged:
        if not getattr(conn, "speaks_current_dialect", False):
            return self._read_file(conn, params)
        try:
            answer = self._read_file(conn, params)
        except RpcError as error:
            raise _not_a_file(params.path, error) from None
        if isinstance(answer, Deferred):

            def reworded(failure: Failure) -> None:
                error = failure.trap(RpcError) and failure.value
                assert isinstance(error, RpcError)
                raise _not_a_file(params.path, error)

            return answer.addErrback(reworded)
        return answer

    def _read_file(self, conn: object, params: ReadFileWire) -> Deferred[Any] | Charged:
        path = absolute_path(params.path)
        limit = self.max_read_file_bytes
        ranged = params.offset is not None or params.length is not None
        span = ops.ReadRange(params.offset or 0, params.length, ranged) if ranged else ops.WHOLE
        # A small file is read in the first trip, against budget reserved
        # up front for its largest reply; larger ones are sized first (stat
        # only), so their reply's bytes are reserved before the file is
        # read: a reply that must wait holds no memory.
        early = self.budget.try_reserve(
            conn, ops.encoded_result_size(ops.SMALL_READ_BYTES, p.I64_MAX if ranged else None)
        )
        small = ops.SMALL_READ_BYTES if early is not None else 0
        directory = local.parent_of(path)
        guarded = self.guard.applies(params.sandbox)
        if (
            early is not None
            and not guarded
            and not ranged
            and self.locality is not None
            and local.inline_eligible(self.locality, path, directory)
        ):
            try:
                rendered = local.read_small_file(path, min(small, limit))
            except local.NotInline:
                pass
            else:
                early.resize(len(rendered))
                return Charged(rendered, early)

        def sized(found: tuple[str, int] | RenderedParts) -> Any:
            if isinstance(found, RenderedParts):
                assert early is not None
                early.resize(len(found))
                return Charged(found, early)
            if early is not None:
                early.release()
            resolved, reply_size = found
            reserved = self.budget.reserve(conn, reply_size)
            return reserved.addCallback(build, resolved)

        def unsized(failure: Failure) -> Failure:
            if early is not None:
                early.release()
            return failure

        def build(charge: Charge, resolved: str) -> Deferred[Charged]:
            def built(rendered: RenderedParts) -> Charged:
                charge.resize(len(rendered))
                return Charged(rendered, charge)

            def failed(failure: Failure) -> Failure:
                charge.release()
                return failure

            built_d: Deferred[Any]
            if guarded:
                built_d = self._guarded(
                    conn,
                    params.sandbox,
                    ((resolved, False),),
                    (),
                    ops.read_file,
                    resolved,
                    limit,
                    span,
                )
            else:
                built_d = self.run(ops.read_file, resolved, limit, span, owner=conn)
            return built_d.addCallbacks(built, failed)

        first: Deferred[Any]
        if guarded:
            first = self._guarded(
                conn,
                params.sandbox,
                ((path, False),),
                (),
                ops.stat_for_read,
                path,
                limit,
                small,
                span,
            )
        else:
            first = self._run_verified(
                directory, ops.stat_for_read, path, limit, small, span, owner=conn
            )
        return first.addCallbacks(sized, unsized)

    def _run_verified(self, directory: str, func: Any, *args: Any, owner: object) -> Deferred[Any]:
        if self.locality is None:
            return self.run(func, *args, owner=owner)
        return self.run(_verified, self.locality, directory, func, *args, owner=owner)

    def write_file(self, conn: object, params: WriteFileWire) -> Deferred[Any]:
        streamed: stream.StreamedWrite | None = params.__dict__.pop("streamed", None)
        try:
            return self._write_file(conn, params, streamed)
        except BaseException:
            stream.discard(streamed)
            raise

    def _write_file(
        self, conn: object, params: WriteFileWire, streamed: stream.StreamedWrite | None
    ) -> Deferred[Any]:
        path = absolute_path(params.path)
        raw = params.data_base64
        if bytes(memoryview(raw)[:1]) != b'"':
            # Not a string: the same -32602 a typed decode would give.
            try:
                msgspec.json.decode(raw, type=str)
            except msgspec.ValidationError as exc:
                raise RpcError.invalid_params(f"{exc} - at `$.dataBase64`") from None
        append = params.append is True
        if append and params.offset is not None:
            raise invalid(
                "fs/writeFile takes either offset or append: true, not both", "invalidRange"
            )
        writes = ((path, True),)
        guarded = self.guard.applies(params.sandbox)
        if params.offset is None and not append:
            if guarded:
                stream.discard(streamed)  # never streamed under a sandbox
                done = self._guarded(conn, params.sandbox, (), writes, ops.write_file, path, raw)
            else:
                done = self.run(ops.write_file, path, raw, streamed, owner=conn)
        else:
            truncate = params.truncate is True
            args = (path, raw, params.offset, append, truncate)
            if guarded:
                stream.discard(streamed)  # never streamed under a sandbox
                done = self._guarded(conn, params.sandbox, (), writes, ops.write_range, *args)
            else:
                done = self.run(ops.write_range, *args, streamed, owner=conn)
        return done.addCallback(lambda _: p.Empty())

    def create_directory(self, conn: object, params: p.FsCreateDirectoryParams) -> Deferred[Any]:
        recursive = True if params.recursive is None else params.recursive
        path = absolute_path(params.path)
        if self.guard.applies(params.sandbox):
            done = self._guarded(
                conn, params.sandbox, (), ((path, True),), ops.create_directory, path, recursive
            )
        else:
            done = self.run(ops.create_directory, path, recursive, owner=conn)
        return done.addCallback(lambda _: p.Empty())

    def get_metadata(
        self, conn: object, params: p.FsGetMetadataParams
    ) -> Deferred[Any] | p.FsGetMetadataResponse:
        path = absolute_path(params.path)
        if self.guard.applies(params.sandbox):
            return self._guarded(conn, params.sandbox, ((path, False),), (), ops.get_metadata, path)
        directory = local.parent_of(path)
        if self.locality is not None and local.inline_eligible(self.locality, path, directory):
            try:
                return local.get_metadata(path)
            except local.NotInline:
                pass
        return self._run_verified(directory, ops.get_metadata, path, owner=conn)

    def read_directory(
        self, conn: object, params: p.FsReadDirectoryParams
    ) -> Deferred[Any] | p.FsReadDirectoryResponse:
        listed = self._read_directory(conn, params)
        if not getattr(conn, "speaks_current_dialect", False):
            return listed
        # The current reference leaves dangling and looping symlinks out.
        if isinstance(listed, Deferred):
            return listed.addCallback(self._without_dangling, conn, params)
        return self._without_dangling(listed, conn, params)

    def _without_dangling(
        self, listed: p.FsReadDirectoryResponse, conn: object, params: p.FsReadDirectoryParams
    ) -> Deferred[Any] | p.FsReadDirectoryResponse:
        if not any(_maybe_dangling(entry) for entry in listed.entries):
            return listed
        path = absolute_path(params.path)
        if self.guard.applies(params.sandbox):
            # Under the same confinement as the listing: a target it cannot
            # see stays unseen.
            return self._guarded(
                conn, params.sandbox, ((path, False),), (), ops.without_dangling, listed, path
            )
        return self.run(ops.without_dangling, listed, path, owner=conn)

    def _read_directory(
        self, conn: object, params: p.FsReadDirectoryParams
    ) -> Deferred[Any] | p.FsReadDirectoryResponse:
        path = absolute_path(params.path)
        if self.guard.applies(params.sandbox):
            return self._guarded(
                conn, params.sandbox, ((path, False),), (), ops.read_directory, path
            )
        if self.locality is not None and local.inline_eligible(self.locality, path, path):
            try:
                return local.read_directory(self.locality, path)
            except local.NotInline:
                pass
        return self._run_verified(path, ops.read_directory, path, owner=conn)

    def remove(self, conn: object, params: p.FsRemoveParams) -> Deferred[Any]:
        recursive = True if params.recursive is None else params.recursive
        force = True if params.force is None else params.force
        path = absolute_path(params.path)
        if self.guard.applies(params.sandbox):
            done = self._guarded(
                conn, params.sandbox, (), ((path, False),), ops.remove, path, recursive, force
            )
        else:
            done = self.run(ops.remove, path, recursive, force, owner=conn)
        return done.addCallback(lambda _: p.Empty())

    def copy(self, conn: object, params: p.FsCopyParams) -> Deferred[Any]:
        source = absolute_path(params.source_path, "sourcePath")
        destination = absolute_path(params.destination_path, "destinationPath")
        args = (source, destination, params.recursive)
        if self.guard.applies(params.sandbox):
            done = self._guarded(
                conn,
                params.sandbox,
                ((source, params.recursive),),
                ((destination, True),),
                ops.copy,
                *args,
            )
        else:
            done = self.run(ops.copy, *args, owner=conn)
        return done.addCallback(lambda _: p.Empty())

    # --- state for the dispatcher, /readyz and /metrics ----------------------------

    def connection_closed(self, conn: object) -> None:
        """Drop ``conn``'s requests that have not started (nobody will read them)."""
        if self.pool is not None:
            self.pool.cancel_owner(conn)
        self.budget.cancel_owner(conn)

    def stall_reason(self) -> str | None:
        return self.pool.stall_reason() if self.pool is not None else None

    @property
    def running(self) -> int:
        return self.pool.running if self.pool is not None else 0

    @property
    def queued(self) -> int:
        return self.pool.queued if self.pool is not None else 0


def register(
    dispatcher: Router, run: Runner | None = None, sandbox_floor: SandboxPolicy | None = None
) -> FileSystem:
    """Add the seven fs/* routes to ``dispatcher``.

    ``sandbox_floor`` (the operator's ``--sandbox-floor``) confines every fs
    call at least that much, whatever its ``sandbox`` asks.
    """
    clock = dispatcher.clock
    config = dispatcher.config
    pool: PoolRunner | None = None
    if run is None:
        if runs_threads(clock):
            pool = thread_pool_runner(
                clock,
                wait_timeout=config.fs_wait_timeout_ms / 1000.0,
                stall_after=config.fs_stall_ms / 1000.0,
                per_owner=config.max_fs_ops_per_session,
            )
            run = pool
        else:
            run = inline_runner
    elif isinstance(run, PoolRunner):
        pool = run
    budget = ReplyBudget(
        clock,
        config.reply_budget_bytes,
        config.connection_reply_budget_bytes,
        config.fs_wait_timeout_ms / 1000.0,
    )
    # Inline calls only beside a real pool (with a fake clock everything
    # already runs at once).
    locality = Locality() if pool is not None else None
    if pool is not None:
        journal.start()  # replay and clean up after a killed server, before serving
    fs = FileSystem(
        config.max_read_file_bytes, run, budget, pool, locality, fsguard.Guard(floor=sandbox_floor)
    )
    if (
        pool is not None
        and locality is not None
        and (sandbox_floor is None or not sandbox_floor.confined)
        and hasattr(dispatcher, "long_line_sink")  # (a Dispatcher; not every Router)
    ):
        # Long fs/writeFile lines are decoded as they arrive (fs/stream.py).
        setattr(  # noqa: B010
            dispatcher, "long_line_sink", functools.partial(stream.start, pool, locality)
        )
    # The server's wire types decode more than the declarations: ranges,
    # the dataBase64 of a streamed write (see ReadFileWire, WriteFileWire).
    dispatcher.add_method(p.FsReadFile, fs.read_file, decode=ReadFileWire)
    dispatcher.add_method(p.FsWriteFile, fs.write_file, decode=WriteFileWire)
    dispatcher.add_method(p.FsCreateDirectory, fs.create_directory)
    dispatcher.add_method(p.FsGetMetadata, fs.get_metadata)
    dispatcher.add_method(p.FsReadDirectory, fs.read_directory)
    dispatcher.add_method(p.FsRemove, fs.remove)
    dispatcher.add_method(p.FsCopy, fs.copy)
    dispatcher.capabilities.extend(
        c for c in RANGE_CAPABILITIES if c not in dispatcher.capabilities
    )
    return fs
