"""TRANSITIONAL RE-EXPORT (issue 25, wave 3): moved to ``tests/support/cutting_proxy.py``.

Tests written in parallel with the move may still import ``tests.cutting_proxy``;
the integrator switches them to ``tests.support.cutting_proxy`` and deletes this
file. New code imports ``tests.support.cutting_proxy``.
"""

from tests.support.cutting_proxy import *  # noqa: F403
