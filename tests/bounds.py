"""TRANSITIONAL RE-EXPORT (issue 25, wave 3): moved to ``tests/support/bounds.py``.

Tests written in parallel with the move may still import ``tests.bounds``;
the integrator switches them to ``tests.support.bounds`` and deletes this
file. New code imports ``tests.support.bounds``.
"""

from tests.support.bounds import *  # noqa: F403
