"""The package's import graph: the layering rules docs/architecture.md states.

- no cycles among the package's modules;
- the dispatcher knows no application, and the fs package no dispatcher;
- the transports load nothing of the application (session, handlers, the
  composition root, ``/metrics``' renderer): they hand bytes to a dispatcher;
- the session imports nothing of ``codex/`` (only the composition root and
  the handshake do);
- no module, of the package or of the tests, imports a test-only shim (a
  module that only re-exports another, as ``execserver/filesystem.py`` did so
  that tests could patch ``os`` through it): the only shims are the client's
  historical import paths (:data:`HISTORICAL_PATHS`); and the package imports
  nothing of the tests.

The graph is read from the source with ``ast`` (nothing is imported): an
edge for every ``import`` of a module of the package, at module level or
inside a function (a lazy import hides a cycle from the interpreter, not
from a reader), but not under ``if TYPE_CHECKING:``. What a module *loads*
adds the packages above each module imported (importing ``a.b.c`` runs
``a/__init__`` and ``a/b/__init__`` first).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import execserver

PACKAGE = Path(execserver.__file__).parent
TESTS = Path(__file__).parent

#: What the dispatcher must not depend on, even indirectly: the application
#: comes from the composition root (``execserver.app``).
APPLICATION = (
    "execserver.app",
    "execserver.handshake",
    "execserver.session",
    "execserver.processes",
    "execserver.containment",
    "execserver.codex",
    "execserver.fs",
    "execserver.spawn",
    "execserver.transports",
    "execserver.service",
)

#: What no transport may load: the application and what renders it.
#: (The dispatcher, the codec and the wire types are what a transport talks to.)
NOT_FOR_TRANSPORTS = (
    *(name for name in APPLICATION if name != "execserver.transports"),
    "execserver.metrics",
    "execserver.sandbox",
)

#: The only modules outside ``codex/`` that may import it: the composition
#: root adds its routes, the handshake puts ``environmentInfo`` in
#: ``initialize``'s result.
CODEX_IMPORTERS = ("execserver.app", "execserver.handshake")

#: The modules that only re-export another and are kept as an import path
#: users of the client have (the classes live in ``clientcore``). Any other
#: re-export-only module is a shim for tests, and nothing may import it.
HISTORICAL_PATHS = frozenset({"execserver.client.errors", "execserver.client.types"})


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    return {module for module in _imported(name, path, modules) if module in modules}


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module ``path`` imports (of the package or not), by dotted name."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*parts, *([child.module] if child.module else [])])
                for alias in child.names:
                    submodule = f"{base}.{alias.name}"
                    found.add(submodule if submodule in modules else base)
            visit(child)

    visit(ast.parse(path.read_text()))
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for target in graph[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def _with_packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` plus an edge to each package above every module imported."""
    loaded: dict[str, set[str]] = {}
    for name, targets in graph.items():
        edges = set(targets)
        for target in targets:
            parts = target.split(".")
            edges.update(".".join(parts[:end]) for end in range(1, len(parts)))
        loaded[name] = {edge for edge in edges if edge in graph and edge != name}
    return loaded


def loads(graph: dict[str, set[str]], start: str) -> set[str]:
    """The package's modules that importing ``start`` runs (besides its own packages)."""
    return reachable(_with_packages(graph), start)


def _within(module: str, names: tuple[str, ...]) -> bool:
    return any(module == name or module.startswith(name + ".") for name in names)


def transport_leaks(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Each transport module's loaded modules that belong to the application."""
    found = {}
    for name in sorted(graph):
        if _within(name, ("execserver.transports",)):
            leaks = sorted(m for m in loads(graph, name) if _within(m, NOT_FOR_TRANSPORTS))
            if leaks:
                found[name] = leaks
    return found


def codex_importers(graph: dict[str, set[str]]) -> list[str]:
    """Modules outside ``codex/`` that import it, other than :data:`CODEX_IMPORTERS`."""
    return sorted(
        name
        for name, targets in graph.items()
        if not _within(name, ("execserver.codex", *CODEX_IMPORTERS))
        and any(_within(target, ("execserver.codex",)) for target in targets)
    )


def is_shim(source: str) -> bool:
    """A module (not a package's ``__init__``) whose body only imports and re-exports."""
    body = ast.parse(source).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return bool(body) and all(
        isinstance(node, ast.Import | ast.ImportFrom)
        or (
            isinstance(node, ast.Assign | ast.AnnAssign)
            and ast.unparse(node.targets[0] if isinstance(node, ast.Assign) else node.target)
            == "__all__"
        )
        for node in body
    )


def shims_for_tests(modules: dict[str, Path]) -> set[str]:
    """The re-export-only modules that are not a historical import path."""
    return {
        name
        for name, path in modules.items()
        if path.name != "__init__.py" and name not in HISTORICAL_PATHS and is_shim(path.read_text())
    }


def shim_imports(modules: dict[str, Path], tests: Path) -> list[str]:
    """``importer -> shim`` for every import of a test-only shim, by the package or the tests."""
    shims = shims_for_tests(modules)
    importers = dict(modules)
    for path in sorted(tests.rglob("*.py")):
        importers["tests." + ".".join(path.relative_to(tests).with_suffix("").parts)] = path
    found = []
    for name, path in sorted(importers.items()):
        for target in sorted(_imported(name, path, modules) & shims):
            found.append(f"{name} -> {target}")
    return found


def imports_of_tests(modules: dict[str, Path]) -> list[str]:
    """``module -> test module`` for each import of ``tests`` (or below) by the package."""
    return sorted(
        f"{name} -> {target}"
        for name, path in modules.items()
        for target in _imported(name, path, modules)
        if _within(target, ("tests",))
    )


def test_the_graph_sees_lazy_imports_and_skips_type_checking_ones() -> None:
    graph = import_graph()
    # service imports the WebSocket transport inside build_service only.
    assert "execserver.transports.websocket" in graph["execserver.service"]
    # metrics names the Dispatcher type under TYPE_CHECKING only.
    assert "execserver.dispatcher" not in graph["execserver.metrics"]


def test_cycles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [{"a", "b", "c"}]


def test_no_import_cycle_in_the_package() -> None:
    # Server and client alike (the client's client/connect and cli/fs
    # cycles are gone too).
    assert [sorted(component) for component in cycles(import_graph())] == []


def test_the_dispatcher_imports_no_application_module() -> None:
    needed = reachable(import_graph(), "execserver.dispatcher")
    application = sorted(
        module
        for module in needed
        if any(module == name or module.startswith(name + ".") for name in APPLICATION)
    )
    assert application == []


def test_the_fs_package_does_not_import_the_dispatcher() -> None:
    assert "execserver.dispatcher" not in reachable(import_graph(), "execserver.fs")


def test_the_session_reaches_no_process_transport() -> None:
    # It steers processes through processes.ChildProcess; only the process
    # module and the spawn package touch a transport or its pipes.
    tree = ast.parse((PACKAGE / "session.py").read_text())
    reaches = sorted(
        f"line {node.lineno}: .{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in ("transport", "pipes")
    )
    assert reaches == []


def test_no_transport_loads_the_application() -> None:
    # http once loaded app, the session, the fs methods and the YAML parser
    # through metrics; /metrics is now a callable the composition root gives.
    assert transport_leaks(import_graph()) == {}


def test_the_session_imports_nothing_of_codex() -> None:
    needed = loads(import_graph(), "execserver.session")
    assert sorted(m for m in needed if _within(m, ("execserver.codex",))) == []


def test_only_the_composition_root_and_the_handshake_import_codex() -> None:
    assert codex_importers(import_graph()) == []


def test_no_module_imports_a_shim_nor_the_package_a_test_module() -> None:
    modules = _modules()
    assert shims_for_tests(modules) == set()
    assert shim_imports(modules, TESTS) == []
    assert imports_of_tests(modules) == []


# --- the rules fail when broken --------------------------------------------------------------


def test_a_transport_loading_the_application_is_named() -> None:
    graph = {name: set(targets) for name, targets in import_graph().items()}
    # Through a package on the way: importing fs.paths runs fs/__init__ too.
    graph["execserver.transports.listen"].add("execserver.metrics")
    graph["execserver.transports.backpressure"].add("execserver.fs.paths")
    leaks = transport_leaks(graph)
    assert "execserver.app" in leaks["execserver.transports.listen"]
    assert "execserver.session" in leaks["execserver.transports.listen"]
    assert "execserver.fs.handlers" in leaks["execserver.transports.backpressure"]
    # The websocket transport imports both.
    assert "execserver.metrics" in leaks["execserver.transports.websocket"]


def test_a_session_reaching_codex_is_named() -> None:
    graph = {name: set(targets) for name, targets in import_graph().items()}
    graph["execserver.env_policy"].add("execserver.codex.environment_info")
    assert "execserver.codex.environment_info" in loads(graph, "execserver.session")
    assert codex_importers(graph) == ["execserver.env_policy"]


@pytest.mark.parametrize(
    ("source", "shim"),
    [
        (
            '"""Old path."""\nimport os\nfrom a import *\nfrom a import __all__ as __all__\n',
            True,
        ),
        ("from a import b\n__all__ = ['b']\n", True),
        ("from a import b\n\n\ndef c() -> None:\n    b()\n", False),
        ('"""Only a docstring."""\n', False),
    ],
)
def test_a_shim_is_told_from_a_module(source: str, shim: bool) -> None:
    assert is_shim(source) is shim


def test_an_import_of_a_shim_or_of_a_test_module_is_named(tmp_path: Path) -> None:
    # The old execserver/filesystem.py shim back, imported by a module of
    # the package and by a test; and a server module importing a test helper.
    shim = tmp_path / "filesystem.py"
    shim.write_text(
        '"""Kept importable."""\n'
        "import os  # noqa: F401\n"
        "from execserver.fs import *  # noqa: F403\n"
        "from execserver.fs import __all__ as __all__\n"
    )
    user = tmp_path / "user.py"
    user.write_text(
        "from execserver import filesystem\nfrom tests import fakes\n\nUSED = (filesystem, fakes)\n"
    )
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_x.py").write_text("from execserver import filesystem as fs\n")
    modules = {
        **_modules(),
        "execserver.filesystem": shim,
        "execserver.user": user,
    }
    assert shims_for_tests(modules) == {"execserver.filesystem"}
    assert shim_imports(modules, tests) == [
        "execserver.user -> execserver.filesystem",
        "tests.test_x -> execserver.filesystem",
    ]
    assert imports_of_tests(modules) == ["execserver.user -> tests"]
