"""The real Codex CLI (0.171.0) runs its commands and file edits through this server.

Each scenario runs ``codex exec --json`` with a scripted fake model
(tests/codex/fake_model.py) and ``CODEX_EXEC_SERVER_URL`` pointing at our
server over WebSocket, and asserts on Codex's own events: the command's exit
code and the output Codex received. The binary comes from the npm registry
through tests/codex/fetch_codex.py (cached); the tests skip, loudly, only
when it cannot be fetched.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.internet.defer import Deferred
from twisted.web.resource import Resource
from twisted.web.server import Request, Site

from tests.support.children import Collected
from tests.support.codex_cli import (
    CODEX_TIMEOUT,
    Run,
    codex_binary,
    codex_env,
    codex_exec,
    fake_model,
    our_server,
    write_codex_home,
)
from tests.support.cutting_proxy import CuttingProxy
from tests.support.harness import observe, pid_alive, reactor, server_env, with_timeout
from tests.support.ws_harness import WsServerProcess, get_request, http_get

__all__ = ["codex_binary"]  # fixtures, used by name


async def run_codex(
    codex: Path, tmp: Path, url: str, model_port: int, extra_args: tuple[str, ...] = ()
) -> tuple[list[dict[str, Any]], Collected]:
    home = tmp / "codex-home"
    write_codex_home(home, model_port)
    work = tmp / "work"
    work.mkdir(exist_ok=True)
    env = codex_env(tmp, home, url)
    argv = [
        str(codex),
        "exec",
        *extra_args,
        "--skip-git-repo-check",
        "--dangerously-bypass-approvals-and-sandbox",
        "--json",
        "-C",
        str(work),
        "Run the shell command and report its output.",
    ]
    return await codex_exec(argv, env, work)


class _ReferenceWs(WsServerProcess):
    """``codex exec-server --listen ws://127.0.0.1:0``: it prints its URL on stdout."""

    def outReceived(self, data: bytes) -> None:
        self.stdout_seen = getattr(self, "stdout_seen", b"") + data
        found = re.search(rb"ws://127\.0\.0\.1:\d+", self.stdout_seen)
        if found and not self.listening.called:
            self.urls = [found.group().decode()]
            self.listening.callback(self.urls)


@asynccontextmanager
async def reference_server(codex: Path, codex_home: Path) -> AsyncIterator[WsServerProcess]:
    env = server_env({"INTEROP_SIDE": "exec-server", "CODEX_HOME": str(codex_home)})
    argv = [str(codex), "exec-server", "--listen", "ws://127.0.0.1:0"]
    proto = _ReferenceWs(1).launch(argv, env=env, description="codex exec-server (ws)")
    proto.allow_stderr(".")  # its own log lines
    try:
        await with_timeout(observe(proto.listening), CODEX_TIMEOUT, "the reference's URL")
        yield proto
    finally:
        await proto.stop()


async def reference_scenario(codex: Path, tmp: Path, spec: dict[str, Any]) -> list[Any]:
    """The scenario against the reference: Codex's command items."""
    server_home = tmp / "server-codex-home"
    server_home.mkdir(exist_ok=True)
    async with (
        fake_model(spec, tmp / "model.jsonl") as port,
        reference_server(codex, server_home) as server,
    ):
        events, _ = await run_codex(codex, tmp, server.url, port)
    return Run(events, "").items("command_execution")


async def scenario(
    codex: Path, tmp: Path, spec: dict[str, Any], via: Any = None, extra_args: tuple[str, ...] = ()
) -> Run:
    server_home = tmp / "server-codex-home"
    server_home.mkdir(exist_ok=True)
    async with fake_model(spec, tmp / "model.jsonl") as port, our_server(server_home) as server:
        url = server.url if via is None else await via(server)
        events, _ = await run_codex(codex, tmp, url, port, extra_args)
        _, _, body = await http_get(*server.host_port, get_request("/metrics"))
        return Run(events, body.decode())


@pytest_twisted.ensureDeferred
async def test_plain_command(codex_binary: Path, tmp_path: Path) -> None:
    spec = {"cmd": "echo hello-from-$INTEROP_SIDE > marker; cat marker; exit 7"}
    run = await scenario(codex_binary, tmp_path, spec)
    [item] = run.items("command_execution")
    assert item["exit_code"] == 7, item
    assert item["aggregated_output"] == "hello-from-exec-server\n", item
    assert (tmp_path / "work" / "marker").read_text() == "hello-from-exec-server\n"


@pytest_twisted.ensureDeferred
async def test_agents_md_is_read_through_the_server(codex_binary: Path, tmp_path: Path) -> None:
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "AGENTS.md").write_text("Project rule: the word is quokka-7731.\n")
    run = await scenario(codex_binary, tmp_path, {"cmd": "true"})
    [item] = run.items("command_execution")
    assert item["exit_code"] == 0, item
    assert run.metric('exec_server_requests_total{method="fs/readFile",outcome="ok"}') >= 1
    # Codex also asks to be told when the files it did not find appear.
    assert run.metric('exec_server_requests_total{method="fs/watchMissing",outcome="ok"}') >= 1
    requests = (tmp_path / "model.jsonl").read_text()
    assert "quokka-7731" in requests


class _McpServer(Resource):
    """A Streamable HTTP MCP server with one tool (JSON answers, no SSE stream)."""

    isLeaf = True

    def __init__(self, sse: bool) -> None:
        super().__init__()
        self.methods: list[str] = []
        #: Answer as server-sent events (one event per answer), not JSON.
        self.sse = sse

    def render_GET(self, request: Request) -> bytes:
        request.setResponseCode(405)  # no server-initiated stream
        return b""

    def render_POST(self, request: Request) -> bytes:
        message = json.loads(request.content.read() if request.content else b"{}")
        self.methods.append(message.get("method", "<response>"))
        if "id" not in message or "method" not in message:
            request.setResponseCode(202)
            return b""
        results = {
            "initialize": {
                "protocolVersion": message.get("params", {}).get("protocolVersion", "2025-03-26"),
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "docs", "version": "1.0.0"},
            },
            "tools/list": {
                "tools": [
                    {
                        "name": "quokka_lookup",
                        "description": "Looks a quokka up.",
                        "inputSchema": {"type": "object", "properties": {}},
                    }
                ]
            },
        }
        if message["method"] in results:
            answer = {"jsonrpc": "2.0", "id": message["id"], "result": results[message["method"]]}
        else:
            error = {"code": -32601, "message": "method not found"}
            answer = {"jsonrpc": "2.0", "id": message["id"], "error": error}
        if self.sse:
            request.setHeader(b"content-type", b"text/event-stream")
            return b"event: message\ndata: " + json.dumps(answer).encode() + b"\n\n"
        request.setHeader(b"content-type", b"application/json")
        return json.dumps(answer).encode()


@pytest.mark.parametrize("sse", [False, True], ids=["json", "sse"])
@pytest_twisted.ensureDeferred
async def test_executor_config_is_read_through_the_server(
    codex_binary: Path, tmp_path: Path, sse: bool
) -> None:
    # Advertised as environmentConfigRead, so Codex asks the server for the
    # MCP servers in the executor's own config.toml, and reaches the HTTP
    # one through the executor (http/request): its tool reaches the model.
    mcp = _McpServer(sse)
    port = reactor.listenTCP(0, Site(mcp), interface="127.0.0.1")
    home = tmp_path / "server-codex-home"
    home.mkdir()
    (home / "config.toml").write_text(
        '[mcp_servers.local]\ncommand = "/bin/false"\n'
        f'[mcp_servers.docs]\nurl = "http://127.0.0.1:{port.getHost().port}/mcp"\n'
    )
    try:
        run = await scenario(codex_binary, tmp_path, {"cmd": "echo configured-$INTEROP_SIDE"})
    finally:
        await port.stopListening()
    [item] = run.items("command_execution")
    assert item["exit_code"] == 0, item
    assert item["aggregated_output"] == "configured-exec-server\n", item
    assert (
        run.metric('exec_server_requests_total{method="environmentConfig/read",outcome="ok"}') >= 1
    )
    assert 'method="environmentConfig/read",outcome="error"' not in run.metrics
    # The MCP handshake and the tool list went through the executor.
    assert run.metric('exec_server_requests_total{method="http/request",outcome="ok"}') >= 2
    assert mcp.methods[:1] == ["initialize"] and "tools/list" in mcp.methods, mcp.methods
    assert "quokka_lookup" in (tmp_path / "model.jsonl").read_text()


@pytest_twisted.ensureDeferred
async def test_skills_are_discovered_through_the_server(codex_binary: Path, tmp_path: Path) -> None:
    # With executor capability discovery switched on (features under
    # development in 0.171), an executor that advertises
    # capabilityDiscoveryV2 and reports executorVersion >= 0.164.0 is asked
    # for its skills: the skill installed in the server's CODEX_HOME reaches
    # the model's instructions, and the run goes on as without it.
    skill = tmp_path / "server-codex-home" / "skills" / "quokka"
    skill.mkdir(parents=True)
    (skill / "SKILL.md").write_text(
        "---\nname: quokka-skill\ndescription: The quokka-9931 skill.\n---\nbody\n"
    )
    features = ("executor_capability_discovery", "executor_capability_discovery_v2")
    flags = tuple(arg for name in features for arg in ("--enable", name))
    run = await scenario(codex_binary, tmp_path, {"cmd": "echo plain"}, extra_args=flags)
    [item] = run.items("command_execution")
    assert (item["exit_code"], item["aggregated_output"]) == (0, "plain\n"), item
    assert (
        run.metric('exec_server_requests_total{method="capabilities/discoverV2",outcome="ok"}') >= 1
    )
    assert not [e for e in run.items("error") if "discovery failed" in e["message"]]
    assert 'method="<unknown>"' not in run.metrics
    requests = (tmp_path / "model.jsonl").read_text()
    assert "quokka-skill" in requests and "quokka-9931" in requests


@pytest_twisted.ensureDeferred
async def test_output_over_one_mib(codex_binary: Path, tmp_path: Path) -> None:
    size = 1536 * 1024
    spec = {"cmd": f"head -c {size} /dev/zero | tr '\\0' x; echo; echo tail-$INTEROP_SIDE"}
    run = await scenario(codex_binary, tmp_path, spec)
    [item] = run.items("command_execution")
    assert item["exit_code"] == 0, {k: v for k, v in item.items() if k != "aggregated_output"}
    # Codex keeps the head and the tail of a long output (1 MiB in all);
    # the server counted every byte read from the child.
    output = item["aggregated_output"]
    assert output.startswith("x" * 4096) and output.endswith("x\ntail-exec-server\n")
    assert len(output) >= 1024 * 1024
    sent = run.metric('exec_server_output_bytes_total{stream="stdout"}')
    assert sent == size + len("\ntail-exec-server\n")


@pytest_twisted.ensureDeferred
async def test_pty_session_driven_through_write_stdin(codex_binary: Path, tmp_path: Path) -> None:
    spec = {
        "cmd": "read line; echo got:$line:$INTEROP_SIDE; tty; exit 4",
        "tty": True,
        "yield_ms": 500,
        "stdin": "ping\n",
    }
    run = await scenario(codex_binary, tmp_path, spec)
    [item] = run.items("command_execution")
    assert item["exit_code"] == 4, item
    output = item["aggregated_output"].replace("\r\n", "\n")
    assert "got:ping:exec-server\n/dev/pts/" in output, item


@pytest_twisted.ensureDeferred
async def test_apply_patch_creates_a_file_in_a_new_directory(
    codex_binary: Path, tmp_path: Path
) -> None:
    patch = (
        "*** Begin Patch\n*** Add File: notes/deep/hello.txt\n"
        "+hello from apply_patch\n*** End Patch"
    )
    spec = {"cmd": f"apply_patch <<'EOF'\n{patch}\nEOF"}
    run = await scenario(codex_binary, tmp_path, spec)
    [change] = run.items("file_change")
    assert change["status"] == "completed", change
    created = tmp_path / "work" / "notes" / "deep" / "hello.txt"
    assert created.read_text() == "hello from apply_patch\n"
    # Through the server's fs methods, not a process.
    assert run.metric('exec_server_requests_total{method="fs/writeFile",outcome="ok"}') >= 1
    assert run.items("command_execution") == []


@pytest_twisted.ensureDeferred
async def test_connection_cut_mid_command(codex_binary: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "started.fifo"
    os.mkfifo(fifo)
    reader = Collected()
    reactor.spawnProcess(reader, "/bin/cat", ["cat", str(fifo)], env={}, path=str(tmp_path))
    proxy: CuttingProxy | None = None

    async def cut_once_running(server: WsServerProcess) -> str:
        nonlocal proxy
        proxy = await CuttingProxy(server.host_port).start()

        async def cut() -> None:
            await with_timeout(reader.first_line, CODEX_TIMEOUT, "the command's start")
            assert proxy is not None
            proxy.cut()

        cutting.append(Deferred.fromCoroutine(cut()))
        return proxy.url

    cutting: list[Deferred[None]] = []
    spec = {"cmd": f"echo before; echo started > {fifo}; sleep 2; echo after-$INTEROP_SIDE; exit 3"}
    try:
        run = await scenario(codex_binary, tmp_path, spec, via=cut_once_running)
        await cutting[0]
    finally:
        reader.kill()
        if proxy is not None:
            await proxy.stop()
    [item] = run.items("command_execution")
    assert item["exit_code"] == 3, item
    assert item["aggregated_output"] == "before\nafter-exec-server\n", item
    assert run.metric("exec_server_connections_opened_total") >= 2


@pytest_twisted.ensureDeferred
async def test_a_background_job_outlives_its_command(codex_binary: Path, tmp_path: Path) -> None:
    # Codex sends process/terminate after every command, also once it
    # exited; as on the reference, that leaves what the command started in
    # the background running, so the next command finds it. It ends with the
    # session (when Codex exits).
    for side in ("ours", "ref"):
        (tmp_path / side).mkdir()
    spec = {
        "cmd": "nohup sleep 300 >/dev/null 2>&1 & echo $! > bg.pid; echo started",
        "then": ["kill -0 $(cat bg.pid) && echo alive-$INTEROP_SIDE"],
    }
    run = await scenario(codex_binary, tmp_path / "ours", spec)
    first, second = run.items("command_execution")
    assert (first["exit_code"], first["aggregated_output"]) == (0, "started\n"), first
    assert (second["exit_code"], second["aggregated_output"]) == (0, "alive-exec-server\n")
    assert not pid_alive(int((tmp_path / "ours" / "work" / "bg.pid").read_text()))
    # What Codex sees against its own server.
    reference = await reference_scenario(codex_binary, tmp_path / "ref", spec)
    shown = [(i["exit_code"], i["aggregated_output"]) for i in reference]
    assert shown == [(first["exit_code"], first["aggregated_output"]), (0, "alive-exec-server\n")]
    with contextlib.suppress(ProcessLookupError):  # the reference may leave it behind
        os.kill(int((tmp_path / "ref" / "work" / "bg.pid").read_text()), signal.SIGKILL)


@pytest_twisted.ensureDeferred
async def test_workspace_skills_reach_the_model(codex_binary: Path, tmp_path: Path) -> None:
    # Codex finds .agents/skills of the project with fs/canonicalize and fs/walk.
    for side in ("ours", "ref"):
        skill = tmp_path / side / "work" / ".agents" / "skills" / "wombat"
        skill.mkdir(parents=True)
        (skill / "SKILL.md").write_text(
            "---\nname: wombat-skill\ndescription: The wombat-5521 skill.\n---\nbody\n"
        )
    run = await scenario(codex_binary, tmp_path / "ours", {"cmd": "echo plain"})
    [item] = run.items("command_execution")
    assert (item["exit_code"], item["aggregated_output"]) == (0, "plain\n"), item
    assert run.metric('exec_server_requests_total{method="fs/walk",outcome="ok"}') >= 1
    assert 'method="<unknown>"' not in run.metrics
    requests = (tmp_path / "ours" / "model.jsonl").read_text()
    assert "wombat-skill" in requests and "wombat-5521" in requests
    # Against its own server Codex shows the model the same skill.
    await reference_scenario(codex_binary, tmp_path / "ref", {"cmd": "echo plain"})
    reference = (tmp_path / "ref" / "model.jsonl").read_text()
    assert "wombat-skill" in reference and "wombat-5521" in reference
