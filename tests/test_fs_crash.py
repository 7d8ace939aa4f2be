"""A server SIGKILLed in the middle of ``fs/writeFile`` loses no data, and leaves nothing behind.

Each test starts the real installed server (stdio, raw pipes), sends a
64 MiB write, watches the file system until the write is visibly under way
(its temporary file has grown, or its journal record exists), SIGKILLs the
server there, and checks what a user would see: the target holds exactly
its old or its new bytes once a server has started again on the same state
directory, and that server has removed the temporary file.
"""

from __future__ import annotations

import base64
import contextlib
import os
import select
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from tests.support.raw_server import RawServer

SIZE = 64 * 1024 * 1024
#: How long the write may take to become visible (two busy cores: generous).
VISIBLE_WITHIN = 60.0


def _payload(seed: int) -> bytes:
    block = bytes((seed + i) % 251 for i in range(4096))
    return block * (SIZE // len(block))


OLD = _payload(1)
NEW = _payload(2)
NEW_TEXT = base64.b64encode(NEW).decode()


def _temps(directory: Path) -> list[Path]:
    return sorted(directory.glob(".exec-server-*.tmp"))


def _unnamed_grown(server: RawServer, directory: Path) -> bool:
    """Whether the server holds an unnamed file in ``directory`` with bytes in it.

    A long write streamed as it arrives (docs/filesystem.md) goes to an
    ``O_TMPFILE`` file, named only once complete: the kernel shows it as
    ``<directory>/#<inode> (deleted)``.
    """
    fds = Path(f"/proc/{server.proc.pid}/fd")
    try:
        entries = list(fds.iterdir())
    except OSError:
        return False
    for entry in entries:
        try:
            link = os.readlink(entry)
            unnamed = link.startswith(f"{directory}/#") and link.endswith(" (deleted)")
            if unnamed and entry.stat().st_size > 0:
                return True
        except OSError:
            continue
    return False


#: Writes tried before giving up on seeing one under way (a busy machine may
#: let a whole write pass between two looks; then it is tried again).
ATTEMPTS = 5


def _kill_when(server: RawServer, request: int, condition: Callable[[], bool]) -> bool:
    """SIGKILL the server once ``condition`` holds (True); False if the write was answered first."""
    deadline = time.monotonic() + VISIBLE_WITHIN
    while time.monotonic() < deadline:
        if condition():
            _kill(server)
            return True
        if server.proc.poll() is not None:
            raise AssertionError("the server ended before the write was seen")
        if _answered(server, request):
            return False
    raise AssertionError(f"the write was neither seen nor answered within {VISIBLE_WITHIN} s")


def _send_quietly(server: RawServer, data: bytes) -> None:
    """Send ``data``; a server killed meanwhile just ends the sending."""
    with contextlib.suppress(OSError, ValueError):
        server.send_raw(data)


def _start(state: Path, monkeypatch: pytest.MonkeyPatch) -> RawServer:
    monkeypatch.setenv("EXECSERVER_STATE_DIR", str(state))
    server = RawServer()
    server.handshake()
    return server


def _kill(server: RawServer) -> None:
    server._signalled_by_test("KILL")
    server.proc.kill()
    server.proc.wait(10)
    server.stop()


def _restart_and_check(
    state: Path, monkeypatch: pytest.MonkeyPatch, directory: Path, target: Path
) -> bytes:
    """Start a server on ``state``: what the target holds once it serves; no temporary left."""
    server = _start(state, monkeypatch)
    try:
        assert _temps(directory) == []
        assert list((state / "writes").glob("*.copy")) == []
        data = target.read_bytes()
        # The restarted server writes the same file normally afterwards.
        server.call("fs/writeFile", {"path": str(target), "dataBase64": "b2s="})
        assert target.read_bytes() == b"ok"
    finally:
        assert server.stop() == 0
    return data


def test_sigkill_during_an_atomic_write_keeps_the_old_file_and_the_next_server_removes_the_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "d"
    directory.mkdir()
    target = directory / "big.bin"
    target.write_bytes(OLD)
    state = tmp_path / "state"

    streamed = False

    def grown() -> bool:
        nonlocal streamed
        if any(_size(t) > 0 for t in _temps(directory)):
            return True
        streamed = _unnamed_grown(server, directory)
        return streamed

    for attempt in range(ATTEMPTS):
        server = _start(state, monkeypatch)
        # Sent from a thread: a streamed write (docs/filesystem.md) is
        # decoded while its line arrives, so it is under way only while
        # the line is still being sent.
        request = 1000 + attempt
        line = msgspec.json.encode(
            {
                "id": request,
                "method": "fs/writeFile",
                "params": {"path": str(target), "dataBase64": NEW_TEXT},
            }
        )
        sender = threading.Thread(target=_send_quietly, args=(server, line + b"\n"))
        sender.start()
        try:
            killed = _kill_when(server, request, grown)
        finally:
            sender.join(VISIBLE_WITHIN)
        if killed:
            break
        assert server.stop() == 0
        target.write_bytes(OLD)
    else:
        raise AssertionError(f"never saw the temporary file grow in {ATTEMPTS} writes")
    assert target.read_bytes() == OLD  # untouched until the rename
    if not streamed:
        # What the killed server left (an unnamed file went with it).
        assert _temps(directory) != []
    assert _restart_and_check(state, monkeypatch, directory, target) == OLD


def _hard_linked(tmp_path: Path) -> tuple[Path, Path, Path]:
    directory = tmp_path / "d"
    directory.mkdir()
    target = directory / "big.bin"
    target.write_bytes(OLD)
    os.link(target, tmp_path / "other-name")
    return directory, target, tmp_path / "other-name"


def _kill_while_writing(
    state: Path,
    monkeypatch: pytest.MonkeyPatch,
    target: Path,
    condition: Callable[[], bool],
    what: str,
) -> None:
    """Write NEW_TEXT to ``target`` until a server is killed once ``condition`` holds
    (a write that finished first is undone and tried again, ATTEMPTS times)."""
    for _attempt in range(ATTEMPTS):
        server = _start(state, monkeypatch)
        request = server.request("fs/writeFile", {"path": str(target), "dataBase64": NEW_TEXT})
        if _kill_when(server, request, condition):
            return
        assert server.stop() == 0
        target.write_bytes(OLD)
    raise AssertionError(f"never saw {what} in {ATTEMPTS} writes")


def test_sigkill_while_a_hard_linked_file_is_written_leaves_the_old_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the copy-back starts, the target has its old bytes (it once became 0 bytes)."""
    directory, target, other = _hard_linked(tmp_path)
    state = tmp_path / "state"

    def under_way() -> bool:
        # The new bytes going into a temporary file, or the target itself changing.
        return any(_size(t) > 0 for t in _temps(directory)) or target.stat().st_size != SIZE

    _kill_while_writing(state, monkeypatch, target, under_way, "the write under way")
    data = _restart_and_check(state, monkeypatch, directory, target)
    assert data in (OLD, NEW), f"{len(data)} bytes, neither the old nor the new contents"
    assert os.path.samefile(target, other)


def test_sigkill_during_the_copy_back_of_a_hard_linked_file_is_completed_by_the_next_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed while the target's own inode is overwritten: the restarted server finishes it."""
    directory, target, other = _hard_linked(tmp_path)
    state = tmp_path / "state"
    records = state / "writes"

    # The record exists for the copy and its fsync.
    def copying() -> bool:
        return any(records.glob("*.copy"))

    _kill_while_writing(state, monkeypatch, target, copying, "the copy-back's journal record")
    data = _restart_and_check(state, monkeypatch, directory, target)
    assert data == NEW, f"{len(data)} bytes, not the new contents"
    assert os.path.samefile(target, other)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0  # renamed or removed since it was listed


def _answered(server: RawServer, request: int) -> bool:
    ready, _, _ = select.select([server.stdout_fd], [], [], 0)
    if not ready:
        return False
    message = server.read_message(timeout=10)
    assert message.get("id") == request, message
    assert message.get("result") == {}, message
    return True
