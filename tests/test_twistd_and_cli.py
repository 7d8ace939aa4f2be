"""The two ways to run the server: ``twistd exec-server`` and the ``exec-server`` script.

The twistd plugin is found only when the package is installed (``pip install
.``, as CI and the README do); the scripts run are the installed ones next to
``sys.executable``, with no path to this checkout (``tests/test_installed.py``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from execserver import cli
from tests.support.harness import REPO_ROOT, child_env, server_env, unb64
from tests.support.raw_server import RawServer

BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    candidate = BIN / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"`{name}` is not installed (run `pip install .`)")
    return found


def run(argv: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
        env=server_env(),
        cwd=str(cwd or REPO_ROOT),
        stdin=subprocess.DEVNULL,
    )


def exec_server(*args: str) -> subprocess.CompletedProcess[str]:
    return run([tool("exec-server"), *args])


# --- twistd -------------------------------------------------------------------------------


def test_twistd_help_lists_exec_server(tmp_path: Path) -> None:
    result = run([tool("twistd"), "--help"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "exec-server" in result.stdout


def test_twistd_exec_server_help_lists_the_flags(tmp_path: Path) -> None:
    result = run([tool("twistd"), "exec-server", "--help"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for flag in (
        "--listen",
        "--retained-output-bytes",
        "--exit-retention-ms",
        "--max-processes",
        "--max-message-bytes",
    ):
        assert flag in result.stdout


def test_twistd_serves_the_protocol_on_stdio_and_logs_to_stderr(tmp_path: Path) -> None:
    server = RawServer(
        command=[tool("twistd"), "-n", "exec-server", "--listen", "stdio://"], cwd=str(tmp_path)
    )
    try:
        result = server.handshake()
        assert result["protocolVersion"] == "exec-server.v0"
        server.call(
            "process/start",
            {
                "processId": "hi",
                "argv": ["printf", "hi"],
                "cwd": str(tmp_path),
                "env": child_env(),
                "tty": False,
                "arg0": None,
            },
        )
        notes: list[dict[str, Any]] = []
        while not any(n.get("method") == "process/closed" for n in notes):
            notes.append(server.read_message())
        outputs = [n["params"] for n in notes if n.get("method") == "process/output"]
        assert b"".join(unb64(o["chunk"]) for o in outputs) == b"hi"
    finally:
        code = server.stop()
    assert code == 0
    # Every line that went to stdout was protocol (read_message decoded each).
    stderr = server.stderr_text()
    assert "exec-server" in stderr or "twistd" in stderr or "Main loop" in stderr, stderr


def test_twistd_stdout_carries_protocol_only(tmp_path: Path) -> None:
    """Log lines that twistd writes at start and stop must not reach stdout."""
    request = b'{"id":1,"method":"initialize","params":{"clientName":"t"}}\n'
    result = subprocess.run(
        [tool("twistd"), "-n", "exec-server", "--listen", "stdio://"],
        input=request,
        check=False,
        capture_output=True,
        timeout=30,
        env=server_env(),
        cwd=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    assert msgspec.json.decode(lines[0])["result"]["protocolVersion"] == "exec-server.v0"
    assert result.stderr.strip(), "twistd's log lines belong on stderr"


def test_twistd_rejects_unsupported_listen_urls(tmp_path: Path) -> None:
    result = run([tool("twistd"), "-n", "exec-server", "--listen", "http://x"], cwd=tmp_path)
    assert result.returncode != 0
    assert "unsupported --listen URL `http://x`; expected `stdio://` or `ws://IP:PORT`" in (
        result.stdout + result.stderr
    )


# --- the exec-server script ---------------------------------------------------------------------


def test_exec_server_serves_stdio_by_default() -> None:
    result = subprocess.run(
        [tool("exec-server")],
        input=b'{"id":"a","method":"initialize","params":{"clientName":"t"}}\n',
        check=False,
        capture_output=True,
        timeout=30,
        env=server_env(),
        cwd=str(REPO_ROOT),
    )
    assert result.returncode == 0, result.stderr
    [line] = result.stdout.splitlines()
    assert msgspec.json.decode(line)["id"] == "a"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (
            "http://127.0.0.1:1234",
            "unsupported --listen URL `http://127.0.0.1:1234`; "
            "expected `stdio://` or `ws://IP:PORT`",
        ),
        ("http://x", "unsupported --listen URL `http://x`; expected `stdio://` or `ws://IP:PORT`"),
        (
            "ws://localhost:1",
            "invalid websocket --listen URL `ws://localhost:1`; expected `ws://IP:PORT`",
        ),
        (
            "ws://localhost:1234",
            "invalid websocket --listen URL `ws://localhost:1234`; expected `ws://IP:PORT`",
        ),
        (
            "ws://127.0.0.1",
            "invalid websocket --listen URL `ws://127.0.0.1`; expected `ws://IP:PORT`",
        ),
        (
            "ws://127.0.0.1:65536",
            "invalid websocket --listen URL `ws://127.0.0.1:65536`; expected `ws://IP:PORT`",
        ),
        ("stdio", "unsupported --listen URL `stdio`; expected `stdio://` or `ws://IP:PORT`"),
    ],
)
def test_bad_listen_urls_print_the_reference_messages(url: str, message: str) -> None:
    result = exec_server("--listen", url)
    assert result.returncode != 0
    assert message in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--max-processes", "-1"], "--max-processes must not be negative, got `-1`"),
        (["--retained-output-bytes=-5"], "--retained-output-bytes must not be negative"),
        (["--exit-retention-ms", "-1"], "--exit-retention-ms must not be negative"),
        (["--max-message-bytes", "-1"], "--max-message-bytes must not be negative"),
        (["--terminate-grace-ms", "-1"], "--terminate-grace-ms must not be negative"),
        (["--max-processes", "many"], "--max-processes takes a whole number, got `many`"),
        (["--max-processes", "1.5"], "--max-processes takes a whole number"),
        (["--max-processes", "0"], "--max-processes must be at least 1"),
        (["--max-message-bytes", "100"], "--max-message-bytes must be at least 1024"),
        (["--listen", "stdio://", "--listen", "stdio://"], "only once"),
        (["--no-such-flag"], "no-such-flag"),
        (["unexpected-argument"], "Wrong number of arguments"),
    ],
)
def test_flags_are_validated_with_clear_messages(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # In-process: parsing fails before any reactor or service exists.
    with pytest.raises(SystemExit) as info:
        cli.main(args)
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert needle in err
    assert "Try `exec-server --help`" in err
    assert out == ""


def test_a_bad_flag_exits_non_zero_from_the_installed_script() -> None:
    result = exec_server("--max-processes", "-1")
    assert result.returncode == 2
    assert "exec-server: --max-processes must not be negative, got `-1`" in result.stderr
    assert result.stdout == ""


def test_version_flag() -> None:
    result = exec_server("--version")
    assert result.returncode == 0
    assert result.stdout.startswith("exec-server ")


def test_flags_take_effect() -> None:
    server = RawServer("--max-processes", "1", "--retained-output-bytes", "4096")
    try:
        server.handshake()
        params = {
            "processId": "big",
            "argv": [
                "sh",
                "-c",
                "for i in 1 2 3 4 5 6 7 8; do head -c 1000 /dev/zero; sleep 0.01; done; sleep 30",
            ],
            "cwd": str(REPO_ROOT),
            "env": child_env(),
            "tty": False,
            "arg0": None,
        }
        server.call("process/start", params)
        seen = 0
        while seen < 8000:
            message = server.read_message()
            if message.get("method") == "process/output":
                seen += len(unb64(message["params"]["chunk"]))
        read = server.call("process/read", {"processId": "big"})
        retained = sum(len(unb64(c["chunk"])) for c in read["chunks"])
        assert 0 < retained <= 4096
        assert read["chunks"][0]["seq"] > 1, "the oldest chunks were dropped"
        request_id = server.request("process/start", {**params, "processId": "second"})
        while True:
            message = server.read_message()
            if message.get("id") == request_id:
                break
        assert message["error"]["code"] == -32600
        assert "--max-processes" in message["error"]["message"]
    finally:
        assert server.stop() == 0
