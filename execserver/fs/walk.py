"""``fs/canonicalize`` and ``fs/walk``: the reference's path resolution and bounded walk.

Codex 0.171 finds workspace skills (``.agents/skills``) through them: it
canonicalizes the project directory and walks the skill roots. Both follow
the reference (Codex's ``ExecutorFileSystem::canonicalize`` and its bounded
``walk``), field for field:

- ``fs/canonicalize {path}`` -> ``{path}``: every symlink and ``..``
  resolved; a path that does not exist (a dangling symlink too) is the
  not-found error, a component that is not a directory ``Not a directory
  (os error 20)``.
- ``fs/walk {path, options: {maxDepth, maxDirectories, maxEntries,
  followDirectorySymlinks}}`` -> ``{entries: [{path, kind}], errors: [{path,
  message}], truncated}``: breadth first, each directory's names sorted by
  their bytes; only directories and regular files are listed (``kind``
  ``directory`` / ``file``); a symlink only when following and it points
  to a directory. Each directory is entered once (by its canonical path
  when following). ``maxEntries`` counts the names looked at (the walk
  stops when one more would be looked at), ``maxDirectories`` the
  directories entered (the root is one), ``maxDepth`` the levels below the
  root that are entered (0: the root's names only). A directory that cannot
  be read is an ``errors`` item, not a failure; the answer stops (with
  ``truncated``) before it would exceed 4 MiB (each item counted as its
  path, and message, plus 64 bytes). A root that is a file (or, unfollowed,
  a symlink) is an empty answer. Limits of 0 or above 64 / 10000 / 50000
  are ``-32600``.

The blocking work runs on the fs pool, as every fs/* call does.
"""

from __future__ import annotations

import os
import stat
from collections import deque
from typing import Any, Final

from execserver.errors import RpcError
from execserver.fs.paths import absolute_path, oserrors, path_to_uri
from execserver.protocol import (
    FsCanonicalize,
    FsCanonicalizeParams,
    FsCanonicalizeResponse,
    FsWalk,
    FsWalkParams,
    FsWalkResponse,
    WalkEntry,
    WalkError,
    WalkOptions,
)
from execserver.spawn import os_error_text

MAX_WALK_DEPTH: Final = 64
MAX_WALK_DIRECTORIES: Final = 10_000
MAX_WALK_ENTRIES: Final = 50_000
#: The answer stops growing before this (paths and messages, plus the overhead per item).
MAX_WALK_RESPONSE_BYTES: Final = 4 * 1024 * 1024
WALK_ITEM_OVERHEAD_BYTES: Final = 64


def check_options(options: WalkOptions) -> None:
    """The reference's limits (``-32600``, its texts); negatives do not decode (``-32602``)."""
    if options.max_directories == 0 or options.max_entries == 0:
        raise RpcError.invalid_request("filesystem walk limits must be greater than zero")
    if (
        options.max_depth > MAX_WALK_DEPTH
        or options.max_directories > MAX_WALK_DIRECTORIES
        or options.max_entries > MAX_WALK_ENTRIES
    ):
        raise RpcError.invalid_request(
            "filesystem walk limits exceed maximums: "
            f"depth={MAX_WALK_DEPTH}, directories={MAX_WALK_DIRECTORIES}, "
            f"entries={MAX_WALK_ENTRIES}"
        )


def canonicalize(path: str) -> str:
    """Every symlink and ``..`` of ``path`` resolved (blocking; raises OSError)."""
    return os.path.realpath(path, strict=True)


class _Answer:
    """The walk's answer and its size so far."""

    def __init__(self, render: Any) -> None:
        self.render = render
        self.outcome = FsWalkResponse()
        self.size = 0

    def reserve(self, content_bytes: int) -> bool:
        total = self.size + content_bytes + WALK_ITEM_OVERHEAD_BYTES
        if total > MAX_WALK_RESPONSE_BYTES:
            self.outcome.truncated = True
            return False
        self.size = total
        return True

    def error(self, path: str, exc: OSError) -> bool:
        message = os_error_text(exc.errno) if exc.errno else str(exc)
        shown = self.render(path)
        if not self.reserve(len(shown) + len(message)):
            return False
        self.outcome.errors.append(WalkError(shown, message))
        return True


def _sorted_names(directory: str) -> list[str]:
    names = os.listdir(directory)
    names.sort(key=lambda name: name.encode("utf-8", "surrogateescape"))
    return names


def walk(root: str, options: WalkOptions, render: Any = path_to_uri) -> FsWalkResponse:
    """The reference's bounded walk of ``root`` (blocking; a missing root raises OSError).

    ``render`` turns a path into what the answer shows (a URI, or the path).
    """
    follow = options.follow_directory_symlinks
    root_stat = os.stat(root)
    if not stat.S_ISDIR(root_stat.st_mode) or (not follow and stat.S_ISLNK(os.lstat(root).st_mode)):
        return FsWalkResponse()
    answer = _Answer(render)
    outcome = answer.outcome
    visited = {canonicalize(root) if follow else root}
    queue: deque[tuple[str, int]] = deque([(root, 0)])
    directories = 1
    looked_at = 0
    while queue:
        directory, depth = queue.popleft()
        try:
            names = _sorted_names(directory)
        except OSError as exc:
            if not answer.error(directory, exc):
                return outcome
            continue
        for name in names:
            if looked_at == options.max_entries:
                outcome.truncated = True
                return outcome
            looked_at += 1
            path = directory.rstrip("/") + "/" + name
            try:
                is_link = stat.S_ISLNK(os.lstat(path).st_mode)
                mode = os.stat(path).st_mode
            except OSError as exc:
                if is_link_or_gone(path):
                    continue  # a dangling symlink, or removed while we walked
                if not answer.error(path, exc):
                    return outcome
                continue
            is_dir = stat.S_ISDIR(mode)
            if is_link and not (follow and is_dir):
                continue
            if not is_dir and not stat.S_ISREG(mode):
                continue
            shown = render(path)
            if not answer.reserve(len(shown)):
                return outcome
            outcome.entries.append(WalkEntry(shown, "directory" if is_dir else "file"))
            if not is_dir or depth >= options.max_depth:
                continue
            if follow:
                try:
                    identity = canonicalize(path)
                except OSError as exc:
                    if not answer.error(path, exc):
                        return outcome
                    continue
            else:
                identity = path
            if identity in visited:
                continue
            visited.add(identity)
            if directories == options.max_directories:
                outcome.truncated = True
            else:
                directories += 1
                queue.append((path, depth + 1))
    return outcome


def is_link_or_gone(path: str) -> bool:
    """Whether ``path`` is a symlink (whose target failed) or no longer there."""
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return True


def register(router: Any, run: Any) -> None:
    """Add ``fs/canonicalize`` and ``fs/walk`` to ``router``; the work runs on ``run`` (fs pool)."""

    def render_for(conn: Any) -> Any:
        # Paths as the client's dialect shows them: URIs to current clients.
        return path_to_uri if getattr(conn, "speaks_current_dialect", False) else _plain

    def handle_canonicalize(conn: Any, params: FsCanonicalizeParams) -> Any:
        path = absolute_path(params.path)
        render = render_for(conn)
        return run(_canonicalize_op, path, owner=conn).addCallback(
            lambda resolved: FsCanonicalizeResponse(render(resolved))
        )

    def handle_walk(conn: Any, params: FsWalkParams) -> Any:
        path = absolute_path(params.path)
        check_options(params.options)
        return run(_walk_op, path, params.options, render_for(conn), owner=conn)

    router.add_method(FsCanonicalize, handle_canonicalize)
    router.add_method(FsWalk, handle_walk)


def _plain(path: str) -> str:
    return path


#: On the pool: the root's OSErrors become the fs errors (-32004 for a missing one).
_canonicalize_op = oserrors(canonicalize)
_walk_op = oserrors(walk)
