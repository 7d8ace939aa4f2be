"""The streamed fs/writeFile decode through the real server, ended mid-line.

A long fs/writeFile line is decoded into an unnamed file as it arrives
(execserver/fs/stream.py). Whether the input ends or the server is
stopped while the line is still arriving, the server exits promptly, with
status 0, and leaves nothing in the target's directory.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest
import pytest_twisted

from tests.support.polling import until
from tests.support.stdio_server import ServerProcess

MiB = 1 << 20


def unnamed_files(pid: int, directory: Path) -> list[str]:
    """The server's open unnamed (``O_TMPFILE``) files in ``directory``."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith(f"{directory}/#") and target.endswith(" (deleted)"):
            found.append(target)
    return found


@pytest.mark.parametrize("end", ["stdin closed", "SIGTERM"])
@pytest_twisted.ensureDeferred
async def test_a_server_ended_mid_line_exits_and_leaves_nothing(end: str, tmp_path: Path) -> None:
    server = ServerProcess.start()
    assert server.pid is not None
    try:
        await server.handshake()
        text = base64.b64encode(os.urandom(4 * MiB))
        head = b'{"id":9,"method":"fs/writeFile","params":{"path":"%s/t","dataBase64":"' % (
            str(tmp_path).encode()
        )
        server.send_raw(head + text[: len(text) // 2])  # half the line: it streams
        await until(
            lambda: unnamed_files(server.pid, tmp_path), "the streamed write's file", timeout=30
        )
        if end == "SIGTERM":
            server.signal("TERM")
        else:
            server.transport.closeStdin()  # type: ignore[union-attr]
        assert await server.stop(timeout=30) == 0
    finally:
        await server.stop()
    assert list(tmp_path.iterdir()) == []
