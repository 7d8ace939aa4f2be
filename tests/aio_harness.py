"""TRANSITIONAL RE-EXPORT (issue 25, wave 3): moved to ``tests/support/aio_harness.py``.

Tests written in parallel with the move may still import ``tests.aio_harness``;
the integrator switches them to ``tests.support.aio_harness`` and deletes this
file. New code imports ``tests.support.aio_harness``.
"""

from tests.support.aio_harness import *  # noqa: F403
