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
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted

from tests.support.children import Collected
from tests.support.codex_cli import (
    Run,
    codex_binary,
    codex_env,
    codex_exec,
    fake_model,
    our_server,
    write_codex_home,
)
from tests.support.harness import reactor, with_timeout
from tests.support.polling import until
from tests.support.ws_harness import WsServerProcess, connect, get_request, http_get

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
        write_codex_home(home, port)
        env = codex_env(tmp, home, server.url)
        argv = [str(codex), "exec", *sandbox_args, "--skip-git-repo-check", "--json",
                "-C", str(work), "Run the shell command and report its output."]  # fmt: skip
        events, _ = await codex_exec(argv, env, work)
        _, _, body = await http_get(*server.host_port, get_request("/metrics"))
    return Run(events, body.decode()), events


def tool_output(model_log: Path) -> str:
    """The command's result as Codex gave it to the model (its last function_call_output).

    Codex's own --json events occasionally leave out the command_execution
    item of a command that ends at once; what it sent the model is certain.
    """
    found = ""
    for line in model_log.read_text().splitlines():
        entry = json.loads(line)
        for item in entry.get("body", {}).get("input", []):
            if isinstance(item, dict) and item.get("type") == "function_call_output":
                out = item.get("output")
                found = out if isinstance(out, str) else json.dumps(out)
    assert found, "Codex never returned the command's output to the model"
    return found


def check_items(run: Run, exit_code: int) -> None:
    for item in run.items("command_execution"):
        assert item["exit_code"] == exit_code, item


@pytest.mark.parametrize(
    "sandbox_args", [(), ("--sandbox", "read-only")], ids=["default", "read-only"]
)
@pytest_twisted.ensureDeferred
async def test_read_only_runs_commands_and_refuses_writes(
    codex_binary: Path, tmp_path: Path, sandbox_args: tuple[str, ...]
) -> None:
    spec = {"cmd": "echo reading-$INTEROP_SIDE; echo x > marker"}
    run, _ = await sandboxed(codex_binary, tmp_path, spec, sandbox_args)
    output = tool_output(tmp_path / "model.jsonl")
    assert "reading-exec-server\n" in output, output
    assert "marker: Read-only file system" in output, output
    assert "Process exited with code 1\n" in output, output
    check_items(run, 1)
    assert not (tmp_path / "work" / "marker").exists()
    assert run.metric('exec_server_sandbox_mechanism{mechanism="bwrap"}') == 1


@pytest_twisted.ensureDeferred
async def test_workspace_write_inside_and_outside(
    codex_binary: Path, tmp_path: Path, outside: Path
) -> None:
    spec = {"cmd": f"echo in > inside.txt && cat inside.txt && echo out > {outside}/f"}
    run, _ = await sandboxed(codex_binary, tmp_path, spec, ("--sandbox", "workspace-write"))
    output = tool_output(tmp_path / "model.jsonl")
    assert "Process exited with code 1\n" in output, output
    # (bash -l may print its profile's complaints about read-only paths first.)
    assert "in\n" in output.splitlines(keepends=True), output
    assert f"{outside}/f: Read-only file system" in output, output
    check_items(run, 1)
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


# --- sandboxDenied and exit codes, command by command, against the reference ------------------

DENIAL_SCRIPTS = {
    "write outside": "echo x > {outside}/f",
    "write into .git": "echo x > .git/config",
    "write inside": "echo x > in.txt",
    "an ordinary failure": "exit 3",
    "not found": "nosuchcommand-xyz",
    "a socket": "python3 -c 'import socket; socket.socket().connect((\"127.0.0.1\", 9))'",
    "rename .git": "mv .git g",
    "mount": "mount -t tmpfs none /mnt",
    "touch outside": "touch {outside}/t",
}


async def _denials(url: str, work: Path, outside: Path) -> dict[str, tuple[int, bool]]:
    from tests.support.sandbox import codex_profile, uri

    client = await connect(url)
    try:
        await client.call("initialize", {"clientName": "denials"})
        client.notify("initialized", {})
        seen = {}
        for i, (name, script) in enumerate(DENIAL_SCRIPTS.items()):
            pid = f"d{i}"
            await client.start_process(
                pid, ["/bin/sh", "-c", script.format(outside=outside)], cwd=uri(work),
                env={"PATH": "/usr/bin:/bin"}, sandbox=codex_profile(work),
            )  # fmt: skip
            exited = await client.wait_notification("process/exited", pid, timeout=30)
            seen[name] = (exited["exitCode"], exited["sandboxDenied"])
        return seen
    finally:
        await client.close()


@pytest_twisted.ensureDeferred
async def test_exit_codes_and_sandbox_denied_match_the_reference(
    codex_binary: Path, tmp_path: Path, outside: Path
) -> None:
    base = Path(tempfile.mkdtemp(prefix="exec-server-denials-", dir="/var/tmp"))
    try:
        work = base / "work"
        (work / ".git").mkdir(parents=True)
        (work / ".git" / "config").write_text("[core]\n")
        home = base / "codex-home"
        home.mkdir()
        port = _free_port()
        # The reference's sandbox helper refuses a CODEX_HOME under TMPDIR.
        env = {"CODEX_HOME": str(home), "TMPDIR": str(tmp_path), "PATH": os.environ["PATH"]}
        reference = Collected()
        argv = [str(codex_binary), "exec-server", "--listen", f"ws://127.0.0.1:{port}"]
        reactor.spawnProcess(reference, argv[0], argv, env=env, path=str(base))
        try:
            await _wait_port(port)
            theirs = await _denials(f"ws://127.0.0.1:{port}", work, outside)
        finally:
            reference.kill()
            await with_timeout(reference.ended, 30, "the reference's exit")
        server = await WsServerProcess.start()
        try:
            ours = await _denials(server.url, work, outside)
        finally:
            await server.stop()
        assert ours == theirs
        # And the cases mean what they say.
        assert theirs["write outside"] == (2, True)
        assert theirs["an ordinary failure"] == (3, False)
        assert list(outside.iterdir()) == []
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def _wait_port(port: int) -> None:
    def listening() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            return False
        return True

    await until(listening, f"the reference to listen on {port}", timeout=15, interval=0.05)
