"""The real Codex CLI run against a server by the tests: the cached binary, its
CODEX_HOME, the fake model it talks to, and our server for it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.codex.fetch_codex import FetchError, fetch
from tests.support.children import Collected
from tests.support.harness import REPO_ROOT, reactor, with_timeout
from tests.support.ws_harness import WsServerProcess

#: codex exec's whole run, per scenario (a busy 2-core machine; typically 1-3 s).
CODEX_TIMEOUT = 90.0


@pytest.fixture(scope="module")
def codex_binary() -> Path:
    try:
        return fetch()
    except FetchError as exc:
        pytest.skip(f"THE REAL CODEX CLI IS NOT AVAILABLE, its interop tests did not run: {exc}")


@asynccontextmanager
async def fake_model(spec: dict[str, Any], log: Path) -> AsyncIterator[int]:
    proto = Collected()
    env = dict(os.environ, FAKE_MODEL_SPEC=json.dumps(spec))
    argv = [sys.executable, "-m", "tests.codex.fake_model", str(log)]
    reactor.spawnProcess(proto, argv[0], argv, env=env, path=str(REPO_ROOT))
    try:
        line = await with_timeout(proto.first_line, 30, "the fake model's port")
        yield int(line)
    finally:
        proto.kill()
        await with_timeout(proto.ended, 30, "the fake model's exit")


def write_codex_home(home: Path, model_port: int) -> None:
    home.mkdir()
    (home / "config.toml").write_text(
        f"""model = "fake-model"
model_provider = "fake"
check_for_update_on_startup = false

[model_providers.fake]
name = "fake"
base_url = "http://127.0.0.1:{model_port}/v1"
wire_api = "responses"
env_key = "FAKE_API_KEY"
request_max_retries = 0
stream_max_retries = 0
"""
    )


@asynccontextmanager
async def our_server(codex_home: Path) -> AsyncIterator[WsServerProcess]:
    # The child inherits INTEROP_SIDE through Codex's envPolicy: output that
    # names it proves the command ran on this server, not locally in Codex.
    # CODEX_HOME is the server's own Codex config (environmentConfig/read).
    env = {"INTEROP_SIDE": "exec-server", "CODEX_HOME": str(codex_home)}
    server = await WsServerProcess.start(env=env)
    try:
        yield server
    finally:
        await server.stop()


class Run:
    """What one scenario left: Codex's --json events and the server's /metrics."""

    def __init__(self, events: list[dict[str, Any]], metrics: str) -> None:
        self.events = events
        self.metrics = metrics

    def items(self, kind: str) -> list[dict[str, Any]]:
        return [
            e["item"]
            for e in self.events
            if e.get("type") == "item.completed" and e.get("item", {}).get("type") == kind
        ]

    def metric(self, line_prefix: str) -> float:
        for line in self.metrics.splitlines():
            if line.startswith(line_prefix + " "):
                return float(line.split()[-1])
        raise AssertionError(f"no {line_prefix} in /metrics:\n{self.metrics}")


def codex_env(home: Path, codex_home: Path, url: str) -> dict[str, str]:
    """The environment ``codex exec`` runs in: its own HOME and CODEX_HOME, our server's URL."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "CODEX_HOME": str(codex_home),
        "FAKE_API_KEY": "dummy",
        "CODEX_EXEC_SERVER_URL": url,
    }


async def codex_exec(
    argv: list[str], env: dict[str, str], cwd: Path
) -> tuple[list[dict[str, Any]], Collected]:
    """Run ``codex exec ... --json`` (stdin closed) to a 0 exit within CODEX_TIMEOUT,
    killed if it overruns; its JSON events and the finished process."""
    proto = Collected()
    reactor.spawnProcess(
        proto, argv[0], argv, env=env, path=str(cwd), childFDs={0: "w", 1: "r", 2: "r"}
    )
    proto.transport.closeStdin()  # type: ignore[union-attr]
    try:
        code = await with_timeout(proto.ended, CODEX_TIMEOUT, "codex exec")
    finally:
        proto.kill()
    assert code == 0, (code, proto.out[-4000:], proto.err[-4000:])
    events = [json.loads(line) for line in proto.out.splitlines() if line.startswith(b"{")]
    return events, proto
