"""The Landlock helper: confine this process, then exec the command (a standalone script).

The server runs it as ``python -I -S -c SOURCE BPF N_READ READ... N_WRITE
WRITE... SCOPE N_ENV KEY=VALUE... EXE ARG0 ARGS...`` in an empty environment
(the command's is given as arguments, so nothing of the client's such as
``LD_PRELOAD`` reaches the interpreter before it is confined) with this
file's text as ``SOURCE`` (read once at startup, so no file a sandboxed
process could write is executed later). It imports only the standard
library: ``ctypes`` for the three
Landlock syscalls and ``prctl``. Steps: a ruleset handling every file
access of the kernel's ABI, read (and execute) beneath each ``READ`` path,
everything beneath each ``WRITE`` path, ``no_new_privs``,
``landlock_restrict_self``, every capability dropped (bounding, ambient,
effective, permitted, inheritable: root keeps no privilege either, as under
bwrap), then the seccomp program read from ``BPF`` (a file the server wrote
where no sandboxed process can write), the default signal dispositions,
and ``execve`` with the command's environment. Any failure exits 126 before the command runs
(nothing runs less confined than asked).
"""

import ctypes
import os
import signal
import struct
import sys

_SYS_CREATE_RULESET = 444
_SYS_ADD_RULE = 445
_SYS_RESTRICT_SELF = 446
_RULE_PATH_BENEATH = 1
_CREATE_RULESET_VERSION = 1
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_PR_CAPBSET_DROP = 24
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_CAPABILITY_VERSION_3 = 0x20080522

_READ = (1 << 0) | (1 << 2) | (1 << 3)  # EXECUTE, READ_FILE, READ_DIR
#: Rights that apply to a file (the others are only for directories).
_FILE_RIGHTS = (1 << 0) | (1 << 1) | (1 << 2) | (1 << 14) | (1 << 15)


def _fail(what: str) -> None:
    err = ctypes.get_errno()
    sys.stderr.write(f"exec-server sandbox (landlock): {what}: {os.strerror(err)}\n")
    sys.stderr.flush()
    os._exit(126)


def _drop_capabilities(libc: ctypes.CDLL) -> None:
    for cap in range(64):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != 22:
            _fail("prctl(PR_CAPBSET_DROP)")  # EINVAL: past the kernel's last capability
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = ctypes.create_string_buffer(struct.pack("=Ii", _CAPABILITY_VERSION_3, 0), 8)
    data = ctypes.create_string_buffer(bytes(24), 24)
    if libc.capset(header, data) != 0:
        _fail("capset")


def main(argv: list[str]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    abi = syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), _CREATE_RULESET_VERSION)
    if abi < 1:
        _fail("the kernel has no Landlock")
    handled = (1 << 13) - 1
    if abi >= 2:
        handled |= 1 << 13  # REFER
    if abi >= 3:
        handled |= 1 << 14  # TRUNCATE
    if abi >= 5:
        handled |= 1 << 15  # IOCTL_DEV
    bpf_path = argv[0]
    n_read = int(argv[1])
    reads = argv[2 : 2 + n_read]
    rest = argv[2 + n_read :]
    n_write = int(rest[0])
    writes = rest[1 : 1 + n_write]
    scope_wanted = int(rest[1 + n_write])
    rest = rest[2 + n_write :]
    n_env = int(rest[0])
    env = dict(item.split("=", 1) for item in rest[1 : 1 + n_env])
    exe = rest[1 + n_env]
    args = rest[2 + n_env :]
    scoped = scope_wanted if abi >= 6 else 0
    # The struct grew with the ABI: handled_access_fs, _net (4), scoped (6).
    attr = struct.pack("=QQQ", handled, 0, scoped) if abi >= 6 else struct.pack("=Q", handled)
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = syscall(_SYS_CREATE_RULESET, buf, ctypes.c_size_t(len(attr)), 0)
    if ruleset < 0:
        _fail("landlock_create_ruleset")

    def add_rule(path: str, fd: int, allowed: int) -> None:
        rule = ctypes.create_string_buffer(struct.pack("=Qi", allowed, fd), 12)
        if syscall(_SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, rule, 0) != 0:
            _fail(f"landlock_add_rule({path})")
        os.close(fd)

    for paths, rights in ((reads, _READ), (writes, handled)):
        for path in paths:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # a missing path grants nothing
            allowed = rights & handled
            if not os.path.isdir(path):
                allowed &= _FILE_RIGHTS
            add_rule(path, fd, allowed)
    for std in (0, 1, 2):
        # Its own terminal, reopened by name (/dev/stdout, /dev/pts/N): the
        # server grants no other terminal of the host.
        try:
            tty = os.ttyname(std)
        except OSError:
            continue
        add_rule(tty, os.open(tty, os.O_PATH | os.O_CLOEXEC), handled & _FILE_RIGHTS)
    with open(bpf_path, "rb") as f:
        program = f.read()
    _drop_capabilities(libc)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        _fail("prctl(PR_SET_NO_NEW_PRIVS)")
    if syscall(_SYS_RESTRICT_SELF, ruleset, 0) != 0:
        _fail("landlock_restrict_self")
    os.close(ruleset)
    filters = ctypes.create_string_buffer(program, len(program))
    fprog = struct.pack("@HP", len(program) // 8, ctypes.addressof(filters))
    fprog_buf = ctypes.create_string_buffer(fprog, len(fprog))
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, fprog_buf, 0, 0) != 0:
        _fail("prctl(PR_SET_SECCOMP)")
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    try:
        os.execve(exe, args, env)
    except OSError as exc:
        sys.stderr.write(f"exec-server sandbox (landlock): {exe}: {exc.strerror}\n")
        sys.stderr.flush()
        os._exit(126)


if __name__ == "__main__":
    main(sys.argv[1:])
