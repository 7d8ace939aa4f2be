"""TRANSITIONAL RE-EXPORT (issue 25, wave 3): moved to ``tests/support/client_fakes.py``.

Tests written in parallel with the move may still import ``tests.test_client_support``;
the integrator switches them to ``tests.support.client_fakes`` and deletes this
file. New code imports ``tests.support.client_fakes``.
"""

from tests.support.client_fakes import *  # noqa: F403
