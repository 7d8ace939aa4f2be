"""The package's import graph: no cycles among server modules; the dispatcher knows no application.

The graph is read from the source with ``ast`` (nothing is imported): an
edge for every ``import`` of a module of the package, at module level or
inside a function (a lazy import hides a cycle from the interpreter, not
from a reader), but not under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import execserver

PACKAGE = Path(execserver.__file__).parent

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


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
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
    return {module for module in found if module in modules}


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
