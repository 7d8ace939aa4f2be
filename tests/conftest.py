from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from typing import Any, cast

import pytest
from hypothesis import HealthCheck, settings
from twisted.logger import ILogObserver, LogLevel, formatEvent, globalLogPublisher

from tests import server_checks

settings.register_profile(
    "ci",
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=100)
# HYPOTHESIS_PROFILE (set by .ci/run) wins; CI=1 alone also selects "ci".
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "allow_logged_errors: the test provokes an error logged through Twisted's "
        "logger on purpose; do not fail it for that",
    )


# --- servers: stderr and exit status checked at teardown ----------------------------------


def _fail_on(report: list[str]) -> None:
    if report:
        pytest.fail("server process check failed:\n" + "\n".join(report), pytrace=False)


@pytest.fixture(autouse=True)
def _check_servers_of_the_test() -> Iterator[None]:
    """Every server this test started: stopped, traceback-free, the exit status it expects."""
    first = server_checks.next_serial()
    yield
    _fail_on(server_checks.check([s for s in server_checks.STARTED if s.serial >= first]))


@pytest.fixture(autouse=True, scope="module")
def _check_servers_of_the_module() -> Iterator[None]:
    """Servers of module-scoped fixtures, checked once those fixtures are torn down."""
    yield
    _fail_on(server_checks.check(list(server_checks.STARTED)))


# --- errors logged through Twisted's logger fail the test --------------------------------


@pytest.fixture(autouse=True)
def _fail_on_logged_errors(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the test on any event logged with a failure or at level error or above.

    (trial does this; pytest-twisted does not.) ``gc.collect()`` at the end
    brings out "Unhandled error in Deferred" of Deferreds the test dropped.
    Tests that log an error on purpose are marked ``allow_logged_errors``.
    """
    errors: list[dict[str, Any]] = []

    def observe(event: dict[str, Any]) -> None:
        if "log_failure" in event or event.get("log_level") in (LogLevel.error, LogLevel.critical):
            errors.append(event)

    observer = cast(ILogObserver, observe)
    globalLogPublisher.addObserver(observer)
    try:
        yield
        gc.collect()
    finally:
        globalLogPublisher.removeObserver(observer)
    if errors and request.node.get_closest_marker("allow_logged_errors") is None:
        lines = []
        for event in errors:
            text = formatEvent(event)
            failure = event.get("log_failure")
            if failure is not None:
                text += "\n" + failure.getTraceback()
            lines.append(text)
        pytest.fail(
            "errors were logged through twisted.logger (mark the test "
            "allow_logged_errors if they are intended):\n" + "\n".join(lines),
            pytrace=False,
        )
