"""What a killed server leaves behind, and how the next one cleans it up.

``fs/writeFile`` writes its bytes to a temporary file first. Its name
carries the writing server's identity (:attr:`Journal.owner`: boot, pid and
process start time), and the directory it lives in is recorded once per
server in the state directory (``<state>/writes/<owner>.dirs``). A write
that must go through the target's own inode (hard links, an unwritable
directory, an owner that cannot be kept) is copied back from that temporary
file under a record (``<state>/writes/<owner>-<token>.copy``) written and
synced before the target is touched and removed once the target is synced.

A server starting on the same state directory (:meth:`Journal.recover`,
before it serves anything) looks at every record whose owner is gone (no
process with that pid and start time on this boot):

- a copy-back record whose temporary file is complete is replayed (the
  copy is idempotent) onto the same inode, then both are removed;
- the temporary files in the recorded directories whose names carry the
  dead owner (``.exec-server-<owner>-<16 hex>.tmp``), are regular files
  and belong to this user are removed; nothing else is touched.

The state directory is ``$EXECSERVER_STATE_DIR``, else
``$XDG_STATE_HOME/exec-server``, else ``~/.local/state/exec-server``. If it
cannot be created the journal is off (:attr:`Journal.enabled`): writes
still go through a temporary file, but nothing is recorded or recovered.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import stat
import threading
from typing import Any, Final

from twisted.logger import Logger

from execserver.fs.paths import libc_function

_log = Logger()

STATE_ENV: Final = "EXECSERVER_STATE_DIR"
_TEMP_PREFIX: Final = ".exec-server-"
_TEMP_SUFFIX: Final = ".tmp"
_OWNER: Final = r"[0-9a-f]{8}-[0-9]+-[0-9]+"
_TEMP_NAME: Final = re.compile(rf"\.exec-server-({_OWNER})-[0-9a-f]{{16}}\.tmp\Z")
_DIRS_NAME: Final = re.compile(rf"({_OWNER})\.dirs\Z")
_COPY_NAME: Final = re.compile(rf"({_OWNER})-[0-9a-f]{{16}}\.copy\Z")
#: Bytes per ``copy_file_range`` of a copy-back.
_COPY_STEP: Final = 64 * 1024 * 1024


def default_state_dir() -> str:
    explicit = os.environ.get(STATE_ENV)
    if explicit:
        return explicit
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state"
    )
    return os.path.join(base, "exec-server")


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip().replace("-", "")[:8]
    except OSError:
        return "00000000"


def _start_time(pid: int) -> int | None:
    """The start time (clock ticks after boot) of process ``pid``, None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after it.
    fields = text[text.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def owner_of(pid: int) -> str | None:
    start = _start_time(pid)
    return None if start is None else f"{_boot_id()}-{pid}-{start}"


def _alive(owner: str) -> bool:
    boot, pid, _start = owner.split("-")
    return boot == _boot_id() and owner_of(int(pid)) == owner


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_back(temp_fd: int, target_fd: int, size: int) -> None:
    """Overwrite ``target_fd`` with the ``size`` bytes of ``temp_fd``, end it there, sync it.

    Overwrites from offset 0 without truncating first, and ends the file
    with ``ftruncate`` after the copy: a copy cut short leaves the new
    bytes up to some offset and the old ones after it, which a replay of
    the same copy repairs.
    """
    _reserve(target_fd, size)
    offset = 0
    while offset < size:
        try:
            count = os.copy_file_range(
                temp_fd, target_fd, min(_COPY_STEP, size - offset), offset, offset
            )
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            count = _copy_slow(temp_fd, target_fd, offset, min(_COPY_STEP, size - offset))
        if not count:
            raise OSError(errno.EIO, "temporary file ended early")
        offset += count
    os.ftruncate(target_fd, size)
    os.fsync(target_fd)


def _copy_slow(src: int, dst: int, offset: int, length: int) -> int:
    data = os.pread(src, min(length, 1 << 20), offset)
    view = memoryview(data)
    at = offset
    while view:
        written = os.pwrite(dst, view, at)
        view = view[written:]
        at += written
    return len(data)


def _reserve(fd: int, size: int) -> None:
    """Allocate ``size`` bytes of ``fd`` without changing its size (``FALLOC_FL_KEEP_SIZE``).

    A disk too full for the new contents fails here, before anything is
    overwritten. File systems without ``fallocate`` are written without it.
    """
    if size <= 0:
        return
    try:
        _fallocate(fd, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise


def _load_fallocate() -> Any:
    import ctypes

    func = libc_function(
        "fallocate64", [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64], ctypes.c_int
    )
    return None if func is None else (func, ctypes.get_errno)


_FALLOCATE: Final[Any] = _load_fallocate()
_FALLOC_FL_KEEP_SIZE: Final = 1


def _fallocate(fd: int, size: int) -> None:
    if _FALLOCATE is None:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))
    func, get_errno = _FALLOCATE
    if func(fd, _FALLOC_FL_KEEP_SIZE, 0, size) != 0:
        code = get_errno()
        raise OSError(code, os.strerror(code))


class Journal:
    """Temporary-file names, their registry, and the copy-back records of one server."""

    def __init__(self, root: str | None = None) -> None:
        self.owner = owner_of(os.getpid()) or f"{_boot_id()}-{os.getpid()}-0"
        self.root = root if root is not None else default_state_dir()
        self.directory = os.path.join(self.root, "writes")
        self.enabled = False
        self._lock = threading.Lock()
        self._registered: set[str] = set()

    def open(self) -> bool:
        """Create the state directory; whether the journal is on."""
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            st = os.stat(self.directory)
            self.enabled = stat.S_ISDIR(st.st_mode) and os.access(self.directory, os.W_OK | os.X_OK)
        except OSError as exc:
            _log.warn(
                "fs journal off: cannot use the state directory {path}: {error}",
                path=self.directory,
                error=exc.strerror,
            )
            self.enabled = False
        return self.enabled

    # --- temporary files -------------------------------------------------------

    def temp_path(self, directory: str) -> str:
        """A fresh temporary-file name in ``directory``, which is registered first."""
        if self.enabled and directory not in self._registered:
            self._register(directory)
        return os.path.join(
            directory, f"{_TEMP_PREFIX}{self.owner}-{secrets.token_hex(8)}{_TEMP_SUFFIX}"
        )

    def _register(self, directory: str) -> None:
        with self._lock:
            if directory in self._registered:
                return
            line = json.dumps(directory, ensure_ascii=False) + "\n"
            path = os.path.join(self.directory, f"{self.owner}.dirs")
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
                try:
                    os.write(fd, line.encode("utf-8", "surrogateescape"))
                finally:
                    os.close(fd)
            except OSError:
                return  # not recorded: a crash leaves this directory's temporaries
            if len(self._registered) < 65536:
                self._registered.add(directory)

    # --- copy-back records -----------------------------------------------------

    def begin_copy(self, temp: str, target: str, st: os.stat_result, size: int) -> str | None:
        """Record (and sync) that ``temp`` is being copied onto ``target``'s inode."""
        if not self.enabled:
            return None
        record = os.path.join(self.directory, f"{self.owner}-{secrets.token_hex(8)}.copy")
        body = {"temp": temp, "target": target, "dev": st.st_dev, "ino": st.st_ino, "size": size}
        data = json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogateescape")
        fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_dir(self.directory)
        return record

    def end_copy(self, record: str | None) -> None:
        if record is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(record)

    # --- recovery --------------------------------------------------------------

    def recover(self) -> tuple[int, int]:
        """Replay and clean up after dead servers: (copies replayed, temporaries removed)."""
        if not self.enabled:
            return 0, 0
        try:
            names = sorted(os.listdir(self.directory))
        except OSError:
            return 0, 0
        replayed = removed = 0
        alive: dict[str, bool] = {}

        def dead(owner: str) -> bool:
            if owner not in alive:
                alive[owner] = owner != self.owner and not _alive(owner)
            return alive[owner]

        for name in names:
            found = _COPY_NAME.match(name)
            if found and dead(found.group(1)):
                replayed += self._replay(os.path.join(self.directory, name))
        for name in names:
            found = _DIRS_NAME.match(name)
            if found and dead(found.group(1)):
                removed += self._clean(os.path.join(self.directory, name), found.group(1))
        if replayed or removed:
            _log.info(
                "fs journal: replayed {replayed} interrupted write(s), "
                "removed {removed} temporary file(s) of stopped servers",
                replayed=replayed,
                removed=removed,
            )
        return replayed, removed

    def _replay(self, record: str) -> int:
        done = 0
        try:
            with open(record, "rb") as f:
                body = json.loads(f.read().decode("utf-8", "surrogateescape"))
            temp, target = str(body["temp"]), str(body["target"])
            dev, ino, size = int(body["dev"]), int(body["ino"]), int(body["size"])
        except (OSError, ValueError, KeyError, TypeError):
            body = None
        if body is not None:
            done = self._replay_copy(temp, target, dev, ino, size)
            with contextlib.suppress(OSError):
                os.unlink(temp)
        with contextlib.suppress(OSError):
            os.unlink(record)
        return done

    @staticmethod
    def _replay_copy(temp: str, target: str, dev: int, ino: int, size: int) -> int:
        flags = os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY | os.O_NOFOLLOW
        try:
            src = os.open(temp, os.O_RDONLY | flags)
        except OSError:
            return 0
        try:
            own = os.fstat(src)
            if not stat.S_ISREG(own.st_mode) or own.st_size != size:
                return 0  # not the complete new contents: the target was not touched
            try:
                dst = os.open(target, os.O_WRONLY | flags)
            except OSError:
                return 0
            try:
                st = os.fstat(dst)
                if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (dev, ino):
                    return 0  # replaced since: not ours to write
                copy_back(src, dst, size)
                return 1
            finally:
                os.close(dst)
        except OSError as exc:
            _log.warn(
                "fs journal: could not replay the write of {target}: {error}",
                target=target,
                error=exc.strerror,
            )
            return 0
        finally:
            os.close(src)

    def _clean(self, registry: str, owner: str) -> int:
        removed = 0
        try:
            with open(registry, "rb") as f:
                lines = f.read().decode("utf-8", "surrogateescape").splitlines()
        except OSError:
            lines = []
        uid = os.geteuid()
        for line in lines:
            try:
                directory = json.loads(line)
            except ValueError:
                continue
            if not isinstance(directory, str):
                continue
            try:
                entries = os.listdir(directory)
            except OSError:
                continue
            for name in entries:
                found = _TEMP_NAME.match(name)
                if not found or found.group(1) != owner:
                    continue
                path = os.path.join(directory, name)
                try:
                    st = os.lstat(path)
                    if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
                        os.unlink(path)
                        removed += 1
                except OSError:
                    continue
        with contextlib.suppress(OSError):
            os.unlink(registry)
        return removed


_JOURNAL: Journal | None = None


def journal() -> Journal:
    """This server's journal (created, off, on first use; :func:`start` turns it on)."""
    global _JOURNAL
    if _JOURNAL is None:
        _JOURNAL = Journal()
    return _JOURNAL


def start() -> tuple[int, int]:
    """At server start: open the state directory and recover after dead servers."""
    found = journal()
    if not found.enabled and not found.open():
        return 0, 0
    return found.recover()
