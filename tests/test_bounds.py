"""The bounds the tests assert are no looser than the figures the docs promise.

``docs/performance.md`` ("Promises the tests enforce") lists each bound with
the name of its constant in ``tests/support/bounds.py``; every constant there must be
listed, and none may exceed its documented figure.
"""

from __future__ import annotations

import re

from tests.support import bounds
from tests.support.harness import REPO_ROOT

UNITS = {"": 1.0, "MiB": float(bounds.MiB), "KiB": 1024.0, "s": 1.0, "ms": 0.001}
ROW = re.compile(r"^\|[^|]*\|\s*([0-9.]+)\s*(MiB|KiB|ms|s)?\s*\|\s*`([A-Z_]+)`\s*\|", re.M)


def documented() -> dict[str, float]:
    text = (REPO_ROOT / "docs" / "performance.md").read_text()
    section = text.split("## Promises the tests enforce", 1)[1].split("\n## ", 1)[0]
    return {name: float(figure) * UNITS[unit or ""] for figure, unit, name in ROW.findall(section)}


def constants() -> dict[str, float]:
    return {
        name: float(value)
        for name, value in vars(bounds).items()
        if name.isupper() and name != "MiB" and isinstance(value, int | float)
    }


def test_every_bound_is_documented_and_no_looser_than_the_docs() -> None:
    docs = documented()
    ours = constants()
    assert ours, "tests/support/bounds.py defines no bounds"
    assert set(ours) == set(docs), (
        f"tests/support/bounds.py and docs/performance.md list different bounds: "
        f"{sorted(set(ours) ^ set(docs))}"
    )
    looser = {name: (ours[name], docs[name]) for name in ours if ours[name] > docs[name]}
    assert not looser, f"bounds looser than docs/performance.md promises (test, doc): {looser}"
