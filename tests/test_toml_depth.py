"""Deep TOML configs are refused like the reference, not with a traceback (issue 22, item 12).

``environmentConfig/read`` with a trusted project config nested 20,000
deep, or a 3,000-segment dotted table, answered ``-32603 internal error:
maximum recursion depth exceeded`` with 285 KB of traceback on stderr. The
reference refuses nesting beyond 80 levels; its texts (checked with the
Codex 0.171.0 binary) are ``cannot recurse further; max recursion depth
met`` at the 81st bracket, and ``recursion limit`` for tables.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from hypothesis import given
from hypothesis import strategies as st

from execserver.codex.toml_depth import (
    TABLES_TOO_DEEP,
    VALUE_TOO_DEEP,
    first_too_deep,
    too_deep,
)
from execserver.codex.toml_writer import dumps
from execserver.fs.paths import path_to_uri
from tests.support.codex_config import read_params, serving, write_file


@pytest.mark.parametrize(
    ("text", "found"),
    [
        # Positions the reference reports (Codex 0.171.0).
        ("a = " + "[" * 81 + "]" * 81 + "\n", (1, 85, VALUE_TOO_DEEP)),
        ("a = " + "[" * 20000 + "]" * 20000 + "\n", (1, 85, VALUE_TOO_DEEP)),
        ("a = " + "{b = " * 81 + "1" + "}" * 81 + "\n", (1, 405, VALUE_TOO_DEEP)),
        ("# [[[\nx = 1\n[" + ".".join(["k"] * 81) + "]\nx = 1\n", (3, 1, TABLES_TOO_DEEP)),
        ("[t]\n" + ".".join(["k"] * 81) + " = 1\n", (2, 1, TABLES_TOO_DEEP)),
        ("a = " + "[" * 80 + "]" * 80 + "\n", None),
        ("[" + ".".join(["k"] * 80) + "]\nx = 1\n", None),
        ('s = "[[[{{"\nm = """\n[[[\n"""\nt = [\n  [1],\n]\n[x.y]\nz = {a = [1, {b = 2}]}\n', None),
    ],
)
def test_the_first_container_too_deep_is_located(
    text: str, found: tuple[int, int, str] | None
) -> None:
    assert first_too_deep(text) == found


_keys = st.text(st.characters(exclude_categories=["Cs"]), max_size=4)
_values = st.recursive(
    st.one_of(st.integers(), st.text(max_size=4), st.booleans()),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_keys, inner, max_size=3),
    max_leaves=16,
)


@given(st.dictionaries(_keys, _values, max_size=4), st.integers(min_value=0, max_value=5))
def test_the_scan_of_the_text_agrees_with_the_parsed_document(
    document: dict[str, Any], limit: int
) -> None:
    text = dumps(document)
    assert tomllib.loads(text) == document
    assert (first_too_deep(text, limit) is not None) == too_deep(document, limit)


# --- through the real server -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "line", "column", "message"),
    [
        ("a = " + "[" * 20000 + "]" * 20000 + "\n", 1, 85, VALUE_TOO_DEEP),
        ("[" + ".".join(["k"] * 3000) + "]\nx = 1\n", 1, 1, TABLES_TOO_DEEP),
    ],
    ids=["20000-deep-array", "3000-segment-table"],
)
@pytest_twisted.ensureDeferred
async def test_environment_config_read_refuses_deep_nesting_with_the_documented_error(
    tmp_path: Path, config: str, line: int, column: int, message: str
) -> None:
    home = tmp_path / "codex-home"
    work = tmp_path / "work"
    (work / ".git").mkdir(parents=True)
    write_file(home / "config.toml", f'[projects."{work}"]\ntrust_level = "trusted"\n')
    project = write_file(work / ".codex" / "config.toml", config)
    async with serving(tmp_path) as server:
        reply = await server.request("environmentConfig/read", read_params(path_to_uri(str(work))))
        # The server is fine afterwards.
        assert (await server.call("fs/getMetadata", {"path": "/"}))["isDirectory"] is True
    assert reply["error"] == {
        "code": -32603,
        "message": (
            f"failed to load executor-local config: Error parsing project config file "
            f"{project}: {project}:{line}:{column}: {message}"
        ),
    }
