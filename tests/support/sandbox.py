"""The sandbox tests' shared setup: their directories, the sandbox profiles and
environments, and a stdio server started with a sandbox mechanism.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import RpcTestClient
from tests.support.stdio_server import ServerProcess

CHILD_PATH = "/usr/local/bin:/usr/bin:/bin"


SECRET = "sbx-secret-4f1c9e"


MECHANISMS = ("bwrap", "landlock")


def uri(path: Path | str) -> str:
    return f"file://{path}"


def codex_profile(
    work: Path, *, write: bool = True, network: str = "restricted", slash_tmp: bool = True
) -> Any:
    """What Codex 0.171 sends for workspace-write (read-only: only the root entry).

    ``slash_tmp=False`` leaves /tmp out (Landlock refuses a profile whose
    carve-outs exist, and other programs may leave a /tmp/.agents or
    /tmp/.git behind on a shared machine): the ``tmpdir`` entry then stands
    for it, with ``TMPDIR`` in the child's environment.
    """
    entries: list[dict[str, Any]] = [
        {"path": {"type": "special", "value": {"kind": "root"}}, "access": "read"}
    ]
    if write:
        entries += [
            {"path": {"type": "special", "value": {"kind": "project_roots"}}, "access": "write"},
        ]
        if slash_tmp:
            entries.append(
                {"path": {"type": "special", "value": {"kind": "slash_tmp"}}, "access": "write"}
            )
        entries += [
            {"path": {"type": "special", "value": {"kind": "tmpdir"}}, "access": "write"},
        ] + [
            {
                "path": {
                    "type": "special",
                    "value": {"kind": "project_roots", "subpath": sub},
                },
                "access": "read",
                "missing_path_behavior": "skip",
            }
            for sub in (".git", ".agents", ".codex", ".aws")
        ]
    return {
        "permissions": {
            "type": "managed",
            "file_system": {"type": "restricted", "entries": entries},
            "network": network,
        },
        "cwd": uri(work),
        "workspaceRoots": [uri(work)],
        "windowsSandboxLevel": "disabled",
        "windowsSandboxProxySettingsMode": "reconcile",
        "useLegacyLandlock": False,
    }


@dataclass
class Dirs:
    base: Path
    work: Path
    outside: Path


@pytest.fixture
def dirs() -> Iterator[Dirs]:
    # Outside /tmp (writable under workspace-write) so "outside" is outside
    # every writable root.
    base = Path(tempfile.mkdtemp(prefix="exec-server-sbx-", dir="/var/tmp"))
    work = base / "work"
    outside = base / "outside"
    work.mkdir()
    outside.mkdir()
    yield Dirs(base, work, outside)
    shutil.rmtree(base, ignore_errors=True)


@dataclass
class Ran:
    exit_code: int
    output: bytes
    denied: bool
    read: dict[str, Any]
    exited: dict[str, Any]


_counter = iter(range(1_000_000))


async def run(
    client: RpcTestClient,
    script: str,
    cwd: Path,
    sandbox: Any,
    env: dict[str, str] | None = None,
    confined: bool | None = None,
    **extra: Any,
) -> Ran:
    pid = f"sbx-{next(_counter)}"
    started = await client.start_process(
        pid,
        ["sh", "-c", script],
        cwd=uri(cwd),
        env=env or {"PATH": CHILD_PATH, "LANG": "C.UTF-8"},
        sandbox=sandbox,
        **extra,
    )
    if confined is None:
        confined = sandbox is not None
    assert started["sandboxType"] == ("linuxSeccomp" if confined else "none")
    exited = await client.wait_notification("process/exited", pid, timeout=30)
    await client.wait_closed(pid, timeout=30)
    read = await client.call("process/read", {"processId": pid, "afterSeq": 0})
    assert read["sandboxDenied"] == exited["sandboxDenied"], (script, read, exited)
    return Ran(exited["exitCode"], client.output_of(pid), exited["sandboxDenied"], read, exited)


@asynccontextmanager
async def stdio_server(*args: str) -> AsyncIterator[ServerProcess]:
    server = ServerProcess.start(*args, env={"SBX_SECRET": SECRET})
    try:
        await server.call("initialize", {"clientName": "sandbox-test"})
        server.notify("initialized", {})
        yield server
    finally:
        await server.stop()


def temp_dir(d: Dirs, mechanism: str) -> str:
    """/tmp under bwrap (Codex's slash_tmp); under Landlock, a TMPDIR of the test's."""
    if mechanism == "bwrap":
        return "/tmp"
    path = d.base / "tmp"
    path.mkdir(exist_ok=True)
    return str(path)


def profile_for(d: Dirs, mechanism: str, **kwargs: Any) -> Any:
    return codex_profile(d.work, slash_tmp=mechanism == "bwrap", **kwargs)


def env_for(d: Dirs, mechanism: str, **extra: str) -> dict[str, str]:
    return {"PATH": CHILD_PATH, "LANG": "C.UTF-8", "TMPDIR": temp_dir(d, mechanism), **extra}
