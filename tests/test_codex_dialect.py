"""The reference's current dialect (what Codex 0.171 sends) next to the seeds', over stdio.

A client that sends ``resumeSessionId`` in ``initialize`` (Codex sends
``null``) or a ``file://`` path speaks the current dialect and gets its
fields and codes; a seed-era client sees the seed behaviour
(tests/test_reference_stdio.py). docs/protocol.md, "Dialects".
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from hypothesis import given
from hypothesis import strategies as st

from execserver import env_policy
from execserver import protocol as p
from execserver.errors import RpcError
from execserver.fs.paths import absolute_path, path_to_uri, uri_to_path
from tests.support.codex_session import CODEX_INIT, serving
from tests.support.harness import REPO_ROOT, b64, child_env
from tests.support.stdio_server import ServerProcess

# --- file:// URIs ---------------------------------------------------------------------------

_component = st.binary(min_size=1, max_size=12).filter(lambda b: b"/" not in b and b"\0" not in b)


@given(st.lists(_component, min_size=0, max_size=5))
def test_any_absolute_path_survives_uri_encoding(parts: list[bytes]) -> None:
    path = os.fsdecode(b"/" + b"/".join(parts))
    uri = path_to_uri(path)
    assert uri.startswith("file:///")
    assert "#" not in uri and "?" not in uri and " " not in uri
    assert uri_to_path(uri) == path


@pytest.mark.parametrize("name", ["a b", "100%", "x#y", "q?r", "caf\xe9", "\udcff raw"])
def test_special_names_round_trip(name: str) -> None:
    path = "/tmp/" + name
    assert uri_to_path(path_to_uri(path)) == path
    assert absolute_path(path_to_uri(path)) == path


def test_localhost_and_plain_paths() -> None:
    assert absolute_path("file://localhost/tmp/x") == "/tmp/x"
    assert absolute_path("file:///tmp/./x/") == "/tmp/x"
    assert absolute_path("/tmp/x") == "/tmp/x"


@pytest.mark.parametrize(
    "value",
    ["file://host/tmp/x", "file:relative", "file:/tmp/x", "http://h/x", "file:///a?q", "file://"],
)
def test_other_uris_are_the_relative_path_error(value: str) -> None:
    with pytest.raises(RpcError) as caught:
        absolute_path(value)
    assert caught.value.code == p.INVALID_PARAMS
    assert caught.value.message == "AbsolutePathBuf deserialized without a base path"
    assert caught.value.data["kind"] == "relativePath"


# --- envPolicy ------------------------------------------------------------------------------

BASE = {"PATH": "/bin", "HOME": "/h", "API_KEY": "k", "MY_TOKEN": "t", "OTHER": "o"}


def test_env_without_policy_is_the_whole_environment() -> None:
    assert env_policy.build_env(None, {"A": "1"}, BASE) == {"A": "1"}


def test_env_policy_like_codex() -> None:
    policy = p.EnvPolicy(inherit="all", ignore_default_excludes=True, exclude=["OTHER"])
    assert env_policy.build_env(policy, {"TERM": "dumb"}, BASE) == {
        "PATH": "/bin",
        "HOME": "/h",
        "API_KEY": "k",
        "MY_TOKEN": "t",
        "TERM": "dumb",
    }


def test_env_policy_default_excludes_core_set_include_only() -> None:
    assert env_policy.build_env(p.EnvPolicy(), {}, BASE) == {
        "PATH": "/bin",
        "HOME": "/h",
        "OTHER": "o",
    }
    core = p.EnvPolicy(inherit="core", set={"X": "1"})
    assert env_policy.build_env(core, {"X": "2"}, BASE) == {"PATH": "/bin", "HOME": "/h", "X": "2"}
    only = p.EnvPolicy(inherit="all", include_only=["p*"], set={"Y": "y"})
    assert env_policy.build_env(only, {"Z": "z"}, BASE) == {"PATH": "/bin", "Z": "z"}
    assert env_policy.build_env(p.EnvPolicy(inherit="none"), {"A": "a"}, BASE) == {"A": "a"}


# --- the server, both dialects --------------------------------------------------------------


def _start_params(process_id: str, cwd: str, **extra: Any) -> dict[str, Any]:
    params: dict[str, Any] = {
        "processId": process_id,
        "argv": ["/bin/sh", "-c", "pwd; echo $CODEX_T; echo ${HOME:+home}"],
        "cwd": cwd,
        "env": {"CODEX_T": "set"},
        "tty": False,
        "arg0": None,
    }
    params.update(extra)
    return params


@pytest_twisted.ensureDeferred
async def test_codex_initialize_start_exit_write(tmp_path: Path) -> None:
    work = tmp_path / "a b#c"
    work.mkdir()
    async with serving(CODEX_INIT) as server:
        info = server.last_init["environmentInfo"]  # type: ignore[attr-defined]
        assert info["capabilities"] == {
            "fsWatchMissing": True,
            "capabilityDiscoveryV2": True,
            "capabilityDiscoverySandbox": True,
            "environmentConfigRead": True,
            "httpHeaderEnvVars": True,
            "sandboxedFileStreaming": True,
            "fileWriteStreaming": True,
        }
        assert info["tempDir"].startswith("file:///")
        assert info["platformOs"] == "linux"
        assert info["shell"]["path"].startswith("/")
        assert await server.call("environment/info", None) == info
        policy = {
            "inherit": "all",
            "ignoreDefaultExcludes": True,
            "exclude": [],
            "set": {},
            "includeOnly": [],
        }
        params = _start_params("p1", path_to_uri(str(work)), envPolicy=policy)
        assert await server.call("process/start", params) == {
            "processId": "p1",
            "sandboxType": "none",
        }
        exited = await server.wait_notification("process/exited", "p1")
        closed = await server.wait_notification("process/closed", "p1")
        # One counter: the output chunks, the exit and (last) the close.
        seqs = [
            m["params"]["seq"] for m in server.notifications if m.get("method") == "process/output"
        ]
        seqs += [exited["seq"], closed["seq"]]
        assert sorted(seqs) == list(range(1, len(seqs) + 1))
        assert closed == {"processId": "p1", "seq": len(seqs)}
        assert exited == {
            "processId": "p1",
            "exitCode": 0,
            "seq": exited["seq"],
            "sandboxDenied": False,
        }
        assert server.output_of("p1") == f"{work}\nset\nhome\n".encode()
        read = await server.call("process/read", {"processId": "p1", "afterSeq": 0})
        assert read["closed"] is True and read["exitCode"] == 0
        assert read["failure"] is None and read["sandboxDenied"] is False
        write = {"processId": "p1", "chunk": b64(b"x"), "writeId": "1"}
        assert await server.call("process/write", write) == {
            "accepted": False,
            "status": "stdinClosed",
        }
        write["processId"] = "nope"
        assert await server.call("process/write", write) == {
            "accepted": False,
            "status": "unknownProcess",
        }
        missing = path_to_uri(str(tmp_path / "missing"))
        error = (await server.request("fs/getMetadata", {"path": missing, "sandbox": None}))[
            "error"
        ]
        assert error["code"] == -32004
        assert error["message"] == "No such file or directory (os error 2)"
        unknown = (await server.request("no/suchMethod", {}))["error"]
        assert unknown == {
            "code": -32601,
            "message": "exec-server stub does not implement `no/suchMethod` yet",
        }


@pytest_twisted.ensureDeferred
async def test_seed_client_sees_seed_shapes(tmp_path: Path) -> None:
    async with serving({"clientName": "seed"}) as server:
        assert "environmentInfo" not in server.last_init  # type: ignore[attr-defined]
        assert "sessionTtlMs" not in server.last_init  # type: ignore[attr-defined]
        params = _start_params("p1", str(tmp_path), env=child_env())
        assert await server.call("process/start", params) == {"processId": "p1"}
        exited = await server.wait_notification("process/exited", "p1")
        assert "sandboxDenied" not in exited
        error = (await server.request("fs/getMetadata", {"path": str(tmp_path / "missing")}))[
            "error"
        ]
        assert error["code"] == p.INTERNAL_ERROR
        unknown = (await server.request("environment/inf", None))["error"]
        assert unknown["code"] == p.INVALID_REQUEST


@pytest_twisted.ensureDeferred
async def test_a_file_uri_makes_a_client_current(tmp_path: Path) -> None:
    async with serving({"clientName": "seed"}) as server:
        missing = str(tmp_path / "missing")
        error = (await server.request("fs/readFile", {"path": missing}))["error"]
        assert error["code"] == p.INTERNAL_ERROR
        error = (await server.request("fs/readFile", {"path": path_to_uri(missing)}))["error"]
        assert error["code"] == -32004
        start = _start_params("p1", path_to_uri(str(REPO_ROOT)), env=child_env())
        assert (await server.call("process/start", start))["sandboxType"] == "none"


# --- fs/watchMissing ------------------------------------------------------------------------


def _changed(server: ServerProcess, watch_id: object) -> Any:
    def match(m: dict[str, Any]) -> bool:
        return m.get("method") == "fs/missingChanged" and m["params"]["watchId"] == watch_id

    return server.wait_for(match, 10, f"fs/missingChanged {watch_id}")


@pytest_twisted.ensureDeferred
async def test_watch_missing_fires_when_a_deep_path_appears(tmp_path: Path) -> None:
    async with serving(CODEX_INIT) as server:
        capabilities = server.last_init["environmentInfo"]["capabilities"]  # type: ignore[attr-defined]
        assert capabilities["fsWatchMissing"] is True
        deep = tmp_path / "a" / "b" / "AGENTS.md"
        params = {"watchId": 1, "missing": [path_to_uri(str(deep))], "present": None}
        assert await server.call("fs/watchMissing", params) == {"watching": True}
        # Ancestors appearing re-arm the watch deeper; only the path itself fires it.
        (tmp_path / "a").mkdir()
        (tmp_path / "a" / "b").mkdir()
        probe = await server.call("fs/getMetadata", {"path": str(tmp_path / "a" / "b")})
        assert probe["isDirectory"]
        assert not [m for m in server.notifications if m.get("method") == "fs/missingChanged"]
        deep.write_text("rules\n")
        note = await _changed(server, 1)
        assert note["params"] == {"watchId": 1}
        # One-shot: the id is free again; as the reference, a watch on paths
        # that all exist already is no watch: {"watching": false}, no notification.
        assert await server.call("fs/watchMissing", params) == {"watching": False}
        assert await server.call("fs/watchMissing", dict(params, watchId=2)) == {"watching": False}


@pytest_twisted.ensureDeferred
async def test_watch_missing_present_path_removed_and_errors(tmp_path: Path) -> None:
    present = tmp_path / "here"
    present.write_text("x")
    async with serving(CODEX_INIT) as server:
        params = {
            "watchId": "w",
            "missing": [str(tmp_path / "absent")],
            "present": [path_to_uri(str(present))],
        }
        assert await server.call("fs/watchMissing", params) == {"watching": True}
        # A watchId still watching: the reference answers {"watching": false}.
        assert await server.call("fs/watchMissing", params) == {"watching": False}
        relative = await server.request("fs/watchMissing", dict(params, watchId=2, missing=["x"]))
        assert relative["error"]["code"] == p.INVALID_PARAMS
        present.unlink()
        await _changed(server, "w")
