"""TRANSITIONAL RE-EXPORT (issue 25, wave 3): moved to ``tests/support/raw_server.py``.

Tests written in parallel with the move may still import ``tests.raw_server``;
the integrator switches them to ``tests.support.raw_server`` and deletes this
file. New code imports ``tests.support.raw_server``.
"""

from tests.support.raw_server import *  # noqa: F403
