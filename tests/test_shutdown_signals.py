"""A second SIGTERM/SIGINT during the shutdown (``execserver/shutdown_signals.py``), in memory.

The reactor's handlers call ``reactor.stop`` on every signal; a second one
during the grace raised ``ReactorNotRunning`` (logged at critical level).
The wrapper forwards the first and absorbs the rest. The handlers are a
dict here (no real handler is touched, no signal raised); the real server's
case is in ``tests/test_deploy.py``.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest

from execserver.shutdown_signals import SIGNALS, RepeatSignals


class HandlerTable:
    """The process's signal handlers as a dict (no real handler is touched)."""

    def __init__(self) -> None:
        self.handlers: dict[int, Any] = {}

    def repeat_signals(self, call_from_thread: Callable[..., object]) -> RepeatSignals:
        return RepeatSignals(
            call_from_thread,
            lambda n: self.handlers.get(n, signal.SIG_DFL),
            self.handlers.__setitem__,
        )

    def deliver(self, number: int) -> None:
        self.handlers[number](number, None)


@pytest.fixture
def table() -> HandlerTable:
    return HandlerTable()


@pytest.fixture
def reactor_handlers(table: HandlerTable) -> list[int]:
    """Callable SIGTERM/SIGINT handlers standing for the reactor's; each records its signal."""
    seen: list[int] = []

    def handler(number: int, frame: FrameType | None) -> None:
        seen.append(number)

    for number in SIGNALS:
        table.handlers[number] = handler
    return seen


def queued_calls() -> tuple[list[tuple[Callable[..., object], tuple[Any, ...]]], Any]:
    calls: list[tuple[Callable[..., object], tuple[Any, ...]]] = []
    return calls, lambda f, *args: calls.append((f, args))


def test_the_first_signal_stops_the_reactor_later_ones_are_logged(
    table: HandlerTable, reactor_handlers: list[int]
) -> None:
    calls, call_from_thread = queued_calls()
    signals = table.repeat_signals(call_from_thread)
    signals.install()
    table.deliver(signal.SIGTERM)
    assert reactor_handlers == [signal.SIGTERM] and signals.stopping
    table.deliver(signal.SIGTERM)
    table.deliver(signal.SIGINT)
    # Not forwarded: the reactor's stop is called once.
    assert reactor_handlers == [signal.SIGTERM]
    for f, args in calls:
        f(*args)
    assert signals.repeated == 2


def test_once_the_shutdown_began_every_signal_is_a_repeat(
    table: HandlerTable, reactor_handlers: list[int]
) -> None:
    # (The shutdown began without a signal, e.g. the reactor was stopped.)
    calls, call_from_thread = queued_calls()
    signals = table.repeat_signals(call_from_thread)
    signals.install()
    signals.shutting_down()
    table.deliver(signal.SIGINT)
    assert reactor_handlers == []
    assert len(calls) == 1


def test_no_handler_of_the_reactor_no_wrapping(table: HandlerTable) -> None:
    table.repeat_signals(lambda *a: None).install()
    assert table.handlers == {}
