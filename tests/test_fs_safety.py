"""fs/remove never removes ``/``; ``..`` is resolved as the kernel resolves it.

Three layers, none of which can remove the host's root directory:

- the decision function (:func:`execserver.fs.removal_target`) is
  given every spelling of ``/`` directly: it decides, it removes nothing;
- through the real server (stdio), ``..`` after a symlink is followed the
  kernel's way by every fs method, shown on a temporary tree whose
  sentinel files must survive (the lexical rule of old removed them);
- through the real server started in a throwaway mount namespace whose
  root is a tmpfs (the host's directories bound read-only), ``fs/remove``
  of every spelling of ``/`` is refused and the sandbox's sentinel
  survives: were the refusal missing, only that tmpfs could be lost.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted

from execserver import fs
from execserver.errors import RpcError
from tests.support.harness import b64, server_env
from tests.support.raw_server import RawServer
from tests.support.stdio_server import ServerProcess

ROOT_ERROR = {
    "code": -32600,
    "message": "fs/remove refuses to remove the root directory `/`",
    "data": {"kind": "rootDirectory"},
}

#: Spellings of ``/`` that need no file system object of their own.
PLAIN_ROOT_SPELLINGS = [
    "/",
    "//",
    "///",
    "/.",
    "/./",
    "/..",
    "/../",
    "/./..//.",
    "/tmp/..",
    "/tmp/../",
    "/tmp/./..",
    "/tmp/../..",
    "/tmp/../tmp/..",
    "/usr/bin/../..",
    "/proc/self/root/..",
]


def decide(path: str) -> tuple[str, os.stat_result | None]:
    return fs.removal_target(fs.absolute_path(path))


# --- the decision, for every spelling of / (nothing is ever removed here) ---------


@pytest.mark.parametrize("spelling", PLAIN_ROOT_SPELLINGS)
def test_every_plain_spelling_of_root_is_refused(spelling: str) -> None:
    with pytest.raises(RpcError) as info:
        decide(spelling)
    assert info.value.data == {"kind": "rootDirectory"}
    assert info.value.code == -32600
    assert info.value.message == ROOT_ERROR["message"]


@pytest.fixture
def links(tmp_path: Path) -> Iterator[Path]:
    """Symlinks to / and symlinks whose ``..`` escapes to /."""
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "rootlink").symlink_to("/")
    depth = len(tmp_path.parts)  # enough ``..`` from tmp_path/a to reach /
    (tmp_path / "a" / "escape").symlink_to("/".join([".."] * (depth + 1)))
    (tmp_path / "a" / "b" / "up").symlink_to("../..")
    yield tmp_path


def test_symlinks_to_root_followed_by_dotdot_are_refused(links: Path) -> None:
    for spelling in (
        f"{links}/rootlink/..",
        f"{links}/rootlink/../..",
        f"{links}/rootlink/../tmp/..",
        f"{links}/a/escape/..",
        f"{links}/a/escape/../.",
        f"{links}/a/b/up/" + "/".join([".."] * len(links.parts)),
    ):
        with pytest.raises(RpcError) as info:
            decide(spelling)
        assert info.value.data == {"kind": "rootDirectory"}, spelling


def test_a_symlink_to_root_is_a_symlink_to_unlink(links: Path) -> None:
    # ``.`` and a trailing slash are dropped: these name the link itself,
    # which fs/remove unlinks and never follows.
    for spelling in (f"{links}/rootlink", f"{links}/rootlink/", f"{links}/rootlink/."):
        path, st = decide(spelling)
        assert path == f"{links}/rootlink"
        assert st is not None and os.path.islink(path)
    path, st = decide(f"{links}/a/escape")
    assert st is not None and os.path.islink(path)


def test_a_tree_is_removed_without_following_its_symlinks(links: Path) -> None:
    outside = links / "outside"
    outside.mkdir()
    (outside / "sentinel").write_text("keep")
    tree = links / "tree"
    (tree / "d" / "e").mkdir(parents=True)
    (tree / "d" / "e" / "f").write_text("x")
    (tree / "d" / "to-outside").symlink_to(outside)
    (tree / "dangling").symlink_to(links / "missing")
    fs.remove(str(tree), True, False)
    assert not tree.exists()
    assert (outside / "sentinel").read_text() == "keep"


def test_an_ordinary_directory_is_not_root(links: Path) -> None:
    path, st = decide(f"{links}/a/b")
    assert path == f"{links}/a/b" and st is not None
    assert decide(f"{links}/a/missing") == (f"{links}/a/missing", None)


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "true"], check=False, capture_output=True, timeout=30)
    return probe.returncode == 0


needs_mount_namespace = pytest.mark.skipif(
    not _can_unshare(), reason="needs root and unshare -m (a throwaway mount namespace)"
)

_BIND_PROBE = """
import json, sys
from execserver import fs
from execserver.errors import RpcError
try:
    fs.removal_target(fs.absolute_path(sys.argv[1]))
except RpcError as exc:
    print(json.dumps(exc.to_wire().data))
else:
    print("allowed")
"""


@needs_mount_namespace
def test_a_bind_mount_of_root_is_refused(tmp_path: Path) -> None:
    # The bind mount lives only in a throwaway mount namespace, and the
    # probe only decides: it never removes anything.
    target = tmp_path / "rootbind"
    target.mkdir()
    script = 'mount --bind / "$1" && exec "$2" -c "$3" "$1" && exit 1'
    result = subprocess.run(
        [
            *("unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh"),
            *(str(target), sys.executable, _BIND_PROBE),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=server_env(),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == '{"kind": "rootDirectory"}'


# --- .. resolved the kernel's way ------------------------------------------------------


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[Path]:
    """``c/link -> ../a/b``: the kernel reads ``c/link/..`` as ``a``, lexically it is ``c``."""
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "link").symlink_to("../a/b")
    for side in ("a", "c"):
        (tmp_path / side / "victim").mkdir()
        (tmp_path / side / "victim" / "f").write_text(f"in {side}")
        (tmp_path / side / "file").write_text(f"file in {side}")
    yield tmp_path


def test_resolve_path_follows_the_kernel(tree: Path) -> None:
    link = f"{tree}/c/link"
    assert fs.resolve_path(f"{link}/..") == f"{tree}/a"
    assert fs.resolve_path(f"{link}/../victim") == f"{tree}/a/victim"
    assert fs.resolve_path(f"{link}/../b/../file") == f"{tree}/a/file"
    # What follows the last .. is kept as given (a final symlink stays one).
    assert fs.resolve_path(f"{tree}/a/../c/link") == f"{tree}/c/link"
    # No .. at all: unchanged, not even looked at.
    assert fs.resolve_path(f"{tree}/nowhere/x") == f"{tree}/nowhere/x"
    for path in (f"{link}/..", f"{link}/../victim/f", f"{tree}/c/./link/../file"):
        assert os.path.samefile(fs.resolve_path(fs.absolute_path(path)), path)


def test_dotdot_after_something_that_is_not_a_directory_is_the_kernels_error(
    tree: Path,
) -> None:
    with pytest.raises(FileNotFoundError):
        fs.resolve_path(f"{tree}/missing/../a")
    with pytest.raises(NotADirectoryError):
        fs.resolve_path(f"{tree}/a/file/../b")


@pytest_twisted.ensureDeferred
async def test_every_fs_method_resolves_dotdot_after_a_symlink_like_the_kernel(
    tree: Path,
) -> None:
    server = ServerProcess.start()
    try:
        await server.call("initialize", {"clientName": "safety"})
        server.notify("initialized", {})
        via = f"{tree}/c/link/.."  # the kernel's a/, lexically c/
        data = await server.call("fs/readFile", {"path": f"{via}/file"})
        assert base64.b64decode(data["dataBase64"]) == b"file in a"
        meta = await server.call("fs/getMetadata", {"path": f"{via}/file"})
        assert meta["size"] == len(b"file in a")
        listing = await server.call("fs/readDirectory", {"path": via})
        assert {e["fileName"] for e in listing["entries"]} == {"b", "victim", "file"}
        await server.call("fs/writeFile", {"path": f"{via}/new", "dataBase64": b64(b"x")})
        assert (tree / "a" / "new").read_bytes() == b"x"
        await server.call("fs/createDirectory", {"path": f"{via}/made"})
        assert (tree / "a" / "made").is_dir()
        await server.call(
            "fs/copy", {"sourcePath": f"{via}/file", "destinationPath": f"{via}/copied"}
        )
        assert (tree / "a" / "copied").read_text() == "file in a"
        await server.call("fs/remove", {"path": f"{via}/victim"})
        assert not (tree / "a" / "victim").exists()
        assert not (tree / "c" / "new").exists() and not (tree / "c" / "made").exists()
        # The sentinel where the lexical rule would have pointed survives.
        assert (tree / "c" / "victim" / "f").read_text() == "in c"
        response = await server.request("fs/getMetadata", {"path": f"{tree}/nope/../a"})
        assert response["error"]["data"] == {"kind": "notFound", "errno": 2}
    finally:
        assert await server.stop() == 0


# --- the real server, in a throwaway mount namespace ------------------------------------

#: A tmpfs becomes the server's root; the host directories the server needs
#: are bound read-only, so not even a broken server could change them.
_SANDBOX = r"""
set -eu
root=$1; shift
mount -t tmpfs -o size=16m exec-server-sandbox "$root"
for dir in "$@"; do
    mkdir -p "$root$dir"
    mount --bind "$dir" "$root$dir"
    mount -o remount,bind,ro "$root$dir"
    # Never go on with a writable host directory in the sandbox.
    if [ -w "$root$dir" ]; then echo "sandbox: $dir is not read-only" >&2; exit 1; fi
done
for top in bin lib lib64 sbin; do
    if [ -L "/$top" ]; then ln -s "$(readlink "/$top")" "$root/$top"; fi
done
mkdir -p "$root/proc" "$root/dev" "$root/tmp/a/b" "$root/tmp/rootbind"
mount -t proc proc "$root/proc"
touch "$root/dev/null"
mount --bind /dev/null "$root/dev/null"
mount --bind "$root" "$root/tmp/rootbind"
echo keep > "$root/sentinel"
ln -s / "$root/tmp/rootlink"
ln -s ../.. "$root/tmp/a/escape"
ln -s ../../.. "$root/tmp/a/b/up"
mkdir "$root/tmp/dir"
ln -s / "$root/tmp/dir/rootlink"
mkdir -p "$root/tmp/tree/a" "$root/tmp/tree/m/rootbind"
echo x > "$root/tmp/tree/a/f"
ln -s / "$root/tmp/tree/link"
mount --bind "$root" "$root/tmp/tree/m/rootbind"
cd /
exec chroot "$root" "$EXEC_SERVER_PYTHON" -m execserver
"""


def _installed_package_root() -> str:
    """Where the server (run with the harness's environment) imports execserver from."""
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import execserver, os; print(os.path.realpath(execserver.__file__))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=server_env(),
        cwd="/",
        check=True,
    )
    return os.path.dirname(os.path.dirname(probe.stdout.strip()))


def _host_dirs() -> list[str]:
    needed = {"/usr", "/etc", sys.prefix, os.path.realpath(sys.base_prefix)}
    needed.add(_installed_package_root())
    needed |= {d for d in ("/lib", "/lib64", "/bin", "/sbin") if not os.path.islink(d)}
    # Bound in order, parents first; nested ones are skipped (bound with their parent).
    ordered: list[str] = []
    for path in sorted(p for p in needed if os.path.isdir(p)):
        if not any(path.startswith(parent + "/") for parent in ordered):
            ordered.append(path)
    return ordered


class SandboxServer(RawServer):
    def answer(self, method: str, params: Any) -> dict[str, Any]:
        request_id = self.request(method, params)
        while True:
            message = self.read_message(30.0)
            if message.get("id") == request_id:
                return message


@pytest.fixture
def sandbox(monkeypatch: pytest.MonkeyPatch) -> Iterator[SandboxServer]:
    root = tempfile.mkdtemp(prefix="exec-server-sandbox-")
    command = ["unshare", "-m", "--propagation", "private", "sh", "-c", _SANDBOX, "sh", root]
    monkeypatch.setenv("EXEC_SERVER_PYTHON", sys.executable)
    server = SandboxServer(command=command + _host_dirs())
    try:
        yield server
    finally:
        server.stop()
        # The tmpfs went with the namespace; the mount point is empty again.
        os.rmdir(root)


@needs_mount_namespace
def test_remove_refuses_every_spelling_of_root_through_the_real_server(
    sandbox: SandboxServer,
) -> None:
    sandbox.handshake()
    spellings = [
        *PLAIN_ROOT_SPELLINGS,
        "/tmp/rootlink/..",
        "/tmp/rootlink/../tmp/..",
        "/tmp/a/escape/..",
        "/tmp/a/escape/.././",
        "/tmp/a/b/up/..",
        "/tmp/dir/rootlink/..",
        "/tmp/rootbind",
        "/tmp/rootbind/",
        "/tmp/rootbind/tmp/..",
    ]
    for spelling in spellings:
        for flags in ({}, {"recursive": False, "force": False}, {"force": True}):
            reply = sandbox.answer("fs/remove", {"path": spelling, **flags})
            assert reply.get("error") == ROOT_ERROR, (spelling, flags, reply)
    # Nothing went: the sentinel, and the links, are all still there.
    data = sandbox.answer("fs/readFile", {"path": "/sentinel"})
    assert base64.b64decode(data["result"]["dataBase64"]) == b"keep\n"
    listing = sandbox.answer("fs/readDirectory", {"path": "/tmp"})["result"]["entries"]
    assert {e["fileName"] for e in listing} >= {"a", "rootlink", "rootbind", "dir"}
    # A symlink to / is removed as a symlink, never followed.
    assert sandbox.answer("fs/remove", {"path": "/tmp/dir/rootlink/"}) == {
        "id": sandbox._next_id - 1,
        "result": {},
    }
    after = sandbox.answer("fs/readDirectory", {"path": "/tmp/dir"})["result"]["entries"]
    assert after == []
    # A tree holding a bind mount of / is removed up to it, never into it.
    assert sandbox.answer("fs/remove", {"path": "/tmp/tree"}).get("error") == ROOT_ERROR
    meta = sandbox.answer("fs/getMetadata", {"path": "/tmp/tree/m/rootbind/sentinel"})
    assert meta["result"]["isFile"] is True
    data = sandbox.answer("fs/readFile", {"path": "/sentinel"})
    assert base64.b64decode(data["result"]["dataBase64"]) == b"keep\n"
