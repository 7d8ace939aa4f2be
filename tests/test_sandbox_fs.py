"""fs/* under a sandbox, through the real installed server (stdio and WebSocket).

The issue's escape matrix for the fs methods: with Codex's workspace-write
profile (and our additive ``workspaceWrite`` mode), writes inside the
workspace work; writes outside it, through a symlink or a hard link that
leaves it, through ``..``, into ``.git``, and reads of a hidden path are
refused with the reference's codes and texts. The same cases run against
the reference server (``codex exec-server``) and their errors are compared.
A thread flipping a symlink between inside and outside races confined
writes through the server: not one byte may land outside.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import pytest_twisted
from twisted.internet.defer import Deferred
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

from execserver.fs.paths import path_to_uri
from tests.codex.fetch_codex import fetch
from tests.support.harness import RpcFailure, b64, reactor, unb64, with_timeout
from tests.support.races import symlink_race
from tests.support.stdio_server import ServerProcess
from tests.support.ws_harness import WsServerProcess, connect

CODEX_INIT = {"clientName": "codex-environment", "resumeSessionId": None}
#: Codex's workspace-write profile makes /tmp (and $TMPDIR) writable: the
#: layouts live elsewhere, so "outside" is outside every writable root.
SCRATCH_PARENT = "/var/tmp"
EROFS = (-32603, "Read-only file system (os error 30)")
EACCES = (-32600, "Permission denied (os error 13)")


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A scratch directory outside /tmp (shadows pytest's, which lives in /tmp)."""
    path = Path(tempfile.mkdtemp(prefix="exec-server-sandbox-", dir=SCRATCH_PARENT))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# --- servers ---------------------------------------------------------------------------


class _Reference(ProcessProtocol):
    """``codex exec-server --listen ws://127.0.0.1:0``: its first stdout line is its URL."""

    def __init__(self) -> None:
        self.out = b""
        self.listening: Deferred[str] = Deferred()
        self.ended: Deferred[None] = Deferred()

    def outReceived(self, data: bytes) -> None:
        self.out += data
        if b"\n" in self.out and not self.listening.called:
            self.listening.callback(self.out.split(b"\n", 1)[0].decode().strip())

    def processEnded(self, reason: Failure) -> None:
        if not self.listening.called:
            self.listening.errback(RuntimeError(f"reference exited: {self.out!r}"))
        self.ended.callback(None)


@asynccontextmanager
async def serving(kind: str, home: Path) -> AsyncIterator[Any]:
    """A client past the handshake with the current dialect, of ``kind``'s server."""
    if kind == "stdio":
        server = ServerProcess.start()
        try:
            await server.call("initialize", CODEX_INIT)
            server.notify("initialized", {})
            yield server
        finally:
            await server.stop()
        return
    if kind == "reference":
        codex_home = home / "codex-home"
        codex_home.mkdir(parents=True, exist_ok=True)
        binary = str(fetch())
        proto = _Reference()
        env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(codex_home)}
        transport = reactor.spawnProcess(
            proto, binary, [binary, "exec-server", "--listen", "ws://127.0.0.1:0"], env=env
        )
        try:
            url = await with_timeout(proto.listening, 30, "the reference's URL")
            client = await connect(url)
            await client.call("initialize", CODEX_INIT)
            client.notify("initialized", {})
            yield client
            await client.close()
        finally:
            with contextlib.suppress(Exception):
                transport.signalProcess("KILL")
            await with_timeout(proto.ended, 30, "the reference's exit")
        return
    mechanism = {"EXECSERVER_FS_SANDBOX_MECHANISM": "landlock"} if kind == "landlock" else None
    ws_server = await WsServerProcess.start(env=mechanism)
    try:
        client = await connect(ws_server.url)
        await client.call("initialize", CODEX_INIT)
        client.notify("initialized", {})
        yield client
        await client.close()
    finally:
        await ws_server.stop()


# --- the layout and the profiles ------------------------------------------------------


@attrs.frozen
class Layout:
    base: Path

    @property
    def work(self) -> Path:
        return self.base / "work"

    @property
    def outside(self) -> Path:
        return self.base / "outside"

    def build(self) -> None:
        (self.work / ".git").mkdir(parents=True)
        (self.work / "secret").mkdir()
        (self.work / "secret" / "key").write_text("s3cret")
        (self.work / "a.txt").write_text("inside")
        (self.work / "sub").mkdir()
        (self.work / "sub" / "inner").mkdir()
        (self.work / "sub" / "inner" / "key").write_text("s3cret")
        (self.work / "tree").mkdir()
        (self.work / "tree" / "t.txt").write_text("t")
        self.outside.mkdir()
        (self.outside / "target").write_text("original")
        os.symlink(self.outside, self.work / "link")
        os.symlink(self.work / "secret", self.work / "alias")
        os.link(self.outside / "target", self.work / "hard")


def _special(kind: str, access: str, **extra: Any) -> dict[str, Any]:
    return {"path": {"type": "special", "value": {"kind": kind, **extra}}, "access": access}


def codex_workspace_write(work: Path, *hidden: Path) -> dict[str, Any]:
    """What Codex 0.171.0 sends in workspace-write (issue 21), plus hidden paths."""
    skip = {"missing_path_behavior": "skip"}
    entries = [
        _special("root", "read"),
        _special("project_roots", "write"),
        _special("slash_tmp", "write"),
        _special("tmpdir", "write"),
        {**_special("project_roots", "read", subpath=".git"), **skip},
        {**_special("project_roots", "read", subpath=".agents"), **skip},
        {**_special("project_roots", "read", subpath=".codex"), **skip},
    ]
    for path in hidden:
        entries.append({"path": {"type": "path", "path": path_to_uri(str(path))}, "access": "none"})
    return {
        "permissions": {
            "type": "managed",
            "file_system": {"type": "restricted", "entries": entries},
            "network": "restricted",
        },
        "cwd": path_to_uri(str(work)),
        "workspaceRoots": [path_to_uri(str(work))],
        "windowsSandboxLevel": "disabled",
        "windowsSandboxProxySettingsMode": "reconcile",
        "useLegacyLandlock": False,
    }


@attrs.frozen
class Case:
    name: str
    method: str
    params: Callable[[Layout], dict[str, Any]]
    #: None: success.
    error: tuple[int, str] | None
    check: Callable[[Layout], bool] = lambda _: True
    #: Compared with the reference's answer (False: a documented difference).
    differential: bool = True


def _u(path: Path) -> str:
    return path_to_uri(str(path))


def _write(
    path: Callable[[Layout], Path], data: bytes = b"hi"
) -> Callable[[Layout], dict[str, Any]]:
    return lambda lay: {"path": _u(path(lay)), "dataBase64": b64(data)}


CASES = [
    Case(
        "write inside",
        "fs/writeFile",
        _write(lambda lay: lay.work / "new.txt"),
        None,
        lambda lay: (lay.work / "new.txt").read_bytes() == b"hi",
    ),
    Case(
        "write outside",
        "fs/writeFile",
        _write(lambda lay: lay.outside / "x"),
        EROFS,
        lambda lay: not (lay.outside / "x").exists(),
    ),
    Case(
        "write through a symlink out",
        "fs/writeFile",
        _write(lambda lay: lay.work / "link" / "x"),
        EROFS,
        lambda lay: not (lay.outside / "x").exists(),
    ),
    Case(
        "overwrite through a symlink out",
        "fs/writeFile",
        _write(lambda lay: lay.work / "link" / "target"),
        EROFS,
        lambda lay: (lay.outside / "target").read_text() == "original",
    ),
    Case(
        "write through ..",
        "fs/writeFile",
        lambda lay: {"path": _u(lay.work) + "/../outside/x", "dataBase64": b64(b"hi")},
        EROFS,
        lambda lay: not (lay.outside / "x").exists(),
    ),
    Case(
        "write into .git",
        "fs/writeFile",
        _write(lambda lay: lay.work / ".git" / "config"),
        EROFS,
        lambda lay: not (lay.work / ".git" / "config").exists(),
    ),
    # The reference writes through a hard link to a file outside (it changes
    # the outside file); we refuse: docs/filesystem.md.
    Case(
        "write through a hard link out",
        "fs/writeFile",
        _write(lambda lay: lay.work / "hard"),
        EROFS,
        lambda lay: (lay.outside / "target").read_text() == "original",
        differential=False,
    ),
    Case(
        "mkdir inside",
        "fs/createDirectory",
        lambda lay: {"path": _u(lay.work / "d" / "e"), "recursive": True},
        None,
        lambda lay: (lay.work / "d" / "e").is_dir(),
    ),
    Case(
        "mkdir outside",
        "fs/createDirectory",
        lambda lay: {"path": _u(lay.outside / "d")},
        EROFS,
        lambda lay: not (lay.outside / "d").exists(),
    ),
    Case(
        "mkdir through a symlink out",
        "fs/createDirectory",
        lambda lay: {"path": _u(lay.work / "link" / "d")},
        EROFS,
        lambda lay: not (lay.outside / "d").exists(),
    ),
    Case(
        "mkdir in .git",
        "fs/createDirectory",
        lambda lay: {"path": _u(lay.work / ".git" / "d")},
        EROFS,
        lambda lay: not (lay.work / ".git" / "d").exists(),
    ),
    Case(
        "copy inside",
        "fs/copy",
        lambda lay: {
            "sourcePath": _u(lay.work / "a.txt"),
            "destinationPath": _u(lay.work / "b.txt"),
            "recursive": False,
        },
        None,
        lambda lay: (lay.work / "b.txt").read_text() == "inside",
    ),
    Case(
        "copy from outside in",
        "fs/copy",
        lambda lay: {
            "sourcePath": _u(lay.outside / "target"),
            "destinationPath": _u(lay.work / "c.txt"),
            "recursive": False,
        },
        None,
        lambda lay: (lay.work / "c.txt").read_text() == "original",
    ),
    Case(
        "copy out",
        "fs/copy",
        lambda lay: {
            "sourcePath": _u(lay.work / "a.txt"),
            "destinationPath": _u(lay.outside / "c"),
            "recursive": False,
        },
        EROFS,
        lambda lay: not (lay.outside / "c").exists(),
    ),
    Case(
        "copy into .git",
        "fs/copy",
        lambda lay: {
            "sourcePath": _u(lay.work / "a.txt"),
            "destinationPath": _u(lay.work / ".git" / "c"),
            "recursive": False,
        },
        EROFS,
        lambda lay: not (lay.work / ".git" / "c").exists(),
    ),
    Case(
        "copy a tree out through a symlink",
        "fs/copy",
        lambda lay: {
            "sourcePath": _u(lay.work / "tree"),
            "destinationPath": _u(lay.work / "link" / "tree"),
            "recursive": True,
        },
        EROFS,
        lambda lay: not (lay.outside / "sub").exists(),
    ),
    Case(
        "remove outside",
        "fs/remove",
        lambda lay: {"path": _u(lay.outside / "target")},
        EROFS,
        lambda lay: (lay.outside / "target").exists(),
    ),
    Case(
        "remove through a symlink out",
        "fs/remove",
        lambda lay: {"path": _u(lay.work / "link" / "target")},
        EROFS,
        lambda lay: (lay.outside / "target").exists(),
    ),
    Case(
        "remove the symlink itself",
        "fs/remove",
        lambda lay: {"path": _u(lay.work / "link")},
        None,
        lambda lay: not os.path.lexists(lay.work / "link") and (lay.outside / "target").exists(),
    ),
    # The reference answers EBUSY (its .git is a mount point); we EROFS.
    Case(
        "remove .git",
        "fs/remove",
        lambda lay: {"path": _u(lay.work / ".git")},
        EROFS,
        lambda lay: (lay.work / ".git").is_dir(),
        differential=False,
    ),
    Case(
        "remove inside",
        "fs/remove",
        lambda lay: {"path": _u(lay.work / "a.txt")},
        None,
        lambda lay: not (lay.work / "a.txt").exists(),
    ),
    # A tree that holds a protected path is refused whole: nothing is removed
    # or copied (the reference refuses both too).
    Case(
        "remove the workspace's tree with .git and a hidden path in it",
        "fs/remove",
        lambda lay: {"path": _u(lay.work), "recursive": True},
        EACCES,
        lambda lay: (lay.work / ".git").is_dir() and (lay.work / "a.txt").exists(),
    ),
    Case(
        "copy a tree holding a hidden path",
        "fs/copy",
        lambda lay: {
            "sourcePath": _u(lay.work / "sub"),
            "destinationPath": _u(lay.work / "copy"),
            "recursive": True,
        },
        EACCES,
        lambda lay: not (lay.work / "copy").exists(),
    ),
    Case(
        "read outside (the root is readable)",
        "fs/readFile",
        lambda lay: {"path": _u(lay.outside / "target")},
        None,
    ),
    Case(
        "read hidden", "fs/readFile", lambda lay: {"path": _u(lay.work / "secret" / "key")}, EACCES
    ),
    Case(
        "read hidden through a symlink",
        "fs/readFile",
        lambda lay: {"path": _u(lay.work / "alias" / "key")},
        EACCES,
    ),
    Case(
        "read hidden through ..",
        "fs/readFile",
        lambda lay: {"path": _u(lay.work / "sub") + "/../secret/key"},
        EACCES,
    ),
    Case(
        "metadata hidden",
        "fs/getMetadata",
        lambda lay: {"path": _u(lay.work / "secret" / "key")},
        EACCES,
    ),
    Case("list hidden", "fs/readDirectory", lambda lay: {"path": _u(lay.work / "secret")}, EACCES),
    Case(
        "write hidden",
        "fs/writeFile",
        _write(lambda lay: lay.work / "secret" / "key"),
        EACCES,
        lambda lay: (lay.work / "secret" / "key").read_text() == "s3cret",
    ),
    Case(
        "copy from hidden",
        "fs/copy",
        lambda lay: {
            "sourcePath": _u(lay.work / "secret" / "key"),
            "destinationPath": _u(lay.work / "k"),
            "recursive": False,
        },
        EACCES,
        lambda lay: not (lay.work / "k").exists(),
    ),
]


async def _answer(client: Any, case: Case, lay: Layout) -> tuple[int, str] | None:
    sandbox = codex_workspace_write(lay.work, lay.work / "secret", lay.work / "sub" / "inner")
    params = {**case.params(lay), "sandbox": sandbox}
    response = await client.request(case.method, params)
    if "error" in response:
        return (response["error"]["code"], response["error"]["message"])
    return None


async def _run_matrix(kind: str, tmp_path: Path) -> dict[str, tuple[int, str] | None]:
    answers: dict[str, tuple[int, str] | None] = {}
    async with serving(kind, tmp_path / "home") as client:
        for i, case in enumerate(CASES):
            lay = Layout(tmp_path / f"case{i}")
            lay.build()
            answers[case.name] = await _answer(client, case, lay)
            if kind != "reference":
                assert answers[case.name] == case.error, case.name
                assert case.check(lay), case.name
    return answers


@pytest.mark.parametrize("kind", ["stdio", "ws", "landlock"])
@pytest_twisted.ensureDeferred
async def test_the_fs_escape_matrix(kind: str, tmp_path: Path) -> None:
    await _run_matrix(kind, tmp_path)


@pytest_twisted.ensureDeferred
async def test_the_matrix_answers_as_the_reference_does(tmp_path: Path) -> None:
    ours = await _run_matrix("stdio", tmp_path / "ours")
    theirs = await _run_matrix("reference", tmp_path / "theirs")
    for case in CASES:
        if case.differential:
            assert ours[case.name] == theirs[case.name], case.name
        else:
            assert ours[case.name] != theirs[case.name], f"{case.name}: no longer a difference"


@pytest_twisted.ensureDeferred
async def test_an_error_carries_kind_and_errno(tmp_path: Path) -> None:
    lay = Layout(tmp_path)
    lay.build()
    async with serving("stdio", tmp_path / "home") as server:
        with pytest.raises(RpcFailure) as info:
            await server.call(
                "fs/writeFile",
                {
                    "path": _u(lay.outside / "x"),
                    "dataBase64": "",
                    "sandbox": codex_workspace_write(lay.work),
                },
            )
        assert info.value.data == {"kind": "readOnlyFilesystem", "errno": 30, "sandbox": "sandbox"}
        with pytest.raises(RpcFailure) as info:
            await server.call(
                "fs/writeFile",
                {
                    "path": _u(lay.work / "hard"),
                    "dataBase64": "",
                    "sandbox": codex_workspace_write(lay.work),
                },
            )
        assert info.value.data["sandbox"] == "multiplyLinked"


@pytest_twisted.ensureDeferred
async def test_without_sandbox_nothing_changes(tmp_path: Path) -> None:
    lay = Layout(tmp_path)
    lay.build()
    async with serving("ws", tmp_path / "home") as client:
        for sandbox in (None, {"mode": "none"}, {"permissions": {"type": "disabled"}}):
            params: dict[str, Any] = {"path": _u(lay.outside / "free"), "dataBase64": b64(b"ok")}
            if sandbox is not None:
                params["sandbox"] = sandbox
            assert await client.call("fs/writeFile", params) == {}
            assert (lay.outside / "free").read_bytes() == b"ok"
            (lay.outside / "free").unlink()


@pytest_twisted.ensureDeferred
async def test_our_mode_forms(tmp_path: Path) -> None:
    lay = Layout(tmp_path)
    lay.build()
    write_mode = {"mode": "workspaceWrite", "writableRoots": [str(lay.work)], "network": False}
    # A seed-era client (no resumeSessionId, plain paths) uses our mode forms.
    server = ServerProcess.start()
    try:
        await server.handshake()
        inside = {"path": str(lay.work / "m.txt"), "dataBase64": b64(b"m"), "sandbox": write_mode}
        assert await server.call("fs/writeFile", inside) == {}
        for path, sandbox in (
            (lay.outside / "m", write_mode),
            (lay.work / "link" / "m", write_mode),
            (lay.work / ".git" / "m", write_mode),
            (lay.work / "r", {"mode": "readOnly"}),
        ):
            with pytest.raises(RpcFailure) as info:
                await server.call(
                    "fs/writeFile", {"path": str(path), "dataBase64": b64(b"m"), "sandbox": sandbox}
                )
            assert (info.value.code, info.value.message) == EROFS
            assert not path.exists()
        read = await server.call(
            "fs/readFile", {"path": str(lay.outside / "target"), "sandbox": {"mode": "readOnly"}}
        )
        assert unb64(read["dataBase64"]) == b"original"
    finally:
        await server.stop()


@pytest_twisted.ensureDeferred
async def test_large_and_ranged_reads_under_a_sandbox(tmp_path: Path) -> None:
    lay = Layout(tmp_path)
    lay.build()
    big = os.urandom(3 * 1024 * 1024 + 5)
    (lay.work / "big.bin").write_bytes(big)
    # The hidden path makes reads confined too (the thread, both phases of a large read).
    sandbox = codex_workspace_write(lay.work, lay.work / "secret")
    async with serving("ws", tmp_path / "home") as client:
        whole = await client.call(
            "fs/readFile", {"path": _u(lay.work / "big.bin"), "sandbox": sandbox}
        )
        assert unb64(whole["dataBase64"]) == big
        part = await client.call(
            "fs/readFile",
            {"path": _u(lay.work / "big.bin"), "offset": 1000, "length": 70000, "sandbox": sandbox},
        )
        assert unb64(part["dataBase64"]) == big[1000:71000]
        response = await client.request(
            "fs/readFile",
            {"path": _u(lay.work / "secret" / "key"), "offset": 0, "sandbox": sandbox},
        )
        assert (response["error"]["code"], response["error"]["message"]) == EACCES


@pytest_twisted.ensureDeferred
async def test_a_renamed_directory_is_judged_where_it_is_now(tmp_path: Path) -> None:
    lay = Layout(tmp_path)
    lay.build()
    sandbox = codex_workspace_write(lay.work)
    async with serving("stdio", tmp_path / "home") as server:
        ok = {"path": _u(lay.work / "sub" / "f"), "dataBase64": b64(b"1"), "sandbox": sandbox}
        assert await server.call("fs/writeFile", ok) == {}
        os.rename(lay.work / "sub", lay.outside / "sub")
        moved = {"path": _u(lay.outside / "sub" / "g"), "dataBase64": b64(b"2"), "sandbox": sandbox}
        with pytest.raises(RpcFailure) as info:
            await server.call("fs/writeFile", moved)
        assert (info.value.code, info.value.message) == EROFS
        assert not (lay.outside / "sub" / "g").exists()
        assert (lay.outside / "sub" / "f").read_bytes() == b"1"
        os.rename(lay.outside / "sub", lay.work / "back")
        back = {"path": _u(lay.work / "back" / "g"), "dataBase64": b64(b"3"), "sandbox": sandbox}
        assert await server.call("fs/writeFile", back) == {}


@pytest.mark.parametrize("kind", ["ws", "landlock"])
@pytest_twisted.ensureDeferred
async def test_a_racing_symlink_swap_lets_no_byte_out_through_the_server(
    kind: str, tmp_path: Path
) -> None:
    outcomes = {"ok": 0, "refused": 0}
    with symlink_race(tmp_path) as race:
        sandbox = codex_workspace_write(race.work)
        async with serving(kind, tmp_path / "home") as client:
            race.start()
            for i in range(200):
                response = await client.request(
                    "fs/writeFile",
                    {
                        "path": _u(race.flip) + f"/f{i}",
                        "dataBase64": b64(b"x" * 64),
                        "sandbox": sandbox,
                    },
                )
                if "error" in response:
                    assert response["error"]["message"] in (EROFS[1], EACCES[1]), response
                    outcomes["refused"] += 1
                else:
                    outcomes["ok"] += 1
    assert os.listdir(race.outside) == []
    assert len(os.listdir(race.inside)) == outcomes["ok"]
    # Both ways happened: the race was real.
    assert outcomes["ok"] > 0 and outcomes["refused"] > 0, outcomes
