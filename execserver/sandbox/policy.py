"""The profile language: what a ``sandbox`` allows, resolved once.

:func:`resolve` turns the decoded wire value (:class:`~execserver.protocol.SandboxConfig`
or ``None``) into a :class:`SandboxPolicy`: a set of absolute path rules
(``read``, ``write`` or ``none``), whether the root is readable and whether
the network is allowed. The resolution follows the reference's
(``codex-rs/protocol`` permissions): special paths resolve against the
context's ``cwd`` and ``workspaceRoots``, the most specific rule wins and, at
equal specificity, ``none`` beats ``write`` beats ``read``; every writable
root gets the reference's default read-only carve-outs (``.git`` — and the
gitdir a ``.git`` pointer file names —, ``.agents``, ``.codex``, when they
exist). Anything this server cannot enforce is a precise ``-32602``, never a
weaker sandbox.

Beyond the reference, every cgroup file system (each mount of type
``cgroup`` or ``cgroup2``) stays read-only in a confined policy, whatever it
asks (:func:`protect_cgroupfs`): root given the cgroup files could move
itself out of the cgroups that track its tree and carry its limits.

:func:`apply_floor` combines a request with the operator's floor: the result
is never less confined than either.
"""

from __future__ import annotations

import os
import re
import select
import threading
from collections.abc import Iterable, Mapping
from typing import IO, Final, Literal

import attrs
import msgspec

from execserver import protocol as p
from execserver.errors import RpcError

Access = Literal["read", "write", "none"]

#: Order of capability (for the floor's intersection): none < read < write.
_CAPABILITY: Final[dict[str, int]] = {"none": 0, "read": 1, "write": 2}
#: Order of precedence between rules on the same path (the reference's):
#: none beats write beats read.
_PRECEDENCE: Final[dict[str, int]] = {"read": 0, "write": 1, "none": 2}

#: What the reference's ``minimal`` special path makes readable on Linux
#: (its LINUX_PLATFORM_DEFAULT_READ_ROOTS); those that exist are used.
PLATFORM_DEFAULT_READ_ROOTS: Final = (
    "/bin",
    "/sbin",
    "/usr",
    "/etc",
    "/lib",
    "/lib64",
    "/nix/store",
    "/run/current-system/sw",
)
#: Directories under every writable root that stay read-only (the reference's
#: defaults): ``.git`` (a directory or a gitdir pointer file), ``.agents``
#: and ``.codex`` (directories), each only when it exists.
DEFAULT_CARVEOUT_DIRS: Final = (".agents", ".codex")


def normalise(path: str) -> str:
    """Lexically normalise an absolute path: drop ``.``, empty parts and resolve ``..``.

    No disk access (symlinks are not resolved; ``..`` is lexical, as the
    reference's AbsolutePathBuf does it).
    """
    parts: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if parts:
                parts.pop()
            continue
        parts.append(part)
    return "/" + "/".join(parts)


def ancestors(path: str) -> Iterable[str]:
    """``path`` and each of its ancestors, most specific first, ending with ``/``."""
    while True:
        yield path
        if path == "/":
            return
        cut = path.rfind("/")
        path = path[:cut] if cut > 0 else "/"


def is_within(path: str, root: str) -> bool:
    """``path`` is ``root`` or beneath it (both normalised, lexically)."""
    return root in ("/", path) or path.startswith(root + "/")


@attrs.frozen
class PathRule:
    #: Absolute, lexically normalised (symlinks not resolved here).
    path: str
    access: Access


@attrs.frozen
class SandboxPolicy:
    """What a sandboxed process or fs call may do; immutable, shared by both sides.

    ``rules`` hold at most one rule per path (ties already decided).
    ``access(path)`` is the rule of the longest ancestor of ``path`` (itself
    included) that has one; no rule is ``none``. An unconfined policy allows
    everything.
    """

    #: False: no confinement asked (seed "none", null, full access).
    confined: bool
    #: The resolved rules, sorted by path.
    rules: tuple[PathRule, ...]
    #: True: network allowed.
    network: bool
    #: The root is readable (rules only narrow it).
    full_read: bool
    #: The request explicitly asked for full access (``disabled``, or an
    #: unrestricted file system with the network enabled): refused under a floor.
    explicit_full_access: bool = False
    _index: dict[str, Access] = attrs.field(init=False, eq=False, repr=False, hash=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_index", {rule.path: rule.access for rule in self.rules})

    def access(self, path: str) -> Access:
        """Access to ``path`` (absolute, symlinks and ``..`` already resolved).

        The most specific rule wins (the longest ancestor with a rule); rules
        on one path were merged by the reference's tie-break (``none`` over
        ``write`` over ``read``) when the policy was built.
        """
        if not self.confined:
            return "write"
        index = self._index
        for ancestor in ancestors(path):
            found = index.get(ancestor)
            if found is not None:
                return found
        return "none"

    def deciding_path(self, path: str) -> str | None:
        """The path of the rule that decides ``path``'s access (None: no rule does)."""
        index = self._index
        return next((ancestor for ancestor in ancestors(path) if ancestor in index), None)

    def writable_roots(self) -> tuple[str, ...]:
        """The paths with a ``write`` rule (each root of a writable hierarchy)."""
        return tuple(r.path for r in self.rules if r.access == "write")

    def readable_roots(self) -> tuple[str, ...]:
        """The paths with a ``read`` rule (``/`` when ``full_read``)."""
        return tuple(r.path for r in self.rules if r.access == "read")

    def read_only_carveouts(self) -> tuple[str, ...]:
        """Paths under a writable root that must stay read-only (``.git``, ``.codex``, ...)."""
        roots = [r.path for r in self.rules if r.access == "write"]
        return tuple(
            r.path
            for r in self.rules
            if r.access == "read" and any(r.path != w and is_within(r.path, w) for w in roots)
        )

    def hidden(self) -> tuple[str, ...]:
        """Paths with access ``none`` (besides ``/`` itself, which is the default)."""
        return tuple(r.path for r in self.rules if r.access == "none" and r.path != "/")

    def is_hidden(self, path: str) -> bool:
        """``path`` is under an explicit ``none`` rule (not merely outside every readable root)."""
        if not self.confined:
            return False
        index = self._index
        for ancestor in ancestors(path):
            found = index.get(ancestor)
            if found is not None:
                return found == "none" and ancestor != "/"
        return False

    def describe(self) -> str:
        """One line for logs and errors."""
        if not self.confined:
            return "unconfined"
        parts: list[str] = []
        if self.full_read:
            parts.append("read /")
        writable = self.writable_roots()
        if writable == ("/",):
            parts.append("write /")
        elif writable:
            parts.append("write " + ", ".join(writable))
        readable = [r for r in self.readable_roots() if r != "/"]
        if readable:
            parts.append("read-only " + ", ".join(readable))
        hidden = self.hidden()
        if hidden:
            parts.append("hidden " + ", ".join(hidden))
        parts.append("network " + ("on" if self.network else "off"))
        return "; ".join(parts)


UNCONFINED: Final = SandboxPolicy(
    confined=False, rules=(PathRule("/", "write"),), network=True, full_read=True
)


def _build(
    rules: Iterable[PathRule], network: bool, *, explicit_full_access: bool = False
) -> SandboxPolicy:
    merged: dict[str, Access] = {}
    for rule in rules:
        held = merged.get(rule.path)
        if held is None or _PRECEDENCE[rule.access] > _PRECEDENCE[held]:
            merged[rule.path] = rule.access
    ordered = tuple(PathRule(path, merged[path]) for path in sorted(merged))
    return SandboxPolicy(
        confined=True,
        rules=ordered,
        network=network,
        full_read=merged.get("/") in ("read", "write"),
        explicit_full_access=explicit_full_access,
    )


def _invalid(message: str, field: str = "sandbox") -> RpcError:
    return RpcError.invalid_params(f"{message} - at `$.{field}`", {"kind": "invalidSandbox"})


def _absolute(value: str, field: str) -> str:
    """A ``file://`` URI or an absolute path, as a normalised native path."""
    # Imported here: execserver.fs imports this module's users.
    from execserver.fs.paths import uri_to_path

    try:
        path = uri_to_path(value, field)
    except RpcError:
        raise _invalid(f"not an absolute path or file URI: `{value}`", field) from None
    if not path.startswith("/") or "\0" in path:
        raise _invalid(f"not an absolute path or file URI: `{value}`", field)
    return normalise(path)


def _exists(path: str) -> bool:
    return os.path.lexists(path)


def _gitdir_of(dot_git: str) -> str | None:
    """The directory a ``.git`` pointer file (``gitdir: <path>``) names, if it exists."""
    try:
        with open(dot_git, encoding="utf-8", errors="replace") as handle:
            text = handle.read(65536).strip()
    except OSError:
        return None
    _, sep, raw = text.partition(":")
    raw = raw.strip()
    if not sep or not raw:
        return None
    base = os.path.dirname(dot_git)
    gitdir = normalise(raw if raw.startswith("/") else base + "/" + raw)
    return gitdir if os.path.exists(gitdir) else None


def default_carveouts(root: str) -> list[str]:
    """The reference's default read-only paths under writable ``root`` (those that exist)."""
    found: list[str] = []
    dot_git = root.rstrip("/") + "/.git"
    if os.path.isfile(dot_git):
        gitdir = _gitdir_of(dot_git)
        if gitdir is not None:
            found.append(gitdir)
        found.append(dot_git)
    elif os.path.isdir(dot_git):
        found.append(dot_git)
    for name in DEFAULT_CARVEOUT_DIRS:
        candidate = root.rstrip("/") + "/" + name
        if os.path.isdir(candidate):
            found.append(candidate)
    return found


def _with_carveouts(rules: list[PathRule]) -> list[PathRule]:
    """Add the default read-only carve-outs under every writable root."""
    explicit = {r.path for r in rules}
    extra: list[PathRule] = []
    for rule in rules:
        if rule.access != "write":
            continue
        for carve in default_carveouts(rule.path):
            if carve not in explicit:
                extra.append(PathRule(carve, "read"))
    return rules + extra


_MOUNTINFO_ESCAPE: Final = re.compile(r"\\([0-7]{3})")


class _MountWatch:
    """The cgroup mounts, re-read only when the mount table changed.

    ``/proc/self/mountinfo`` kept open: the kernel marks it ``POLLPRI`` after
    any mount or unmount (a ``poll`` clears the mark), so an unchanged table
    costs one ``poll``, not a read and a parse.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._file: IO[bytes] | None = None
        self._poller = select.poll()
        self._mounts: tuple[str, ...] = ()

    def current(self) -> tuple[str, ...]:
        with self._lock:
            try:
                if self._file is None:
                    self._file = open("/proc/self/mountinfo", "rb")  # noqa: SIM115
                    self._poller.register(self._file, select.POLLPRI)
                elif not self._poller.poll(0):
                    return self._mounts
                self._file.seek(0)
                text = self._file.read().decode("utf-8", "surrogateescape")
            except OSError:
                return ()
            self._mounts = cgroup_mounts(text)
            return self._mounts


_WATCH: Final = _MountWatch()


def mount_point(field: str) -> str:
    """A mount point as ``/proc/self/mountinfo`` writes it (octal escapes), normalised."""
    return normalise(_MOUNTINFO_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field))


def cgroup_mounts(mountinfo: str | None = None) -> tuple[str, ...]:
    """The mount points of every ``cgroup`` and ``cgroup2`` file system, sorted.

    ``mountinfo`` is the text of ``/proc/self/mountinfo`` (None: this
    process's, as it is now); a bind mount of a cgroup file system elsewhere
    is one of them too.
    """
    if mountinfo is None:
        return _WATCH.current()
    found: set[str] = set()
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, kind = left.split(), right.split()
        if not sep or len(fields) < 5 or not kind or kind[0] not in ("cgroup", "cgroup2"):
            continue
        found.add(mount_point(fields[4]))
    return tuple(sorted(found))


def protect_cgroupfs(policy: SandboxPolicy, mounts: Iterable[str] | None = None) -> SandboxPolicy:
    """``policy`` with every cgroup file system (``mounts``: :func:`cgroup_mounts`) read-only.

    A ``write`` rule at or beneath a cgroup mount (on its path or on the
    path it resolves to) becomes ``read``; a cgroup mount beneath a
    writable root (or beneath the path one resolves to) gets a ``read``
    rule: a carve-out, re-protected as the default ones are. ``none`` rules
    stay. An unconfined policy is returned as is (nothing is confined).
    """
    if not policy.confined:
        return policy
    cgroupfs = tuple(cgroup_mounts() if mounts is None else mounts)
    if not cgroupfs:
        return policy

    def in_cgroupfs(path: str) -> bool:
        return any(is_within(path, mount) for mount in cgroupfs if mount != "/")

    rules: list[PathRule] = []
    writable: list[str] = []
    for rule in policy.rules:
        if rule.access == "write":
            real = realpath(rule.path)
            if in_cgroupfs(rule.path) or in_cgroupfs(real):
                rules.append(PathRule(rule.path, "read"))
                continue
            writable += [rule.path, real]
        rules.append(rule)
    for mount in cgroupfs:
        if any(is_within(mount, root) for root in writable):
            rules.append(PathRule(mount, "read"))
    if rules == list(policy.rules):
        return policy
    return _build(rules, policy.network, explicit_full_access=policy.explicit_full_access)


def _resolve_mode(sandbox: p.SandboxConfig, cwd: str) -> SandboxPolicy:
    mode = sandbox.mode
    if mode == "none":
        return UNCONFINED
    if mode == "hostDefault":
        # As before the profile language: no host default is defined here.
        raise RpcError.invalid_request(
            "sandbox mode `hostDefault` is not supported by exec-server yet"
        )
    network = sandbox.network is True
    rules = [PathRule("/", "read")]
    if mode == "workspaceWrite":
        roots = sandbox.writable_roots if isinstance(sandbox.writable_roots, list) else []
        if not roots:
            rules.append(PathRule(normalise(cwd), "write"))
        for i, root in enumerate(roots):
            rules.append(PathRule(_absolute(root, f"sandbox.writableRoots[{i}]"), "write"))
        rules = _with_carveouts(rules)
    return _build(rules, network)


def _special(
    value: p.SpecialPath,
    *,
    cwd: str,
    project_roots: list[str],
    env: Mapping[str, str],
) -> list[str]:
    """The absolute paths a special path names here (none: it names nothing)."""
    if isinstance(value, p.SpecialRoot):
        return ["/"]
    if isinstance(value, p.SpecialMinimal):
        return [root for root in PLATFORM_DEFAULT_READ_ROOTS if _exists(root)]
    if isinstance(value, p.SpecialCurrentWorkingDirectory):
        return [cwd]
    if isinstance(value, p.SpecialProjectRoots):
        if value.subpath is None:
            return list(project_roots)
        if "\0" in value.subpath:
            raise _invalid("a subpath must not contain NUL", "sandbox.permissions")
        if value.subpath.startswith("/"):
            return [normalise(value.subpath)]
        return [normalise(root + "/" + value.subpath) for root in project_roots]
    if isinstance(value, p.SpecialTmpdir):
        tmpdir = env.get("TMPDIR", "")
        return [normalise(tmpdir)] if tmpdir.startswith("/") else []
    if isinstance(value, p.SpecialSlashTmp):
        return ["/tmp"] if os.path.isdir("/tmp") else []
    # SpecialUnknown: a newer client's token; the reference ignores it.
    return []


def _resolve_profile(sandbox: p.SandboxConfig, cwd: str, env: Mapping[str, str]) -> SandboxPolicy:
    permissions = sandbox.permissions
    assert not isinstance(permissions, msgspec.UnsetType)
    if isinstance(permissions, p.DisabledPermissions):
        return attrs.evolve(UNCONFINED, explicit_full_access=True)
    if isinstance(permissions, p.ExternalPermissions):
        # The caller confines the file system; the network is as asked.
        if permissions.network == "enabled":
            return UNCONFINED
        return _build([PathRule("/", "write")], False)
    network = permissions.network == "enabled"
    file_system = permissions.file_system
    if isinstance(file_system, p.UnrestrictedFileSystem):
        if network:
            return attrs.evolve(UNCONFINED, explicit_full_access=True)
        return _build([PathRule("/", "write")], False)
    base = _absolute(sandbox.cwd, "sandbox.cwd") if sandbox.cwd is not None else normalise(cwd)
    if sandbox.workspace_roots:
        project_roots = [
            _absolute(root, f"sandbox.workspaceRoots[{i}]")
            for i, root in enumerate(sandbox.workspace_roots)
        ]
    else:
        project_roots = [base]
    rules: list[PathRule] = []
    for i, entry in enumerate(file_system.entries):
        field = f"sandbox.permissions.file_system.entries[{i}]"
        access: Access = "none" if entry.access == "deny" else entry.access
        target = entry.path
        if isinstance(target, p.GlobTarget):
            raise _invalid(
                "glob_pattern entries are not supported by exec-server: list the paths instead",
                field,
            )
        if isinstance(target, p.PathTarget):
            paths = [_absolute(target.path, field + ".path.path")]
        else:
            paths = _special(target.value, cwd=base, project_roots=project_roots, env=env)
        for path in paths:
            if entry.missing_path_behavior == "skip" and not _exists(path):
                continue
            rules.append(PathRule(path, access))
    policy = _build(_with_carveouts(rules), network)
    if network and policy.rules == (PathRule("/", "write"),):
        # Every path writable and the network on: full access, as the
        # reference reads it (its DangerFullAccess).
        return attrs.evolve(UNCONFINED, explicit_full_access=True)
    return policy


def resolve(sandbox: p.SandboxConfig | None, *, cwd: str, env: Mapping[str, str]) -> SandboxPolicy:
    """The policy ``sandbox`` asks for; ``cwd`` and ``env`` are the context's.

    ``cwd`` is the fallback for a profile without its own ``cwd`` (and the
    one writable root of ``workspaceWrite`` without ``writableRoots``);
    ``env`` gives ``TMPDIR`` for the ``tmpdir`` special path. Disk access:
    ``missing_path_behavior: "skip"``, the default carve-outs and
    ``minimal`` look at what exists, the cgroup mounts are read from
    ``/proc/self/mountinfo`` (:func:`protect_cgroupfs`). Raises
    :class:`RpcError` (``-32602``) for what cannot be enforced.
    """
    if sandbox is None:
        return UNCONFINED
    if isinstance(sandbox.permissions, msgspec.UnsetType):
        return protect_cgroupfs(_resolve_mode(sandbox, cwd))
    return protect_cgroupfs(_resolve_profile(sandbox, cwd, env))


# --- what the kernel sees ------------------------------------------------------------


def realpath(path: str) -> str:
    """``os.path.realpath``, by the kernel where the path exists (one open, one readlink)."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return os.path.realpath(path)
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return os.path.realpath(path)
    finally:
        os.close(fd)
    return (
        real if real.startswith("/") and not real.endswith(" (deleted)") else os.path.realpath(path)
    )


def effective(policy: SandboxPolicy) -> SandboxPolicy:
    """``policy`` with each rule also on the path its existing prefix resolves to.

    A rule on ``/work/link`` (a symlink to ``/data/w``) also covers
    ``/data/w``, where a resolved target lands; the literal path stays, so
    a rule on a symlink still covers the link itself. Disk access.
    """
    if not policy.confined:
        return policy
    rules: list[PathRule] = list(policy.rules)
    for rule in policy.rules:
        real = realpath(rule.path)
        if real != rule.path:
            rules.append(PathRule(real, rule.access))
    return _build(rules, policy.network, explicit_full_access=policy.explicit_full_access)


def floor_refusal(floor: SandboxPolicy) -> RpcError:
    return RpcError.invalid_params(
        "sandbox: full access (`danger-full-access`) is refused: this server confines "
        f"every process and fs call at least to its floor ({floor.describe()})",
        {"kind": "sandboxFloor", "floor": floor.describe()},
    )


def apply_floor(policy: SandboxPolicy, floor: SandboxPolicy | None) -> SandboxPolicy:
    """``policy`` confined at least to ``floor``: never less confined than either.

    Per path, the access is the lesser of the two (none < read < write):
    writes are the intersection, hidden paths the union, the network only
    if both allow it. A request with no confinement (null, ``none``) gets
    the floor; an explicit full-access request (``disabled``, unrestricted
    with the network) under a confining floor is refused (``-32602``).
    """
    if floor is None or not floor.confined:
        return policy
    if not policy.confined:
        if policy.explicit_full_access:
            raise floor_refusal(floor)
        return floor
    paths = {r.path for r in policy.rules} | {r.path for r in floor.rules}
    # The floor judges each path also where it really leads: a symlink
    # lexically inside the floor's writable root that points outside it
    # gets the floor's access of its target (the floor's own rules also on
    # their real paths, so a floor root that is a symlink still works).
    real_floor = effective(floor)
    rules = []
    for path in paths:
        mine = policy.access(path)
        theirs = min(
            floor.access(path), real_floor.access(realpath(path)), key=_CAPABILITY.__getitem__
        )
        rules.append(PathRule(path, mine if _CAPABILITY[mine] <= _CAPABILITY[theirs] else theirs))
    return _build(rules, policy.network and floor.network)
