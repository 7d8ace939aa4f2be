"""Attacks on the sandbox (issue 21 review): each one an escape found and fixed.

A hostile command inside the sandbox and a hostile client crafting the
start, through the real installed server, both mechanisms where they
apply. Each test failed before its fix (see the commit that adds it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted

from tests.support.harness import RpcFailure, b64
from tests.support.sandbox import (
    CHILD_PATH,
    MECHANISMS,
    Dirs,
    codex_profile,
    dirs,
    env_for,
    profile_for,
    run,
    stdio_server,
    uri,
)
from tests.support.ws_harness import WsServerProcess, connect

__all__ = ["dirs"]


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest_twisted.ensureDeferred
async def test_loader_variables_do_not_reach_the_unconfined_wrapper(
    dirs: Dirs, mechanism: str
) -> None:
    # LD_DEBUG_OUTPUT makes the dynamic loader of every program that starts
    # with it write a file: the wrapper that runs before confinement (sh and
    # bwrap, or the Landlock helper's interpreter) must not see the client's
    # environment, only the command inside does.
    target = dirs.outside / "pwn"
    env = env_for(dirs, mechanism, LD_DEBUG="files", LD_DEBUG_OUTPUT=str(target))
    async with stdio_server("--sandbox-mechanism", mechanism) as server:
        ran = await run(
            server, 'echo "$LD_DEBUG_OUTPUT"', dirs.work, profile_for(dirs, mechanism), env
        )
    assert ran.exit_code == 0, ran.output
    # The command itself still gets the variable the client set.
    assert ran.output.splitlines()[-1] == str(target).encode()
    assert sorted(p.name for p in dirs.outside.iterdir()) == []


@pytest.mark.parametrize("target", ["absolute", "relative"])
@pytest_twisted.ensureDeferred
async def test_floor_holds_against_a_writable_root_that_is_a_symlink(
    dirs: Dirs, target: str
) -> None:
    # A symlink inside the floor's writable root, pointing outside it, asked
    # for as a writable root: lexically within the floor, really outside.
    link = dirs.work / "link"
    link.symlink_to(dirs.outside if target == "absolute" else Path("..") / "outside")
    sandbox = {"mode": "workspaceWrite", "writableRoots": [str(link)], "network": False}
    async with stdio_server(
        "--sandbox-floor", "workspace-write", "--floor-writable-root", str(dirs.work),
        "--floor-no-network",
    ) as server:  # fmt: skip
        ran = await run(
            server,
            f"echo pwn > {dirs.outside}/p; echo pwn > {link}/q; echo pwn > {dirs.work}/in",
            dirs.work,
            sandbox,
            {"PATH": CHILD_PATH},
        )
        with pytest.raises(RpcFailure) as refused:
            await server.call(
                "fs/writeFile",
                {"path": str(link / "r"), "dataBase64": b64(b"pwn"), "sandbox": sandbox},
            )
        assert (refused.value.code, refused.value.message) == (
            -32603,
            "Read-only file system (os error 30)",
        )
    assert ran.exit_code != 0
    assert sorted(p.name for p in dirs.outside.iterdir()) == []


OPENAT2_SETUID = (
    "python3 -c 'import ctypes, os, struct, sys; c = ctypes.CDLL(None, use_errno=True); "
    "c.syscall.restype = ctypes.c_long; "
    'how = struct.pack("QQQ", os.O_CREAT | os.O_WRONLY, 0o4755, 0); '
    "how = ctypes.create_string_buffer(how, 24); "
    "r = c.syscall(437, -100, sys.argv[1].encode(), how, ctypes.c_size_t(24)); "
    "print(r, os.strerror(ctypes.get_errno()))' "
)


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest_twisted.ensureDeferred
async def test_no_setuid_file_through_openat2(dirs: Dirs, mechanism: str) -> None:
    # The filter refuses a setuid/setgid mode on open/openat/creat/chmod...;
    # openat2 takes its mode in a struct seccomp cannot read.
    target = dirs.work / "suid"
    async with stdio_server("--sandbox-mechanism", mechanism) as server:
        ran = await run(
            server,
            OPENAT2_SETUID + str(target),
            dirs.work,
            profile_for(dirs, mechanism),
            env_for(dirs, mechanism),
        )
    assert ran.exit_code == 0, ran.output
    assert not target.exists() or not target.stat().st_mode & 0o6000, oct(target.stat().st_mode)


@pytest_twisted.ensureDeferred
async def test_fs_path_through_a_missing_directory_and_dotdot(dirs: Dirs) -> None:
    # A hostile client's path: `..` after a directory that does not exist.
    # The guard's own resolution meets the kernel's error first: it must be
    # the same answer as without a sandbox (not an internal error with a
    # traceback in the server's log), and nothing is written.
    (dirs.work / ".git").mkdir()
    path = f"{uri(dirs.work)}/missing/../.git/config"
    async with stdio_server() as server:
        answers = []
        for sandbox in (None, codex_profile(dirs.work)):
            for method, params in (
                ("fs/writeFile", {"path": path, "dataBase64": b64(b"pwn")}),
                ("fs/createDirectory", {"path": path, "recursive": True}),
                ("fs/remove", {"path": path}),
                ("fs/readFile", {"path": path}),
            ):
                response = await server.request(method, {**params, "sandbox": sandbox})
                assert "error" in response, (method, sandbox, response)
                answers.append((sandbox is None, method, response["error"]))
    plain = [(m, e) for unconfined, m, e in answers if unconfined]
    confined = [(m, e) for unconfined, m, e in answers if not unconfined]
    assert all("internal" not in e["message"] for _, e in confined), confined
    assert [(m, e["code"], e["message"]) for m, e in confined] == [
        (m, e["code"], e["message"]) for m, e in plain
    ]
    assert list((dirs.work / ".git").iterdir()) == []


# ioctl's request is an `unsigned int` for the kernel, a 64-bit register for
# seccomp: TIOCSTI with high bits set is still TIOCSTI.
TIOCSTI_HIGH_BITS = (
    "python3 -c 'import ctypes, os; c = ctypes.CDLL(None, use_errno=True); "
    'c.syscall.restype = ctypes.c_long; ch = ctypes.c_char(b"x"); '
    "r = c.syscall(16, 0, ctypes.c_ulong(0x5412 | 1 << 32), ctypes.byref(ch)); "
    'print("TIOCSTI", r, os.strerror(ctypes.get_errno()))\''
)


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest_twisted.ensureDeferred
async def test_tiocsti_with_high_bits_is_refused(dirs: Dirs, mechanism: str) -> None:
    async with stdio_server("--sandbox-mechanism", mechanism) as server:
        ran = await run(
            server,
            TIOCSTI_HIGH_BITS,
            dirs.work,
            profile_for(dirs, mechanism),
            env_for(dirs, mechanism, TERM="dumb"),
            tty=True,
        )
    assert b"TIOCSTI -1 Operation not permitted" in ran.output, ran.output


@pytest_twisted.ensureDeferred
async def test_an_explicit_none_on_the_root_with_readable_and_writable_children(
    dirs: Dirs,
) -> None:
    # `none` on `/` is the default of a restricted profile; said explicitly,
    # it must not make the sandbox's own root read-only before the binds.
    (dirs.outside / "target").write_text("secret\n")
    sandbox = codex_profile(dirs.work)
    entries = sandbox["permissions"]["file_system"]["entries"]
    entries[0] = {"path": {"type": "special", "value": {"kind": "root"}}, "access": "none"}
    entries.insert(1, {"path": {"type": "special", "value": {"kind": "minimal"}}, "access": "read"})
    async with stdio_server("--sandbox-mechanism", "bwrap") as server:
        ok = await run(server, f"echo in > {dirs.work}/f && cat {dirs.work}/f", dirs.work, sandbox)
        hidden = await run(server, f"cat {dirs.outside}/target", dirs.work, sandbox)
    assert (ok.exit_code, ok.output) == (0, b"in\n"), ok.output
    assert hidden.exit_code != 0 and b"secret" not in hidden.output, hidden.output


@pytest.mark.parametrize(
    ("mechanism", "shape"),
    [("bwrap", "missing"), ("landlock", "missing"), ("bwrap", "symlink")],
)
@pytest_twisted.ensureDeferred
async def test_a_carve_out_the_command_could_create_or_replace_is_a_refusal(
    dirs: Dirs, mechanism: str, shape: str
) -> None:
    # A read-only path inside a writable root that does not exist (an entry
    # without missing_path_behavior skip), or is a symlink there: a mount
    # (or a Landlock rule) cannot keep the command from creating it or
    # replacing the link by a directory of its own (a .git with hooks).
    w = dirs.work
    sandbox = profile_for(dirs, mechanism)
    if shape == "missing":
        protected = w / "protected"
        sandbox["permissions"]["file_system"]["entries"].append(
            {"path": {"type": "path", "path": str(protected)}, "access": "read"}
        )
    else:
        (w / "realgit").mkdir()
        (w / "realgit" / "config").write_text("[core]\n")
        protected = w / ".git"
        protected.symlink_to("realgit")
    script = (
        f"rm -f {protected}; mkdir {protected} && echo pwn > {protected}/config && echo ESCAPED"
    )
    async with stdio_server("--sandbox-mechanism", mechanism) as server:
        with pytest.raises(RpcFailure) as refused:
            await run(server, script, w, sandbox, env_for(dirs, mechanism))
    assert refused.value.code == -32602
    assert refused.value.message.startswith("sandbox intent cannot be enforced on this executor")
    assert str(protected) in refused.value.message
    assert protected.is_symlink() if shape == "symlink" else not protected.exists()


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest_twisted.ensureDeferred
async def test_the_filters_stay_out_of_reach_through_a_symlinked_root(
    dirs: Dirs, mechanism: str
) -> None:
    # /dev/shm (where the server keeps its seccomp programs) asked for as a
    # writable root through a symlink: refused as /dev/shm itself is, or
    # the command could rewrite the filter every later sandbox loads.
    link = dirs.work / "shm"
    link.symlink_to("/dev/shm")
    sandbox = {"mode": "workspaceWrite", "writableRoots": [str(link)], "network": False}
    async with stdio_server("--sandbox-mechanism", mechanism) as server:
        for root in ("/dev/shm", str(link)):
            sandbox["writableRoots"] = [root]
            with pytest.raises(RpcFailure) as refused:
                await run(server, "ls /dev/shm", dirs.work, sandbox, env_for(dirs, mechanism))
            assert refused.value.code == -32602, root
            assert "where the server keeps its seccomp filters" in refused.value.message, root


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest_twisted.ensureDeferred
async def test_another_sessions_terminal_is_out_of_reach(dirs: Dirs, mechanism: str) -> None:
    # A PTY process of another (unconfined) client; a read-only confined
    # command opens its terminal by name: it must neither read the input
    # meant for it (a password typed there) nor write into its output.
    steal = (
        "python3 -c 'import os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_NOCTTY); "
        'os.write(fd, b"SPOOFED\\n"); print("OPENED", flush=True); os.read(fd, 100)\' '
    )
    async with stdio_server("--sandbox-mechanism", mechanism) as server:

        def output_has(pid: str, data: bytes, count: int = 1) -> Any:
            return lambda _: server.output_of(pid).count(data) >= count

        def exited(pid: str) -> Any:
            return lambda m: m.get("method") == "process/exited" and m["params"]["processId"] == pid

        await server.start_process(
            "victim", ["sh", "-c", "tty; exec cat"], cwd=uri(dirs.outside),
            env={"PATH": CHILD_PATH}, tty=True,
        )  # fmt: skip
        await server.wait_for(output_has("victim", b"\n"), 30, "the victim's tty")
        tty = server.output_of("victim").split(b"\r\n")[0].decode()
        assert tty.startswith("/dev/pts/"), tty
        started = await server.start_process(
            "attacker", ["sh", "-c", steal + tty], cwd=uri(dirs.work),
            env={"PATH": CHILD_PATH}, sandbox=codex_profile(dirs.work, write=False),
        )  # fmt: skip
        assert started["sandboxType"] == "linuxSeccomp"
        opened, gone = output_has("attacker", b"OPENED"), exited("attacker")
        last = await server.wait_for(lambda m: opened(m) or gone(m), 30, "the attacker's try")
        if not gone(last):
            # It holds the terminal (it would read the victim's next input).
            await server.call("process/terminate", {"processId": "attacker"})
        exit_params = (await server.wait_for(gone, 30, "the attacker's exit"))["params"]
        await server.call("process/terminate", {"processId": "victim"})
    attacker_output = server.output_of("attacker")
    assert exit_params["exitCode"] != 0 and b"OPENED" not in attacker_output, attacker_output
    assert b"SPOOFED" not in server.output_of("victim")


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest_twisted.ensureDeferred
async def test_the_servers_token_file_is_hidden_from_the_sandbox(
    dirs: Dirs, mechanism: str
) -> None:
    # Everything is readable under Codex's profiles, the file of bearer
    # tokens that guards the server's listeners too: with it a command that
    # reaches a listener (network enabled) starts processes unconfined.
    tokens = dirs.outside / "tokens"
    tokens.write_text("tok-4f1c9e0123456789abcdef\n")
    tokens.chmod(0o600)
    server = await WsServerProcess.start(
        "--listen", "ws://127.0.0.1:0", "--auth-token-file", str(tokens),
        "--sandbox-mechanism", mechanism,
    )  # fmt: skip
    try:
        client = await connect(
            server.url, headers={"Authorization": "Bearer tok-4f1c9e0123456789abcdef"}
        )
        try:
            await client.call("initialize", {"clientName": "sandbox-tokens"})
            client.notify("initialized", {})
            ran = await run(
                client, f"cat {tokens}", dirs.work, profile_for(dirs, mechanism),
                env_for(dirs, mechanism),
            )  # fmt: skip
        finally:
            await client.close()
    finally:
        assert await server.stop() == 0
    assert ran.exit_code != 0 and b"tok-4f1c9e" not in ran.output, ran.output


@pytest.mark.parametrize(
    ("mechanism", "shape"),
    [("bwrap", "missing"), ("landlock", "missing"), ("bwrap", "symlink")],
)
@pytest_twisted.ensureDeferred
async def test_a_hidden_path_the_command_could_create_or_replace_is_a_refusal(
    dirs: Dirs, mechanism: str, shape: str
) -> None:
    # A hidden path (deny) inside a writable root that does not exist, or is
    # a symlink there: a mount masks only what exists (and the link's
    # target), so the command could create the path, or replace the link by
    # a directory of its own, and write there, which the profile denies (a
    # confined fs call refuses it). Before the fix both ran (ESCAPED).
    w = dirs.work
    sandbox = profile_for(dirs, mechanism)
    protected = w / "denied"
    if shape == "symlink":
        (dirs.outside / "secret").mkdir()
        protected.symlink_to(dirs.outside / "secret")
    sandbox["permissions"]["file_system"]["entries"].append(
        {"path": {"type": "path", "path": str(protected)}, "access": "deny"}
    )
    script = f"rm -f {protected}; mkdir {protected} && echo pwn > {protected}/x && echo ESCAPED"
    async with stdio_server("--sandbox-mechanism", mechanism) as server:
        with pytest.raises(RpcFailure) as refused:
            await run(server, script, w, sandbox, env_for(dirs, mechanism))
    assert refused.value.code == -32602
    assert refused.value.message.startswith("sandbox intent cannot be enforced on this executor")
    assert str(protected) in refused.value.message
    assert protected.is_symlink() if shape == "symlink" else not protected.exists()


#: A file capability (VFS_CAP_REVISION_2, effective): CAP_SYS_ADMIN permitted.
_CAP_SYS_ADMIN_XATTR = "struct.pack('<5I', 0x02000001, 1 << 21, 0, 0, 0)"


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest_twisted.ensureDeferred
async def test_a_confined_command_has_no_capability_to_set_a_file_capability(
    dirs: Dirs, mechanism: str
) -> None:
    # A server run as root: bubblewrap keeps every capability (in the
    # command's user namespace, where uid 0 is the host's root) unless told
    # to drop them, and CAP_SETFCAP there writes a file capability the host
    # honours (its root id is the host's root): any later, unconfined run of
    # the file would get CAP_SYS_ADMIN, what the filter's refusal of setuid
    # bits is there to prevent. Before the fix (bwrap): CapEff 1fffeffffff
    # and the capability set.
    import sys

    assert os.geteuid() == 0  # CI runs as root: the case this pins
    w = dirs.work
    target = w / "tool"
    target.write_bytes(b"#!/bin/sh\n")
    script = (
        "grep CapEff /proc/self/status; "
        f'{sys.executable} -I -c "import os, struct; '
        f"os.setxattr('{target}', 'security.capability', {_CAP_SYS_ADMIN_XATTR})\" "
        "2>/dev/null && echo SETFCAP"
    )
    async with stdio_server("--sandbox-mechanism", mechanism) as server:
        ran = await run(server, script, w, profile_for(dirs, mechanism), env_for(dirs, mechanism))
    assert b"CapEff:\t0000000000000000\n" in ran.output, ran.output
    assert b"SETFCAP" not in ran.output, ran.output
    with pytest.raises(OSError):
        os.getxattr(target, "security.capability")


@pytest_twisted.ensureDeferred
async def test_a_bwrap_confined_command_cannot_reach_the_hosts_system_v_ipc(dirs: Dirs) -> None:
    # A read-only profile, the network restricted: the host's System V shared
    # memory (a segment of the server's user, mode 0600) is out of reach.
    # Before the fix (no --unshare-ipc) the command removed it: IPC_RMID by
    # its owner's uid, no capability needed.
    import ctypes
    import sys

    libc = ctypes.CDLL(None, use_errno=True)
    ipc_private, ipc_creat, ipc_rmid = 0, 0o1000, 0
    segment = libc.shmget(ipc_private, 4096, ipc_creat | 0o600)
    assert segment >= 0, os.strerror(ctypes.get_errno())
    remove = (
        f"import ctypes; libc = ctypes.CDLL(None); "
        f"print('REMOVED' if libc.shmctl({segment}, {ipc_rmid}, None) == 0 else 'UNSEEN')"
    )
    try:
        async with stdio_server("--sandbox-mechanism", "bwrap") as server:
            ran = await run(
                server,
                f'{sys.executable} -I -c "{remove}"',
                dirs.work,
                profile_for(dirs, "bwrap", write=False),
                env_for(dirs, "bwrap"),
            )
        assert ran.output == b"UNSEEN\n", ran.output
    finally:
        gone = libc.shmctl(segment, ipc_rmid, None) != 0
    assert not gone  # the host's segment was still there
