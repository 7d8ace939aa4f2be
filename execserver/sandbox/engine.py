"""Which confinement this host can give a process, and the command line that gives it.

Two mechanisms, both finishing with the seccomp filter of
:mod:`execserver.sandbox.seccomp` under ``no_new_privs``:

- ``bwrap`` (preferred, as the reference): bubblewrap with a new user, pid
  and (network restricted) network namespace, ``/`` read-only, each
  writable root bound writable, each read-only carve-out bound read-only
  again inside it, each hidden path masked, a fresh ``/proc`` and ``/dev``,
  ``--die-with-parent``; the filter is loaded by bwrap (``--seccomp 3``).
- ``landlock`` (where bwrap cannot run, or for ``useLegacyLandlock``):
  :mod:`execserver.sandbox.landlock_exec` run by the interpreter, in the
  child, before the command. Landlock only grants, so it cannot re-protect
  a path inside a writable root nor hide one beneath a readable one: a
  profile that needs either (an existing carve-out or hidden path) is
  refused here rather than run less confined.

Both are argv transformations of a :class:`~execserver.spawn.ProcessSpec`
(no hook in the spawn paths: the fast ``posix_spawn`` path and the stock
path both start the wrapped command unchanged, inside the process's cgroup).
The bwrap command line is::

    /bin/sh -c 'trap "" HUP INT ...; exec 3<"$0" && exec "$@"' FILTER \\
      BWRAP --die-with-parent --unshare-user --unshare-pid [--unshare-net] ... \\
      --seccomp 3 --setenv KEY VALUE... -- ENV --default-signal -- EXECUTABLE ARGS...

run with an empty environment: the client's variables are set by bwrap for
the command only (``--setenv``), so no ``LD_PRELOAD``/``LD_AUDIT``/
``LD_DEBUG_OUTPUT`` of the client's reaches a program that runs unconfined
(the Landlock helper likewise gets them as arguments and ``execve``s the
command with them).

``sh`` opens the filter (a file the server wrote at startup in a private
directory of ``/dev/shm``, which no sandboxed process sees or can write) as
fd 3 and makes
bwrap and its pid-1 reaper ignore the signals a client sends (and a
terminal's ^C), so they reach the command only (``env --default-signal``
restores them for it) and its exit status is what bwrap reports; bwrap is
not given ``--new-session`` so the command keeps the process group (and
the controlling terminal of a PTY) the server signals, while the filter
refuses ``TIOCSTI``/``TIOCLINUX``, what ``--new-session`` guards against.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from typing import TYPE_CHECKING, Final, Literal

import attrs
from twisted.logger import Logger

from execserver.errors import RpcError
from execserver.sandbox import seccomp
from execserver.sandbox.peers import ConfinedPeers
from execserver.sandbox.policy import (
    cgroup_mounts,
    effective,
    is_within,
    mount_point,
    realpath,
)
from execserver.spawn import ProcessSpec
from execserver.spawn.lookup import DEFAULT_PATH, resolve_executable

if TYPE_CHECKING:
    from execserver import protocol as p
    from execserver.sandbox.policy import SandboxPolicy

log = Logger()

Mechanism = Literal["bwrap", "landlock"]
MechanismChoice = Literal["auto", "bwrap", "landlock"]
MECHANISM_CHOICES: Final[tuple[MechanismChoice, ...]] = ("auto", "bwrap", "landlock")

#: What ``process/start`` answers current-dialect clients for a confined process.
SANDBOX_TYPE: Final = "linuxSeccomp"

#: The reference's text for a profile this executor cannot enforce.
CANNOT_ENFORCE: Final = "sandbox intent cannot be enforced on this executor"

#: The signals bwrap and its reaper ignore (the command gets them back).
_SHIELDED: Final = "HUP INT QUIT TERM USR1 USR2 ALRM TSTP TTIN TTOU PIPE XFSZ"
#: Processes bwrap keeps around the command for its whole life: bwrap itself
#: (outside, waiting for it) and its init, pid 1 of the new pid namespace
#: (``--unshare-pid``). ``maxProcesses`` counts the command's processes, so
#: ``pids.max`` gets room for these two (``sh`` execs bwrap, ``env`` and
#: ``bash -c 'exec ...'`` exec the command: none of them stays).
BWRAP_PROCESSES: Final = 2
_SH_SCRIPT: Final = f'trap \'\' {_SHIELDED}; exec 3<"$0" && exec "$@"'
#: Devices a Landlock-confined process may still open for writing (its
#: own terminal is /dev/tty; a new one comes from /dev/ptmx).
_LANDLOCK_DEVICES: Final = (
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/tty",
    "/dev/ptmx",
)
#: All of /dev a Landlock-confined process may open, as bwrap's fresh /dev:
#: not /dev/pts (every terminal of the host: another session's input could
#: be read there), the consoles, the disks, the host's /dev/shm.
#: (/dev/stdin, /dev/stdout... lead to the process's own descriptors: a pipe
#: is not Landlock's, its own terminal the helper grants.)
_LANDLOCK_DEVICE_READS: Final = (*_LANDLOCK_DEVICES, "/dev/random", "/dev/urandom")


def _cover(directory: str, excluded: frozenset[str]) -> list[str]:
    """The entries of ``directory`` that together grant all of it but ``excluded``.

    Landlock only grants (each rule follows its symlink): an entry leading
    to an excluded path is left out, one leading to an ancestor of one is
    replaced by its own entries.
    """
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    found: list[str] = []
    for name in names:
        path = f"{directory.rstrip('/')}/{name}"
        real = os.path.realpath(path)
        if real in excluded or path in excluded:
            continue
        if any(e != real and is_within(e, real) for e in excluded):
            if os.path.isdir(real):
                found += _cover(real, excluded)
            continue
        found.append(path)
    return found


def _landlock_reads(masked: Iterable[str]) -> list[str]:
    """What a "read /" grants under Landlock: all but /dev and ``masked``, and safe devices."""
    excluded = frozenset({"/dev", *(os.path.realpath(path) for path in masked)})
    return _cover("/", excluded) + list(_LANDLOCK_DEVICE_READS)


def _landlock_writes(roots: Iterable[str], cgroupfs: frozenset[str]) -> list[str]:
    """What grants writing ``roots`` under Landlock: all of them but the cgroup mounts.

    A root with a cgroup mount beneath it (or beneath the path it leads to)
    is replaced by its entries that hold none (:func:`_cover`): the
    directories on the way down to a mount (``/sys/fs/cgroup`` itself, say)
    are not writable then, only their other entries.
    """
    writes: list[str] = []
    for root in roots:
        real = os.path.realpath(root)
        if any(mount != real and is_within(mount, real) for mount in cgroupfs):
            writes += _cover(root, cgroupfs)
        else:
            writes.append(root)
    return writes


#: LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | LANDLOCK_SCOPE_SIGNAL (ABI 6).
_LANDLOCK_SCOPES: Final = 0b11


_LANDLOCK_ERRORS: Final = {
    38: "the kernel has no Landlock (ENOSYS)",
    95: "Landlock is disabled (EOPNOTSUPP: add `landlock` to the kernel's lsm= list)",
}


def _landlock_abi() -> tuple[int, str | None]:
    import ctypes

    from execserver.sandbox import fsguard

    abi = fsguard.landlock_abi()
    if abi < 1:
        err = ctypes.get_errno()
        why = _LANDLOCK_ERRORS.get(err, os.strerror(err))
        return 0, why
    return abi, None


@attrs.frozen
class HostSupport:
    """What confinement works here (``exec-server --check-sandbox`` prints it)."""

    bwrap: str | None
    bwrap_problem: str | None
    landlock_abi: int
    landlock_problem: str | None
    seccomp_problem: str | None
    #: bwrap takes ``--disable-userns`` (0.8 and later; older ones rely on the
    #: seccomp filter alone to refuse new user namespaces).
    bwrap_disable_userns: bool = True

    def lines(self) -> list[str]:
        def state(problem: str | None, good: str) -> str:
            return f"ok ({good})" if problem is None else f"NO: {problem}"

        if self.bwrap is None:
            userns = "untested (no bwrap)"
        else:
            userns = state(self.bwrap_problem, "bwrap created its namespaces")
        return [
            f"bubblewrap:       {state(self.bwrap_problem, str(self.bwrap))}",
            f"user namespaces:  {userns}",
            f"landlock:         {state(self.landlock_problem, f'ABI {self.landlock_abi}')}",
            f"seccomp:          {state(self.seccomp_problem, 'libseccomp, kernel filters')}",
        ]


def _probe_bwrap(path: str | None, explicit: bool) -> tuple[str | None, str | None]:
    if path is None:
        return None, (
            "bwrap not found on PATH (install the `bubblewrap` package, or pass --bwrap PATH)"
        )
    if explicit and not os.access(path, os.X_OK):
        return path, f"--bwrap {path} is not an executable file"
    argv = [path, "--die-with-parent", "--unshare-user", "--unshare-pid", "--unshare-net",
            "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev",
            "--", "/bin/true"]  # fmt: skip
    try:
        result = subprocess.run(argv, capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return path, f"{path} cannot run: {exc}"
    if result.returncode != 0:
        said = result.stderr.decode(errors="replace").strip().splitlines()
        return path, (
            f"{path} cannot create its namespaces here "
            f"({said[-1] if said else result.returncode}); "
            "enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 "
            "or user.max_user_namespaces > 0; on Ubuntu "
            "kernel.apparmor_restrict_unprivileged_userns=0) "
            "or give the container CAP_SYS_ADMIN"
        )
    return path, None


def _takes_disable_userns(path: str) -> bool:
    argv = [path, "--unshare-user", "--disable-userns", "--ro-bind", "/", "/", "--", "/bin/true"]
    try:
        return subprocess.run(argv, capture_output=True, timeout=10, check=False).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def probe(bwrap: str | None = None) -> HostSupport:
    """Try each mechanism on this host (runs bwrap once: call at startup)."""
    path = (
        bwrap
        if bwrap is not None
        else shutil.which("bwrap", path=os.environ.get("PATH", DEFAULT_PATH))
    )
    bwrap_path, bwrap_problem = _probe_bwrap(path, bwrap is not None)
    abi, landlock_problem = _landlock_abi()
    seccomp_problem: str | None = None
    if not seccomp.kernel_supports_filters():
        seccomp_problem = "the kernel has no seccomp filters (CONFIG_SECCOMP_FILTER)"
    else:
        try:
            seccomp.build(False)
        except seccomp.SeccompError as exc:
            seccomp_problem = str(exc)
    disable_userns = bwrap_problem is None and bwrap_path is not None
    if disable_userns:
        assert bwrap_path is not None
        disable_userns = _takes_disable_userns(bwrap_path)
    return HostSupport(
        bwrap_path, bwrap_problem, abi, landlock_problem, seccomp_problem, disable_userns
    )


#: Where the filters are kept: a sandboxed process never sees the host's
#: /dev/shm (bwrap mounts a fresh /dev; Landlock grants no write there).
FILTER_PARENT: Final = "/dev/shm"


_FILTER_PREFIX: Final = "exec-server-seccomp-"


def _remove_stale_filters(parent: str) -> None:
    """Remove the filter directories of servers that died without stopping (SIGKILL)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        if not name.startswith(_FILTER_PREFIX):
            continue
        pid_text = name[len(_FILTER_PREFIX) :].split("-", 1)[0]
        if not pid_text.isdigit():
            continue
        path = os.path.join(parent, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue


def _write_filters(directory: str) -> dict[bool, str]:
    paths = {}
    for network in (False, True):
        path = os.path.join(directory, "network" if network else "no-network")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o400)
        try:
            os.write(fd, seccomp.build(network))
        finally:
            os.close(fd)
        paths[network] = path
    return paths


def _set_not_dumpable() -> None:
    """Keep /proc/<server>/environ, maps, mem... from same-user processes without CAP_SYS_PTRACE.

    Landlock does not scope those reads (bwrap's pid namespace hides the
    server instead); a Landlock-confined process has no capabilities.
    """
    import ctypes

    pr_set_dumpable = 4
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_dumpable, 0, 0, 0, 0)


def _other_mounts_of(path: str, outside: str) -> list[str]:
    """The mount points, not within ``outside``, of the file system ``path`` is on."""
    try:
        device = os.stat(path).st_dev
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return [path]  # cannot tell: as if it were
    wanted = f"{os.major(device)}:{os.minor(device)}"
    found = []
    for line in lines:
        fields = line.split()
        if len(fields) > 4 and fields[2] == wanted:
            point = mount_point(fields[4])
            if not is_within(point, outside):
                found.append(point)
    return found


def _existing(paths: Iterable[str]) -> list[str]:
    return [p for p in paths if os.path.lexists(p)]


def _unprotectable(policy: SandboxPolicy, path: str, kept: str = "read-only") -> str | None:
    """Why ``path`` (inside a writable root) cannot be kept ``kept``, if it cannot.

    A mount protects what exists: a missing component the command may
    create (its parent writable) or a symlink it may replace (same) would
    let it make the path its own (a ``.git`` of its own, with hooks; a
    hidden path written).
    """
    current = ""
    for part in path.strip("/").split("/"):
        parent, current = current or "/", f"{current}/{part}"
        if policy.access(parent) != "write":
            if not os.path.lexists(current):
                return None  # cannot be created from inside either
            continue
        if not os.path.lexists(current):
            return (
                f"{path} is {kept} inside a writable root but {current} does not exist: "
                "a confined process could create it (create it before the start, or send "
                'the entry with "missing_path_behavior": "skip")'
            )
        if os.path.islink(current):
            return (
                f"{path} is {kept} inside a writable root but {current} is a symlink "
                "a confined process could replace (make it a directory, or leave the path "
                "out of the profile)"
            )
    return None


@attrs.define
class SandboxEngine:
    """The server's sandbox: the mechanism in use, its filters, the operator's floor."""

    requested: MechanismChoice = "auto"
    #: ``--bwrap PATH`` (None: ``bwrap`` on PATH).
    bwrap_flag: str | None = None
    #: ``--sandbox-floor``: every process and fs call is confined at least this much.
    floor: SandboxPolicy | None = None
    #: Paths masked in every sandbox: the server's own Unix sockets, its
    #: bearer tokens file (Landlock cannot refuse connecting to a socket:
    #: only the file is left out of its reads there).
    masked: tuple[str, ...] = ()
    support: HostSupport | None = attrs.field(init=False, default=None)
    #: The mechanism a confined start uses (None: confined starts are refused).
    mechanism: Mechanism | None = attrs.field(init=False, default=None)
    #: The seccomp programs (network allowed or not), as files only the server writes.
    _filters: dict[bool, str] = attrs.field(init=False, factory=dict)
    _dir: str | None = attrs.field(init=False, default=None)
    _helper: str = attrs.field(init=False, default="")
    #: The trees of the processes started confined, which the ``unix://``
    #: listeners refuse (given containment and a clock when the server is composed).
    peers: ConfinedPeers = attrs.field(init=False, factory=ConfinedPeers)

    def start(self) -> None:
        """Probe the host, choose the mechanism, build the filters; log the choice."""
        support = self.support = probe(self.bwrap_flag)
        bwrap_ok = support.bwrap_problem is None and support.seccomp_problem is None
        landlock_ok = support.landlock_problem is None and support.seccomp_problem is None
        if self.requested in ("auto", "bwrap") and bwrap_ok:
            self.mechanism = "bwrap"
        elif self.requested in ("auto", "landlock") and landlock_ok:
            self.mechanism = "landlock"
        if self.mechanism is not None:
            parent = FILTER_PARENT if os.access(FILTER_PARENT, os.W_OK) else None
            _remove_stale_filters(parent or tempfile.gettempdir())
            self._dir = tempfile.mkdtemp(prefix=f"{_FILTER_PREFIX}{os.getpid()}-", dir=parent)
            self._filters = _write_filters(self._dir)
            if support.landlock_problem is None and self.requested != "bwrap":
                _set_not_dumpable()
        with open(os.path.join(os.path.dirname(__file__), "landlock_exec.py")) as f:
            self._helper = f.read()
        if self.mechanism is None:
            log.warn(
                "sandbox: confined process starts will be refused: {why}", why=self.unavailable()
            )
        else:
            log.info(
                "sandbox: confined processes run under {mechanism} + seccomp",
                mechanism=self.describe(),
            )

    def stop(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def describe(self) -> str:
        """``bwrap``, ``landlock`` or ``none`` (environment/info, /metrics)."""
        return self.mechanism or "none"

    def unavailable(self, landlock_wanted: bool = False) -> str:
        """Why no confined process can start here, and how to fix it."""
        support = self.support
        if support is None:
            return f"{CANNOT_ENFORCE}: the sandbox was not started"
        problems = []
        if support.seccomp_problem is not None:
            problems.append(f"seccomp: {support.seccomp_problem}")
        if self.requested != "landlock":
            problems.append(f"bubblewrap: {support.bwrap_problem or 'not chosen'}")
        else:
            problems.append("bubblewrap: not used (--sandbox-mechanism landlock)")
        if self.requested != "bwrap" or landlock_wanted:
            problems.append(f"Landlock: {support.landlock_problem or 'not chosen'}")
        else:
            problems.append("Landlock: not used (--sandbox-mechanism bwrap)")
        return (
            f"{CANNOT_ENFORCE}: "
            + "; ".join(problems)
            + " (exec-server --check-sandbox shows what works here)"
        )

    # --- wrapping a start ----------------------------------------------------

    def wrap(
        self, spec: ProcessSpec, policy: SandboxPolicy, legacy_landlock: bool = False
    ) -> ProcessSpec:
        """``spec`` run confined by ``policy`` (raises RpcError when it cannot be)."""
        mechanism = self.mechanism
        support = self.support
        if (
            legacy_landlock
            and support is not None
            and support.landlock_problem is None
            and support.seccomp_problem is None
            and self.requested != "bwrap"
        ):
            mechanism = "landlock"
        if mechanism is None:
            raise RpcError.invalid_params(self.unavailable())
        exposed = self._filters_exposed(policy, mechanism)
        if exposed is not None:
            raise RpcError.invalid_params(
                f"{CANNOT_ENFORCE}: the profile makes {exposed}, where the server keeps its "
                "seccomp filters, writable"
            )
        for path, kept in (
            *((path, "read-only") for path in policy.read_only_carveouts()),
            *((path, "hidden") for path in policy.hidden()),
        ):
            problem = _unprotectable(policy, path, kept)
            if problem is not None:
                raise RpcError.invalid_params(f"{CANNOT_ENFORCE}: {problem}")
        executable = resolve_executable(spec.argv[0], spec.env, spec.cwd)
        if mechanism == "landlock":
            return self._landlock(spec, policy, executable)
        return self._bwrap(spec, policy, executable)

    def _filters_exposed(self, policy: SandboxPolicy, mechanism: Mechanism) -> str | None:
        """Where ``policy`` would let a command write the filters (None: nowhere).

        Judged on the real paths too (a writable root that is a symlink to
        /dev/shm). Under bubblewrap a writable ``/`` does not reach them
        when they are under ``/dev``: its fresh ``/dev`` covers the host's,
        unless the same file system is mounted somewhere else too.
        """
        directory = self._dir
        if directory is None:
            return None
        seen = effective(policy)
        if any(
            rule.access == "write" and rule.path != directory and is_within(rule.path, directory)
            for rule in seen.rules
        ):
            return directory
        if seen.access(directory) != "write":
            return None
        if (
            mechanism != "bwrap"
            or seen.deciding_path(directory) != "/"
            or not is_within(directory, "/dev")
        ):
            return directory
        elsewhere = _other_mounts_of(directory, outside="/dev")
        return elsewhere[0] if elsewhere else None

    def _command(self, spec: ProcessSpec, executable: str) -> list[str]:
        """What bwrap runs: the command, its signals back to their defaults."""
        env = shutil.which("env", path=DEFAULT_PATH) or "/usr/bin/env"
        program = spec.argv[0]
        if (spec.arg0 is None or spec.arg0 == program) and "=" not in program:
            # env finds it along the child's PATH from the cwd, as
            # resolve_executable did, and keeps argv[0] as given.
            return [env, "--default-signal", "--", *spec.argv]
        # bash's exec -a sets another argv[0] (env would read NAME=VALUE as a setting).
        bash = shutil.which("bash", path=DEFAULT_PATH) or "/bin/bash"
        arg0 = spec.arg0 if spec.arg0 is not None else program
        # --norc: bash reads ~/.bashrc even non-interactive when it takes
        # its stdin for a network connection.
        return [env, "--default-signal", "--", bash, "--noprofile", "--norc", "-c",
                'exec -a "$0" "$@"', arg0, executable, *spec.argv[1:]]  # fmt: skip

    def bwrap_args(self, policy: SandboxPolicy, cwd: str) -> list[str]:
        """bwrap's options for ``policy`` (before ``--``)."""
        assert self.support is not None and self.support.bwrap is not None
        args = [self.support.bwrap, "--die-with-parent", "--unshare-user"]
        if self.support.bwrap_disable_userns:
            args.append("--disable-userns")
        args.append("--unshare-pid")
        if not policy.network:
            args.append("--unshare-net")
        if os.getuid() == 0:
            # Run by root, bwrap keeps every capability for the command (in
            # its user namespace, where uid 0 is the host's root: CAP_SETFCAP
            # there writes file capabilities the host honours). Not given
            # otherwise: bwrap then drops them itself, and a setuid bwrap
            # refuses --cap-drop from a user.
            args += ["--cap-drop", "ALL"]
        # The host's System V IPC (shared memory, semaphores, message queues)
        # is reached by uid, not by path: a namespace of its own.
        args.append("--unshare-ipc")
        # Rules on symlinks count on their real paths too (below), the root's
        # as well: a ``deny`` on a link to / hides / (none beats read).
        seen = effective(policy)
        full_read = seen.full_read
        if not full_read:
            args += ["--tmpfs", "/"]
        elif seen.access("/") == "write":
            # A writable / (as the reference binds it): what the deeper rules,
            # the cgroup mounts and the masks below re-protect stays so.
            args += ["--bind", "/", "/"]
        else:
            args += ["--ro-bind", "/", "/"]
        # Before every other mount (none of them is /: one would cover it).
        args += ["--dev", "/dev"]
        # bwrap cannot mount onto a symlink (the link's target is looked up
        # outside the new root): every rule is mounted where its path really
        # leads, as the reference binds a symlinked writable root at its
        # target, so the deeper rules, on their real paths too, land beneath
        # it (a read-only or hidden target inside a writable or readable one
        # stays so). Judged on the real paths too (``effective``), as a
        # confined fs call judges them: a hidden target stays hidden. A rule
        # leading to / itself is the root's (above), never a mount of its own.
        mounts: dict[str, str] = {}
        links: list[tuple[str, str]] = []
        for rule in policy.rules:
            real = realpath(rule.path)
            if (
                rule.access != "none"
                and real != rule.path
                and not full_read
                and seen.access(os.path.dirname(rule.path)) == "none"
                and not seen.is_hidden(os.path.dirname(rule.path))
            ):
                # Nothing shows the link (under a readable root, the link
                # itself, read-only there, still leads to the mount): make it
                # (not inside a hidden path, whose empty mount is read-only:
                # there the link stays unseen).
                links.append((real, rule.path))
            if "/" in (rule.path, real) or real in mounts:
                continue
            mounts[real] = seen.access(real)
        # Deeper rules after shallower ones: a mount covers what is beneath it.
        for path in sorted(mounts, key=lambda path: (path.rstrip("/").count("/"), path)):
            access = mounts[path]
            if access == "none":
                if os.path.isdir(path):
                    # A deeper directory's mount point is made in the empty
                    # mount while it is still writable, and the way to it
                    # may be walked (not listed).
                    deeper = [
                        other
                        for other in mounts
                        if other != path
                        and is_within(other, path)
                        and mounts[other] != "none"
                        and os.path.isdir(other)
                    ]
                    args += ["--perms", "111" if deeper else "000", "--tmpfs", path]
                    for other in deeper:
                        args += ["--perms", "111", "--dir", other]
                    args += ["--remount-ro", path]
                elif os.path.lexists(path):
                    args += ["--ro-bind", "/dev/null", path]
                continue
            if not os.path.exists(path) or (path == "/dev" and access == "read"):
                # (bwrap's fresh /dev is readable: the host's, bound over
                # it, would leave no device usable, every bind being nodev.)
                continue
            # "-try": a path that vanished since the policy was resolved binds
            # nothing (a writable root stays read-only; a carve-out that no
            # longer exists has nothing to protect, as when it was missing).
            # A hidden path that vanished fails the start instead (above).
            if access == "write":
                args += ["--bind-try", path, path]
            elif (
                not full_read
                or seen.access(os.path.dirname(path) or "/") != "read"
                or is_within(path, "/dev")
            ):
                args += ["--ro-bind-try", path, path]
        for real, link in links:
            if os.path.exists(real):
                args += ["--symlink", real, link]
        for path in self.masked:
            if os.path.lexists(path):
                args += ["--ro-bind-try", "/dev/null", path]
        args += ["--proc", "/proc", "--chdir", cwd, "--seccomp", "3"]
        return args

    def _bwrap(self, spec: ProcessSpec, policy: SandboxPolicy, executable: str) -> ProcessSpec:
        # The client's environment reaches the command only (bwrap sets it
        # last): sh and bwrap run unconfined, and their dynamic loader would
        # honour LD_PRELOAD, LD_AUDIT, LD_DEBUG_OUTPUT... from it.
        setenv = [arg for key, value in spec.env.items() for arg in ("--setenv", key, value)]
        argv = ["/bin/sh", "-c", _SH_SCRIPT, self._filters[policy.network],
                *self.bwrap_args(policy, spec.cwd), *setenv,
                "--", *self._command(spec, executable)]  # fmt: skip
        return attrs.evolve(
            spec, argv=tuple(argv), arg0=None, env={}, sandbox_processes=BWRAP_PROCESSES
        )

    def _landlock(self, spec: ProcessSpec, policy: SandboxPolicy, executable: str) -> ProcessSpec:
        if not policy.full_read:
            raise RpcError.invalid_params(
                f"{CANNOT_ENFORCE}: Landlock cannot restrict reads to part of the filesystem "
                "here; install the `bubblewrap` package (or pass --bwrap PATH)"
            )
        # A cgroup file system inside a writable root is left out of the
        # write grants instead (a mount point cannot be renamed or replaced).
        cgroupfs = frozenset(cgroup_mounts())
        carveouts = [path for path in policy.read_only_carveouts() if path not in cgroupfs]
        blocked = _existing(carveouts) + _existing(policy.hidden())
        if blocked:
            raise RpcError.invalid_params(
                f"{CANNOT_ENFORCE}: Landlock cannot re-protect {blocked[0]} inside a writable "
                "root; install the `bubblewrap` package (or pass --bwrap PATH) "
                "and enable user namespaces"
            )
        import sys

        reads = _landlock_reads(_existing(self.masked))
        writes = [*_landlock_writes(policy.writable_roots(), cgroupfs), *_LANDLOCK_DEVICES]
        program = [executable, spec.arg0 if spec.arg0 is not None else spec.argv[0], *spec.argv[1:]]
        # The client's environment is the command's only (the helper execs
        # it with it): the interpreter runs unconfined until the helper has
        # confined it, and its dynamic loader would honour LD_PRELOAD...
        env = [f"{key}={value}" for key, value in spec.env.items()]
        argv = [sys.executable, "-I", "-S", "-c", self._helper, self._filters[policy.network],
                str(len(reads)), *reads, str(len(writes)), *writes,
                str(_LANDLOCK_SCOPES), str(len(env)), *env, *program]  # fmt: skip
        return attrs.evolve(spec, argv=tuple(argv), arg0=None, env={})


def describe_sandbox(info: p.EnvironmentInfo, engine: SandboxEngine | None) -> p.EnvironmentInfo:
    """``info`` with our additive ``sandbox`` field: the mechanism, or ``none``."""
    info.sandbox = engine.describe() if engine is not None else "none"
    return info
