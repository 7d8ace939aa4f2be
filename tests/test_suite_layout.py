"""The suite stays findable: no test module imports another, and each says what it tests.

What two test modules share lives in ``tests/support/`` (issue 25, point 5);
a test module imported as a library hides helpers where nobody looks for
them and runs its module-level fixtures and marks in its importer.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.harness import REPO_ROOT

TESTS = REPO_ROOT / "tests"


def _sources() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "fuzz_corpus" not in p.parts)


def _imported_test_modules(tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            if node.module.startswith("tests.test_"):
                found.append(node.module)
            elif node.module == "tests":
                found += [f"tests.{a.name}" for a in node.names if a.name.startswith("test_")]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("tests.test_")]
    return found


def test_the_layout_checks_see_the_suite() -> None:
    names = {p.name for p in _sources()}
    assert {"conftest.py", "test_suite_layout.py"} <= names
    assert (TESTS / "support" / "polling.py").exists()


def test_no_module_imports_a_test_module() -> None:
    offenders = {
        str(path.relative_to(REPO_ROOT)): imported
        for path in _sources()
        if (imported := _imported_test_modules(ast.parse(path.read_text(), str(path))))
    }
    assert not offenders, (
        f"move what these share into tests/support/ and import it from there: {offenders}"
    )


def test_the_check_catches_each_form_of_import() -> None:
    source = (
        "from tests.test_a import x\n"
        "from tests import test_b as b, support\n"
        "import tests.test_c\n"
        "from tests.support.harness import reactor\n"
    )
    assert _imported_test_modules(ast.parse(source)) == [
        "tests.test_a",
        "tests.test_b",
        "tests.test_c",
    ]


def test_every_test_module_says_what_it_tests() -> None:
    missing = [
        str(path.relative_to(REPO_ROOT))
        for path in _sources()
        if path.name.startswith("test_") and not ast.get_docstring(ast.parse(path.read_text()))
    ]
    assert not missing, f"test modules without a docstring saying what they test: {missing}"
