"""The real Codex CLI (0.171.0) with its sandbox, against this server (issue 21).

Codex's default sandbox (read-only for ``codex exec``), ``--sandbox
read-only`` and ``--sandbox workspace-write``: Codex sends its permission
profile on ``process/start`` and the ``fs/*`` writes; the command runs
confined (``sandboxType: linuxSeccomp``), writes inside the workspace
succeed, writes outside fail as they do against the reference (``Read-only
file system``), and ``apply_patch`` through a symlink that leaves the
workspace is refused. Helpers are those of tests/test_codex_cli.py.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted

from tests.harness import reactor, with_timeout
from tests.test_codex_cli import (
    CODEX_TIMEOUT,
    Run,
    _codex_home,
    _Collect,
    codex_binary,
    fake_model,
    our_server,
)
from tests.ws_harness import get_request, http_get

__all__ = ["codex_binary"]


@pytest.fixture
def outside() -> Iterator[Path]:
    # Outside /tmp, which workspace-write makes writable.
    path = Path(tempfile.mkdtemp(prefix="exec-server-codex-out-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def sandboxed(
    codex: Path, tmp: Path, spec: dict[str, Any], sandbox_args: tuple[str, ...]
) -> tuple[Run, list[dict[str, Any]]]:
    """Codex with ``sandbox_args`` (no bypass flag) against our server; Codex's events."""
    server_home = tmp / "server-codex-home"
    server_home.mkdir(exist_ok=True)
    home = tmp / "codex-home"
    work = tmp / "work"
    work.mkdir(exist_ok=True)
    log = tmp / "model.jsonl"
    async with fake_model(spec, log) as port, our_server(server_home) as server:
        _codex_home(home, port)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(tmp),
            "CODEX_HOME": str(home),
            "FAKE_API_KEY": "dummy",
            "CODEX_EXEC_SERVER_URL": server.url,
        }
        argv = [str(codex), "exec", *sandbox_args, "--skip-git-repo-check", "--json",
                "-C", str(work), "Run the shell command and report its output."]  # fmt: skip
        proto = _Collect()
        reactor.spawnProcess(
            proto, argv[0], argv, env=env, path=str(work), childFDs={0: "w", 1: "r", 2: "r"}
        )
        proto.transport.closeStdin()  # type: ignore[union-attr]
        try:
            code = await with_timeout(proto.ended, CODEX_TIMEOUT, "codex exec")
        finally:
            proto.kill()
        assert code == 0, (code, proto.out[-4000:], proto.err[-4000:])
        events = [json.loads(line) for line in proto.out.splitlines() if line.startswith(b"{")]
        _, _, body = await http_get(*server.host_port, get_request("/metrics"))
    return Run(events, body.decode()), events


@pytest.mark.parametrize(
    "sandbox_args", [(), ("--sandbox", "read-only")], ids=["default", "read-only"]
)
@pytest_twisted.ensureDeferred
async def test_read_only_runs_commands_and_refuses_writes(
    codex_binary: Path, tmp_path: Path, sandbox_args: tuple[str, ...]
) -> None:
    spec = {"cmd": "echo reading-$INTEROP_SIDE; echo x > marker"}
    run, _ = await sandboxed(codex_binary, tmp_path, spec, sandbox_args)
    items = run.items("command_execution")
    assert len(items) == 1, run.events
    [item] = items
    output = item["aggregated_output"]
    assert "reading-exec-server\n" in output, item
    assert "marker: Read-only file system" in output, item
    assert item["exit_code"] == 1, item
    assert not (tmp_path / "work" / "marker").exists()
    assert run.metric('exec_server_sandbox_mechanism{mechanism="bwrap"}') == 1


@pytest_twisted.ensureDeferred
async def test_workspace_write_inside_and_outside(
    codex_binary: Path, tmp_path: Path, outside: Path
) -> None:
    spec = {"cmd": f"echo in > inside.txt && cat inside.txt && echo out > {outside}/f"}
    run, _ = await sandboxed(codex_binary, tmp_path, spec, ("--sandbox", "workspace-write"))
    items = run.items("command_execution")
    assert len(items) == 1, run.events
    [item] = items
    assert item["exit_code"] == 1, item
    # (bash -l may print its profile's complaints about read-only paths first.)
    assert "in\n" in item["aggregated_output"].splitlines(keepends=True), item
    assert f"{outside}/f: Read-only file system" in item["aggregated_output"], item
    assert (tmp_path / "work" / "inside.txt").read_text() == "in\n"
    assert list(outside.iterdir()) == []


@pytest_twisted.ensureDeferred
async def test_workspace_write_apply_patch_through_a_symlink_is_refused(
    codex_binary: Path, tmp_path: Path, outside: Path
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "escape").symlink_to(outside)
    patch = "*** Begin Patch\n*** Add File: escape/pwned.txt\n+pwned\n*** End Patch"
    spec = {"cmd": f"apply_patch <<'EOF'\n{patch}\nEOF"}
    run, _ = await sandboxed(codex_binary, tmp_path, spec, ("--sandbox", "workspace-write"))
    changes = run.items("file_change")
    assert all(change["status"] != "completed" for change in changes), changes
    assert list(outside.iterdir()) == []
