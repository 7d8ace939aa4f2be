"""execserver.sandbox.fsguard on real threads and the real kernel (no server).

The race: a thread flips a symlink inside the workspace between a directory
inside and one outside while confined writes go through it; not one byte may
land outside, whichever mechanism enforces the policy.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from execserver import protocol as p
from execserver.errors import RpcError
from execserver.fs import ops
from execserver.sandbox import fsguard
from execserver.sandbox.fsguard import Guard, Mechanism
from execserver.sandbox.policy import SandboxPolicy, effective, resolve
from tests.support.races import symlink_race

MECHANISMS: tuple[Mechanism, ...] = ("mount-namespace", "landlock")


def _workspace_write(root: Path) -> p.SandboxConfig:
    return msgspec.convert(
        {"mode": "workspaceWrite", "writableRoots": [str(root)]}, p.SandboxConfig
    )


def _raw(data: bytes) -> msgspec.Raw:
    return msgspec.Raw(msgspec.json.encode(data))


def test_both_mechanisms_work_here() -> None:
    # CI runs as root on a kernel with Landlock: both must be there (no skip).
    assert fsguard.mechanism() == "mount-namespace"
    assert fsguard.landlock_abi() >= 1
    for how in MECHANISMS:
        assert fsguard._probe(how)


def _no_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Leave the check out: what is refused then, the kernel refused."""
    monkeypatch.setattr(fsguard, "check_write", lambda policy, path, follows=True: None)
    monkeypatch.setattr(fsguard, "check_read", lambda policy, path, deep=False: None)


@pytest.mark.parametrize("how", MECHANISMS)
def test_confinement_stays_on_its_thread(
    tmp_path: Path, how: Mechanism, monkeypatch: pytest.MonkeyPatch
) -> None:
    work, outside = tmp_path / "work", tmp_path / "outside"
    work.mkdir()
    outside.mkdir()
    guard = Guard(how=how)
    sandbox = _workspace_write(work)
    guard.run(
        sandbox, (), ((str(work / "in"), True),), ops.write_file, str(work / "in"), _raw(b"x")
    )
    assert (work / "in").read_bytes() == b"x"
    _no_check(monkeypatch)
    with pytest.raises(RpcError) as info:
        target = str(outside / "f")
        guard.run(sandbox, (), ((target, True),), ops.write_file, target, _raw(b"x"))
    assert "os error 30" in info.value.message or "os error 13" in info.value.message
    assert not (outside / "f").exists()
    # This thread (the pool's, the server's) is not confined.
    (outside / "g").write_bytes(b"free")


@pytest.mark.parametrize("how", MECHANISMS)
def test_carveouts_and_hidden_paths_are_refused_by_the_check(
    tmp_path: Path, how: Mechanism
) -> None:
    work = tmp_path / "work"
    (work / ".git").mkdir(parents=True)
    guard = Guard(how=how)
    sandbox = _workspace_write(work)
    target = str(work / ".git" / "config")
    with pytest.raises(RpcError) as info:
        guard.run(sandbox, (), ((target, True),), ops.write_file, target, _raw(b"x"))
    assert (info.value.code, info.value.message) == (-32603, "Read-only file system (os error 30)")
    assert not os.path.exists(target)


@pytest.mark.parametrize("how", MECHANISMS)
def test_a_tree_holding_a_carveout_is_not_removed(tmp_path: Path, how: Mechanism) -> None:
    work = tmp_path / "work"
    (work / "proj" / ".git").mkdir(parents=True)
    (work / "proj" / "f").write_text("kept")
    sandbox = msgspec.convert(
        {"mode": "workspaceWrite", "writableRoots": [str(work), str(work / "proj")]},
        p.SandboxConfig,
    )
    target = str(work / "proj")
    with pytest.raises(RpcError) as info:
        Guard(how=how).run(sandbox, (), ((target, False),), ops.remove, target, True, True)
    assert info.value.message == "Read-only file system (os error 30)"
    assert (work / "proj" / "f").read_text() == "kept"
    assert (work / "proj" / ".git").is_dir()


def test_the_mount_namespace_refuses_a_carveout_write_the_check_missed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    (work / ".git").mkdir(parents=True)
    target = str(work / ".git" / "config")
    _no_check(monkeypatch)
    with pytest.raises(RpcError) as info:
        Guard(how="mount-namespace").run(
            _workspace_write(work), (), ((target, True),), ops.write_file, target, _raw(b"x")
        )
    assert info.value.message == "Read-only file system (os error 30)"
    assert not os.path.exists(target)


@pytest.mark.parametrize("how", MECHANISMS)
def test_without_a_root_entry_nothing_outside_is_writable(
    tmp_path: Path, how: Mechanism, monkeypatch: pytest.MonkeyPatch
) -> None:
    work, outside = tmp_path / "work", tmp_path / "outside"
    work.mkdir()
    outside.mkdir()
    sandbox = msgspec.convert(
        {
            "permissions": {
                "type": "managed",
                "file_system": {
                    "type": "restricted",
                    "entries": [
                        {
                            "path": {"type": "special", "value": {"kind": "minimal"}},
                            "access": "read",
                        },
                        {"path": {"type": "path", "path": str(work)}, "access": "write"},
                    ],
                },
                "network": "restricted",
            }
        },
        p.SandboxConfig,
    )
    guard = Guard(how=how)
    inside = str(work / "f")
    guard.run(sandbox, (), ((inside, True),), ops.write_file, inside, _raw(b"x"))
    target = str(outside / "f")
    with pytest.raises(RpcError) as info:
        guard.run(sandbox, (), ((target, True),), ops.write_file, target, _raw(b"x"))
    assert info.value.message == "No such file or directory (os error 2)"  # as the reference
    _no_check(monkeypatch)
    with pytest.raises(RpcError):
        guard.run(sandbox, (), ((target, True),), ops.write_file, target, _raw(b"x"))
    with pytest.raises(RpcError):  # reads outside the readable roots too
        guard.run(sandbox, (), (), ops.read_directory, str(outside))
    assert os.listdir(outside) == []


def test_the_mount_namespace_hides_what_the_check_missed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    (work / "hidden").mkdir(parents=True)
    (work / "hidden" / "key").write_text("s3cret")
    (work / "hidden.txt").write_text("s3cret")
    sandbox = msgspec.convert(
        {
            "permissions": {
                "type": "managed",
                "file_system": {
                    "type": "restricted",
                    "entries": [
                        {"path": {"type": "special", "value": {"kind": "root"}}, "access": "read"},
                        {"path": {"type": "path", "path": str(work)}, "access": "write"},
                        {"path": {"type": "path", "path": str(work / "hidden")}, "access": "none"},
                        {
                            "path": {"type": "path", "path": str(work / "hidden.txt")},
                            "access": "none",
                        },
                    ],
                },
                "network": "restricted",
            }
        },
        p.SandboxConfig,
    )
    _no_check(monkeypatch)
    guard = Guard(how="mount-namespace")
    key = str(work / "hidden" / "key")
    with pytest.raises(RpcError) as info:
        guard.run(sandbox, ((key, False),), (), ops.get_metadata, key)
    assert info.value.data["kind"] == "notFound"  # an empty tmpfs covers the directory
    listing = guard.run(
        sandbox, ((str(work), False),), (), ops.read_directory, str(work / "hidden")
    )
    assert listing.entries == []
    # /dev/null covers the file: nothing of it can be read.
    with pytest.raises(RpcError) as info:
        guard.run(sandbox, (), (), ops.read_file, str(work / "hidden.txt"), 1 << 20)
    assert info.value.message == "fs/readFile only supports regular files"
    assert (work / "hidden.txt").read_text() == "s3cret"  # untouched, outside the thread


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    how=st.sampled_from(MECHANISMS),
    writes=st.lists(st.binary(min_size=1, max_size=64), min_size=5, max_size=40),
    ranged=st.booleans(),
)
def test_a_racing_symlink_swap_never_lets_a_byte_out(
    tmp_path_factory: pytest.TempPathFactory, how: Mechanism, writes: list[bytes], ranged: bool
) -> None:
    base = tmp_path_factory.mktemp("race")
    with symlink_race(base) as race:
        race.start()
        guard = Guard(how=how)
        sandbox = _workspace_write(race.work)
        landed = 0
        for i, data in enumerate(writes):
            path = f"{race.flip}/f{i}"
            try:
                if ranged:
                    guard.run(
                        sandbox,
                        (),
                        ((path, True),),
                        ops.write_range,
                        path,
                        _raw(data),
                        0,
                        False,
                        False,
                    )
                else:
                    guard.run(sandbox, (), ((path, True),), ops.write_file, path, _raw(data))
                landed += 1
            except RpcError as exc:
                assert exc.message in (
                    "Read-only file system (os error 30)",
                    "Permission denied (os error 13)",
                    "No such file or directory (os error 2)",
                ), exc.message
    assert os.listdir(race.outside) == []
    assert len(os.listdir(race.inside)) == landed


def _floor(root: Path) -> SandboxPolicy:
    return resolve(_workspace_write(root), cwd="/", env={})


def test_a_floor_confines_calls_that_ask_for_nothing(tmp_path: Path) -> None:
    work, outside = tmp_path / "work", tmp_path / "outside"
    work.mkdir()
    outside.mkdir()
    guard = Guard(floor=_floor(work))
    for sandbox in (None, msgspec.convert({"mode": "none"}, p.SandboxConfig)):
        assert guard.applies(sandbox)
        target = str(outside / "f")
        with pytest.raises(RpcError) as info:
            guard.run(sandbox, (), ((target, True),), ops.write_file, target, _raw(b"x"))
        assert info.value.message == "Read-only file system (os error 30)"
        inside = str(work / "f")
        guard.run(sandbox, (), ((inside, True),), ops.write_file, inside, _raw(b"x"))
    assert os.listdir(outside) == []


def test_a_floor_narrows_a_wider_request(tmp_path: Path) -> None:
    work, other = tmp_path / "work", tmp_path / "other"
    work.mkdir()
    other.mkdir()
    guard = Guard(floor=_floor(work))
    wider = msgspec.convert(
        {"mode": "workspaceWrite", "writableRoots": [str(work), str(other)]}, p.SandboxConfig
    )
    target = str(other / "f")
    with pytest.raises(RpcError) as info:
        guard.run(wider, (), ((target, True),), ops.write_file, target, _raw(b"x"))
    assert info.value.message == "Read-only file system (os error 30)"
    assert guard.policy(wider).writable_roots() == (str(work),)


def test_full_access_under_a_floor_is_refused(tmp_path: Path) -> None:
    guard = Guard(floor=_floor(tmp_path))
    for wire in (
        {"permissions": {"type": "disabled"}},
        {
            "permissions": {
                "type": "managed",
                "file_system": {"type": "unrestricted"},
                "network": "enabled",
            }
        },
    ):
        sandbox = msgspec.convert(wire, p.SandboxConfig)
        with pytest.raises(RpcError) as info:
            guard.run(sandbox, (), (), os.getcwd)
        assert info.value.code == -32602
        assert info.value.message.startswith(
            "sandbox: full access (`danger-full-access`) is refused: this server confines every"
        )
        assert info.value.data == {"kind": "sandboxFloor", "floor": guard.floor.describe()}  # type: ignore[union-attr]


def test_confinement_failure_is_a_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(policy: SandboxPolicy) -> None:
        raise fsguard.ConfinementFailed(
            "unshare(CLONE_NEWNS): Operation not permitted (os error 1)"
        )

    monkeypatch.setattr(fsguard, "_confine_mounts", broken)
    target = str(tmp_path / "f")
    with pytest.raises(RpcError) as info:
        Guard(how="mount-namespace").run(
            _workspace_write(tmp_path), (), ((target, True),), ops.write_file, target, _raw(b"x")
        )
    assert info.value.code == -32603
    assert info.value.message == (
        "sandbox: the fs call could not be confined: "
        "unshare(CLONE_NEWNS): Operation not permitted (os error 1)"
    )
    assert not os.path.exists(target)
    with pytest.raises(RpcError) as info:
        Guard(how="none").run(_workspace_write(tmp_path), (), (), os.getcwd)
    assert info.value.data == {"kind": "sandboxUnavailable"}


def test_only_writable_rules_without_the_root_still_confine(tmp_path: Path) -> None:
    work, outside = tmp_path / "work", tmp_path / "outside"
    work.mkdir()
    outside.mkdir()
    entry = {"path": {"type": "path", "path": str(work)}, "access": "write"}
    sandbox = msgspec.convert(
        {
            "permissions": {
                "type": "managed",
                "file_system": {"type": "restricted", "entries": [entry]},
                "network": "restricted",
            }
        },
        p.SandboxConfig,
    )
    target = str(outside / "f")
    with pytest.raises(RpcError):
        Guard().run(sandbox, (), ((target, True),), ops.write_file, target, _raw(b"x"))
    assert os.listdir(outside) == []
    # `external` confines only the network: the file system is the caller's.
    external = msgspec.convert(
        {"permissions": {"type": "external", "network": "restricted"}}, p.SandboxConfig
    )
    Guard().run(external, (), ((target, True),), ops.write_file, target, _raw(b"x"))
    assert os.listdir(outside) == ["f"]


def test_landlock_grants_only_the_directory_written_in_when_it_is_clean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    (work / ".git").mkdir(parents=True)
    (work / "sub").mkdir()
    sandbox = _workspace_write(work)
    guard = Guard(how="landlock")
    declared = str(work / "sub" / "x")
    guard.run(sandbox, (), ((declared, True),), ops.write_file, declared, _raw(b"x"))
    assert (work / "sub" / "x").read_bytes() == b"x"
    # The operation lands elsewhere than checked (what a swapped symlink
    # would do): beneath a clean directory, the kernel refuses .git and the
    # rest of the workspace alike.
    _no_check(monkeypatch)
    for elsewhere in (work / ".git" / "config", work / "other"):
        with pytest.raises(RpcError) as info:
            guard.run(sandbox, (), ((declared, True),), ops.write_file, str(elsewhere), _raw(b"x"))
        assert info.value.message == "Permission denied (os error 13)"
        assert not elsewhere.exists()
    # Where the directory written in holds a carve-out, the grant is the
    # writable root (the check alone guards .git there, documented).
    assert (
        fsguard.narrow_write_grants(
            effective(resolve(sandbox, cwd="/", env={})), [(str(work / "y"), True)]
        )
        is None
    )


def test_a_carve_out_removed_before_its_mount_binds_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another process removes a default carve-out (a /tmp/.agents another
    # program made) between the moment the policy saw it and its bind
    # mount. Before the fix the fs call failed: "sandbox: the fs call could
    # not be confined: bind .../.agents: No such file or directory".
    work = tmp_path / "work"
    agents = work / ".agents"
    agents.mkdir(parents=True)
    real_mount = fsguard._mount

    def removing_first(
        source: str | None, target: str, fstype: str | None, flags: int, data: str | None
    ) -> int:
        if source == str(agents) and agents.exists():
            agents.rmdir()
        return real_mount(source, target, fstype, flags, data)

    monkeypatch.setattr(fsguard, "_mount", removing_first)
    guard = Guard(how="mount-namespace")
    sandbox = _workspace_write(work)
    assert str(agents) in guard.policy(sandbox).read_only_carveouts()
    target = str(work / "in")
    guard.run(sandbox, (), ((target, True),), ops.write_file, target, _raw(b"x"))
    assert (work / "in").read_bytes() == b"x" and not agents.exists()
    # Its path is still refused by the policy.
    agents.mkdir()
    with pytest.raises(RpcError) as info:
        inside = str(agents / "f")
        guard.run(sandbox, (), ((inside, True),), ops.write_file, inside, _raw(b"x"))
    assert info.value.message == "Read-only file system (os error 30)"
