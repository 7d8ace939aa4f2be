"""Resource limits without a kernel: the value, defaults and ceilings, and the
cgroup file I/O of both layouts against a fake cgroupfs (a tree of ordinary
files laid out as the kernel's), so the cgroup v2 code is checked on a host
that has no delegated v2 controllers."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from execserver import cgroups
from execserver.cgroups import Counters, Usage
from execserver.containment import LimitPlacement
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
