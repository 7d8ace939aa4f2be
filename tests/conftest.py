"""The suite's fixtures and hooks: hypothesis profiles, skips turned into failures
where ``EXECSERVER_FORBID_SKIPS=1`` (CI), and the teardown checks that fail a test
on a server's traceback or undeclared exit (``tests/support/server_checks.py``) or
on an error logged through Twisted's logger.
"""

from __future__ import annotations

import gc
import os
import re
from collections.abc import Iterator
from typing import Any, cast

import pytest
from hypothesis import HealthCheck, settings
from twisted.logger import ILogObserver, LogLevel, formatEvent, globalLogPublisher

from execserver.clientcore.framing import LOCAL_SERVER_LOG_DIR_ENV
from tests.support import server_checks

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
        "allow_logged_errors(*patterns): the test provokes errors logged through "
        "Twisted's logger on purpose; each must match one of the regular expressions "
        "(searched in the event's text and traceback), and each pattern must match one",
    )


# --- skips: a failure where the machine has what the test needs ---------------------------

#: Set (as .ci/run does) on machines with root, cgroup v2, user namespaces,
#: bwrap and the Codex binary: there a skipped test is a failure, whatever
#: its reason says (NO TEST MAY SKIP in CI).
FORBID_SKIPS_ENV = "EXECSERVER_FORBID_SKIPS"


def _forbid_skip(report: Any, nodeid: str) -> None:
    """Turn a skip into a failure naming its reason, where skips are forbidden."""
    if os.environ.get(FORBID_SKIPS_ENV) != "1" or not report.skipped:
        return
    if hasattr(report, "wasxfail"):
        return  # an expected failure is not a skip
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
    report.outcome = "failed"
    report.longrepr = (
        f"{nodeid} skipped ({reason}) but {FORBID_SKIPS_ENV}=1 says this machine "
        "has everything the suite needs: a skip here is lost coverage"
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    _forbid_skip(report, item.nodeid)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Any:
    # A module-level skip (``pytest.importorskip``, ``allow_module_level``).
    report = yield
    _forbid_skip(report, collector.nodeid)
    return report


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


@pytest.fixture(autouse=True)
def _check_servers_clients_launched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Servers the client libraries and the CLI launch themselves (``--stdio``,
    ``connect()`` without a URL, ``spawn_local``) write a copy of their stderr
    into ``EXEC_SERVER_LOCAL_LOG_DIR`` (inherited by the CLI through the
    environment): the same stderr checks as the harness's servers."""
    directory = tmp_path_factory.mktemp("local-server-logs")
    previous = os.environ.get(LOCAL_SERVER_LOG_DIR_ENV)
    os.environ[LOCAL_SERVER_LOG_DIR_ENV] = str(directory)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(LOCAL_SERVER_LOG_DIR_ENV, None)
        else:
            os.environ[LOCAL_SERVER_LOG_DIR_ENV] = previous
    _fail_on(server_checks.check_local_server_logs(str(directory)))


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
    Tests that log an error on purpose are marked ``allow_logged_errors``
    with a regular expression per error they expect: an error matching none
    fails the test, and so does a pattern that matched nothing (the error
    expected did not happen, or was logged differently).
    """
    marker = request.node.get_closest_marker("allow_logged_errors")
    allowed = [re.compile(pattern) for pattern in (marker.args if marker else ())]
    if marker is not None and not allowed:
        pytest.fail(
            "allow_logged_errors needs the pattern of each error the test expects", pytrace=False
        )
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
    texts = []
    for event in errors:
        text = formatEvent(event)
        failure = event.get("log_failure")
        if failure is not None:
            text += "\n" + failure.getTraceback()
        texts.append(text)
    unexpected = [t for t in texts if not any(p.search(t) for p in allowed)]
    if unexpected:
        pytest.fail(
            "errors were logged through twisted.logger (mark the test "
            "allow_logged_errors(PATTERN) if they are intended):\n" + "\n".join(unexpected),
            pytrace=False,
        )
    unmatched = [p.pattern for p in allowed if not any(p.search(t) for t in texts)]
    if unmatched:
        pytest.fail(
            f"allow_logged_errors expected errors matching {unmatched}, none was logged",
            pytrace=False,
        )
