"""Filesystem reads that stall (a FIFO held open that nobody writes) and the
server's gauges read from ``/metrics``.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.polling import until_blocking
from tests.support.ws_harness import WsServerProcess, get_request, http_get

NOT_REGULAR_READ = {
    "code": -32600,
    "message": "fs/readFile only supports regular files",
    "data": {"kind": "notRegularFile"},
}


@pytest.fixture
def held_fifo(tmp_path: Path) -> Iterator[Path]:
    """A FIFO opened read-write by a process that never reads it."""
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    holder = subprocess.Popen(["sh", "-c", 'exec 3<>"$1"; exec sleep 1000000', "sh", str(fifo)])
    try:
        # Wait (bounded) until the holder has the FIFO open.

        def holding() -> bool:
            assert holder.poll() is None, "the holder ended"
            return _holds(holder.pid, fifo)

        until_blocking(holding, "the holder to open the FIFO", timeout=10, interval=0.01)
        yield fifo
    finally:
        holder.kill()
        holder.wait(10)
    assert not os.path.exists(f"/proc/{holder.pid}/status") or holder.returncode is not None


def _holds(pid: int, fifo: Path) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == str(fifo):
                return True
        except OSError:
            continue
    return False


async def gauges_of(server: WsServerProcess) -> dict[str, float]:
    host, port = server.host_port
    status, _, body = await http_get(host, port, get_request("/metrics"))
    assert status == 200
    values: dict[str, float] = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values
