"""TRANSITIONAL RE-EXPORT (issue 25, wave 3): moved to ``tests/support/server_checks.py``.

Tests written in parallel with the move may still import ``tests.server_checks``;
the integrator switches them to ``tests.support.server_checks`` and deletes this
file. New code imports ``tests.support.server_checks``.
"""

from tests.support.server_checks import *  # noqa: F403
