"""TRANSITIONAL RE-EXPORT (issue 25, wave 3): moved to ``tests/support/fuzz_target.py``.

Tests written in parallel with the move may still import ``tests.fuzz_target``;
the integrator switches them to ``tests.support.fuzz_target`` and deletes this
file. New code imports ``tests.support.fuzz_target``.
"""

from tests.support.fuzz_target import *  # noqa: F403
