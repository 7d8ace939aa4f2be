"""The wheel ships every package of the source tree.

``pyproject.toml`` lists packages explicitly (``twisted.plugins`` is mapped from
``twisted_plugins/``), so a new subpackage left out of the list would install
without its modules and fail only on a user's machine. This test reads the
list and the tree from the checkout, beside the installed package.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def source_packages() -> set[str]:
    return {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "execserver").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }


def test_every_source_package_is_listed_in_pyproject() -> None:
    pyproject = ROOT / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("no source checkout next to the tests")
    listed = set(tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["packages"])
    missing = source_packages() - listed
    assert not missing, f"packages missing from pyproject's [tool.setuptools] packages: {missing}"
    stale = {name for name in listed if name.startswith("execserver")} - source_packages()
    assert not stale, f"pyproject lists packages that do not exist: {stale}"
