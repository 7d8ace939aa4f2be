"""Pure parts of the process sandbox: the sandboxDenied guess, the filter, bwrap's mounts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from execserver.sandbox import seccomp
from execserver.sandbox.denied import KEYWORDS, likely_denied
from execserver.sandbox.engine import HostSupport, SandboxEngine
from execserver.sandbox.policy import Access, PathRule, SandboxPolicy

# --- sandboxDenied, as the reference's is_likely_sandbox_denied ---------------------------------


def test_the_reference_cases() -> None:
    assert not likely_denied(1, False, [b""])  # requires a keyword
    assert likely_denied(1, False, [b"", b"Operation not permitted"])
    assert not likely_denied(127, False, [b"command not found"])  # quick reject
    assert likely_denied(101, False, [b"cargo failed: Read-only file system when writing"])
    assert likely_denied(128 + 31, False, [])  # SIGSYS
    assert not likely_denied(0, False, [b"Permission denied"])
    assert not likely_denied(1, True, [b"Permission denied"])  # timed out
    assert not likely_denied(None, False, [b"Permission denied"])
    # A keyword wins over a quick-reject code.
    assert likely_denied(2, False, [b"sh: 1: cannot create /x: Read-only file system\n"])


@given(
    code=st.integers(min_value=1, max_value=255),
    keyword=st.sampled_from(KEYWORDS),
    cut=st.integers(min_value=0, max_value=30),
    upper=st.booleans(),
)
def test_a_keyword_in_any_case_across_chunks(
    code: int, keyword: bytes, cut: int, upper: bool
) -> None:
    text = b"before " + (keyword.upper() if upper else keyword) + b" after"
    cut = min(cut, len(text))
    assert likely_denied(code, False, [text[:cut], text[cut:]])


@given(code=st.integers(min_value=1, max_value=255), noise=st.binary(max_size=64))
def test_without_a_keyword_only_sigsys(code: int, noise: bytes) -> None:
    if any(word in noise.lower() for word in KEYWORDS):
        return
    assert likely_denied(code, False, [noise]) == (code == 159)


# --- the filter ---------------------------------------------------------------------------------


def test_filters_are_classic_bpf_and_differ_by_network() -> None:
    restricted, open_network = seccomp.build(False), seccomp.build(True)
    for program in (restricted, open_network):
        assert program and len(program) % 8 == 0  # struct sock_filter
    assert restricted != open_network


# --- bwrap's command line -----------------------------------------------------------------------


def _engine() -> SandboxEngine:
    engine = SandboxEngine(masked=("/nonexistent/exec.sock",))
    engine.support = HostSupport("/usr/bin/bwrap", None, 7, None, None, True)
    engine.mechanism = "bwrap"
    return engine


def test_mounts_go_shallow_to_deep(tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / ".git").mkdir(parents=True)
    (work / "secret").mkdir()
    (work / "key.pem").write_text("k")
    policy = SandboxPolicy(
        confined=True,
        rules=tuple(
            sorted(
                [
                    PathRule("/", "read"),
                    PathRule(str(work), "write"),
                    PathRule(str(work / ".git"), "read"),
                    PathRule(str(work / "secret"), "none"),
                    PathRule(str(work / "key.pem"), "none"),
                    PathRule(str(tmp_path / "missing"), "write"),
                ],
                key=lambda r: r.path,
            )
        ),
        network=False,
        full_read=True,
    )
    args = _engine().bwrap_args(policy, str(work))
    assert args[:6] == [
        "/usr/bin/bwrap", "--die-with-parent", "--unshare-user", "--disable-userns",
        "--unshare-pid", "--unshare-net",
    ]  # fmt: skip
    joined = " ".join(args)
    # Run by root, bwrap would keep every capability for the command.
    assert ("--unshare-net --cap-drop ALL --unshare-ipc" in joined) == (os.getuid() == 0)
    assert "--unshare-ipc --ro-bind / / --dev /dev" in joined
    assert "--ro-bind / / --dev /dev" in joined
    bind = joined.index(f"--bind-try {work} {work}")
    assert joined.index(f"--ro-bind-try {work}/.git {work}/.git") > bind
    assert joined.index(f"--perms 000 --tmpfs {work}/secret --remount-ro {work}/secret") > bind
    assert joined.index(f"--ro-bind /dev/null {work}/key.pem") > bind
    assert str(tmp_path / "missing") not in joined  # a missing writable root binds nothing
    assert "/nonexistent/exec.sock" not in joined  # masked only where it exists
    assert args[-6:] == ["--proc", "/proc", "--chdir", str(work), "--seccomp", "3"]


def test_network_allowed_keeps_the_host_network(tmp_path: Path) -> None:
    policy = SandboxPolicy(
        confined=True, rules=(PathRule("/", "read"),), network=True, full_read=True
    )
    assert "--unshare-net" not in _engine().bwrap_args(policy, str(tmp_path))


def _policy(*rules: tuple[str, Access]) -> SandboxPolicy:
    return SandboxPolicy(
        confined=True,
        rules=tuple(
            sorted((PathRule(path, access) for path, access in rules), key=lambda r: r.path)
        ),
        network=False,
        full_read=any(path == "/" and access != "none" for path, access in rules),
    )


def test_a_writable_root_is_bound_writable(tmp_path: Path) -> None:
    # Before the fix: "--ro-bind / /" and the "/" rule skipped.
    (tmp_path / "secret").mkdir()
    args = " ".join(
        _engine().bwrap_args(_policy(("/", "write"), (str(tmp_path / "secret"), "none")), "/")
    )
    assert "--bind / / --dev /dev" in args and "--ro-bind / /" not in args
    assert f"--perms 000 --tmpfs {tmp_path}/secret --remount-ro {tmp_path}/secret" in args
    # A read-only root stays read-only.
    args = " ".join(_engine().bwrap_args(_policy(("/", "read"), (str(tmp_path), "write")), "/"))
    assert "--ro-bind / / --dev /dev" in args and "--bind / /" not in args
    assert f"--bind-try {tmp_path} {tmp_path}" in args


def test_a_symlinked_root_is_bound_where_it_leads(tmp_path: Path) -> None:
    # Before the fix: "--bind-try LINK LINK", which bwrap cannot mount.
    target = tmp_path / "target"
    (target / ".git").mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(target)
    policy = _policy(("/", "read"), (str(link), "write"), (f"{link}/.git", "read"))
    joined = " ".join(_engine().bwrap_args(policy, "/"))
    bind = joined.index(f"--bind-try {target} {target}")
    assert joined.index(f"--ro-bind-try {target}/.git {target}/.git") > bind
    assert str(link) not in joined


def test_a_symlinked_root_never_opens_a_hidden_target(tmp_path: Path) -> None:
    # The link is writable, its target hidden: none beats write on the
    # target, as a confined fs call judges it.
    target = tmp_path / "target"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    policy = _policy(("/", "read"), (str(link), "write"), (str(target), "none"))
    joined = " ".join(_engine().bwrap_args(policy, "/"))
    assert f"--perms 000 --tmpfs {target} --remount-ro {target}" in joined
    assert "--bind-try" not in joined


@pytest.mark.parametrize("requested", ["auto", "bwrap", "landlock"])
def test_unavailable_names_every_piece(requested: str) -> None:
    engine = SandboxEngine(requested)  # type: ignore[arg-type]
    engine.support = HostSupport(None, "bwrap not found on PATH", 0, "no Landlock", None)
    text = engine.unavailable()
    assert text.startswith("sandbox intent cannot be enforced on this executor: ")
    assert ("bwrap not found on PATH" in text) == (requested != "landlock")
    assert ("no Landlock" in text) == (requested != "bwrap")


def test_stale_filter_directories_are_removed(tmp_path: Path) -> None:
    import subprocess

    from execserver.sandbox.engine import _remove_stale_filters

    child = subprocess.Popen(["true"])  # a pid that has exited and been reaped
    child.wait()
    stale = tmp_path / f"exec-server-seccomp-{child.pid}-abc"
    live = tmp_path / f"exec-server-seccomp-{os.getpid()}-def"
    other = tmp_path / "exec-server-seccomp-notapid"
    for path in (stale, live, other):
        path.mkdir()
    _remove_stale_filters(str(tmp_path))
    assert not stale.exists() and live.exists() and other.exists()


def test_landlock_write_grants_leave_the_cgroup_mounts_out(tmp_path: Path) -> None:
    from execserver.sandbox.engine import _landlock_writes

    root = tmp_path / "root"
    for sub in ("fs/cgroup/pids", "fs/cgroup/unified", "fs/bpf", "kernel"):
        (root / sub).mkdir(parents=True)
    (root / "file").write_text("x")
    link = tmp_path / "link"
    link.symlink_to(root / "fs")
    other = tmp_path / "other"
    other.mkdir()
    mounts = frozenset({str(root / "fs/cgroup/pids"), str(root / "fs/cgroup/unified")})
    assert _landlock_writes([str(root), str(other)], mounts) == [
        str(root / "file"), str(root / "fs/bpf"), str(root / "kernel"), str(other)
    ]  # fmt: skip
    # Through a symlink: its entries (each then followed by Landlock).
    assert _landlock_writes([str(link)], mounts) == [str(link / "bpf")]
    assert _landlock_writes([str(root / "fs/cgroup")], mounts) == []


def test_without_a_readable_root_a_symlinked_root_gets_its_link(tmp_path: Path) -> None:
    # The empty root shows no link: it is made, leading to the bound target,
    # but never inside a hidden path (its empty mount is read-only).
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "hidden").mkdir()
    for link in (tmp_path / "link", tmp_path / "hidden" / "link"):
        link.symlink_to(target)
    shown = _policy(("/usr", "read"), (str(tmp_path / "link"), "write"))
    joined = " ".join(_engine().bwrap_args(shown, "/"))
    assert joined.startswith("/usr/bin/bwrap") and "--tmpfs / --dev /dev" in joined
    assert joined.index(f"--bind-try {target} {target}") < joined.index(
        f"--symlink {target} {tmp_path}/link"
    )
    unseen = _policy(
        ("/usr", "read"), (str(tmp_path / "hidden"), "none"), (f"{tmp_path}/hidden/link", "write")
    )
    joined = " ".join(_engine().bwrap_args(unseen, "/"))
    assert f"--bind-try {target} {target}" in joined and "--symlink" not in joined


def test_where_a_profile_exposes_the_filters(tmp_path: Path) -> None:
    import tempfile

    engine = _engine()
    shm = engine._dir = tempfile.mkdtemp(prefix="exec-server-seccomp-test-", dir="/dev/shm")
    try:
        root = _policy(("/", "write"))
        # bwrap's fresh /dev covers /dev/shm (mounted nowhere else here).
        assert engine._filters_exposed(root, "bwrap") is None
        # Landlock grants the host's /dev/shm with a writable /.
        assert engine._filters_exposed(root, "landlock") == shm
        for rules in (
            (("/", "read"), ("/dev/shm", "write")),
            (("/", "read"), ("/dev", "write")),
            (("/", "write"), ("/dev", "write")),
            (("/", "read"), (f"{shm}/network", "write")),
        ):
            assert engine._filters_exposed(_policy(*rules), "bwrap") == shm, rules
        hidden = _policy(("/", "write"), ("/dev/shm", "none"))
        assert engine._filters_exposed(hidden, "landlock") is None
        # Kept elsewhere (no writable /dev/shm): a writable / reaches them.
        engine._dir = str(tmp_path)
        assert engine._filters_exposed(root, "bwrap") == str(tmp_path)
    finally:
        os.rmdir(shm)


def test_a_rule_leading_to_the_root_never_covers_the_fresh_dev(tmp_path: Path) -> None:
    # A symlink to / with a rule of its own: a bind of / after `--dev /dev`
    # would cover the fresh /dev with the host's (its /dev/shm: the filters).
    link = tmp_path / "root"
    link.symlink_to("/")
    for rules, root in (
        ((("/", "write"), (str(link), "read")), "--bind / /"),
        ((("/", "read"), (str(link), "write")), "--bind / /"),
        ((("/", "read"), (str(link), "read")), "--ro-bind / /"),
    ):
        args = _engine().bwrap_args(_policy(*rules), "/")  # type: ignore[arg-type]
        joined = " ".join(args)
        assert joined.count(" / /") == 1 and f"{root} --dev /dev" in joined, (rules, joined)
