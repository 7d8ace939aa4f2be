"""TRANSITIONAL RE-EXPORT (issue 25, wave 3): moved to ``tests/support/client_fakes.py``.

Tests written in parallel with the move may still import ``tests.test_client_support``;
the integrator switches them to ``tests.support.client_fakes`` and deletes this
file. New code imports ``tests.support.client_fakes``.
"""

from collections.abc import Callable

from tests.support.client_fakes import *  # noqa: F403
from tests.support.harness import *  # noqa: F403  (b64, which lived here)
from tests.support.polling import until


async def eventually(
    predicate: Callable[[], bool], what: str, timeout: float = 10.0, step: float = 0.02
) -> None:
    """TRANSITIONAL: the old poll of this module, now ``tests.support.polling.until``."""
    await until(predicate, what, timeout=timeout, interval=step)
