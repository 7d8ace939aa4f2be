"""Writable roots under bubblewrap: ``/`` itself, a symlink, and their neighbours.

Before the fix, a profile making ``/`` writable ran with ``/`` read-only
(bwrap was given ``--ro-bind / /`` and the ``/`` rule was skipped), and a
writable root that is a symlink failed the start (``bwrap: Can't bind
mount ...``: bwrap cannot mount onto a symlink). Now ``/`` is bound
writable (``--bind / /``, as the reference does with a writable ``/``) and a
symlinked root is bound at the directory it leads to (as the reference's
linux-sandbox does), its carve-outs with it. The neighbours pin that
nothing got less confined: a read-only root with a writable subdirectory,
a symlinked writable directory inside a read-only root, a deny rule (and
the cgroup files) under a writable ``/``. Through the real installed server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytest_twisted

from tests.support.harness import RpcFailure
from tests.support.sandbox import Dirs, dirs, env_for, run, stdio_server, uri

__all__ = ["dirs"]

ROOT = {"type": "special", "value": {"kind": "root"}}


def profile(d: Dirs, *entries: tuple[Any, str]) -> Any:
    """A restricted profile of ``entries`` (path or special, access), network restricted."""
    return {
        "permissions": {
            "type": "managed",
            "file_system": {
                "type": "restricted",
                "entries": [
                    {
                        "path": path
                        if isinstance(path, dict)
                        else {"type": "path", "path": str(path)},
                        "access": access,
                    }
                    for path, access in entries
                ],
            },
            "network": "restricted",
        },
        "cwd": uri(d.work),
    }


def attempt(*paths: Path) -> str:
    """A script that tries to create each of ``paths`` and prints OK or the error per path."""
    return "; ".join(
        f'if ( : > "{path}" ) 2>/dev/null; then echo "OK {path}"; else echo "NO {path}"; fi'
        for path in paths
    )


def outcome(output: bytes) -> dict[str, str]:
    found = {}
    for line in output.decode(errors="replace").splitlines():
        verdict, _, path = line.partition(" ")
        if verdict in ("OK", "NO"):
            found[path] = verdict
    return found


@pytest_twisted.ensureDeferred
async def test_a_writable_root_runs_writable(dirs: Dirs) -> None:
    secret = dirs.outside / "secret"
    secret.mkdir()
    (secret / "key").write_text("k")
    sandbox = profile(dirs, (ROOT, "write"), ("/dev/shm", "deny"), (secret, "deny"))
    free = dirs.outside / "free"
    in_secret = secret / "new"
    async with stdio_server("--sandbox-mechanism", "bwrap") as server:
        ran = await run(
            server,
            attempt(free, dirs.base / "also", in_secret)
            # (The cgroup files under a writable /: test_sandbox_cgroupfs.)
            + f'; cat "{secret}/key" 2>/dev/null && echo LEAK',
            dirs.work,
            sandbox,
            env=env_for(dirs, "bwrap"),
        )
    assert outcome(ran.output) == {
        str(free): "OK",
        str(dirs.base / "also"): "OK",
        str(in_secret): "NO",
    }, ran.output
    assert b"LEAK" not in ran.output, ran.output
    assert free.exists() and not in_secret.exists()


@pytest_twisted.ensureDeferred
async def test_a_read_only_root_with_a_writable_subdirectory(dirs: Dirs) -> None:
    sandbox = profile(dirs, (ROOT, "read"), (dirs.work, "write"))
    async with stdio_server("--sandbox-mechanism", "bwrap") as server:
        ran = await run(
            server,
            attempt(dirs.work / "in", dirs.outside / "out", dirs.base / "beside"),
            dirs.work,
            sandbox,
            env=env_for(dirs, "bwrap"),
        )
    assert outcome(ran.output) == {
        str(dirs.work / "in"): "OK",
        str(dirs.outside / "out"): "NO",
        str(dirs.base / "beside"): "NO",
    }, ran.output


@pytest_twisted.ensureDeferred
async def test_a_symlinked_writable_root_inside_a_read_only_root(dirs: Dirs) -> None:
    target = dirs.outside / "target"
    (target / ".git").mkdir(parents=True)
    link = dirs.work / "link"
    link.symlink_to(target)
    sandbox = profile(dirs, (ROOT, "read"), (link, "write"))
    async with stdio_server("--sandbox-mechanism", "bwrap") as server:
        ran = await run(
            server,
            attempt(
                link / "through-link",
                target / "by-target",
                link / ".git" / "hook",
                dirs.outside / "beside",
                dirs.work / "in-work",
            )
            + f'; [ -L "{link}" ] && echo STILL-A-LINK',
            dirs.work,
            sandbox,
            env=env_for(dirs, "bwrap"),
        )
    assert ran.exit_code == 0, ran.output
    assert outcome(ran.output) == {
        str(link / "through-link"): "OK",
        str(target / "by-target"): "OK",
        # Its .git carve-out follows it to the target.
        str(link / ".git" / "hook"): "NO",
        str(dirs.outside / "beside"): "NO",
        str(dirs.work / "in-work"): "NO",
    }, ran.output
    assert b"STILL-A-LINK" in ran.output
    assert (target / "through-link").exists() and not (target / ".git" / "hook").exists()


@pytest_twisted.ensureDeferred
async def test_a_symlinked_writable_root_under_a_restricted_read(dirs: Dirs) -> None:
    # No readable root: bwrap starts from an empty one, so the link is made
    # there too (it leads to the bound target) and nothing else shows.
    target = dirs.outside / "target"
    target.mkdir()
    (dirs.outside / "other").write_text("other\n")
    link = dirs.work / "link"
    link.symlink_to(target)
    minimal = {"type": "special", "value": {"kind": "minimal"}}
    sandbox = profile(dirs, (minimal, "read"), (link, "write"))
    async with stdio_server("--sandbox-mechanism", "bwrap") as server:
        ran = await run(
            server,
            attempt(link / "through-link")
            + f'; cat "{dirs.outside}/other" 2>/dev/null && echo LEAK; ls "{dirs.work}"',
            target,
            sandbox,
            env=env_for(dirs, "bwrap"),
        )
    assert outcome(ran.output) == {str(link / "through-link"): "OK"}, ran.output
    assert b"LEAK" not in ran.output and (target / "through-link").exists(), ran.output
    assert ran.output.decode().splitlines()[-1] == "link", ran.output


@pytest_twisted.ensureDeferred
async def test_an_unrestricted_file_system_with_the_network_restricted(dirs: Dirs) -> None:
    # Every path writable, the network off (the reference binds / writable
    # and unshares the network). Before the fix: refused, the filters in
    # /dev/shm counted as writable although bwrap's fresh /dev hides them;
    # under Landlock they would be (it grants the host's /dev/shm): refused.
    sandbox = {
        "permissions": {
            "type": "managed",
            "file_system": {"type": "unrestricted"},
            "network": "restricted",
        },
        "cwd": uri(dirs.work),
    }
    free = dirs.outside / "free"
    async with stdio_server("--sandbox-mechanism", "bwrap") as server:
        ran = await run(
            server,
            # (/proc/net/dev lists the interfaces of the command's network namespace.)
            attempt(free) + "; ls -a /dev/shm; echo NET $(tail -n +3 /proc/net/dev | cut -d: -f1)",
            dirs.work,
            sandbox,
            env=env_for(dirs, "bwrap"),
        )
    assert outcome(ran.output) == {str(free): "OK"}, ran.output
    assert b"exec-server-seccomp" not in ran.output and b"\nNET lo\n" in ran.output, ran.output
    async with stdio_server("--sandbox-mechanism", "landlock") as server:
        with pytest.raises(RpcFailure) as refused:
            await run(server, "true", dirs.work, sandbox, env=env_for(dirs, "landlock"))
    assert refused.value.code == -32602
    assert refused.value.message.startswith(
        "sandbox intent cannot be enforced on this executor: the profile makes /dev/shm/"
        "exec-server-seccomp-"
    ), refused.value.message
    assert refused.value.message.endswith(", where the server keeps its seccomp filters, writable")


@pytest_twisted.ensureDeferred
async def test_a_deny_rule_on_a_symlink_to_the_root_hides_the_root(dirs: Dirs) -> None:
    # A rule on a symlink counts on its real path too: `deny` on a link to /
    # hides / (none beats read), as a confined fs call judges it; only the
    # deeper rules show. Before the fix bwrap was given `--ro-bind / /`
    # (the root chosen by the lexical rules alone): everything was readable.
    (dirs.outside / "other").write_text("other\n")
    link = dirs.work / "root"
    link.symlink_to("/")
    minimal = {"type": "special", "value": {"kind": "minimal"}}
    data = dirs.outside / "data"
    data.mkdir()
    sandbox = profile(dirs, (ROOT, "read"), (minimal, "read"), (link, "deny"), (data, "write"))
    async with stdio_server("--sandbox-mechanism", "bwrap") as server:
        ran = await run(
            server,
            attempt(data / "in")
            + f'; cat "{dirs.outside}/other" 2>/dev/null && echo LEAK'
            + f'; cat "{link}{dirs.outside}/other" 2>/dev/null && echo LINK-LEAK',
            data,
            sandbox,
            env=env_for(dirs, "bwrap"),
        )
    assert outcome(ran.output) == {str(data / "in"): "OK"}, ran.output
    assert b"LEAK" not in ran.output, ran.output


@pytest_twisted.ensureDeferred
async def test_without_a_readable_root_rules_on_symlinks_hold_at_their_targets(
    dirs: Dirs,
) -> None:
    # No readable root: a read or deny rule on a symlink held at the link's
    # own path only (a bind onto the empty root), not where it leads.
    # Before the fix, a deny on a link into a writable root left its target
    # readable there, a read-only rule on one left its target writable, and
    # a readable link bound the whole target, a path hidden inside it too.
    minimal = {"type": "special", "value": {"kind": "minimal"}}
    data = dirs.outside / "data"
    for sub in ("secret", "sub", "pub/hidden"):
        (data / sub).mkdir(parents=True)
    (data / "secret" / "key").write_text("k")
    (data / "pub" / "hidden" / "key").write_text("k")
    links = dirs.work / "links"
    links.mkdir()
    for name, target in (("secret", "secret"), ("data", ""), ("pub", "pub")):
        (links / name).symlink_to(data / target)
    sandbox = profile(
        dirs,
        (minimal, "read"),
        (data, "write"),
        (links / "secret", "deny"),
        (links / "data" / "sub", "read"),
        (links / "pub", "read"),
        (data / "pub" / "hidden", "deny"),
    )
    async with stdio_server("--sandbox-mechanism", "bwrap") as server:
        ran = await run(
            server,
            attempt(data / "in", data / "sub" / "x", links / "data" / "sub" / "y")
            + f'; cat "{data}/secret/key" 2>/dev/null && echo LEAK-SECRET'
            + f'; cat "{links}/pub/hidden/key" 2>/dev/null && echo LEAK-HIDDEN'
            + f'; ls "{links}/pub/" && echo PUB-SHOWN',
            data,
            sandbox,
            env=env_for(dirs, "bwrap"),
        )
    assert outcome(ran.output) == {
        str(data / "in"): "OK",
        str(data / "sub" / "x"): "NO",
        str(links / "data" / "sub" / "y"): "NO",
    }, ran.output
    assert b"LEAK" not in ran.output and b"PUB-SHOWN" in ran.output, ran.output
    assert not (data / "sub" / "x").exists()


@pytest_twisted.ensureDeferred
async def test_a_rule_inside_a_hidden_directory_is_mounted_there(dirs: Dirs) -> None:
    # A writable directory inside a hidden one: its mount point is made in
    # the hidden directory's empty mount before that is made read-only.
    # Before the fix the start failed (bwrap: Can't mkdir ...: Read-only
    # file system): the empty mount was read-only already.
    data = dirs.outside / "data"
    (data / "w").mkdir(parents=True)
    (data / "pub").mkdir()
    (data / "pub" / "note").write_text("shown\n")
    (data / "key").write_text("k")
    sandbox = profile(
        dirs, (ROOT, "read"), (data, "deny"), (data / "w", "write"), (data / "pub", "read")
    )
    async with stdio_server("--sandbox-mechanism", "bwrap") as server:
        ran = await run(
            server,
            attempt(data / "w" / "in", data / "out")
            + f'; cat "{data}/key" 2>/dev/null && echo LEAK; cat "{data}/pub/note"',
            dirs.work,
            sandbox,
            env=env_for(dirs, "bwrap"),
        )
    assert outcome(ran.output) == {str(data / "w" / "in"): "OK", str(data / "out"): "NO"}, (
        ran.output
    )
    assert b"LEAK" not in ran.output and not (data / "out").exists(), ran.output
    # A readable directory there too (under a readable root it needs a bind
    # of its own once its parent is hidden): before, an empty directory.
    assert b"shown\n" in ran.output, ran.output


@pytest_twisted.ensureDeferred
async def test_a_read_rule_on_dev_keeps_the_fresh_dev(dirs: Dirs) -> None:
    # bwrap's fresh /dev is readable already; binding the host's over it
    # (every bind is nodev) left no device usable. Before the fix:
    # `/dev/null: Permission denied`.
    minimal = {"type": "special", "value": {"kind": "minimal"}}
    for base in (ROOT, minimal):
        sandbox = profile(dirs, (base, "read"), ("/dev", "read"), (dirs.work, "write"))
        async with stdio_server("--sandbox-mechanism", "bwrap") as server:
            ran = await run(
                server,
                "echo hi > /dev/null && head -c 1 /dev/urandom >/dev/null && echo DEV-OK",
                dirs.work,
                sandbox,
                env=env_for(dirs, "bwrap"),
            )
        assert ran.output == b"DEV-OK\n", (base, ran.output)
