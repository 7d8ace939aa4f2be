"""The client exits as if killed by the signal that stopped it (issue 22, frictions).

SIGHUP of ``exec-server-client run`` terminated the remote command and then
exited 143 (the remote's death by our SIGTERM); a local command killed by
SIGHUP exits 129. Through the real installed client and server.
"""

from __future__ import annotations

import signal

import pytest
import pytest_twisted

from tests.support.cli import Cli


@pytest.mark.parametrize("sig", ["HUP", "TERM"])
@pytest_twisted.ensureDeferred
async def test_a_signal_that_stops_the_client_gives_128_plus_its_number(sig: str) -> None:
    cli = Cli.start("run", "--stdio", "--", "sh", "-c", "echo started; exec sleep 30")
    await cli.output(rb"started\n", "the command to start")
    cli.signal(sig)
    assert await cli.finish() == 128 + int(getattr(signal, f"SIG{sig}"))
