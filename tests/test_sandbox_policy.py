"""The profile language (execserver.sandbox.policy): decoding, resolution, precedence, floor."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from execserver import protocol as p
from execserver.errors import RpcError
from execserver.sandbox import policy as pol
from tests.support.sandbox import codex_profile

_DECODE = msgspec.json.Decoder(p.ExecParams)


def _start(sandbox: Any) -> p.ExecParams:
    return _DECODE.decode(
        msgspec.json.encode(
            {
                "processId": "a",
                "argv": ["true"],
                "cwd": "/",
                "env": {},
                "tty": False,
                "sandbox": sandbox,
            }
        )
    )


def _special(kind: str, access: str, **extra: Any) -> dict[str, Any]:
    return {"path": {"type": "special", "value": {"kind": kind, **extra}}, "access": access}


def _path(path: str, access: str) -> dict[str, Any]:
    return {"path": {"type": "path", "path": "file://" + path}, "access": access}


def _managed(entries: list[dict[str, Any]], network: str = "restricted") -> dict[str, Any]:
    return {
        "type": "managed",
        "file_system": {"type": "restricted", "entries": entries},
        "network": network,
    }


def _context(permissions: dict[str, Any], cwd: str, **extra: Any) -> dict[str, Any]:
    return {
        "permissions": permissions,
        "cwd": "file://" + cwd,
        "workspaceRoots": ["file://" + cwd],
        "windowsSandboxLevel": "disabled",
        "windowsSandboxProxySettingsMode": "reconcile",
        "useLegacyLandlock": False,
        **extra,
    }


def _resolve(sandbox: Any, cwd: str = "/", env: dict[str, str] | None = None) -> pol.SandboxPolicy:
    return pol.resolve(_start(sandbox).sandbox, cwd=cwd, env=env or {})


# --- decoding ---------------------------------------------------------------------------


def test_seed_shapes_decode_as_before() -> None:
    assert _start({"mode": "none"}).sandbox == p.SandboxConfig(mode="none")
    assert _start(None).sandbox is None
    with pytest.raises(
        msgspec.ValidationError, match=r"^Object missing required field `mode` - at `\$.sandbox`$"
    ):
        _start({})
    with pytest.raises(
        msgspec.ValidationError, match=r"Invalid enum value 'x' - at `\$.sandbox.mode`"
    ):
        _start({"mode": "x"})


def test_every_fs_params_struct_carries_sandbox() -> None:
    for cls in (
        p.FsReadFileParams,
        p.FsWriteFileParams,
        p.FsCreateDirectoryParams,
        p.FsGetMetadataParams,
        p.FsReadDirectoryParams,
        p.FsRemoveParams,
        p.FsCopyParams,
    ):
        assert "sandbox" in cls.__struct_fields__


@pytest.mark.parametrize(
    ("permissions", "message"),
    [
        ({"type": "foo"}, "Invalid value 'foo' - at `$.sandbox.permissions.type`"),
        (_managed([_special("home", "write")]), "'home'"),
        (_managed([{**_special("root", "read"), "missing_path_behavior": "fail"}]), "'fail'"),
        (_managed([{**_special("root", "rw")}]), "'rw'"),
        (_managed([], network="full"), "'full'"),
        (
            {"type": "managed", "file_system": {"type": "restricted"}, "network": "restricted"},
            "missing required field `entries`",
        ),
        ({"type": "external"}, "missing required field `network`"),
    ],
)
def test_what_the_reference_refuses_is_refused(permissions: dict[str, Any], message: str) -> None:
    with pytest.raises(msgspec.ValidationError) as info:
        _start(_context(permissions, "/"))
    assert message in str(info.value)


def test_mode_forms_are_checked() -> None:
    with pytest.raises(msgspec.ValidationError, match="writableRoots"):
        _start({"mode": "readOnly", "writableRoots": ["/x"]})
    with pytest.raises(msgspec.ValidationError, match="network"):
        _start({"mode": "none", "network": True})
    with pytest.raises(msgspec.ValidationError, match="either `mode` or `permissions`"):
        _start({"mode": "none", "permissions": {"type": "disabled"}})
    with pytest.raises(RpcError) as info:
        _resolve({"mode": "workspaceWrite", "writableRoots": ["relative"]})
    assert info.value.code == p.INVALID_PARAMS
    assert "$.sandbox.writableRoots[0]" in info.value.message


# --- resolution -------------------------------------------------------------------------


def test_codex_workspace_write_profile(tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / ".git").mkdir(parents=True)
    (work / ".codex").mkdir()
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    policy = _resolve(codex_profile(work), env={"TMPDIR": str(tmpdir)})
    assert policy.confined and policy.full_read and not policy.network
    assert set(policy.writable_roots()) == {str(work), "/tmp", str(tmpdir)}
    assert set(policy.read_only_carveouts()) == {str(work / ".git"), str(work / ".codex")}
    assert policy.hidden() == ()
    assert policy.access(str(work / "a" / "b")) == "write"
    assert policy.access(str(work / ".git" / "config")) == "read"
    assert policy.access(str(work / ".gitx")) == "write"
    assert policy.access("/etc/passwd") == "read"
    assert policy.access(str(tmpdir / "x")) == "write"
    # .agents and .aws are missing and "skip": no rule for them.
    assert not any(r.path.endswith((".agents", ".aws")) for r in policy.rules)
    assert "network off" in policy.describe()


def test_read_only_profile_and_network(tmp_path: Path) -> None:
    policy = _resolve(_context(_managed([_special("root", "read")], "enabled"), str(tmp_path)))
    assert policy.confined and policy.network and policy.writable_roots() == ()
    assert policy.access(str(tmp_path)) == "read"


def test_other_permission_types() -> None:
    disabled = _resolve(_context({"type": "disabled"}, "/"))
    assert not disabled.confined and disabled.explicit_full_access
    unrestricted = {
        "type": "managed",
        "file_system": {"type": "unrestricted"},
        "network": "enabled",
    }
    assert _resolve(_context(unrestricted, "/")).explicit_full_access
    # Without the network, "unrestricted" and "external" still confine the network.
    for permissions in (
        {"type": "managed", "file_system": {"type": "unrestricted"}, "network": "restricted"},
        {"type": "external", "network": "restricted"},
    ):
        policy = _resolve(_context(permissions, "/"))
        assert policy.confined and not policy.network
        assert policy.writable_roots() == ("/",) and policy.access("/etc") == "write"
    assert not _resolve(_context({"type": "external", "network": "enabled"}, "/")).confined
    # A restricted profile that writes everything with the network on is full access too.
    everything = _resolve(_context(_managed([_special("root", "write")], "enabled"), "/"))
    assert not everything.confined and everything.explicit_full_access
    narrowed = _managed([_special("root", "write"), _path("/zz-absent/ro", "read")], "enabled")
    assert _resolve(_context(narrowed, "/")).confined


def test_special_paths_and_absolute_paths(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    sandbox = _context(
        _managed(
            [
                _special("minimal", "read"),
                _special("current_working_directory", "write"),
                _special("project_roots", "none", subpath="secret"),
                _special("project_roots", "write", subpath="../sibling"),
                _special("unknown", "write", path=":future"),
                _path(str(other), "deny"),
            ]
        ),
        str(tmp_path / "work"),
        workspaceRoots=["file://" + str(tmp_path / "work")],
    )
    policy = _resolve(sandbox)
    assert not policy.full_read
    assert policy.access("/usr/bin/env") == "read"
    assert policy.access("/home") == "none"
    assert policy.access(str(tmp_path / "work" / "x")) == "write"
    assert policy.access(str(tmp_path / "work" / "secret" / "x")) == "none"
    assert policy.is_hidden(str(tmp_path / "work" / "secret" / "x"))
    assert not policy.is_hidden("/home")
    assert policy.access(str(tmp_path / "sibling")) == "write"
    assert set(policy.hidden()) == {str(tmp_path / "work" / "secret"), str(other)}


def test_project_roots_cover_every_workspace_root(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    sandbox = _context(
        _managed([_special("root", "read"), _special("project_roots", "write")]),
        str(a),
        workspaceRoots=["file://" + str(a), "file://" + str(b)],
    )
    assert set(_resolve(sandbox).writable_roots()) == {str(a), str(b)}


def test_tmpdir_without_an_absolute_tmpdir_names_nothing() -> None:
    sandbox = _context(_managed([_special("root", "read"), _special("tmpdir", "write")]), "/")
    assert _resolve(sandbox, env={}).writable_roots() == ()
    assert _resolve(sandbox, env={"TMPDIR": "rel"}).writable_roots() == ()


def test_glob_patterns_are_refused_precisely() -> None:
    sandbox = _context(
        _managed([{"path": {"type": "glob_pattern", "pattern": "/x/**"}, "access": "none"}]), "/"
    )
    with pytest.raises(RpcError) as info:
        _resolve(sandbox)
    assert info.value.code == p.INVALID_PARAMS
    assert "glob_pattern" in info.value.message
    assert "$.sandbox.permissions.file_system.entries[0]" in info.value.message


def test_git_pointer_file_protects_its_gitdir(tmp_path: Path) -> None:
    gitdir = tmp_path / "main" / ".git" / "worktrees" / "w"
    gitdir.mkdir(parents=True)
    work = tmp_path / "w"
    work.mkdir()
    (work / ".git").write_text(f"gitdir: {gitdir}\n")
    policy = _resolve({"mode": "workspaceWrite", "writableRoots": [str(work), str(tmp_path)]})
    assert policy.access(str(work / ".git")) == "read"
    assert policy.access(str(gitdir / "HEAD")) == "read"
    assert policy.access(str(tmp_path / "main" / "x")) == "write"


def test_mode_forms_resolve(tmp_path: Path) -> None:
    (tmp_path / ".agents").mkdir()
    assert not _resolve({"mode": "none"}).confined
    read_only = _resolve({"mode": "readOnly"})
    assert read_only.confined and read_only.writable_roots() == () and not read_only.network
    default_root = _resolve({"mode": "workspaceWrite", "network": True}, cwd=str(tmp_path))
    assert default_root.writable_roots() == (str(tmp_path),) and default_root.network
    assert default_root.read_only_carveouts() == (str(tmp_path / ".agents"),)
    with pytest.raises(RpcError, match="hostDefault"):
        _resolve({"mode": "hostDefault"})


# --- precedence (against a model of the reference's rule) -------------------------------

_NAMES = st.sampled_from(["a", "b", "c"])
_PATHS = st.lists(_NAMES, max_size=4).map(lambda parts: "/zz-absent/" + "/".join(parts))
_RULES = st.lists(st.tuples(_PATHS, st.sampled_from(["read", "write", "none", "deny"])), max_size=8)


def _model(rules: list[tuple[str, str]], path: str) -> str:
    """The reference: max over matching entries of (component count, none > write > read)."""
    rank = {"read": 0, "write": 1, "none": 2}
    best: tuple[int, int] | None = None
    found = "none"
    for rule_path, wire_access in rules:
        access = "none" if wire_access == "deny" else wire_access
        rp = pol.normalise(rule_path)
        if path == rp or path.startswith(rp.rstrip("/") + "/"):
            key = (len([c for c in rp.split("/") if c]), rank[access])
            if best is None or key > best:
                best, found = key, access
    return found


def _policy_of(rules: list[tuple[str, str]], network: bool = False) -> pol.SandboxPolicy:
    entries = [_path(path, access) for path, access in rules]
    return _resolve(_context(_managed(entries, "enabled" if network else "restricted"), "/"))


@given(_RULES, _PATHS)
def test_most_specific_rule_wins_and_ties_go_none_write_read(
    rules: list[tuple[str, str]], query: str
) -> None:
    assert _policy_of(rules).access(query) == _model(rules, query)


@given(_RULES, _RULES, st.booleans(), st.booleans(), _PATHS)
def test_the_floor_is_the_per_path_minimum_and_never_weaker(
    mine: list[tuple[str, str]], floor: list[tuple[str, str]], net_a: bool, net_b: bool, query: str
) -> None:
    a, b = _policy_of(mine, net_a), _policy_of(floor, net_b)
    combined = pol.apply_floor(a, b)
    order = {"none": 0, "read": 1, "write": 2}
    got = order[combined.access(query)]
    assert got == min(order[a.access(query)], order[b.access(query)])
    assert combined.network == (net_a and net_b)
    assert set(combined.hidden()) >= {
        h for h in a.hidden() + b.hidden() if combined.access(h) == "none"
    }


def test_floor_with_unconfined_requests() -> None:
    floor = _resolve({"mode": "workspaceWrite", "writableRoots": ["/zz-absent/w"]})
    assert pol.apply_floor(pol.UNCONFINED, floor) == floor
    assert pol.apply_floor(_resolve({"mode": "none"}), floor) == floor
    assert pol.apply_floor(floor, None) == floor
    assert pol.apply_floor(floor, pol.UNCONFINED) == floor
    with pytest.raises(RpcError) as info:
        pol.apply_floor(_resolve(_context({"type": "disabled"}, "/")), floor)
    assert info.value.code == p.INVALID_PARAMS
    assert "danger-full-access" in info.value.message
    assert info.value.data["kind"] == "sandboxFloor"


def test_normalise() -> None:
    assert pol.normalise("/a/./b//c/../d/") == "/a/b/d"
    assert pol.normalise("/../..") == "/"
    assert os.path.isabs(pol.normalise("/x"))


def test_effective_rules_follow_symlinked_roots(tmp_path: Path) -> None:
    real = tmp_path / "real"
    (real / ".git").mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(real)
    policy = _resolve({"mode": "workspaceWrite", "writableRoots": [str(link)]})
    seen = pol.effective(policy)
    # The literal rules stay; the real paths get the same access.
    assert seen.access(str(link / "x")) == "write"
    assert seen.access(str(real / "x")) == "write"
    assert seen.access(str(real / ".git" / "config")) == "read"
    assert pol.effective(pol.UNCONFINED) is pol.UNCONFINED
    assert pol.realpath(str(link / ".git")) == str(real / ".git")
    assert pol.realpath(str(link / "missing" / "x")) == str(real / "missing" / "x")


# --- the cgroup file systems stay read-only ------------------------------------------

MOUNTINFO = """\
23 1 0:21 / /sys rw,nosuid - sysfs sysfs rw
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
52 1 0:38 /sub /srv/cg\\040bind rw,relatime - cgroup2 cgroup2 rw
60 1 8:1 / /data rw - ext4 /dev/sda1 rw
"""
CGROUPFS = ("/srv/cg bind", "/sys/fs/cgroup/pids", "/sys/fs/cgroup/unified")


def test_cgroup_mounts_are_every_cgroup_file_system() -> None:
    assert pol.cgroup_mounts(MOUNTINFO) == CGROUPFS
    assert pol.cgroup_mounts("") == ()
    # This host's own (CI has cgroups mounted).
    assert pol.cgroup_mounts()


def _protected(*rules: tuple[str, str]) -> pol.SandboxPolicy:
    built = pol._build([pol.PathRule(path, access) for path, access in rules], False)  # type: ignore[arg-type]
    return pol.protect_cgroupfs(built, CGROUPFS)


def test_a_cgroup_file_system_under_a_writable_root_is_a_carve_out() -> None:
    policy = _protected(("/", "read"), ("/sys/fs/cgroup", "write"))
    assert policy.access("/sys/fs/cgroup/x") == "write"
    assert policy.access("/sys/fs/cgroup/pids/cgroup.procs") == "read"
    assert policy.access("/sys/fs/cgroup/unified/a/cgroup.procs") == "read"
    assert set(policy.read_only_carveouts()) == {"/sys/fs/cgroup/pids", "/sys/fs/cgroup/unified"}
    # `/` writable: every one of them, the bind elsewhere too.
    everything = _protected(("/", "write"))
    assert {path for path in CGROUPFS if everything.access(path + "/f") == "read"} == set(CGROUPFS)
    assert everything.access("/data/f") == "write"


def test_a_write_rule_inside_a_cgroup_file_system_becomes_read() -> None:
    policy = _protected(("/", "read"), ("/sys/fs/cgroup/unified/mine", "write"),
                        ("/sys/fs/cgroup/pids", "write"), ("/data", "write"))  # fmt: skip
    assert policy.access("/sys/fs/cgroup/unified/mine/cgroup.procs") == "read"
    assert policy.access("/sys/fs/cgroup/pids/tasks") == "read"
    assert policy.writable_roots() == ("/data",)


def test_hidden_stays_hidden_and_nothing_else_changes() -> None:
    policy = _protected(("/", "read"), ("/sys", "write"), ("/sys/fs/cgroup/unified", "none"))
    assert policy.access("/sys/fs/cgroup/unified/cgroup.procs") == "none"
    assert policy.access("/sys/fs/cgroup/pids/tasks") == "read"
    untouched = pol._build([pol.PathRule("/", "read"), pol.PathRule("/data", "write")], True)
    assert pol.protect_cgroupfs(untouched, CGROUPFS) is untouched
    assert pol.protect_cgroupfs(pol.UNCONFINED, CGROUPFS) is pol.UNCONFINED


def test_a_writable_root_leading_into_cgroupfs_is_protected(tmp_path: Path) -> None:
    # On the path it resolves to (bind mounts and symlinks lead there).
    mount = str(tmp_path / "cgroupfs")
    os.mkdir(mount)
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    inside = tmp_path / "into"
    inside.symlink_to(mount)
    built = pol._build(
        [pol.PathRule("/", "read"), pol.PathRule(str(link), "write"),
         pol.PathRule(str(inside), "write")], False
    )  # fmt: skip
    policy = pol.protect_cgroupfs(built, (mount,))
    assert policy.access(mount + "/cgroup.procs") == "read"
    assert policy.access(str(inside / "cgroup.procs")) == "read"
    assert policy.access(str(link / "other")) == "write"


def test_resolve_protects_every_confined_policy() -> None:
    mounts = pol.cgroup_mounts()
    root_writable = _resolve(
        _context(
            {"type": "managed", "file_system": {"type": "unrestricted"}, "network": "restricted"},
            "/",
        )
    )
    workspace = _resolve({"mode": "workspaceWrite", "writableRoots": ["/sys"]})
    for policy in (root_writable, workspace):
        assert all(policy.access(mount + "/cgroup.procs") == "read" for mount in mounts)
    assert _resolve({"mode": "none"}) is pol.UNCONFINED


def test_a_new_bind_of_a_cgroup_file_system_is_seen(tmp_path: Path) -> None:
    # The mount table is watched (poll on /proc/self/mountinfo): a bind of
    # cgroupfs made after the last look is protected at the next resolve.
    import subprocess

    before = pol.cgroup_mounts()
    assert before, "CI has cgroups mounted"
    bind = tmp_path / "cg"
    bind.mkdir()
    subprocess.run(["mount", "--bind", before[-1], str(bind)], check=True, timeout=30)
    try:
        assert str(bind) in pol.cgroup_mounts()
        policy = _resolve({"mode": "workspaceWrite", "writableRoots": [str(tmp_path)]})
        assert policy.access(str(bind / "cgroup.procs")) == "read"
        assert policy.access(str(tmp_path / "other")) == "write"
    finally:
        subprocess.run(["umount", str(bind)], check=True, timeout=30)
    assert pol.cgroup_mounts() == before


_parts = st.lists(st.sampled_from(["a", "b", "ab", "a.b", "-"]), max_size=4)


@given(_parts, _parts)
def test_is_within_is_a_prefix_of_components(path: list[str], root: list[str]) -> None:
    # The one path-containment check the sandbox (policy, engine, fsguard)
    # uses: by whole components, never by characters ("/ab" is not in "/a").
    as_path = "/" + "/".join(path)
    as_root = "/" + "/".join(root)
    assert pol.is_within(as_path, as_root) == (path[: len(root)] == root)
    assert pol.is_within(as_path, "/") and pol.is_within(as_path, as_path)
