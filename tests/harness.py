"""TRANSITIONAL RE-EXPORT (issue 25, wave 3): moved to ``tests/support/harness.py``.

Tests written in parallel with the move may still import ``tests.harness``;
the integrator switches them to ``tests.support.harness`` and deletes this
file. New code imports ``tests.support.harness``.
"""

from tests.support.harness import *  # noqa: F403
from tests.support.stdio_server import *  # noqa: F403
