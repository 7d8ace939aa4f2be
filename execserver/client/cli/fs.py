"""``fs``: file operations on the server (cat, put, get, ls, stat, rm, cp, mkdir).

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
from typing import Any, BinaryIO, TextIO

from execserver import protocol as p
from execserver.client.api import ClientApi
from execserver.client.cli.common import (
    EXIT_CONNECTION,
    EXIT_REMOTE_ERROR,
    EXIT_USAGE,
    CliError,
    connect,
    connection_options,
    write_all,
)
from execserver.client.errors import ExecServerError, RangesNotSupported, ServerError
from execserver.client.fs import download, upload

_REMOTE = "remote path (a relative one is resolved against this directory with --stdio)"
_FS_COMMANDS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("cat", "write a remote file to stdout", [("path", _REMOTE)]),
    (
        "put",
        "write stdin or a local file to a remote file (in 8 MiB ranges; progress on a terminal)",
        [("local", "local file, or - for stdin"), ("path", _REMOTE)],
    ),
    (
        "get",
        "copy a remote file to a local file or stdout (in 8 MiB ranges; progress on a terminal)",
        [("path", _REMOTE), ("local", "local file, or - for stdout")],
    ),
    ("ls", "list a remote directory", [("path", _REMOTE)]),
    ("stat", "show a remote path's metadata", [("path", _REMOTE)]),
    (
        "rm",
        "remove a remote path",
        [("path", _REMOTE), ("-r", "recursive"), ("-f", "ignore a missing path")],
    ),
    (
        "cp",
        "copy on the remote host",
        [("source", _REMOTE), ("destination", _REMOTE), ("-r", "recursive")],
    ),
    ("mkdir", "create a remote directory", [("path", _REMOTE), ("-p", "create parents")]),
]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``fs`` subcommand and its operations."""
    fs = sub.add_parser("fs", help="file operations: cat put get ls stat rm cp mkdir")
    connection_options(fs)
    fs_sub = fs.add_subparsers(dest="fs_command", required=True, metavar="OP")
    for name, help_text, args in _FS_COMMANDS:
        op = fs_sub.add_parser(name, help=help_text)
        connection_options(op, suppress=True)
        for arg, arg_help in args:
            if arg.startswith("-"):
                op.add_argument(arg, action="store_true", help=arg_help)
            else:
                op.add_argument(arg, help=arg_help)


class ProgressBar:
    """A one-line progress display on a terminal (stderr), at most 10 updates/s.

    Shows the bytes moved, the share of the file and the average rate since
    the transfer began (``9.0 / 9.0 MiB (100%), 212.4 MiB/s``).
    """

    def __init__(
        self, label: str, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self._clock = clock
        self._started = clock()
        self._last = 0.0
        self._shown = False

    def __call__(self, done: int, total: int | None) -> None:
        now = self._clock()
        if now - self._last < 0.1 and (total is None or done < total):
            return
        self._last = now
        mib = done / (1024 * 1024)
        if total:
            whole = total / (1024 * 1024)
            text = f"{self.label}: {mib:.1f} / {whole:.1f} MiB ({100 * done // total}%)"
        else:
            text = f"{self.label}: {mib:.1f} MiB"
        elapsed = now - self._started
        if elapsed > 0:
            text += f", {mib / elapsed:.1f} MiB/s"
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


def _no_ranges(args: argparse.Namespace) -> str:
    """What ``put``/``get`` say to a server without ranged ``fs`` calls (a baseline one)."""
    if args.fs_command == "get":
        return (
            f"{describe(args)}: the server does not support ranged reads "
            f"({p.FS_READ_FILE}:range); `fs cat` reads a file in one call"
        )
    return (
        f"{describe(args)}: the server does not support ranged writes "
        f"({p.FS_WRITE_FILE}:range), so only a file of at most one 8 MiB range can be put"
    )


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


async def run_fs(reactor: Any, args: argparse.Namespace) -> int:
    # Before connecting: a path that cannot be sent is a usage error (unless
    # no server is given at all, which connect() reports).
    if args.stdio or args.url or os.environ.get("EXEC_SERVER_URL"):
        resolve_paths(args, local_server=bool(args.stdio))
    client = await connect(reactor, args)
    try:
        return await run_fs_command(client, args)
    except ServerError as exc:
        raise CliError(f"{describe(args)}: {exc.message}", EXIT_REMOTE_ERROR) from None
    except RangesNotSupported:
        raise CliError(_no_ranges(args), EXIT_REMOTE_ERROR) from None
    except ExecServerError as exc:
        raise CliError(f"{describe(args)}: {exc}", EXIT_CONNECTION) from None
    finally:
        await client.close()
