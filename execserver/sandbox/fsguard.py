"""fs/* calls under a sandbox: each confined call runs on a fresh, confined thread.

The kernel enforces the policy, so no check can be raced:

* ``mount-namespace`` (the server has ``CAP_SYS_ADMIN``, e.g. runs as
  root): the thread leaves the server's mount namespace
  (``unshare(CLONE_NEWNS | CLONE_FS)`` affects the calling thread only),
  makes every mount private, then rebuilds the policy as mounts, as
  bubblewrap does for the reference's fs helper: ``/`` read-only unless
  writable, each writable root a read-write bind mount, each read-only
  carve-out (``.git``, ``.codex``, ...) a read-only bind mount, each hidden
  path covered by an empty read-only tmpfs (``/dev/null`` for a file).
  A write that would leave the writable roots, by any route (a symlink
  swapped in meanwhile, ``..``, a renamed directory), meets a read-only
  mount and fails with ``EROFS``: the reference's ``Read-only file system
  (os error 30)``.
* ``landlock`` (no ``CAP_SYS_ADMIN``): the thread restricts itself with
  Landlock (also per thread) to writing under the writable roots. The
  kernel refuses an escaping write (``EACCES``); carve-outs and hidden
  paths inside a writable or readable root, which Landlock cannot
  express, are checked on the resolved path just before the operation.

Either way, a readable-roots policy (no ``root`` entry, e.g. ``minimal``)
also restricts reads with Landlock. The thread exits after its one
operation, so nothing it applied outlives it or reaches the server.

Before the operation, the target is resolved as the kernel would resolve
it (every symlink and ``..``) and checked, so the common refusals carry the
reference's texts: a write outside the writable roots or into a carve-out
is ``-32603 Read-only file system (os error 30)``; any access to a hidden
path (``none``/``deny``) is ``-32600 Permission denied (os error 13)``; a
read outside the readable roots is ``No such file or directory (os error
2)``, as the reference's sandbox (which does not mount them) answers.
"""

from __future__ import annotations

import _thread
import ctypes
import errno
import os
import stat
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, Literal, TypeVar

import attrs

from execserver import protocol as p
from execserver.errors import RpcError
from execserver.fs.paths import os_error, resolve_path
from execserver.sandbox.policy import (
    PathRule,
    SandboxPolicy,
    apply_floor,
    effective,
    is_within,
    realpath,
    resolve,
)

_T = TypeVar("_T")

Mechanism = Literal["mount-namespace", "landlock", "none"]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

_CLONE_NEWNS: Final = 0x00020000
_CLONE_FS: Final = 0x00000200
_MS_RDONLY: Final = 1
_MS_NOSUID: Final = 2
_MS_NODEV: Final = 4
_MS_NOEXEC: Final = 8
_MS_REMOUNT: Final = 32
_MS_BIND: Final = 4096
_MS_REC: Final = 16384
_MS_PRIVATE: Final = 1 << 18
_AT_FDCWD: Final = -100
_AT_RECURSIVE: Final = 0x8000
_MOUNT_ATTR_RDONLY: Final = 0x1
_SYS_MOUNT_SETATTR: Final = 442
_SYS_LANDLOCK_CREATE_RULESET: Final = 444
_SYS_LANDLOCK_ADD_RULE: Final = 445
_SYS_LANDLOCK_RESTRICT_SELF: Final = 446
_LANDLOCK_CREATE_RULESET_VERSION: Final = 1
_LANDLOCK_RULE_PATH_BENEATH: Final = 1
_PR_SET_NO_NEW_PRIVS: Final = 38

# Landlock filesystem rights (ABI 1..5).
_LL_EXECUTE: Final = 1 << 0
_LL_WRITE_FILE: Final = 1 << 1
_LL_READ_FILE: Final = 1 << 2
_LL_READ_DIR: Final = 1 << 3
_LL_REMOVE_DIR: Final = 1 << 4
_LL_REMOVE_FILE: Final = 1 << 5
_LL_MAKE_CHAR: Final = 1 << 6
_LL_MAKE_DIR: Final = 1 << 7
_LL_MAKE_REG: Final = 1 << 8
_LL_MAKE_SOCK: Final = 1 << 9
_LL_MAKE_FIFO: Final = 1 << 10
_LL_MAKE_BLOCK: Final = 1 << 11
_LL_MAKE_SYM: Final = 1 << 12
_LL_REFER: Final = 1 << 13  # ABI 2
_LL_TRUNCATE: Final = 1 << 14  # ABI 3
_LL_IOCTL_DEV: Final = 1 << 15  # ABI 5
_LL_READ: Final = _LL_READ_FILE | _LL_READ_DIR | _LL_EXECUTE
_LL_WRITE_ABI1: Final = (
    _LL_WRITE_FILE
    | _LL_REMOVE_DIR
    | _LL_REMOVE_FILE
    | _LL_MAKE_CHAR
    | _LL_MAKE_DIR
    | _LL_MAKE_REG
    | _LL_MAKE_SOCK
    | _LL_MAKE_FIFO
    | _LL_MAKE_BLOCK
    | _LL_MAKE_SYM
)


class _MountAttr(ctypes.Structure):
    _fields_ = (
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    )


class _RulesetAttr(ctypes.Structure):
    _fields_ = (("handled_access_fs", ctypes.c_uint64),)


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = (("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32))


class ConfinementFailed(Exception):
    """The confined thread could not be set up: the call is refused, never run unconfined."""


def _check(result: int, what: str) -> None:
    if result < 0:
        code = ctypes.get_errno()
        raise ConfinementFailed(f"{what}: {os.strerror(code)} (os error {code})")


def _mount(
    source: str | None, target: str, fstype: str | None, flags: int, data: str | None
) -> int:
    return int(
        _libc.mount(
            None if source is None else os.fsencode(source),
            os.fsencode(target),
            None if fstype is None else fstype.encode(),
            ctypes.c_ulong(flags),
            None if data is None else data.encode(),
        )
    )


def _set_readonly(path: str, readonly: bool) -> int:
    attr = _MountAttr(
        _MOUNT_ATTR_RDONLY if readonly else 0, 0 if readonly else _MOUNT_ATTR_RDONLY, 0, 0
    )
    return int(
        _libc.syscall(
            ctypes.c_long(_SYS_MOUNT_SETATTR),
            ctypes.c_int(_AT_FDCWD),
            ctypes.c_char_p(os.fsencode(path)),
            ctypes.c_uint(_AT_RECURSIVE),
            ctypes.byref(attr),
            ctypes.c_size_t(ctypes.sizeof(attr)),
        )
    )


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: none)."""
    result = int(
        _libc.syscall(
            ctypes.c_long(_SYS_LANDLOCK_CREATE_RULESET),
            None,
            ctypes.c_size_t(0),
            ctypes.c_uint32(_LANDLOCK_CREATE_RULESET_VERSION),
        )
    )
    return max(result, 0)


# --- refusals with the reference's texts ----------------------------------------------


def read_only_error(reason: str = "sandbox") -> RpcError:
    error = os_error(OSError(errno.EROFS, os.strerror(errno.EROFS)))
    error.data = {**error.data, "sandbox": reason}
    return error


def hidden_error() -> RpcError:
    error = os_error(OSError(errno.EACCES, os.strerror(errno.EACCES)))
    # The reference answers a denied (hidden) path with -32600.
    return RpcError.invalid_request(error.message, {**error.data, "sandbox": "hidden"})


def unreadable_error() -> RpcError:
    error = os_error(OSError(errno.ENOENT, os.strerror(errno.ENOENT)))
    error.data = {**error.data, "sandbox": "notReadable"}
    return error


def _physical(path: str) -> str:
    """``path`` with every symlink (the last component too) and ``..`` resolved."""
    return realpath(resolve_path(path))


def _entry(path: str) -> str:
    """``path`` with its parent resolved, the last component itself kept (not followed)."""
    path = resolve_path(path)
    if path == "/":
        return path
    parent, name = os.path.split(path)
    return os.path.join(realpath(parent), name)


def check_read(policy: SandboxPolicy, path: str, *, deep: bool = False) -> None:
    """Refuse a read of ``path`` the policy does not allow (``deep``: its whole tree is read)."""
    targets = {_physical(path), _entry(path)}
    for target in targets:
        if policy.access(target) == "none":
            raise hidden_error() if policy.is_hidden(target) else unreadable_error()
    if deep and any(
        hidden != target and is_within(hidden, target)
        for hidden in policy.hidden()
        for target in targets
    ):
        # A recursive fs/copy would copy what is hidden inside the tree.
        raise hidden_error()


def check_write(policy: SandboxPolicy, path: str, *, follows: bool = True) -> None:
    """Refuse a write to ``path`` the policy does not allow (``follows``: a final symlink is).

    Not following (fs/remove), a path that does not exist is left to the
    operation (its own answer: nothing to remove), as the reference does.
    """
    if not follows and not os.path.lexists(resolve_path(path)):
        return
    targets = {_entry(path)}
    if follows:
        targets.add(_physical(path))
    for target in targets:
        if policy.is_hidden(target):
            raise hidden_error()
        access = policy.access(target)
        if access == "none":
            # Outside every readable root: the reference's sandbox has no such path.
            raise unreadable_error()
        if access != "write":
            raise read_only_error()
        if not follows:
            # A removal reaches the whole tree: nothing in it may be protected.
            inner = [
                r
                for r in policy.rules
                if r.access != "write" and r.path != target and is_within(r.path, target)
            ]
            if any(policy.is_hidden(r.path) for r in inner):
                raise hidden_error()
            if inner:
                raise read_only_error()
    if policy.access("/") == "write":
        return
    try:
        st = os.stat(path)
    except OSError:
        return
    if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
        # Writing in place to a file with other names could change a file
        # outside the writable roots (its other names are unknown here).
        raise read_only_error("multiplyLinked")


# --- confining a thread ---------------------------------------------------------------


def _confine_mounts(policy: SandboxPolicy) -> None:
    _check(unshare_thread(), "unshare(CLONE_NEWNS)")
    _check(_mount(None, "/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
    rules = sorted(policy.rules, key=lambda r: (r.path.count("/") if r.path != "/" else 0, r.path))
    # The root first: read-only unless writable (with or without a rule of
    # its own: a profile without `root` reads only its roots, and writes none).
    state: dict[str, str] = {"/": "write"}
    if policy.access("/") != "write":
        _check(_set_readonly("/", True), "read-only /")
        state["/"] = "read"

    def mounted_access(path: str) -> str:
        # The access the mounts give ``path`` so far (the nearest rule applied).
        probe = path
        while probe not in state:
            probe = os.path.dirname(probe)
        return state[probe]

    for rule in rules:
        if rule.path == "/":
            continue
        if not os.path.lexists(rule.path):
            continue
        now = mounted_access(rule.path)
        if rule.access == "none":
            if os.path.isdir(rule.path):
                result = _mount(
                    "tmpfs",
                    rule.path,
                    "tmpfs",
                    _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC,
                    "size=4k,mode=000",
                )
                _check(result, f"hide {rule.path}")
            else:
                _check(_mount("/dev/null", rule.path, None, _MS_BIND, None), f"hide {rule.path}")
                _check(
                    _mount(None, rule.path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY, None),
                    f"hide {rule.path}",
                )
            state[rule.path] = "none"
            continue
        wanted = "write" if rule.access == "write" else "read"
        if now == wanted:
            continue
        result = _mount(rule.path, rule.path, None, _MS_BIND | _MS_REC, None)
        if result < 0 and ctypes.get_errno() == errno.ENOENT and not os.path.lexists(rule.path):
            # Gone since it was seen (another process removed it): nothing
            # to bind, as bwrap's --bind-try (a writable root stays as its
            # parent; a carve-out that no longer exists has nothing to
            # protect, and the check refuses what the policy refuses there).
            continue
        _check(result, f"bind {rule.path}")
        if wanted == "read":
            _check(_set_readonly(rule.path, True), f"read-only {rule.path}")
        else:
            # Best effort: a mount that stays read-only only refuses more.
            _set_readonly(rule.path, False)
        state[rule.path] = wanted


def unshare_thread() -> int:
    return int(_libc.unshare(ctypes.c_int(_CLONE_NEWNS | _CLONE_FS)))


def _add_rule(ruleset: int, fd: int, allowed: int, what: str) -> None:
    if not stat.S_ISDIR(os.fstat(fd).st_mode):
        # Rights that only make sense on directories are refused on files.
        allowed &= _LL_WRITE_FILE | _LL_READ_FILE | _LL_EXECUTE | _LL_TRUNCATE
    if not allowed:
        return
    beneath = _PathBeneathAttr(allowed, fd)
    result = int(
        _libc.syscall(
            ctypes.c_long(_SYS_LANDLOCK_ADD_RULE),
            ctypes.c_int(ruleset),
            ctypes.c_int(_LANDLOCK_RULE_PATH_BENEATH),
            ctypes.byref(beneath),
            ctypes.c_uint32(0),
        )
    )
    _check(result, f"landlock_add_rule {what}")


def _landlock(
    policy: SandboxPolicy,
    *,
    writes: bool,
    reads: bool,
    write_fds: Sequence[int] | None = None,
) -> None:
    """Restrict this thread: writes (if ``writes``) to the policy's writable roots, or
    only beneath the directories ``write_fds`` hold; reads (if ``reads``) to its roots."""
    abi = landlock_abi()
    if abi < 1:
        raise ConfinementFailed("Landlock is not available on this kernel")
    write_rights = _LL_WRITE_ABI1
    if abi >= 2:
        write_rights |= _LL_REFER
    if abi >= 3:
        write_rights |= _LL_TRUNCATE
    if abi >= 5:
        write_rights |= _LL_IOCTL_DEV
    handled = (write_rights if writes else 0) | (_LL_READ if reads else 0)
    if not handled:
        return
    attr = _RulesetAttr(handled)
    ruleset = int(
        _libc.syscall(
            ctypes.c_long(_SYS_LANDLOCK_CREATE_RULESET),
            ctypes.byref(attr),
            ctypes.c_size_t(ctypes.sizeof(attr)),
            ctypes.c_uint32(0),
        )
    )
    _check(ruleset, "landlock_create_ruleset")
    try:
        for rule in policy.rules:
            if rule.access == "none":
                continue
            allowed = _LL_READ if reads else 0
            if rule.access == "write" and writes and write_fds is None:
                allowed |= write_rights
            allowed &= handled
            if not allowed:
                continue
            try:
                fd = os.open(rule.path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # a missing path grants nothing
            try:
                _add_rule(ruleset, fd, allowed, rule.path)
            finally:
                os.close(fd)
        for fd in write_fds or ():
            _add_rule(ruleset, fd, (write_rights | _LL_READ) & handled, f"fd {fd}")
        _check(int(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)), "no_new_privs")
        result = int(
            _libc.syscall(
                ctypes.c_long(_SYS_LANDLOCK_RESTRICT_SELF),
                ctypes.c_int(ruleset),
                ctypes.c_uint32(0),
            )
        )
        _check(result, "landlock_restrict_self")
    finally:
        os.close(ruleset)


def _open_directory_at_or_above(path: str) -> int:
    """An ``O_PATH`` descriptor of ``path``, or of its nearest existing ancestor directory."""
    while True:
        try:
            return os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            if path == "/":
                raise
            path = os.path.dirname(path)


def narrow_write_grants(
    policy: SandboxPolicy, writes: Iterable[tuple[str, bool]]
) -> list[int] | None:
    """Descriptors of the directories the writes happen in, if each is safe to grant whole.

    A directory is held first, then judged on the path the kernel gives for
    the held descriptor, and the grant is made on that same descriptor, so no
    swap between the judgement and the grant can move it. Safe: writable, with
    no carve-out or hidden path at or beneath it. None (the caller grants the
    writable roots instead) if any is not.
    """
    fds: list[int] = []
    try:
        for path, follows in writes:
            targets = {_entry(path)} | ({_physical(path)} if follows else set())
            for target in targets:
                fd = _open_directory_at_or_above(os.path.dirname(target) or "/")
                fds.append(fd)
                real = os.readlink(f"/proc/self/fd/{fd}")
                if policy.access(real) != "write" or any(
                    r.access != "write" and is_within(r.path, real) for r in policy.rules
                ):
                    raise LookupError(real)
    except (OSError, LookupError):
        for fd in fds:
            os.close(fd)
        return None
    return fds


def _run_on_fresh_thread(body: Callable[[], _T]) -> _T:
    """``body()`` on a new OS thread, which ends with it; its result or exception here."""
    outcome: list[Any] = []
    done = _thread.allocate_lock()
    done.acquire()

    def main() -> None:
        try:
            outcome.append((True, body()))
        except BaseException as exc:  # handed to the caller's thread
            outcome.append((False, exc))
        finally:
            done.release()

    # The low-level thread: threading.Thread's bookkeeping costs more than
    # the confinement itself, and this thread is never seen by anyone else.
    _thread.start_new_thread(main, ())
    done.acquire()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def _probe(mechanism: Mechanism) -> bool:
    def body() -> bool:
        try:
            if mechanism == "mount-namespace":
                _confine_mounts(SandboxPolicy(True, (PathRule("/", "read"),), False, True))
            else:
                _landlock(
                    SandboxPolicy(True, (PathRule("/", "read"),), False, True),
                    writes=True,
                    reads=False,
                )
        except ConfinementFailed:
            return False
        return True

    return _run_on_fresh_thread(body)


#: The environment variable that picks the mechanism (``mount-namespace`` or
#: ``landlock``) instead of the best one that works; a test knob, and for an
#: operator who wants the fallback.
MECHANISM_VARIABLE: Final = "EXECSERVER_FS_SANDBOX_MECHANISM"
_MECHANISMS: Final[tuple[Mechanism, ...]] = ("mount-namespace", "landlock")
_mechanism: list[Mechanism] = []
_mechanism_lock = threading.Lock()


def mechanism() -> Mechanism:
    """How confined fs calls are enforced here (probed once, on a throwaway thread)."""
    with _mechanism_lock:
        if not _mechanism:
            forced = os.environ.get(MECHANISM_VARIABLE)
            candidates = [m for m in _MECHANISMS if forced in (None, "", m)]
            _mechanism.append(next((m for m in candidates if _probe(m)), "none"))
        return _mechanism[0]


def unavailable_error() -> RpcError:
    return RpcError.internal(
        "sandbox: fs calls cannot be confined on this host (no CAP_SYS_ADMIN for a mount "
        "namespace and no Landlock): run the server as root or on a kernel with Landlock",
        {"kind": "sandboxUnavailable"},
    )


# --- the entry point ------------------------------------------------------------------

Kind = Literal["read", "write", "remove", "copy"]


@attrs.frozen
class Guard:
    """Builds the policy of one fs call and runs it confined.

    ``floor`` is the operator's (``--sandbox-floor``); ``cwd`` and ``env``
    are the server's, used where a profile has no ``cwd`` of its own and
    for ``TMPDIR``.
    """

    floor: SandboxPolicy | None = None
    cwd: str = attrs.field(factory=os.getcwd)
    env: Mapping[str, str] = attrs.field(factory=lambda: os.environ)
    #: The mechanism to use; None: the best that works here (:func:`mechanism`).
    how: Mechanism | None = None

    def policy(self, sandbox: p.SandboxConfig | None) -> SandboxPolicy:
        return apply_floor(resolve(sandbox, cwd=self.cwd, env=self.env), self.floor)

    def applies(self, sandbox: p.SandboxConfig | None) -> bool:
        """Whether a call with ``sandbox`` must go through :meth:`run` (cheap, no disk)."""
        if self.floor is not None and self.floor.confined:
            return True
        if sandbox is None:
            return False
        return not (
            sandbox.mode == "none" or isinstance(sandbox.permissions, p.DisabledPermissions)
        )

    def run(
        self,
        sandbox: p.SandboxConfig | None,
        reads: Iterable[tuple[str, bool]],
        writes: Iterable[tuple[str, bool]],
        func: Callable[..., _T],
        *args: Any,
    ) -> _T:
        """Run ``func(*args)`` confined to ``sandbox``'s policy (blocking: on the pool).

        ``reads`` are the paths read (with whether their whole tree is: a
        recursive fs/copy), ``writes`` the paths written (with whether the
        operation follows a final symlink there; one that does not, fs/remove,
        reaches the whole tree).
        """
        policy = self.policy(sandbox)
        if not policy.confined or (
            policy.access("/") == "write" and all(r.access == "write" for r in policy.rules)
        ):
            # Nothing to confine for the file system: everything writable
            # (`external`, or an unrestricted file system without the network).
            return func(*args)
        how = self.how or mechanism()
        if how == "none":
            raise unavailable_error()
        reads, writes = tuple(reads), tuple(writes)
        if not writes and policy.full_read and not policy.hidden():
            # A read where everything is readable: nothing to confine (the
            # process side still confines the network; fs calls use none).
            return func(*args)

        def body() -> _T:
            seen = effective(policy)
            if self.floor is not None:
                # Again on the real paths as they are now (a symlink swapped
                # in since the floor was applied must not widen it).
                seen = apply_floor(seen, self.floor)
            try:
                for path, deep in reads:
                    check_read(seen, path, deep=deep)
                for path, follows in writes:
                    check_write(seen, path, follows=follows)
            except OSError as exc:
                # The kernel's error for an unreachable prefix (``..`` after
                # a missing directory): the operation's own answer.
                raise os_error(exc) from None
            try:
                if how == "mount-namespace":
                    _confine_mounts(seen)
                    if not seen.full_read:
                        _landlock(seen, writes=False, reads=True)
                else:
                    # Writes beneath the directories they happen in when those
                    # hold nothing protected (carve-outs and hidden paths are then
                    # out of reach for the kernel too), else the writable roots.
                    narrowed = narrow_write_grants(seen, writes)
                    try:
                        _landlock(
                            seen,
                            writes=seen.access("/") != "write" or narrowed is not None,
                            reads=not seen.full_read,
                            write_fds=narrowed,
                        )
                    finally:
                        for fd in narrowed or ():
                            os.close(fd)
            except ConfinementFailed as exc:
                raise RpcError.internal(
                    f"sandbox: the fs call could not be confined: {exc}",
                    {"kind": "sandboxUnavailable"},
                ) from None
            return func(*args)

        return _run_on_fresh_thread(body)
