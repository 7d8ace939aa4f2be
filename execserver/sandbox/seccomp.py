"""The seccomp filter every sandboxed process runs under, compiled with libseccomp.

The rules follow the reference's Linux sandbox (``codex-linux-sandbox``):
with the network restricted, every socket call but those on Unix sockets
and ``connect`` itself fail with ``EPERM`` (``recvfrom``/``sendmsg`` stay,
for socketpairs between a tool's own processes); ``ptrace``,
``process_vm_readv``/``writev`` and ``io_uring`` always fail; with the
network allowed, only ``AF_VSOCK`` sockets are refused. On top of the
reference: mounting, keyrings, new namespaces (``unshare``, ``setns``,
``clone`` with a ``CLONE_NEW*`` flag; ``clone3`` answers ``ENOSYS`` so libc
falls back to ``clone``; ``openat2`` answers ``ENOSYS`` too, its mode being out
of the filter's reach), ``bpf``, ``perf_event_open``, kernel modules,
``kexec``, ``reboot``, swap, ``open_by_handle_at``, terminal injection
(``TIOCSTI``, ``TIOCLINUX``) and setting a setuid or setgid bit (``chmod``
family, ``mknod``, ``open``/``openat``/``creat`` with ``O_CREAT``).

The program is built once per network mode and exported as classic BPF
(``seccomp_export_bpf``): bubblewrap loads it from a descriptor
(``--seccomp FD``), the Landlock helper with ``prctl(PR_SET_SECCOMP)``.
Syscalls of another architecture (the i386 ABI on x86_64) are killed,
libseccomp's default for a foreign architecture.
"""

from __future__ import annotations

import ctypes
import errno
import os
import tempfile
from typing import Final

LIBRARY: Final = "libseccomp.so.2"

_ACT_ALLOW: Final = 0x7FFF0000
_FLTATR_CTL_OPTIMIZE: Final = 8
_CMP_NE: Final = 1
_CMP_MASKED_EQ: Final = 7

_AF_UNIX: Final = 1
_AF_VSOCK: Final = 40
_O_CREAT: Final = 0o100
_S_ISUID: Final = 0o4000
_S_ISGID: Final = 0o2000
_TIOCSTI: Final = 0x5412
_TIOCLINUX: Final = 0x541C
#: CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET.
_CLONE_NEW_FLAGS: Final = (
    0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000,
)  # fmt: skip

#: Refused in every sandbox (EPERM).
ALWAYS_DENIED: Final = (
    "ptrace", "process_vm_readv", "process_vm_writev",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr",
    "keyctl", "add_key", "request_key",
    "unshare", "setns", "bpf", "perf_event_open",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "swapon", "swapoff", "reboot", "open_by_handle_at",
)  # fmt: skip

#: Refused when the network is restricted (EPERM), as the reference does.
NETWORK_DENIED: Final = (
    "connect", "accept", "accept4", "bind", "listen", "getpeername", "getsockname",
    "shutdown", "sendto", "sendmmsg", "recvmmsg", "getsockopt", "setsockopt",
)  # fmt: skip


class SeccompError(RuntimeError):
    """libseccomp is missing or refused the filter."""


class _ArgCmp(ctypes.Structure):
    _fields_ = (
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    )


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


def _load() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(LIBRARY, use_errno=True)
    except OSError as exc:
        raise SeccompError(
            f"cannot load {LIBRARY} (install the libseccomp2 package): {exc}"
        ) from None
    lib.seccomp_init.argtypes = (ctypes.c_uint32,)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_release.argtypes = (ctypes.c_void_p,)
    lib.seccomp_release.restype = None
    lib.seccomp_syscall_resolve_name.argtypes = (ctypes.c_char_p,)
    lib.seccomp_syscall_resolve_name.restype = ctypes.c_int
    lib.seccomp_rule_add_array.argtypes = (
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp),
    )  # fmt: skip
    lib.seccomp_rule_add_array.restype = ctypes.c_int
    lib.seccomp_attr_set.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32)
    lib.seccomp_attr_set.restype = ctypes.c_int
    lib.seccomp_export_bpf.argtypes = (ctypes.c_void_p, ctypes.c_int)
    lib.seccomp_export_bpf.restype = ctypes.c_int
    return lib


class _Filter:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        ctx = lib.seccomp_init(_ACT_ALLOW)
        if not ctx:
            raise SeccompError("seccomp_init failed")
        self._ctx = ctx
        # A binary tree of syscall numbers instead of a linear scan: every
        # syscall of the confined process runs the filter (libseccomp >= 2.5;
        # older ones refuse the attribute and keep the linear program).
        lib.seccomp_attr_set(ctx, _FLTATR_CTL_OPTIMIZE, 2)

    def close(self) -> None:
        self._lib.seccomp_release(self._ctx)

    def deny(
        self, name: str, *conditions: tuple[int, int, int, int], code: int = errno.EPERM
    ) -> None:
        nr = self._lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:
            # Not a syscall of this architecture (or of this libseccomp): nothing to refuse.
            return
        array = (_ArgCmp * max(1, len(conditions)))(*(_ArgCmp(*c) for c in conditions))
        rc = self._lib.seccomp_rule_add_array(
            self._ctx, _errno_action(code), nr, len(conditions), array
        )
        if rc < 0:
            raise SeccompError(f"seccomp_rule_add({name}) failed: {os.strerror(-rc)}")

    def export(self) -> bytes:
        with tempfile.TemporaryFile() as f:
            rc = self._lib.seccomp_export_bpf(self._ctx, f.fileno())
            if rc < 0:
                raise SeccompError(f"seccomp_export_bpf failed: {os.strerror(-rc)}")
            f.seek(0)
            return f.read()


def _setid_bit(arg: int) -> list[tuple[tuple[int, int, int, int], ...]]:
    return [((arg, _CMP_MASKED_EQ, bit, bit),) for bit in (_S_ISUID, _S_ISGID)]


def build(network: bool) -> bytes:
    """The filter as a classic BPF program (``struct sock_filter`` array)."""
    lib = _load()
    f = _Filter(lib)
    try:
        for name in ALWAYS_DENIED:
            f.deny(name)
        f.deny("clone3", code=errno.ENOSYS)
        # openat2 takes its flags and mode in a struct the filter cannot
        # read (a setuid file would get through): ENOSYS, callers fall back
        # to openat, which the filter checks.
        f.deny("openat2", code=errno.ENOSYS)
        for flag in _CLONE_NEW_FLAGS:
            f.deny("clone", (0, _CMP_MASKED_EQ, flag, flag))
        for request in (_TIOCSTI, _TIOCLINUX):
            # The kernel reads the request as an unsigned int: compare the
            # low 32 bits only (TIOCSTI | 1 << 32 is TIOCSTI).
            f.deny("ioctl", (1, _CMP_MASKED_EQ, 0xFFFFFFFF, request))
        for name, mode_arg in (("chmod", 1), ("fchmod", 1), ("fchmodat", 2), ("fchmodat2", 2),
                               ("mknod", 1), ("mknodat", 2), ("creat", 1)):  # fmt: skip
            for cond in _setid_bit(mode_arg):
                f.deny(name, *cond)
        for name, flags_arg, mode_arg in (("open", 1, 2), ("openat", 2, 3)):
            for cond in _setid_bit(mode_arg):
                f.deny(name, (flags_arg, _CMP_MASKED_EQ, _O_CREAT, _O_CREAT), *cond)
        if network:
            # An int for the kernel: the low 32 bits only, as for ioctl.
            f.deny("socket", (0, _CMP_MASKED_EQ, 0xFFFFFFFF, _AF_VSOCK))
            f.deny("socketpair", (0, _CMP_MASKED_EQ, 0xFFFFFFFF, _AF_VSOCK))
        else:
            for name in NETWORK_DENIED:
                f.deny(name)
            f.deny("socket", (0, _CMP_NE, _AF_UNIX, 0))
            f.deny("socketpair", (0, _CMP_NE, _AF_UNIX, 0))
        return f.export()
    finally:
        f.close()


def kernel_supports_filters() -> bool:
    """Whether this kernel has seccomp filters (``Seccomp:`` in /proc/self/status)."""
    try:
        with open("/proc/self/status") as status:
            return any(line.startswith("Seccomp:") for line in status)
    except OSError:
        return False
