"""The ``fs`` subcommands of ``exec-server-client`` over the typed fs methods.

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

from execserver.client.client import ExecServerClient

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


async def run_fs_command(client: ExecServerClient, args: argparse.Namespace) -> int:
    op = args.fs_command
    if op == "cat":
        response = await client.fs_read_file(args.path)
        _write_stdout(response.data_base64)
    elif op == "put":
        if args.local == "-":
            data = sys.stdin.buffer.read()
        else:
            from execserver.client.cli import EXIT_USAGE, CliError

            try:
                with open(args.local, "rb") as f:
                    data = f.read()
            except OSError as exc:
                raise CliError(f"cannot read {args.local}: {exc.strerror}", EXIT_USAGE) from None
        await client.fs_write_file(args.path, data)
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
