"""Fuzzing the codec and the dispatcher (``tests/support/fuzz_target.py``) with hypothesis.

Two generators: raw bytes (anything at all, cut into random reads), and
JSON-RPC-shaped lines built from the real method names and field names with
hostile values (extreme integers, wrong types, deep nesting, huge strings,
invalid UTF-8). Every input of ``tests/fuzz_corpus`` runs first. The budget
is ``EXEC_SERVER_FUZZ_EXAMPLES`` inputs per generator (default 200; ``.ci/run``
runs a larger fixed budget in a step of its own).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.task import Clock

from execserver.app import build_dispatcher
from tests.support import fuzz_target
from tests.support.fakes import FakeSpawner
from tests.support.fuzz_target import CUT, FUZZ_CONFIG

EXAMPLES = int(os.environ.get("EXEC_SERVER_FUZZ_EXAMPLES", "200"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=False,
)

#: Every route the application serves (so a new method is fuzzed the day it
#: lands), plus initialized, an unknown name and an empty one.
METHODS = [
    *sorted(build_dispatcher(FUZZ_CONFIG, Clock(), FakeSpawner()).routes),
    "initialized",
    "nope",
    "",
]
FIELDS = [
    "processId",
    "argv",
    "cwd",
    "env",
    "tty",
    "arg0",
    "chunk",
    "path",
    "clientName",
    "waitMs",
    "afterSeq",
    "maxBytes",
    "signal",
    "size",
    "rows",
    "cols",
    "offset",
    "length",
    "sessionTtlMs",
    "resumeSessionId",
    "onDetachedFull",
    "pipeStdin",
    "writeId",
    "closeStdin",
    "envPolicy",
]
PATHS = [
    "/",
    "/tmp",
    "/nonexistent",
    "relative",
    "",
    "/dev/zero",
    "/proc/self/status",
    "file:///tmp",
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**53, 2**63 - 1, 2**63, 2**64]),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.sampled_from(PATHS),
    st.sampled_from(["true", "sleep", "cat", "aGVsbG8=", "SIGTERM", "pause", "drop"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(FIELDS), inner, max_size=4)
    ),
    max_leaves=12,
)
params = st.one_of(
    st.none(),
    st.dictionaries(st.sampled_from(FIELDS), values, max_size=8),
    values,
)
ids = st.one_of(
    st.integers(min_value=-3, max_value=40),
    st.sampled_from(["a", "", "1", 2**60, 1.5, True, None, [1], {"x": 1}]),
)


@st.composite
def message(draw: st.DrawFn) -> bytes:
    body: dict[str, Any] = {}
    if draw(st.booleans()) or draw(st.booleans()):
        body["jsonrpc"] = draw(st.sampled_from(["2.0", "1.0", 2]))
    if draw(st.integers(0, 9)) > 0:
        body["method"] = draw(st.one_of(st.sampled_from(METHODS), st.text(max_size=12)))
    if draw(st.integers(0, 9)) > 1:
        body["id"] = draw(ids)
    if draw(st.booleans()):
        body["params"] = draw(params)
    for key in draw(st.lists(st.sampled_from(["result", "error", "extra"]), max_size=2)):
        body[key] = draw(values)
    line = json.dumps(body).encode()
    mutation = draw(st.integers(0, 9))
    if mutation == 0 and line:
        cut = draw(st.integers(0, len(line)))
        line = line[:cut]
    elif mutation == 1:
        line = line + draw(st.binary(max_size=8))
    return line


@st.composite
def session(draw: st.DrawFn) -> bytes:
    """Lines, usually opening with initialize, cut into random reads."""
    lines = draw(st.lists(message(), max_size=12))
    if draw(st.booleans()):
        lines.insert(0, b'{"id":0,"method":"initialize","params":{"clientName":"fuzz"}}')
        lines.insert(1, b'{"method":"initialized","params":{}}')
    data = b"\n".join(lines) + draw(st.sampled_from([b"\n", b"", b"\r\n"]))
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=4)))
    pieces, start = [], 0
    for cut in cuts:
        pieces.append(data[start:cut])
        start = cut
    pieces.append(data[start:])
    return CUT.join(pieces)


@pytest.mark.parametrize("path", fuzz_target.corpus(), ids=lambda p: p.name)
def test_corpus(path: Path) -> None:
    fuzz_target.run(path.read_bytes())


def test_corpus_is_there() -> None:
    assert len(fuzz_target.corpus()) >= 5


@FUZZ
@given(st.binary(max_size=6000))
def test_raw_bytes(data: bytes) -> None:
    fuzz_target.run(data)


@FUZZ
@given(session())
def test_json_rpc_shaped_lines(data: bytes) -> None:
    fuzz_target.run(data)
