"""A peer cannot make the real server flood its log (issue 22, item 10).

Above ``--max-connections`` every refused connection used to log a warning
line (~270 KiB/s from one unauthenticated peer); now one line per
``REPEAT_INTERVAL_SECONDS`` says how many were refused since the last.
"""

from __future__ import annotations

import time

import pytest_twisted

from execserver.logsink import REPEAT_INTERVAL_SECONDS
from tests.support.harness import DEFAULT_TIMEOUT
from tests.support.metrics_probe import metric_at_least, open_idle
from tests.support.polling import until
from tests.support.ws_harness import WsServerProcess, get_request, http_get

REFUSED = 60


@pytest_twisted.ensureDeferred
async def test_refused_connections_log_at_most_one_line_per_interval_with_a_count() -> None:
    server = await WsServerProcess.start(
        "--max-connections", "2", "--handshake-timeout-ms", "60000"
    )
    host, port = server.host_port
    try:
        idle = [await open_idle(host, port) for _ in range(2)]
        began = time.monotonic()
        for _ in range(REFUSED):
            status, _, _ = await http_get(host, port, get_request("/readyz"))
            assert status == 503
        elapsed = time.monotonic() - began
        for proto in idle:
            proto.transport.loseConnection()  # type: ignore[union-attr]
        await until(
            lambda: metric_at_least(
                host, port, 'exec_server_refused_total{limit="connections"}', REFUSED
            ),
            "every refusal counted",
            timeout=DEFAULT_TIMEOUT,
        )
    finally:
        assert await server.stop() == 0
    lines = [ln for ln in server.stderr.splitlines() if b"refusing a connection" in ln]
    # One line per interval begun during the flood (the figure operations.md gives).
    assert 1 <= len(lines) <= 1 + int(elapsed // REPEAT_INTERVAL_SECONDS)
    assert b"refused since the last such line" in lines[0]
