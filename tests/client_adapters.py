"""TRANSITIONAL RE-EXPORT (issue 25, wave 3): moved to ``tests/support/client_adapters.py``.

Tests written in parallel with the move may still import ``tests.client_adapters``;
the integrator switches them to ``tests.support.client_adapters`` and deletes this
file. New code imports ``tests.support.client_adapters``.
"""

from tests.support.client_adapters import *  # noqa: F403
