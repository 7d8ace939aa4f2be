"""The real Codex CLI (0.171.0) in workspace-write: its apply_patch goes through our fs/*
under its permission profile, and a patch through a symlink that leaves the
workspace is refused (issue 21: it used to overwrite the file outside).

Scenarios as in tests/test_codex_cli.py (a scripted fake model, our server
over WebSocket), with ``--sandbox workspace-write`` instead of bypassing the
sandbox. The workspace and the "outside" directory live in /var/tmp: Codex's
workspace-write profile makes /tmp writable.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted

from tests.support.codex_cli import (
    codex_binary,
    codex_env,
    codex_exec,
    fake_model,
    our_server,
    write_codex_home,
)

__all__ = ["codex_binary"]  # the fixture, re-exported for pytest


@pytest.fixture
def scratch() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="exec-server-codex-sandbox-", dir="/var/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def run_sandboxed(codex: Path, base: Path, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """``codex exec --sandbox workspace-write`` in ``base/work`` against our server."""
    server_home = base / "server-codex-home"
    server_home.mkdir()
    async with fake_model(spec, base / "model.jsonl") as port, our_server(server_home) as server:
        home = base / "codex-home"
        write_codex_home(home, port)
        env = codex_env(base, home, server.url)
        argv = [
            str(codex), "exec", "--skip-git-repo-check", "--sandbox", "workspace-write",
            "--json", "-C", str(base / "work"), "Apply the patch.",
        ]  # fmt: skip
        events, _ = await codex_exec(argv, env, base / "work")
        return events


def _changes(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        e["item"]
        for e in events
        if e.get("type") == "item.completed" and e.get("item", {}).get("type") == "file_change"
    ]


def _patch(body: str) -> dict[str, Any]:
    return {"cmd": f"apply_patch <<'EOF'\n*** Begin Patch\n{body}\n*** End Patch\nEOF"}


@pytest_twisted.ensureDeferred
async def test_apply_patch_inside_the_workspace_works(codex_binary: Path, scratch: Path) -> None:
    (scratch / "work").mkdir()
    events = await run_sandboxed(
        codex_binary, scratch, _patch("*** Add File: notes/hello.txt\n+hello")
    )
    [change] = _changes(events)
    assert change["status"] == "completed", change
    assert (scratch / "work" / "notes" / "hello.txt").read_text() == "hello\n"


@pytest_twisted.ensureDeferred
async def test_apply_patch_through_a_symlink_out_is_refused(
    codex_binary: Path, scratch: Path
) -> None:
    work, outside = scratch / "work", scratch / "outside"
    work.mkdir()
    outside.mkdir()
    (outside / "victim.txt").write_text("original\n")
    os.symlink(outside, work / "escape")
    body = (
        "*** Update File: escape/victim.txt\n@@\n-original\n+overwritten\n"
        "*** Add File: escape/created.txt\n+created"
    )
    events = await run_sandboxed(codex_binary, scratch, _patch(body))
    changes = _changes(events)
    assert changes and all(c["status"] == "failed" for c in changes), changes
    assert (outside / "victim.txt").read_text() == "original\n"
    assert sorted(os.listdir(outside)) == ["victim.txt"]
    # Codex tried the write, and what came back to the model is the failure.
    assert "Failed to write file" in (scratch / "model.jsonl").read_text()
