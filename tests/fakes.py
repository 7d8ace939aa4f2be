"""TRANSITIONAL RE-EXPORT (issue 25, wave 3): moved to ``tests/support/fakes.py``.

Tests written in parallel with the move may still import ``tests.fakes``;
the integrator switches them to ``tests.support.fakes`` and deletes this
file. New code imports ``tests.support.fakes``.
"""

from tests.support.fakes import *  # noqa: F403
