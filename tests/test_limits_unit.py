"""Resource limits without a kernel: the value, defaults and ceilings, and the
cgroup file I/O of both layouts against a fake cgroupfs (a tree of ordinary
files laid out as the kernel's), so the cgroup v2 code is checked on a host
that has no delegated v2 controllers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from execserver import cgroups, containment
from execserver.cgroups import Counters, Usage
from execserver.containment import Containment, LimitPlacement, core, placement
from execserver.errors import RpcError
from execserver.limits import FIELDS, NO_LIMITS, Limits, check_defaults, parse_spec, resolve

MiB = 1 << 20


# --- the value, defaults and ceilings ------------------------------------------------------


def test_resolve_takes_the_request_then_the_default_then_the_ceiling() -> None:
    defaults = Limits(max_processes=64)
    ceiling = Limits(memory_bytes=256 * MiB, max_processes=128)
    assert resolve(None, defaults, ceiling) == Limits(memory_bytes=256 * MiB, max_processes=64)
    asked = Limits(max_processes=100, file_size_bytes=10)
    assert resolve(asked, defaults, ceiling) == Limits(
        memory_bytes=256 * MiB, max_processes=100, file_size_bytes=10
    )
    assert resolve(None, NO_LIMITS, NO_LIMITS) == NO_LIMITS
    assert not resolve(None, NO_LIMITS, NO_LIMITS)


def test_resolve_refuses_above_the_ceiling_naming_field_and_ceiling() -> None:
    with pytest.raises(RpcError) as refused:
        resolve(Limits(cpu_percent=300), NO_LIMITS, Limits(cpu_percent=200))
    assert refused.value.code == -32602
    assert refused.value.message == (
        "limits.cpuPercent 300 is above this server's ceiling 200 (--limit-ceiling cpuPercent=200)"
    )
    assert refused.value.data == {"field": "cpuPercent", "ceiling": 200}


@pytest.mark.parametrize(
    ("field", "value"),
    [("memoryBytes", MiB - 1), ("maxProcesses", 0), ("cpuPercent", 0), ("cpuPercent", 409601)],
)
def test_resolve_refuses_values_out_of_range(field: str, value: int) -> None:
    with pytest.raises(RpcError) as refused:
        resolve(Limits(**{FIELDS[field]: value}), NO_LIMITS, NO_LIMITS)
    assert refused.value.code == -32602
    assert refused.value.message.startswith(f"limits.{field} must be between ")


@given(
    st.dictionaries(
        st.sampled_from(sorted(FIELDS)),
        st.integers(min_value=1, max_value=4096),
    ),
    st.sampled_from(["", "k", "M", "G", "KiB", "mb"]),
)
def test_parse_spec_reads_what_it_is_given(values: dict[str, int], suffix: str) -> None:
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[suffix[:1].lower()]
    text = ",".join(f"{name}={value}{suffix}" for name, value in values.items())
    expected = {FIELDS[name]: value * scale for name, value in values.items()}
    if any(
        v < {"memoryBytes": MiB}.get(n, 1) or (n == "cpuPercent" and v > 409600)
        for n, v in ((n, v * scale) for n, v in values.items())
    ):
        with pytest.raises(ValueError):
            parse_spec(text, "--default-limits")
        return
    assert parse_spec(text, "--default-limits") == Limits(**expected)


def test_parse_spec_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="got `memory=1`"):
        parse_spec("memory=1", "--limit-ceiling")
    with pytest.raises(ValueError, match="maxProcesses takes a whole number"):
        parse_spec("maxProcesses=lots", "--limit-ceiling")
    with pytest.raises(ValueError, match="is above --limit-ceiling maxProcesses=5"):
        check_defaults(Limits(max_processes=6), Limits(max_processes=5))


# --- a fake cgroupfs --------------------------------------------------------------------------

V2_FILES = {
    "cgroup.procs": "",
    "memory.max": "max\n",
    "memory.swap.max": "max\n",
    "memory.oom.group": "0\n",
    "memory.current": "1234\n",
    "memory.peak": "5678\n",
    "memory.events": "low 0\nhigh 0\nmax 3\noom 1\noom_kill 0\noom_group_kill 0\n",
    "pids.max": "max\n",
    "pids.current": "3\n",
    "pids.events": "max 0\n",
    "cpu.max": "max 100000\n",
    "cpu.stat": "usage_usec 250000\nuser_usec 200000\nsystem_usec 50000\n"
    "nr_periods 10\nnr_throttled 0\nthrottled_usec 0\n",
}
V1_MEMORY = {
    "cgroup.procs": "",
    "tasks": "",
    "memory.limit_in_bytes": "9223372036854771712\n",
    "memory.memsw.limit_in_bytes": "9223372036854771712\n",
    "memory.usage_in_bytes": "4096\n",
    "memory.max_usage_in_bytes": "8192\n",
    "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n",
}
V1_PIDS = {
    "cgroup.procs": "",
    "tasks": "",
    "pids.max": "max\n",
    "pids.current": "2\n",
    "pids.events": "max 0\n",
}
V1_CPU = {
    "cgroup.procs": "",
    "cpu.cfs_period_us": "100000\n",
    "cpu.cfs_quota_us": "-1\n",
    "cpu.stat": "nr_periods 0\nnr_throttled 0\nthrottled_time 0\n",
}
V1_CPUACCT = {"cgroup.procs": "", "cpuacct.usage": "7000000\n"}


def make(directory: Path, files: dict[str, str]) -> str:
    directory.mkdir(parents=True)
    for name, text in files.items():
        (directory / name).write_text(text)
    return str(directory)


def text(directory: str, name: str) -> str:
    return Path(directory, name).read_text()


def test_v2_limits_are_written_with_group_oom_and_no_swap(tmp_path: Path) -> None:
    d = make(tmp_path / "cg", V2_FILES)
    dirs = {"memory": d, "pids": d, "cpu": d}
    cgroups.apply(2, dirs, Limits(memory_bytes=64 * MiB, max_processes=50, cpu_percent=25))
    assert text(d, "memory.max") == str(64 * MiB)
    assert text(d, "memory.swap.max") == "0"
    assert text(d, "memory.oom.group") == "1"
    assert text(d, "pids.max") == "50"
    assert text(d, "cpu.max") == "25000 100000"
    # A reused cgroup is set back to unlimited.
    cgroups.apply(2, dirs, NO_LIMITS)
    assert (text(d, "memory.max"), text(d, "memory.swap.max")) == ("max", "max")
    assert text(d, "memory.oom.group") == "0"
    assert (text(d, "pids.max"), text(d, "cpu.max")) == ("max", "max 100000")


def test_v2_without_swap_accounting_writes_no_swap_file(tmp_path: Path) -> None:
    files = dict(V2_FILES)
    del files["memory.swap.max"]
    d = make(tmp_path / "cg", files)
    cgroups.apply(2, {"memory": d}, Limits(memory_bytes=64 * MiB))
    assert not Path(d, "memory.swap.max").exists()
    assert text(d, "memory.max") == str(64 * MiB)


def test_v2_events_say_which_limit_was_hit(tmp_path: Path) -> None:
    d = make(tmp_path / "cg", V2_FILES)
    dirs = {"memory": d, "pids": d, "cpu": d}
    limits = Limits(memory_bytes=64 * MiB, max_processes=50, cpu_percent=25)
    before = cgroups.counters(2, dirs)
    assert before == Counters(0, 0, 0)
    assert cgroups.exceeded(limits, cgroups.counters(2, dirs), before) is None
    Path(d, "cpu.stat").write_text("usage_usec 1\nnr_periods 30\nnr_throttled 7\n")
    assert cgroups.exceeded(limits, cgroups.counters(2, dirs), before) == "cpu"
    Path(d, "pids.events").write_text("max 2\n")
    assert cgroups.exceeded(limits, cgroups.counters(2, dirs), before) == "processes"
    Path(d, "memory.events").write_text("oom 1\noom_kill 1\noom_group_kill 1\n")
    assert cgroups.exceeded(limits, cgroups.counters(2, dirs), before) == "memory"
    # Counters from before the process (a reused cgroup) do not count.
    assert cgroups.exceeded(limits, cgroups.counters(2, dirs), cgroups.counters(2, dirs)) is None
    # Nor does an event of a kind that was not limited.
    assert cgroups.exceeded(Limits(cpu_percent=25), Counters(5, 5, 0), before) is None


def test_v2_usage(tmp_path: Path) -> None:
    d = make(tmp_path / "cg", V2_FILES)
    assert cgroups.usage(2, {"memory": d, "pids": d}, d) == Usage(1234, 5678, 250000, 3)
    # Without controllers: CPU time (core cpu.stat) and cgroup.procs only.
    Path(d, "cgroup.procs").write_text("10\n11\n")
    assert cgroups.usage(2, {}, d) == Usage(None, None, 250000, 2)


def test_v1_memory_limit_covers_swap_and_resets_the_peak(tmp_path: Path) -> None:
    d = make(tmp_path / "memory" / "1", V1_MEMORY)
    cgroups.apply(1, {"memory": d}, Limits(memory_bytes=64 * MiB))
    assert text(d, "memory.limit_in_bytes") == str(64 * MiB)
    assert text(d, "memory.memsw.limit_in_bytes") == str(64 * MiB)
    assert text(d, "memory.max_usage_in_bytes") == "0"
    cgroups.apply(1, {"memory": d}, NO_LIMITS)
    assert text(d, "memory.limit_in_bytes") == "-1"
    assert text(d, "memory.memsw.limit_in_bytes") == "-1"


def test_v1_pids_and_cpu(tmp_path: Path) -> None:
    pids = make(tmp_path / "pids" / "1", V1_PIDS)
    cpu = make(tmp_path / "cpu" / "1", V1_CPU)
    acct = make(tmp_path / "cpuacct" / "1", V1_CPUACCT)
    cgroups.apply(1, {"pids": pids, "cpu": cpu}, Limits(max_processes=50, cpu_percent=150))
    assert text(pids, "pids.max") == "50"
    assert text(cpu, "cpu.cfs_period_us") == "100000"
    assert text(cpu, "cpu.cfs_quota_us") == "150000"
    assert cgroups.usage(1, {"pids": pids, "cpuacct": acct}, None) == Usage(None, None, 7000, 2)
    Path(pids, "pids.events").write_text("max 9\n")
    Path(cpu, "cpu.stat").write_text("nr_periods 3\nnr_throttled 1\nthrottled_time 5\n")
    assert cgroups.counters(1, {"pids": pids, "cpu": cpu}) == Counters(0, 9, 1)


def test_v1_oom_kill_counter(tmp_path: Path) -> None:
    d = make(tmp_path / "memory" / "1", V1_MEMORY)
    before = cgroups.counters(1, {"memory": d})
    Path(d, "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    now = cgroups.counters(1, {"memory": d})
    assert cgroups.exceeded(Limits(memory_bytes=64 * MiB), now, before) == "memory"


def test_a_mixed_placement_reads_each_side_by_its_rules(tmp_path: Path) -> None:
    # v2 memory delegated, v1 pids: each controller is read where it lives.
    v2 = make(tmp_path / "unified" / "1", V2_FILES)
    pids = make(tmp_path / "pids" / "1", V1_PIDS)
    placement = LimitPlacement(
        Limits(memory_bytes=64 * MiB, max_processes=5),
        {"memory": v2, "pids": pids},
        frozenset({"pids"}),
        (pids,),
    )
    assert [version for version, _side in placement.sides()] == [1, 2]
    Path(v2, "memory.events").write_text("oom_kill 2\n")
    Path(pids, "pids.events").write_text("max 4\n")
    assert placement.counters() == Counters(2, 4, 0)
    assert placement.usage(v2) == Usage(1234, 5678, 250000, 2)


def test_hierarchies_are_found_from_mounts_and_own_cgroups(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,relatime,cpu,cpuacct 0 0\n"
        "cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0\n"
        "cgroup /sys/fs/cgroup/devices cgroup rw,relatime,devices 0 0\n"
        "cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n"
    )
    own = tmp_path / "cgroup"
    own.write_text("5:devices:/\n4:memory:/job/7\n2:cpu,cpuacct:/\n0::/\n")
    found = cgroups.v1_hierarchies(str(mounts), str(own))
    assert sorted(found) == ["cpu", "cpuacct", "memory"]
    assert found["memory"].own == "/sys/fs/cgroup/memory/job/7"
    assert found["cpu"] is found["cpuacct"]
    assert found["cpu"].own == "/sys/fs/cgroup/cpu,cpuacct"
    # No pids hierarchy mounted: none is offered.
    assert "pids" not in found


def test_v2_delegation_is_what_subtree_control_accepted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = make(tmp_path / "svc", {"cgroup.controllers": "cpuset cpu io memory pids\n"})
    assert cgroups.v2_available(d) == frozenset({"cpu", "memory", "pids"})
    Path(d, "cgroup.subtree_control").write_text("")
    written: list[str] = []
    refused = {"cpu"}

    def kernel_write(path: str, value: str) -> None:
        # As the kernel: "+a +b" enables each it can; reading lists them bare.
        written.append(value)
        names = [n[1:] for n in value.split() if n[1:] not in refused]
        if not names:
            raise OSError(16, "Device or resource busy")
        Path(path).write_text(" ".join(names) + "\n")

    monkeypatch.setattr(cgroups, "write", kernel_write)
    assert cgroups.v2_enable(d, frozenset({"memory", "pids"})) == frozenset({"memory", "pids"})
    assert written == ["+memory +pids"]
    Path(d, "cgroup.subtree_control").write_text("")
    # One refused: only what the file then lists is in force.
    refused = {"cpu", "pids"}
    assert cgroups.v2_enable(d, frozenset({"memory", "pids"})) == frozenset({"memory"})
    Path(d, "cgroup.subtree_control").write_text("")
    refused = {"cpu", "pids", "memory"}
    assert cgroups.v2_enable(d, frozenset({"memory"})) == frozenset()


# --- containment on a fake cgroup v2 host with delegated controllers ---------------------------


class FakeKernel:
    """Enough of cgroupfs for :class:`Containment` on a v2 host that delegates.

    A new directory gets the control files a kernel would show (the limit
    files of the controllers its parent enables for it); ``+x``/``-x``
    written to ``cgroup.subtree_control`` enable or disable controllers the
    cgroup has; ``rmdir`` removes a directory with its control files.
    """

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self._mkdir = os.mkdir
        self._rmdir = os.rmdir
        self._write = cgroups.write
        self.populate(root, "cpu cpuset io memory pids")
        monkeypatch.setattr(os, "mkdir", self.mkdir)
        monkeypatch.setattr(os, "rmdir", self.rmdir)
        monkeypatch.setattr(cgroups, "write", self.write)

    def mine(self, path: str | Path) -> bool:
        return Path(path).resolve().is_relative_to(self.root)

    def populate(self, directory: Path, controllers: str) -> None:
        files = {
            "cgroup.procs": "",
            "cgroup.events": "populated 0\nfrozen 0\n",
            "cgroup.kill": "",
            "cgroup.controllers": controllers + "\n",
            "cgroup.subtree_control": "\n",
            "cpu.stat": "usage_usec 0\nuser_usec 0\nsystem_usec 0\n",
        }
        names = controllers.split()
        for name, text in V2_FILES.items():
            if name.split(".")[0] in names:
                files.setdefault(name, text)
        for name, text in files.items():
            (directory / name).write_text(text)

    def mkdir(self, path: Any, mode: int = 0o777, *args: Any, **kwargs: Any) -> None:
        self._mkdir(path, mode, *args, **kwargs)
        if self.mine(path):
            parent = Path(path).parent
            self.populate(Path(path), (parent / "cgroup.subtree_control").read_text().strip())

    def rmdir(self, path: Any, *args: Any, **kwargs: Any) -> None:
        if self.mine(path) and Path(path).is_dir():
            if any(p.is_dir() for p in Path(path).iterdir()):
                raise OSError(16, "Device or resource busy", str(path))
            for entry in Path(path).iterdir():
                entry.unlink()
        self._rmdir(path, *args, **kwargs)

    def write(self, path: str, text: str) -> None:
        if self.mine(path) and path.endswith("cgroup.subtree_control"):
            directory = Path(path).parent
            # A cgroup has what its parent enables for its children (now).
            source = directory.parent / "cgroup.subtree_control"
            if directory == self.root or not source.exists():
                source = directory / "cgroup.controllers"
            have = set(source.read_text().split())
            on = set(directory.joinpath("cgroup.subtree_control").read_text().split())
            for word in text.split():
                if word[1:] not in have:
                    raise OSError(2, "No such file or directory", path)
                (on.add if word[0] == "+" else on.discard)(word[1:])
            Path(path).write_text(" ".join(sorted(on)) + "\n")
            return
        self._write(path, text)


def fake_v2_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, controllers: str = ""
) -> tuple[Path, FakeKernel]:
    """A fake cgroup v2 root whose service cgroup ``/svc`` offers ``controllers``,
    found by :class:`Containment` as the server's own (the root and its kernel)."""
    root = tmp_path / "cgroup2"
    root.mkdir()
    kernel = FakeKernel(root, monkeypatch)
    os.mkdir(root / "svc")
    (root / "svc" / "cgroup.controllers").write_text(controllers + "\n")
    monkeypatch.setattr(core, "find_cgroup2_mount", lambda mounts="": str(root))
    monkeypatch.setattr(core, "own_cgroup", lambda path="": "/svc")
    monkeypatch.setattr(core, "set_child_subreaper", lambda: True)
    return root, kernel


def test_containment_delegates_v2_controllers_and_places_limits_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The service's own cgroup offers the controllers its parent enabled.
    root, kernel = fake_v2_host(tmp_path, monkeypatch, "cpu memory pids")
    own = root / "svc"
    (root / "cgroup.subtree_control").write_text("cpu memory pids\n")
    monkeypatch.setattr(cgroups, "v1_hierarchies", lambda *a: {})
    monkeypatch.setenv("EXEC_SERVER_STATE_DIR", str(tmp_path / "state"))
    box = Containment("cgroup")
    box.start()
    try:
        assert box.mode == "cgroup"
        assert box.v2_controllers == frozenset({"cpu", "memory", "pids"})
        parent = Path(box._parent)
        # The server left its own cgroup for a leaf: it may hold no process
        # beside children with controllers.
        assert box._own_procs == str(parent / "server" / "cgroup.procs")
        assert (own / "cgroup.subtree_control").read_text().split() == ["cpu", "memory", "pids"]
        assert (parent / "cgroup.subtree_control").read_text().split() == ["cpu", "memory", "pids"]
        assert box.limits_report()[:3] == [
            "memoryBytes: enforced (cgroup v2 memory)",
            "maxProcesses: enforced (cgroup v2 pids)",
            "cpuPercent: enforced (cgroup v2 cpu)",
        ]
        limits = Limits(memory_bytes=64 * MiB, max_processes=50, cpu_percent=25)
        seen: dict[str, str] = {}

        def create() -> int:
            # What the child inherits: the server is inside, with room for
            # its own threads in pids.max.
            (child,) = [p for p in parent.iterdir() if p.name.isdigit()]
            seen["procs"] = (child / "cgroup.procs").read_text()
            seen["pids.max"] = (child / "pids.max").read_text()
            return 999_999_999

        pid, tree = box.spawn(create, limits)
        assert pid == 999_999_999
        assert isinstance(tree, containment.CgroupTree)
        cg = Path(tree.path)
        assert seen["procs"] == "0"
        assert int(seen["pids.max"]) > 50
        assert (cg / "pids.max").read_text() == "50"
        assert (cg / "memory.max").read_text() == str(64 * MiB)
        assert (cg / "memory.swap.max").read_text() == "0"
        assert (cg / "memory.oom.group").read_text() == "1"
        assert (cg / "cpu.max").read_text() == "25000 100000"
        # The server is back in its leaf.
        assert (parent / "server" / "cgroup.procs").read_text() == "0"
        assert tree.exceeded() is None
        (cg / "memory.events").write_text("oom 1\noom_kill 1\noom_group_kill 1\n")
        assert tree.exceeded() == ("memory", 64 * MiB)
        assert tree.usage() == Usage(1234, 5678, 0, 3)
        assert not tree.alive()
        tree.release()
        # With controllers, a cgroup is never reused (its peak and events
        # would be its last user's): it is gone.
        assert not cg.exists()
        assert box._free == []
        # Under the bwrap sandbox pids.max has room for bwrap and its init,
        # and the process count leaves them out (3 in pids.current: 1).
        pid, tree = box.spawn(create, limits, 2)
        assert isinstance(tree, containment.CgroupTree)
        assert int(seen["pids.max"]) > 52
        assert Path(tree.path, "pids.max").read_text() == "52"
        assert tree.usage().processes == 1
        assert not tree.alive()
        tree.release()
    finally:
        box.stop()
    assert kernel.mine(box._own_procs)
    assert box._own_procs == str(own / "cgroup.procs")
    assert not parent.exists()
    assert (own / "cgroup.subtree_control").read_text().split() == []


def test_limits_refused_where_no_controller_is_available(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_v2_host(tmp_path, monkeypatch)
    monkeypatch.setattr(cgroups, "v1_hierarchies", lambda *a: {})
    monkeypatch.setenv("EXEC_SERVER_STATE_DIR", str(tmp_path / "state"))
    box = Containment("cgroup")
    box.start()
    try:
        assert box.v2_controllers == frozenset()
        with pytest.raises(RpcError) as refused:
            box.check_limits(Limits(max_processes=5))
        assert refused.value.code == -32600
        assert refused.value.message == (
            "limits.maxProcesses cannot be enforced on this host: no cgroup v2 pids controller "
            "is delegated to the server's cgroup and no cgroup v1 pids hierarchy is mounted"
        )
        box.check_limits(Limits(file_size_bytes=5))
        assert box.limits_report()[3] == "fileSizeBytes: enforced (RLIMIT_FSIZE in the child)"
    finally:
        box.stop()


# --- containment on a fake cgroup v1 host (this host's layout, without its kernel) -------------


class FakeV1:
    """Cgroup v1 hierarchies of ordinary files: a new directory gets its
    controller's control files, ``rmdir`` removes them with it."""

    FILES: dict[str, dict[str, str]] = {
        "memory": V1_MEMORY,
        "pids": V1_PIDS,
        "cpu": {**V1_CPU, "tasks": ""},
        "cpuacct": {**V1_CPUACCT, "tasks": ""},
    }

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self._mkdir = os.mkdir
        self._rmdir = os.rmdir
        self.hierarchies: dict[str, cgroups.V1Hierarchy] = {}
        for name in self.FILES:
            own = root / name / "svc"
            own.mkdir(parents=True)
            self.populate(own, name)
            self.hierarchies[name] = cgroups.V1Hierarchy(
                str(root / name), frozenset({name}), str(own)
            )
        monkeypatch.setattr(os, "mkdir", self.mkdir)
        monkeypatch.setattr(os, "rmdir", self.rmdir)
        monkeypatch.setattr(cgroups, "v1_hierarchies", lambda *a: self.hierarchies)

    def controller(self, path: Any) -> str | None:
        resolved = Path(path).resolve()
        if not resolved.is_relative_to(self.root):
            return None
        return resolved.relative_to(self.root).parts[0]

    def populate(self, directory: Path, controller: str) -> None:
        for name, content in self.FILES[controller].items():
            (directory / name).write_text(content)

    def mkdir(self, path: Any, mode: int = 0o777, *args: Any, **kwargs: Any) -> None:
        self._mkdir(path, mode, *args, **kwargs)
        controller = self.controller(path)
        if controller is not None:
            self.populate(Path(path), controller)

    def rmdir(self, path: Any, *args: Any, **kwargs: Any) -> None:
        if self.controller(path) is not None and Path(path).is_dir():
            if any(p.is_dir() for p in Path(path).iterdir()):
                raise OSError(16, "Device or resource busy", str(path))
            for entry in Path(path).iterdir():
                entry.unlink()
        self._rmdir(path, *args, **kwargs)


def test_v1_limits_are_entered_by_the_spawning_thread_and_the_sets_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_v2_host(tmp_path, monkeypatch)
    v1 = FakeV1(tmp_path / "v1", monkeypatch)
    monkeypatch.setenv("EXEC_SERVER_STATE_DIR", str(tmp_path / "state"))
    box = Containment("cgroup")
    box.start()
    try:
        assert box.limits_report()[:3] == [
            f"memoryBytes: enforced (cgroup v1 memory at {tmp_path}/v1/memory)",
            f"maxProcesses: enforced (cgroup v1 pids at {tmp_path}/v1/pids)",
            f"cpuPercent: enforced (cgroup v1 cpu at {tmp_path}/v1/cpu)",
        ]
        limits = Limits(memory_bytes=64 * MiB, max_processes=2, cpu_percent=25)
        seen: list[dict[str, str]] = []

        def create() -> int:
            # What the child inherits: the spawning thread is in each v1
            # directory, with room for exactly itself in pids.max.
            found = {}
            for name in ("memory", "pids", "cpu"):
                parent = next((tmp_path / "v1" / name / "svc").glob("exec-server-*"))
                (child,) = [p for p in parent.iterdir() if p.name.isdigit()]
                found[name] = (child / "tasks").read_text()
                found["dir:" + name] = str(child)
            found["pids.max"] = Path(found["dir:pids"], "pids.max").read_text()
            seen.append(found)
            return 999_999_999

        def own_tasks() -> list[str]:
            return [(tmp_path / "v1" / c / "svc" / "tasks").read_text() for c in FakeV1.FILES]

        pid, tree = box.spawn(create, limits)
        assert pid == 999_999_999
        assert isinstance(tree, containment.CgroupTree)
        first = seen[0]
        assert [first[c] for c in ("memory", "pids", "cpu")] == ["0", "0", "0"]
        assert first["pids.max"] == "3"
        # Written exactly once the child exists; the thread went back.
        assert text(first["dir:pids"], "pids.max") == "2"
        assert text(first["dir:memory"], "memory.limit_in_bytes") == str(64 * MiB)
        assert text(first["dir:memory"], "memory.memsw.limit_in_bytes") == str(64 * MiB)
        assert text(first["dir:cpu"], "cpu.cfs_quota_us") == "25000"
        assert own_tasks()[:3] == ["0", "0", "0"]
        assert tree.exceeded() is None
        Path(first["dir:pids"], "pids.events").write_text("max 1\n")
        assert tree.exceeded() == ("processes", 2)
        assert not tree.alive()
        tree.release()
        # The empty set is kept, with the counters it had when it emptied.
        (kept,) = box._v1_free[("cpu", "memory", "pids")]
        assert kept.last == Counters(0, 1, 0)
        assert kept.written == limits
        assert len(box.files) > 0

        # The next process reuses it: its baseline is those counters (the
        # earlier refusal is not reported again), pids.max gets room again.
        Path(first["dir:memory"], "memory.max_usage_in_bytes").write_text("12345\n")
        pid, tree = box.spawn(create, limits)
        assert isinstance(tree, containment.CgroupTree)
        second = seen[1]
        assert [second["dir:" + c] for c in ("memory", "pids", "cpu")] == [
            first["dir:" + c] for c in ("memory", "pids", "cpu")
        ]
        assert second["pids.max"] == "3"
        assert text(first["dir:pids"], "pids.max") == "2"
        assert text(first["dir:memory"], "memory.max_usage_in_bytes") == "0"
        # A member in a v1 directory (gone from the v2 cgroup) keeps the tree alive.
        Path(first["dir:memory"], "cgroup.procs").write_text("4242\n")
        assert tree.exceeded() is None
        assert tree.alive()
        Path(first["dir:memory"], "memory.oom_control").write_text(
            "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n"
        )
        Path(first["dir:memory"], "cgroup.procs").write_text("")
        assert tree.exceeded() == ("memory", 64 * MiB)
        assert not tree.alive()
        tree.release()
        # Found empty before its counters were read: those are the next baseline.
        (kept,) = box._v1_free[("cpu", "memory", "pids")]
        assert kept.last == Counters(1, 1, 0)
    finally:
        box.stop()
    assert len(box.files) == 0
    assert v1.controller(first["dir:pids"]) == "pids"
    assert not Path(first["dir:pids"]).exists()


def test_control_files_keep_cgroupfs_descriptors_within_their_budget(tmp_path: Path) -> None:
    empty = tmp_path / "tasks"
    empty.write_text("")
    full = tmp_path / "pids.max"
    full.write_text("max\n")
    files = containment.ControlFiles(1)
    files.write(str(empty), "0")
    assert len(files) == 1
    # An ordinary file with contents is written by path, as cgroups.write does.
    files.write(str(full), "12")
    assert full.read_text() == "12"
    files.write(str(full), "7")
    assert full.read_text() == "7"
    # A kept read descriptor sees each new content; past the budget, reads open the file.
    assert files.read(str(full)) == "7"
    assert len(files) == 1
    assert files.read(str(tmp_path / "missing")) is None
    files.forget(str(tmp_path))
    assert len(files) == 0
    assert files.read(str(empty)) == "0"
    files.close()
    assert len(files) == 0
    unkept = containment.ControlFiles(0)
    unkept.write(str(empty), "1")
    assert len(unkept) == 0
    assert empty.read_text() == "1"
    # A limit file (rewritten only when the limits change) is never kept.
    limit = tmp_path / "memory.limit_in_bytes"
    limit.write_text("")
    roomy = containment.ControlFiles(100)
    roomy.write(str(limit), "4096")
    assert limit.read_text() == "4096"
    assert roomy.read(str(limit)) == "4096"
    assert len(roomy) == 0
    tasks = tmp_path / "v1" / "tasks"
    tasks.parent.mkdir()
    tasks.write_text("")
    roomy.write(str(tasks), "2")
    assert len(roomy) == 1
    roomy.close()


@given(
    st.dictionaries(
        st.sampled_from(["oom_kill", "oom_kill_disable", "under_oom", "max", "nr_throttled"]),
        st.integers(min_value=0, max_value=1 << 62),
    ),
    st.sampled_from(["oom_kill", "max", "nr_throttled"]),
)
def test_key_values_are_read_as_read_key_does(values: dict[str, int], key: str) -> None:
    content = "".join(f"{name} {value}\n" for name, value in values.items())
    assert placement._key_value(content, key) == values.get(key, 0)
    # The exit's counters parse the raw bytes the same way.
    head = key.encode() + b" "
    assert placement._counter_value(content.encode(), head, b"\n" + head) == values.get(key, 0)


def test_counter_bytes_without_a_newline_or_a_number() -> None:
    for data, found in ((b"max 3", 3), (b"max x\n", 0), (b"", 0), (b"maxi 2\nmax 4\n", 4)):
        assert placement._counter_value(data, b"max ", b"\nmax ") == found
        assert placement._key_value(data.decode(), "max") == found


def test_a_sets_moves_use_kept_descriptors_until_they_are_closed(tmp_path: Path) -> None:
    """The spawn's moves in and out of a pooled v1 set are pwrites on kept
    descriptors, looked up once; closing kept descriptors invalidates them."""
    own = {}
    by_controller = {}
    for name in ("memory", "pids"):
        parent = tmp_path / name / "svc" / "exec-server-1-ns1"
        (parent / "7").mkdir(parents=True)
        (parent / "7" / "tasks").write_text("")
        (tmp_path / name / "svc" / "tasks").write_text("")
        own[str(parent)] = str(tmp_path / name / "svc" / "tasks")
        by_controller[name] = str(parent / "7")
    v1set = containment.V1Set(by_controller, own)
    files = containment.ControlFiles(100)
    first = v1set.moves(files)
    assert first is not None
    assert v1set.moves(files) == first
    assert len(files) == 4
    files.forget(v1set.dirs[0])
    second = v1set.moves(files)
    assert second is not None
    assert len(files) == 4
    files.close()
    assert len(files) == 0
    small = containment.ControlFiles(1)
    assert containment.V1Set(by_controller, own).moves(small) is None
    small.close()
    again = v1set.moves(files)
    assert again is not None
    files.close()


def test_a_cgroups_events_are_read_through_a_kept_descriptor(tmp_path: Path) -> None:
    """``cgroup.events`` (each exit's emptiness look) is kept open: a read sees
    each new content; forgetting its directory closes it without moving the
    generation that the v1 sets' kept descriptors depend on."""
    events = tmp_path / "7" / "cgroup.events"
    events.parent.mkdir()
    events.write_text("populated 1\nfrozen 0\n")
    files = containment.ControlFiles(100)
    assert files.read_bytes(str(events)) == b"populated 1\nfrozen 0\n"
    assert len(files) == 1
    events.write_text("populated 0\nfrozen 0\n")
    assert files.read_bytes(str(events), 64) == b"populated 0\nfrozen 0\n"
    assert len(files) == 1
    assert files.read_bytes(str(tmp_path / "8" / "cgroup.events")) is None
    generation = files.generation
    files.forget(str(events.parent))
    assert len(files) == 0
    assert files.generation == generation
    tasks = tmp_path / "7" / "tasks"
    tasks.write_text("")
    files.write(str(tasks), "0")
    files.forget(str(events.parent))
    assert files.generation == generation + 1
    # Without a budget, by path as before.
    unkept = containment.ControlFiles(0)
    assert unkept.read_bytes(str(events)) == b"populated 0\nfrozen 0\n"
    assert len(unkept) == 0
    files.close()


def test_the_oom_watch_reads_the_memory_counter_alone(tmp_path: Path) -> None:
    """The OOM watch's look at a set is one pread of ``memory.oom_control``
    (kept) parsed as the exit's counters are; without a memory directory
    there is nothing to read."""
    own = {}
    by_controller = {}
    for name in ("memory", "pids"):
        parent = tmp_path / name / "svc" / "exec-server-1-ns1"
        (parent / "7").mkdir(parents=True)
        (tmp_path / name / "svc" / "tasks").write_text("")
        own[str(parent)] = str(tmp_path / name / "svc" / "tasks")
        by_controller[name] = str(parent / "7")
    oom = Path(by_controller["memory"], "memory.oom_control")
    oom.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    Path(by_controller["pids"], "pids.events").write_text("max 5\n")
    for files in (containment.ControlFiles(100), containment.ControlFiles(0)):
        # (A set serves one containment's ControlFiles.)
        v1set = containment.V1Set(by_controller, own)
        assert v1set.oom_kills(files) == 0
        oom.write_text("oom_kill_disable 0\nunder_oom 1\noom_kill 3\n")
        assert v1set.oom_kills(files) == 3
        assert v1set.counters(files) == Counters(3, 5, 0)
        oom.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
        files.close()
    pids_only = containment.V1Set({"pids": by_controller["pids"]}, own)
    assert pids_only.oom_kills(containment.ControlFiles(100)) is None
