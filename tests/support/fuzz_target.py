"""The fuzz target: bytes in through the stdio codec and the dispatcher, responses out.

One input is a byte string fed to :class:`~execserver.codec.LineFramer` (the
NDJSON codec of ``stdio://``) in the pieces the input says, every line
handed to a dispatcher :class:`~execserver.dispatcher.Connection` on a fake
clock with a fake spawner (no real process is ever started). Afterwards the
connection is shut down and the clock run out. :func:`check` raises
``AssertionError`` when an invariant breaks:

- nothing was logged with a failure or at level error or above;
- every request carrying an id (a JSON object with a string ``method`` and an
  integer or string ``id``) got exactly one response with that id (at most
  one if the server closed the connection for a protocol violation);
- every process the input started was killed or ended (none left behind).

Run by ``tests/test_fuzz.py`` (hypothesis, a fixed budget, in ``.ci/run``)
and by ``tests/fuzz_atheris.py`` (coverage-guided, where atheris is
installed). Seeds and every input that once failed live in
``tests/fuzz_corpus/``.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, cast

from twisted.logger import ILogObserver, LogLevel, formatEvent, globalLogPublisher

from execserver.codec import OVERSIZED, LineFramer
from execserver.config import ServerConfig
from tests.support.fakes import Harness

CORPUS = Path(__file__).parent.parent / "fuzz_corpus"

#: Routes that change the real filesystem or hold resources across inputs:
#: answered as unknown methods here (the fs/* read side stays, on the real
#: filesystem, read-only).
UNSAFE_METHODS = frozenset(
    {
        "fs/writeFile",
        "fs/remove",
        "fs/copy",
        "fs/createDirectory",
        "fs/watchMissing",
        # fs/open "replace" truncates a file; handles outlive an input.
        "fs/open",
        "fs/writeBlock",
    }
)

#: Small limits, so that inputs reach them.
FUZZ_CONFIG = ServerConfig(
    max_message_bytes=4096,
    max_processes=4,
    max_server_processes=6,
    retained_output_bytes=1024,
    max_read_file_bytes=4096,
)

#: Separates the reads the input is delivered in (not part of the data).
CUT = b"\x00CUT\x00"


def _no_constants(name: str) -> Any:
    # NaN and Infinity are not JSON (RFC 8259); the server's codec rejects them.
    raise ValueError(name)


def _object(line: bytes) -> dict[str, Any] | None:
    try:
        message = json.loads(line, parse_constant=_no_constants)
    except (ValueError, RecursionError):
        return None
    return message if isinstance(message, dict) else None


def other_ids(line: bytes) -> list[Any]:
    """The ``id`` of a JSON object line that is not a request (its error may echo it)."""
    message = _object(line)
    if message is None or "id" not in message or request_ids(line):
        return []
    try:
        hash(message["id"])
    except TypeError:
        return []
    return [message["id"]]


def request_ids(line: bytes) -> list[Any]:
    """The id of ``line`` if it is a request carrying one (as the invariant counts them)."""
    message = _object(line)
    if message is None or not isinstance(message.get("method"), str):
        return []
    request_id = message.get("id")
    if isinstance(request_id, bool):
        return []
    if isinstance(request_id, int):
        return [request_id]
    if isinstance(request_id, str):
        return [request_id]
    return []


def run(data: bytes) -> None:
    """Feed ``data`` to a fresh connection and check the invariants (AssertionError)."""
    logged: list[dict[str, Any]] = []

    def observe(event: dict[str, Any]) -> None:
        if "log_failure" in event or event.get("log_level") in (LogLevel.error, LogLevel.critical):
            logged.append(event)

    observer = cast(ILogObserver, observe)
    globalLogPublisher.addObserver(observer)
    try:
        harness = _feed(data)
    finally:
        globalLogPublisher.removeObserver(observer)
    problems = [formatEvent(event) for event in logged]
    assert not problems, f"logged errors: {problems}"
    check(harness)


def _feed(data: bytes) -> _Fed:
    harness = Harness(FUZZ_CONFIG)
    for method in UNSAFE_METHODS:
        harness.dispatcher.routes.pop(method, None)
    framer = LineFramer(FUZZ_CONFIG.max_message_bytes)
    expected: Counter[Any] = Counter()
    others: Counter[Any] = Counter()
    for piece in data.split(CUT):
        if harness.outbound.closed:
            break
        for item in framer.feed(piece):
            if harness.outbound.closed:
                break
            if item is OVERSIZED:
                harness.conn.oversized_message()
            else:
                line = bytes(cast(bytes, item))
                expected.update(request_ids(line))
                others.update(other_ids(line))
                harness.conn.message_received(line)
    if not harness.outbound.closed:
        for item in framer.finish():
            if item is not OVERSIZED:
                line = bytes(cast(bytes, item))
                expected.update(request_ids(line))
                others.update(other_ids(line))
                harness.conn.message_received(line)
    for _ in range(20):
        harness.clock.advance(60)
    harness.conn.shutdown()
    for _ in range(20):
        harness.clock.advance(60)
    return _Fed(harness, expected, others)


class _Fed:
    def __init__(self, harness: Harness, expected: Counter[Any], others: Counter[Any]) -> None:
        self.harness = harness
        #: Requests carrying an id, by id: each must be answered exactly once.
        self.expected = expected
        #: Other objects carrying an id (e.g. ``{"id": 1}``): may be answered, once.
        self.others = others


def check(fed: _Fed) -> None:
    harness = fed.harness
    answered: Counter[Any] = Counter()
    for message in harness.outbound.messages:
        if "method" not in message and "id" in message:
            answered[message["id"]] += 1
    closed = harness.outbound.closed
    for request_id in set(fed.expected) | set(answered):
        if request_id is None:
            continue  # errors about unreadable messages
        sent = fed.expected.get(request_id, 0)
        most = sent + fed.others.get(request_id, 0)
        got = answered.get(request_id, 0)
        least = 0 if closed else sent
        assert least <= got <= most, (
            f"id {request_id!r}: {sent} requests (+{most - sent} other messages with "
            f"that id), {got} responses"
        )
    kill = harness.spawner.kill
    left = [
        t.proto.process_id
        for t in harness.spawner.spawned
        if t.pid not in kill.dead and not t.proto.exited
    ]
    assert not left, f"processes left behind: {left}"


def corpus() -> list[Path]:
    return sorted(CORPUS.glob("*.ndjson"))
