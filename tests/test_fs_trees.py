"""Deep trees, sparse files and abandoned copies, through the real installed server.

- ``fs/remove`` and ``fs/copy`` (recursive) of a 5,000-level directory chain
  work (they once answered ``maximum recursion depth exceeded``, leaving a
  partial copy): the walks are iterative and use one descriptor per tree;
- ``fs/copy`` keeps a sparse file's holes (it once wrote them out in full);
- a recursive copy whose connection goes stops, and removes the partial
  tree it had made.
"""

from __future__ import annotations

import base64
import os
import threading
from pathlib import Path

import pytest_twisted

from execserver.errors import RpcError
from execserver.fs import ops, pool
from tests.support.polling import until
from tests.support.raw_server import RawServer, handshaken_raw_server
from tests.support.ws_harness import WsServerProcess, connect

__all__ = ["handshaken_raw_server"]  # the fixture ``server``, used by name

DEPTH = 5000


def _chain(top: Path, depth: int) -> None:
    """``top/d/d/.../d`` (``depth`` levels) with a file at the bottom, made with descriptors."""
    top.mkdir()
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        leaf = os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o640, dir_fd=fd)
        os.write(leaf, b"bottom")
        os.close(leaf)
    finally:
        os.close(fd)


def _chain_depth(top: Path) -> tuple[int, bytes]:
    """Levels below ``top`` and the bottom file's contents."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    depth = 0
    try:
        while "d" in os.listdir(fd):
            assert sorted(os.listdir(fd)) == ["d"]
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
            depth += 1
        leaf = os.open("leaf", os.O_RDONLY, dir_fd=fd)
        data = os.read(leaf, 100)
        os.close(leaf)
    finally:
        os.close(fd)
    return depth, data


def test_a_5000_level_tree_is_removed(server: RawServer, tmp_path: Path) -> None:
    top = tmp_path / "deep"
    _chain(top, DEPTH)
    assert server.call("fs/remove", {"path": str(top), "recursive": True}, timeout=120) == {}
    assert not top.exists()


def test_a_5000_level_tree_is_copied_whole(server: RawServer, tmp_path: Path) -> None:
    top = tmp_path / "deep"
    _chain(top, DEPTH)
    copy = tmp_path / "copy"
    params = {"sourcePath": str(top), "destinationPath": str(copy), "recursive": True}
    assert server.call("fs/copy", params, timeout=120) == {}
    assert _chain_depth(copy) == (DEPTH, b"bottom")
    assert server.call("fs/remove", {"path": str(copy)}, timeout=120) == {}
    assert server.call("fs/remove", {"path": str(top)}, timeout=120) == {}


SPARSE_SIZE = 256 * 1024 * 1024


def test_copy_keeps_the_holes_of_a_sparse_file(server: RawServer, tmp_path: Path) -> None:
    source = tmp_path / "sparse"
    # One fs/writeFile away: 4 bytes at the start and at 256 MiB.
    server.call("fs/writeFile", {"path": str(source), "dataBase64": "aGVhZA=="})
    tail = {"path": str(source), "dataBase64": base64.b64encode(b"tail").decode()}
    server.call("fs/writeFile", {**tail, "offset": SPARSE_SIZE})
    allocated = os.stat(source).st_blocks * 512
    assert allocated <= 64 * 1024
    copy = tmp_path / "copy"
    server.call("fs/copy", {"sourcePath": str(source), "destinationPath": str(copy)})
    st = os.stat(copy)
    assert st.st_size == SPARSE_SIZE + 4
    # The copy takes what the source takes (a file system may round up to a block or two).
    assert st.st_blocks * 512 <= max(allocated, 64 * 1024), st.st_blocks
    with open(copy, "rb") as f:
        assert f.read(4) == b"head"
        f.seek(SPARSE_SIZE)
        assert f.read() == b"tail"
        f.seek(SPARSE_SIZE // 2)
        assert f.read(4096) == bytes(4096)


FILES = 20_000


@pytest_twisted.ensureDeferred
async def test_a_copy_stops_and_removes_its_partial_tree_when_its_connection_goes(
    tmp_path: Path,
) -> None:
    source = tmp_path / "many"
    source.mkdir()
    for i in range(FILES):
        (source / f"f{i:05}").write_bytes(b"x")
    copy = tmp_path / "copy"
    server = await WsServerProcess.start(env={"EXECSERVER_STATE_DIR": str(tmp_path / "state")})
    try:
        client = await connect(server.url)
        await client.handshake()
        params = {"sourcePath": str(source), "destinationPath": str(copy), "recursive": True}
        client.send({"id": 99, "method": "fs/copy", "params": params})

        def started() -> bool:
            try:
                return len(os.listdir(copy)) > 0
            except FileNotFoundError:
                return False

        await until(started, "the copy to begin", timeout=60.0)
        client.abort()
        # The copy notices between two entries and removes what it made.
        await until(lambda: not copy.exists(), "the partial copy to be removed", timeout=60.0)
        other = await connect(server.url)
        await other.handshake()
        assert await other.call("fs/getMetadata", {"path": str(source)}) is not None
        await other.close()
    finally:
        await server.stop()


def test_a_file_copy_stops_between_two_steps_once_cancelled(tmp_path: Path) -> None:
    """The pool's cancellation flag stops a big file's copy (the unit under the test above)."""
    source = tmp_path / "big"
    with open(source, "wb") as f:
        f.write(b"y" * (ops.COPY_STEP_BYTES * 2))
    job = pool._Job(lambda: None, (), None, None)  # type: ignore[arg-type]
    job.cancelled = True
    outcome: list[BaseException] = []

    def run() -> None:
        pool._current.job = job
        try:
            ops.copy(str(source), str(tmp_path / "copy"), False)
        except BaseException as exc:
            outcome.append(exc)
        finally:
            pool._current.job = None

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], RpcError), outcome
    assert outcome[0].data == {"kind": "cancelled"}
    assert os.stat(tmp_path / "copy").st_size == 0  # nothing copied after the flag
