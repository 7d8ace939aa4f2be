"""TRANSITIONAL RE-EXPORT (issue 25, wave 3): moved to ``tests/support/ws_harness.py``.

Tests written in parallel with the move may still import ``tests.ws_harness``;
the integrator switches them to ``tests.support.ws_harness`` and deletes this
file. New code imports ``tests.support.ws_harness``.
"""

from tests.support.harness import *  # noqa: F403  (observe, which lived here)
from tests.support.ws_harness import *  # noqa: F403
