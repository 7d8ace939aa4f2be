"""A known pseudo-random output stream (the child script that writes it and the
bytes expected), the cut points chosen in it, and a reconnecting client for
resume tests.
"""

from __future__ import annotations

import random
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from execserver.client import (
    ConnectOptions,
)
from execserver.client.reconnect import ReconnectingClient
from tests.support.harness import (
    reactor,
)

CHUNK = 4096


CHUNKS = 96  # 384 KiB


SEED = 1107


EXIT_CODE = 3


#: A child writing CHUNKS pseudo-random chunks of CHUNK bytes, then exiting 3.
STREAM_SCRIPT = (
    "import random, sys\n"
    f"r = random.Random({SEED})\n"
    "out = sys.stdout.buffer\n"
    f"for _ in range({CHUNKS}):\n"
    f"    out.write(r.randbytes({CHUNK})); out.flush()\n"
    f"sys.exit({EXIT_CODE})\n"
)


def expected_stream() -> bytes:
    r = random.Random(SEED)
    return b"".join(r.randbytes(CHUNK) for _ in range(CHUNKS))


def reconnecting(url: str, **kwargs: Any) -> ReconnectingClient:
    return ReconnectingClient(
        reactor,
        url,
        ConnectOptions("resume-test", initialize_timeout=10.0),
        initial_delay=0.02,
        max_delay=0.2,
        factor=1.5,
        jitter=lambda: 0,
        call_timeout=20.0,
        **{"connect_timeout": 5.0, **kwargs},
    )


cut_points = st.lists(st.integers(min_value=1, max_value=300_000), min_size=1, max_size=3)


def chosen_cuts() -> list[list[int]]:
    """Cut points chosen by hypothesis (a few: each example runs a real server).

    The scenario runs on the reactor, where hypothesis cannot drive a test
    itself, so hypothesis draws the examples and the test runs each in turn
    (reporting the failing one).
    """
    picked: list[list[int]] = []

    @settings(
        max_examples=min(5, settings().max_examples),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(cuts=cut_points)
    def pick(cuts: list[int]) -> None:
        picked.append(cuts)

    pick()
    return picked
