"""Whole-file transfers in ranges, and the ``fs`` subcommands of ``exec-server-client``.

:func:`upload` and :func:`download` move a file of any size as a sequence
of ranged ``fs/writeFile`` / ``fs/readFile`` calls (8 MiB each by default),
so neither side ever holds more than one range; :class:`FileTransfers`
offers them as client methods.

Paths on the wire are absolute. A relative path on the command line is
resolved against this process's working directory when the server is local
(``--stdio``: it sees the same files); with ``--url`` the server's files are
not ours, so a relative path is a usage error rather than a guess.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from collections.abc import Callable
from typing import BinaryIO, TextIO

import msgspec
from twisted.internet.defer import Deferred

from execserver import protocol as p
from execserver.client.api import ClientApi
from execserver.client.errors import RangesNotSupported

#: Bytes per ranged call of :func:`upload` and :func:`download`.
TRANSFER_CHUNK_BYTES = 8 * 1024 * 1024

#: ``progress(done, total)``: bytes moved so far, and the file's size when known.
Progress = Callable[[int, "int | None"], None]


class _RangedRead(msgspec.Struct, rename="camel"):
    path: str
    offset: int
    length: int


class _RangedReadResult(msgspec.Struct, rename="camel"):
    data_base64: bytes
    size: int


class _RangedWrite(msgspec.Struct, rename="camel", omit_defaults=True):
    path: str
    data_base64: bytes
    offset: int | None = None
    truncate: bool | None = None


#: What a server lists in ``capabilities`` when it takes ranged fs calls.
RANGE_CAPABILITIES = ("fs/readFile:range", "fs/writeFile:range")


def _require_ranges(client: ClientApi, capability: str) -> None:
    # A client that knows the server's capabilities checks them: a baseline
    # server would ignore `offset` and replace the whole file with each range.
    known = getattr(client, "capabilities", None)
    if isinstance(known, list) and capability not in known:
        raise RangesNotSupported(
            f"the server does not support ranged fs calls ({capability} not in its "
            "capabilities); use fs_read_file/fs_write_file"
        )


def _open_local(
    local_file: str | os.PathLike[str] | BinaryIO, write: bool
) -> tuple[BinaryIO, bool]:
    """The file to use, and whether it was opened here (and so is closed here)."""
    if isinstance(local_file, str | os.PathLike):
        return (open(local_file, "wb") if write else open(local_file, "rb")), True
    return local_file, False


async def download(
    client: ClientApi,
    path: str,
    local_file: str | os.PathLike[str] | BinaryIO,
    *,
    chunk_bytes: int = TRANSFER_CHUNK_BYTES,
    progress: Progress | None = None,
) -> int:
    """Copy the remote file ``path`` into ``local_file`` (a path or a binary file).

    Reads ranges of ``chunk_bytes`` until the end of the file; returns the
    bytes copied. Each range is read when asked for: a file that changes
    meanwhile is copied as the ranges found it.
    """
    _require_ranges(client, RANGE_CAPABILITIES[0])
    offset = 0
    got = await client._call(
        p.FS_READ_FILE, _RangedRead(path, offset, chunk_bytes), _RangedReadResult
    )
    # Opened once the first range has arrived: a missing or unreadable
    # remote file leaves the local file as it was.
    out, owned = _open_local(local_file, write=True)
    try:
        while True:
            data = got.data_base64
            out.write(data)
            offset += len(data)
            if progress is not None:
                progress(offset, got.size)
            if len(data) < chunk_bytes or offset >= got.size:
                return offset
            params = _RangedRead(path, offset, chunk_bytes)
            got = await client._call(p.FS_READ_FILE, params, _RangedReadResult)
    finally:
        if owned:
            out.close()


async def upload(
    client: ClientApi,
    path: str,
    local_file: str | os.PathLike[str] | BinaryIO,
    *,
    chunk_bytes: int = TRANSFER_CHUNK_BYTES,
    progress: Progress | None = None,
) -> int:
    """Copy ``local_file`` (a path or a binary file, e.g. stdin) to the remote ``path``.

    A file that fits in one chunk is written with one plain ``fs/writeFile``
    (an atomic replacement). A larger one is written in place, range by
    range: the first range truncates the remote file (``offset: 0,
    truncate: true``), each next one extends it; until the last range
    arrives, readers see a partial file. Returns the bytes copied.
    """
    source, owned = _open_local(local_file, write=False)
    try:
        try:
            total: int | None = os.fstat(source.fileno()).st_size
        except (OSError, ValueError, AttributeError):
            total = None
        data = source.read(chunk_bytes)
        following = source.read(chunk_bytes) if len(data) == chunk_bytes else b""
        if not following:
            await client._call(p.FS_WRITE_FILE, p.FsWriteFileParams(path, data), p.Empty)
            if progress is not None:
                progress(len(data), len(data))
            return len(data)
        _require_ranges(client, RANGE_CAPABILITIES[1])
        offset = 0
        while data:
            params = _RangedWrite(path, data, offset, truncate=True if offset == 0 else None)
            await client._call(p.FS_WRITE_FILE, params, p.Empty)
            offset += len(data)
            if progress is not None:
                progress(offset, total)
            data, following = following, source.read(chunk_bytes) if following else b""
        return offset
    finally:
        if owned:
            source.close()


class FileTransfers:
    """:func:`upload` and :func:`download` as methods of a client."""

    def upload(
        self,
        path: str,
        local_file: str | os.PathLike[str] | BinaryIO,
        *,
        chunk_bytes: int = TRANSFER_CHUNK_BYTES,
        progress: Progress | None = None,
    ) -> Deferred[int]:
        assert isinstance(self, ClientApi)
        return Deferred.fromCoroutine(
            upload(self, path, local_file, chunk_bytes=chunk_bytes, progress=progress)
        )

    def download(
        self,
        path: str,
        local_file: str | os.PathLike[str] | BinaryIO,
        *,
        chunk_bytes: int = TRANSFER_CHUNK_BYTES,
        progress: Progress | None = None,
    ) -> Deferred[int]:
        assert isinstance(self, ClientApi)
        return Deferred.fromCoroutine(
            download(self, path, local_file, chunk_bytes=chunk_bytes, progress=progress)
        )


class ProgressBar:
    """A one-line progress display on a terminal (stderr), at most 10 updates/s."""

    def __init__(self, label: str, stream: TextIO | None = None) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self._last = 0.0
        self._shown = False

    def __call__(self, done: int, total: int | None) -> None:
        now = time.monotonic()
        if now - self._last < 0.1 and (total is None or done < total):
            return
        self._last = now
        mib = done / (1024 * 1024)
        if total:
            whole = total / (1024 * 1024)
            text = f"{self.label}: {mib:.1f} / {whole:.1f} MiB ({100 * done // total}%)"
        else:
            text = f"{self.label}: {mib:.1f} MiB"
        self.stream.write(f"\r{text}\x1b[K")
        self.stream.flush()
        self._shown = True

    def finish(self) -> None:
        if self._shown:
            self.stream.write("\n")
            self.stream.flush()


#: The positional arguments of each fs operation that name remote paths.
REMOTE_PATH_ARGS = ("path", "source", "destination")


def _write_stdout(data: bytes) -> None:
    from execserver.client.cli import write_all

    write_all(sys.stdout.fileno(), data)


def _when(ms: int) -> str:
    if ms <= 0:
        return "-"
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC).isoformat(timespec="seconds")


def resolve_remote_path(path: str, local_server: bool) -> str:
    """The absolute path to send for ``path`` as typed (see the module doc).

    Leading ``.`` and ``..`` components are resolved here: the working
    directory is a physical path (``getcwd`` has no symlinks), so its parent
    is what the kernel would use. Anything after them is sent as typed, for
    the server to resolve by its own rules.
    """
    from execserver.client.cli import EXIT_USAGE, CliError

    if not path:
        raise CliError("empty path", EXIT_USAGE)
    if os.path.isabs(path):
        return path
    if not local_server:
        raise CliError(
            f"`{path}` is a relative path: with --url give an absolute remote path "
            "(relative paths are resolved against this directory only with --stdio)",
            EXIT_USAGE,
        )
    base = os.getcwd()
    parts = path.split("/")
    while parts and parts[0] in ("", ".", ".."):
        if parts.pop(0) == "..":
            base = os.path.dirname(base)
    return os.path.join(base, *parts) if parts else base


def resolve_paths(args: argparse.Namespace, local_server: bool) -> None:
    """Replace each remote path argument of ``args`` by the path to send."""
    from execserver.client.cli import CliError

    for name in REMOTE_PATH_ARGS:
        value = getattr(args, name, None)
        if isinstance(value, str):
            try:
                setattr(args, name, resolve_remote_path(value, local_server))
            except CliError as exc:
                raise CliError(f"fs {args.fs_command}: {exc}", exc.exit_code) from None


def describe(args: argparse.Namespace) -> str:
    """``fs OP PATH...``, for error messages."""
    paths = [getattr(args, n) for n in REMOTE_PATH_ARGS if isinstance(getattr(args, n, None), str)]
    return " ".join(["fs", args.fs_command, *paths])


def _progress(label: str) -> ProgressBar | None:
    return ProgressBar(label) if sys.stderr.isatty() else None


async def _transfer(client: ClientApi, args: argparse.Namespace) -> None:
    """``fs put LOCAL PATH`` / ``fs get PATH LOCAL`` in ranges (``-``: stdin/stdout)."""
    from execserver.client.cli import EXIT_USAGE, CliError

    bar = _progress(f"{args.fs_command} {args.path}")
    try:
        if args.fs_command == "put":
            local: str | BinaryIO = sys.stdin.buffer if args.local == "-" else args.local
            try:
                await upload(client, args.path, local, progress=bar)
            except OSError as exc:
                raise CliError(f"cannot read {args.local}: {exc.strerror}", EXIT_USAGE) from None
        else:
            local = sys.stdout.buffer if args.local == "-" else args.local
            try:
                await download(client, args.path, local, progress=bar)
            except OSError as exc:
                raise CliError(f"cannot write {args.local}: {exc.strerror}", EXIT_USAGE) from None
            if args.local == "-":
                sys.stdout.buffer.flush()
    finally:
        if bar is not None:
            bar.finish()


async def run_fs_command(client: ClientApi, args: argparse.Namespace) -> int:
    op = args.fs_command
    if op == "cat":
        response = await client.fs_read_file(args.path)
        _write_stdout(response.data_base64)
    elif op in ("put", "get"):
        await _transfer(client, args)
    elif op == "ls":
        listing = await client.fs_read_directory(args.path)
        lines = []
        for entry in sorted(listing.entries, key=lambda e: e.file_name):
            suffix = "/" if entry.is_directory else ("@" if entry.is_symlink is True else "")
            lines.append(f"{entry.file_name}{suffix}\n")
        _write_stdout("".join(lines).encode("utf-8", "surrogateescape"))
    elif op == "stat":
        meta = await client.fs_get_metadata(args.path)
        kind = "directory" if meta.is_directory else "file" if meta.is_file else "other"
        if meta.is_symlink is True:
            kind = f"symlink to {kind}"
        fields = [f"path: {args.path}", f"type: {kind}"]
        if isinstance(meta.size, int):
            fields.append(f"size: {meta.size}")
        fields.append(f"created: {_when(meta.created_at_ms)}")
        fields.append(f"modified: {_when(meta.modified_at_ms)}")
        _write_stdout(("\n".join(fields) + "\n").encode())
    elif op == "rm":
        await client.fs_remove(args.path, recursive=args.r, force=args.f)
    elif op == "cp":
        await client.fs_copy(args.source, args.destination, recursive=args.r)
    elif op == "mkdir":
        await client.fs_create_directory(args.path, recursive=args.p)
    else:  # pragma: no cover - argparse restricts the choices
        raise AssertionError(op)
    return 0
