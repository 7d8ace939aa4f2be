"""Which fs calls may run on the reactor thread: the inline rule.

A thread hop costs far more than a ``stat`` of a cached inode, so small
calls run inline when they provably touch only local file systems. The
rule (docs/filesystem.md, "Inline or pool"):

- only ``fs/getMetadata``, ``fs/readDirectory`` of a directory whose size
  is at most :data:`SMALL_DIRECTORY_BYTES` and ``fs/readFile`` of a
  regular file of at most 64 KiB; nothing that writes, copies or removes;
- the path has no ``..`` (resolving it looks at the disk);
- the directory looked in (the parent, or for ``readDirectory`` the
  directory itself) was verified on the pool within the last
  :data:`VERIFIED_SECONDS`: its path has no symlink in it (so the kernel's
  walk is the path as written) and every mount it crosses is of a local
  type (:data:`LOCAL_TYPES`: never NFS, CIFS, FUSE, 9p, ``/proc``...);
- the final component is neither a symlink (its target may be anywhere)
  nor the mount point of a non-local file system; in a listing, an entry
  that is a symlink or such a mount point sends the whole call to the pool.

Anything else goes to the pool; so does a call whose inline attempt finds
one of these conditions untrue. A FIFO or device is never opened inline
(``readFile`` opens only what ``lstat`` says is a regular file, with
``O_NONBLOCK | O_NOFOLLOW``, and checks ``fstat``). What stays possible is a
local disk's latency for an inode or block not in the page cache (bounded
by the device, not by a remote server), and a directory swapped for a
symlink within the verification window.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import time
from collections.abc import Callable
from typing import Final

from execserver import protocol as p
from execserver.codec import RenderedParts
from execserver.fs import b64
from execserver.fs.paths import lossy, lstatx, os_error, unix_ms
from execserver.sandbox.policy import is_within

#: File system types whose calls never wait on another machine or process.
LOCAL_TYPES: Final = frozenset(
    {
        "ext2",
        "ext3",
        "ext4",
        "xfs",
        "btrfs",
        "f2fs",
        "tmpfs",
        "ramfs",
        "overlay",
        "zfs",
        "vfat",
        "exfat",
        "ntfs3",
        "jfs",
        "reiserfs",
        "bcachefs",
    }
)
#: How long a directory verified on the pool stays trusted.
VERIFIED_SECONDS: Final = 1.0
#: Directories listed inline at most this large (``st_size``; about 100-200 entries).
SMALL_DIRECTORY_BYTES: Final = 4096
#: Trusted directories remembered at most (the memory of the cache).
MAX_VERIFIED: Final = 4096
MOUNTINFO: Final = "/proc/self/mountinfo"


class NotInline(Exception):
    """The call must go to the pool after all."""


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo.
    if "\\" not in field:
        return field
    return field.encode().decode("unicode_escape").encode("latin-1").decode("utf-8", "replace")


def remote_mounts(text: str) -> frozenset[str]:
    """Mount points of non-local file systems in a mountinfo text."""
    remote = set()
    for line in text.splitlines():
        fields = line.split()
        try:
            dash = fields.index("-")
            point, fstype = _unescape(fields[4]), fields[dash + 1]
        except (ValueError, IndexError):
            continue
        if fstype not in LOCAL_TYPES:
            remote.add(point)
    return frozenset(remote)


class Locality:
    """Trusted directories (verified on the pool) and the non-local mounts.

    :meth:`verify` runs on the pool (it reads the mount table and resolves
    symlinks); :meth:`trusted` is a dictionary look-up on the reactor thread.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        mountinfo: str = MOUNTINFO,
    ) -> None:
        self._clock = clock
        self._mountinfo = mountinfo
        self._trusted: dict[str, float] = {}
        self._remote: frozenset[str] = frozenset({"/"})  # nothing is local until read
        self._remote_read_at = -VERIFIED_SECONDS

    def trusted(self, directory: str) -> bool:
        until = self._trusted.get(directory)
        return until is not None and until > self._clock()

    def is_remote_mount(self, path: str) -> bool:
        return path in self._remote

    def verify(self, directory: str) -> None:
        """Trust ``directory`` for a while if the rule allows (blocking: on the pool)."""
        if self.trusted(directory):
            return
        now = self._clock()
        if now - self._remote_read_at >= VERIFIED_SECONDS:
            try:
                with open(self._mountinfo, encoding="utf-8", errors="replace") as f:
                    self._remote = remote_mounts(f.read())
            except OSError:
                self._remote = frozenset({"/"})
            self._remote_read_at = now
        remote = self._remote
        if any(is_within(directory, point) for point in remote):
            return
        try:
            if os.path.realpath(directory, strict=True) != directory:
                return  # a symlink on the way
        except OSError:
            return
        if len(self._trusted) >= MAX_VERIFIED:
            self._trusted.clear()
        self._trusted[directory] = now + VERIFIED_SECONDS


def parent_of(path: str) -> str:
    return path.rpartition("/")[0] or "/"


#: The reactor thread's statx buffer (inline calls run only there).
_REACTOR_BUFFER: Final = ctypes.create_string_buffer(256)


def inline_eligible(locality: Locality, path: str, directory: str) -> bool:
    """Whether ``path`` (looked up in ``directory``) may be tried inline."""
    return (
        path != "/"
        and "/../" not in path + "/"
        and locality.trusted(directory)
        and not locality.is_remote_mount(path)
    )


def get_metadata(path: str) -> p.FsGetMetadataResponse:
    """``fs/getMetadata`` inline: one ``statx`` of the path itself (no symlink, so it
    is the ``stat``), with the birth time in the same call."""
    try:
        found = lstatx(path, _REACTOR_BUFFER)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            raise os_error(exc) from None
        raise NotInline from None
    if found is None:
        raise NotInline
    mode, size, mtime_ns, birth_ms = found
    if stat.S_ISLNK(mode):
        raise NotInline
    return p.FsGetMetadataResponse(
        is_directory=stat.S_ISDIR(mode),
        is_file=stat.S_ISREG(mode),
        created_at_ms=birth_ms,
        modified_at_ms=unix_ms(mtime_ns),
        is_symlink=False,
        size=size,
    )


def read_directory(locality: Locality, path: str) -> p.FsReadDirectoryResponse:
    """``fs/readDirectory`` inline, for a small directory without symlinks or remote mounts."""
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_size > SMALL_DIRECTORY_BYTES:
            raise NotInline
        entries: list[p.FsReadDirectoryEntry] = []
        with os.scandir(path) as it:
            for entry in it:
                if entry.is_symlink() or locality.is_remote_mount(entry.path):
                    raise NotInline
                entries.append(
                    p.FsReadDirectoryEntry(
                        file_name=lossy(entry.name),
                        is_directory=entry.is_dir(follow_symlinks=False),
                        is_file=entry.is_file(follow_symlinks=False),
                        is_symlink=False,
                    )
                )
    except OSError:
        raise NotInline from None  # the pool gives the error, with its rules
    return p.FsReadDirectoryResponse(entries)


def read_small_file(path: str, small: int) -> RenderedParts:
    """``fs/readFile`` (whole) inline, of a regular file of at most ``small`` bytes."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > small:
            raise NotInline
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY | os.O_NOFOLLOW
        fd = os.open(path, flags)
        try:
            own = os.fstat(fd)
            if not stat.S_ISREG(own.st_mode) or own.st_size > small:
                raise NotInline
            data = os.read(fd, small + 1)
        finally:
            os.close(fd)
    except OSError:
        raise NotInline from None
    if len(data) > small:
        raise NotInline
    return RenderedParts((b'{"dataBase64":"', *b64.encode_pieces(data), b'"}'))
