"""Logging never blocks the reactor, repeated lines are rate-limited, expected errors are one line.

Issue 22, items 4 and 10: a stdio server whose stderr pipe nobody reads
stopped answering after one large traceback (a 600-level ``fs/remove``);
one client could make it log megabytes of tracebacks per second.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from twisted.internet.task import Clock
from twisted.logger import ILogObserver, LogLevel, globalLogPublisher

from execserver import protocol as p
from execserver.logsink import (
    EVENT_TEXT_LIMIT,
    REPEAT_BURST,
    REPEAT_INTERVAL_SECONDS,
    RepeatLimiter,
    SinkStream,
    StderrSink,
    cut_text,
    format_event,
)
from tests.support.fakes import Harness
from tests.support.harness import console_script, server_env

#: Every wait on the server in the stdio test.
WAIT_SECONDS = 20.0


def _event(fmt: str, **fields: Any) -> dict[str, Any]:
    return {
        "log_format": fmt,
        "log_level": LogLevel.warn,
        "log_namespace": "test",
        "log_time": 0.0,
        **fields,
    }


# --- the sink ------------------------------------------------------------------------------


def _read_until(fd: int, marker: bytes, seconds: float) -> bytes:
    got = bytearray()
    deadline = time.monotonic() + seconds
    while marker not in got:
        left = deadline - time.monotonic()
        assert left > 0, f"{marker!r} not seen; read {len(got)} bytes"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 1 << 16)
            assert chunk, "pipe closed"
            got += chunk
    return bytes(got)


def _read_all(fd: int, sink: StderrSink) -> bytes:
    """Everything the sink writes to ``fd`` until it has nothing left."""
    got = bytearray()
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        assert time.monotonic() < deadline, f"the sink did not drain; read {len(got)} bytes"
        ready, _, _ = select.select([fd], [], [], 0.05)
        if ready:
            got += os.read(fd, 1 << 16)
        elif sink.drain(0):
            ready, _, _ = select.select([fd], [], [], 0)
            if not ready:
                return bytes(got)


def test_a_sink_whose_pipe_nobody_reads_drops_and_counts_and_says_so_once_read() -> None:
    read_end, write_end = os.pipe()
    try:
        sink = StderrSink(write_end, capacity=64 * 1024)
        line = "x" * 1023 + "\n"
        # 4 MiB: far beyond the pipe (64 KiB) plus the queue (64 KiB). Each
        # write returns at once; a blocking one would hang the test.
        for _ in range(4096):
            sink.write(line)
        # At most the pipe, the queue and the line being written got through.
        assert sink.dropped_total >= 4096 - 2 * 64 - 1
        got = _read_all(read_end, sink)
        # Every message was either written or counted in a notice.
        notices = [int(n) for n in re.findall(rb"exec-server: (\d+) log messages dropped", got)]
        assert sum(notices) == sink.dropped_total
        assert got.count(line.encode()) + sink.dropped_total == 4096
        sink.write("after\n")
        assert _read_until(read_end, b"after\n", WAIT_SECONDS) == b"after\n"
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_sink_reports_dropped_messages_even_when_no_line_follows() -> None:
    read_end, write_end = os.pipe()
    try:
        sink = StderrSink(write_end, capacity=1024)
        for _ in range(200):
            sink.write("y" * 999 + "\n")
        got = _read_all(read_end, sink)
        # The last thing written says what is missing.
        assert got.endswith(b" log messages dropped (stderr was not read)\n")
        notices = [int(n) for n in re.findall(rb"exec-server: (\d+) log messages dropped", got)]
        assert sum(notices) == sink.dropped_total > 0
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_closed_stderr_ends_the_writer_and_never_raises_into_the_caller() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)
    sink = StderrSink(write_end, capacity=1024)
    sink.write("lost\n")  # EPIPE in the writer thread (SIGPIPE is ignored by Python)
    assert sink.drain(WAIT_SECONDS)
    sink.write("also lost\n")
    os.close(write_end)


# --- bounded text and repeats ----------------------------------------------------------------


def test_long_event_text_keeps_head_and_tail_within_the_limit() -> None:
    text = "".join(f"line {i}\n" for i in range(20000))
    cut = cut_text(text)
    assert len(cut) < EVENT_TEXT_LIMIT + 100
    assert cut.startswith("line 0\n") and cut.endswith("line 19999\n")
    assert "characters omitted" in cut
    assert cut_text("short") == "short"
    formatted = format_event(_event("{x}", x="z" * (3 * EVENT_TEXT_LIMIT)))
    assert formatted is not None and len(formatted) < EVENT_TEXT_LIMIT + 200


def test_repeated_lines_are_limited_per_interval_and_summarised_on_a_fake_clock() -> None:
    clock = Clock()
    seen: list[dict[str, Any]] = []
    limiter = RepeatLimiter(cast(ILogObserver, seen.append), clock)
    for i in range(50):
        limiter(_event("refused {peer}", peer=i))
    limiter(_event("another kind"))
    assert [e["log_format"] for e in seen] == ["refused {peer}"] * REPEAT_BURST + ["another kind"]
    clock.advance(REPEAT_INTERVAL_SECONDS)
    summary = seen[-1]
    assert summary["count"] == 50 - REPEAT_BURST
    assert summary["what"] == "refused {peer}"
    assert summary["log_level"] == LogLevel.warn
    # A new window: written again.
    limiter(_event("refused {peer}", peer=99))
    assert seen[-1]["peer"] == 99
    assert not clock.getDelayedCalls()


# --- expected failures are one line ----------------------------------------------------------


def test_an_os_error_escaping_a_handler_is_one_warning_line_not_a_traceback() -> None:
    logged: list[dict[str, Any]] = []
    observer = cast(ILogObserver, logged.append)
    globalLogPublisher.addObserver(observer)
    try:
        h = Harness()

        def denied(conn: Any, params: Any) -> Any:
            raise PermissionError(13, "Permission denied", "/somewhere")

        h.dispatcher.add_route("test/denied", p.Empty, denied, family=None)
        error = h.error("test/denied", {})
    finally:
        globalLogPublisher.removeObserver(observer)
    assert error["code"] == -32603
    assert not [e for e in logged if "log_failure" in e]
    warnings = [e for e in logged if e.get("log_level") == LogLevel.warn]
    assert len(warnings) == 1 and "Permission denied" in warnings[0]["error"]


# --- the real server with a stderr pipe nobody reads ----------------------------------------


@pytest.fixture
def deep_tree(tmp_path: Path) -> Iterator[Path]:
    top = tmp_path / "deep"
    path = top
    for _ in range(600):
        path = path / "d"
    path.mkdir(parents=True)
    yield top


def test_a_stdio_server_whose_stderr_nobody_reads_keeps_answering(deep_tree: Path) -> None:
    """The reproduction of item 4: deep removes log a large traceback (before i22-fs's fix)."""
    read_end, write_end = os.pipe()
    server = subprocess.Popen(
        [console_script("exec-server")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=write_end,
        env=server_env(),
    )
    os.close(write_end)
    assert server.stdin is not None and server.stdout is not None
    stdin, stdout = server.stdin, server.stdout

    def send(message: dict[str, Any]) -> None:
        stdin.write(json.dumps(message).encode() + b"\n")
        stdin.flush()

    def receive(request_id: int) -> dict[str, Any]:
        deadline = time.monotonic() + WAIT_SECONDS
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no answer to request {request_id}: the server stopped answering"
            ready, _, _ = select.select([stdout], [], [], left)
            if ready:
                line = stdout.readline()
                assert line, "the server closed stdout"
                message = json.loads(line)
                if message.get("id") == request_id:
                    return cast(dict[str, Any], message)

    try:
        send({"id": 1, "method": "initialize", "params": {"clientName": "t"}})
        assert "result" in receive(1)
        send({"method": "initialized", "params": {}})
        for n in range(10, 40):
            send(
                {
                    "id": n,
                    "method": "fs/remove",
                    "params": {"path": str(deep_tree), "recursive": True, "force": True},
                }
            )
            receive(n)
        send({"id": 2, "method": "fs/getMetadata", "params": {"path": "/"}})
        assert receive(2)["result"]["isDirectory"] is True
    finally:
        server.kill()
        server.wait(WAIT_SECONDS)
        stdin.close()
        stdout.close()
        os.close(read_end)


def test_the_stderr_stream_sends_whole_lines_in_order() -> None:
    read_end, write_end = os.pipe()
    try:
        sink = StderrSink(write_end)
        stream = SinkStream(sink, write_end)
        print("exec-server listening on", "ws://127.0.0.1:1", file=stream)
        sink.write("a log line\n")
        stream.write("no newline yet")
        assert stream.encoding == "utf-8" and not stream.isatty()
        stream.flush()
        got = _read_until(read_end, b"no newline yet", WAIT_SECONDS)
        assert got == b"exec-server listening on ws://127.0.0.1:1\na log line\nno newline yet"
    finally:
        os.close(read_end)
        os.close(write_end)
