"""PTYs are capped per session and server-wide (issue 22, item 8).

One session took 256 of the host's 4,096 PTYs, with no cap. Through the
real installed server: ``--max-ptys-per-session`` and ``--max-server-ptys``
refuse a ``tty`` start beyond them with ``-32600``; a closed PTY process
frees its slot; pipes are not counted. The server-wide default is a quarter
of the host's ``/proc/sys/kernel/pty/max``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import pytest_twisted

from execserver import ptys
from execserver.service import Options
from tests.support.harness import RpcFailure
from tests.support.stdio_server import ServerProcess


async def _start_tty(server: ServerProcess, process_id: str) -> None:
    await server.start_process(process_id, ["sleep", "60"], tty=True, cwd="/")


@pytest_twisted.ensureDeferred
async def test_a_session_beyond_its_pty_cap_is_refused_and_a_closed_pty_frees_a_slot() -> None:
    server = ServerProcess.start("--max-ptys-per-session", "2")
    try:
        await server.handshake()
        await _start_tty(server, "t1")
        await _start_tty(server, "t2")
        # A pipe process is not a PTY.
        await server.start_process("pipe", ["sleep", "60"])
        with pytest.raises(RpcFailure) as refused:
            await _start_tty(server, "t3")
        assert (refused.value.code, refused.value.message) == (
            -32600,
            "too many PTYs: this session already holds 2, the limit set by "
            "--max-ptys-per-session is 2; close some tty processes first",
        )
        await server.call("process/terminate", {"processId": "t1"})
        await server.wait_closed("t1")
        await _start_tty(server, "t3")
    finally:
        assert await server.stop() == 0


@pytest_twisted.ensureDeferred
async def test_the_server_wide_pty_cap_refuses_every_session() -> None:
    server = ServerProcess.start("--max-server-ptys", "1")
    try:
        await server.handshake()
        await _start_tty(server, "t1")
        with pytest.raises(RpcFailure) as refused:
            await _start_tty(server, "t2")
        assert refused.value.message == (
            "too many PTYs: the server already holds 1, the limit set by --max-server-ptys "
            "is 1; retry once other tty processes have closed"
        )
    finally:
        assert await server.stop() == 0


def test_the_server_default_is_a_quarter_of_the_hosts_ptys(tmp_path: Path) -> None:
    host = ptys.host_pty_max()
    assert host is not None  # Linux with /proc
    options = Options()
    options.parseOptions([])
    assert options.config().max_server_ptys == host // 4
    assert options.config().max_ptys_per_session == 64
    fake = tmp_path / "max"
    fake.write_text("4096\n")
    assert ptys.default_server_ptys(str(fake)) == 1024
    fake.write_text("junk\n")
    assert ptys.default_server_ptys(str(fake)) == ptys.FALLBACK_SERVER_PTYS
    assert ptys.default_server_ptys(str(tmp_path / "absent")) == ptys.FALLBACK_SERVER_PTYS
