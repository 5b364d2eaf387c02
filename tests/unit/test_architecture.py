"""The layering of the packages, read from the source with ``ast`` (every import, module level or in
a function): each layer imports only those below it, nothing imports the command line, nothing but
the command line names the measurement wing (``lab``), and import circles stay few and inside one
package.

::

    backfill                         the command line and composition: commands, up, submit
    lab.bench                        the benchmarks         (the measurement wing: beside the
    lab.simulate                     the fleet simulator     services, above them; only the
    lab.toolkit                      the measuring tools     command line names it, lazily)
    batch_gateway (HTTP API, admin)  workers          router          engine_twin
    batch_gateway.store              async_processor
    common                           (the ground layer: contracts, logging, tracing)
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("backfill", "lab", "common", "batch_gateway", "workers", "async_processor", "router", "engine_twin",
            "migrations")
SERVICES = {"common", "batch_gateway", "batch_gateway.store", "workers", "async_processor", "router", "engine_twin",
            "migrations"}

#: layer -> the project layers it may import (besides itself).
ALLOWED = {
    "common": set(),
    "engine_twin": {"common"},
    "router": {"common"},
    "async_processor": {"common"},
    "batch_gateway.store": {"common"},
    "migrations": {"common", "batch_gateway.store"},
    "workers": {"common", "batch_gateway.store", "async_processor"},
    "batch_gateway": {"common", "batch_gateway.store", "async_processor"},
    "lab.toolkit": SERVICES,
    "lab.simulate": SERVICES | {"lab.toolkit"},
    "lab.bench": SERVICES | {"lab.toolkit", "lab.simulate"},
    "lab": SERVICES | {"lab.toolkit", "lab.simulate", "lab.bench"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str, *, module_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in (_module_level(tree) if module_level_only else ast.walk(tree)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.add(target)
            found |= {f"{target}.{alias.name}" for alias in node.names}
    return {name for name in found if name.split(".")[0] in PACKAGES}


def _module_level(tree: ast.Module) -> list[ast.AST]:
    """The nodes run on import: every statement outside a function or class body (``if``/``try``
    blocks included, ``if TYPE_CHECKING:`` too)."""
    found: list[ast.AST] = []
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        found.append(node)
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            todo.extend(ast.iter_child_nodes(node))
    return found


def _graph(*, module_level_only: bool = False) -> dict[str, set[str]]:
    modules = {_module_name(p): p for pkg in PACKAGES if (REPO / pkg).is_dir()
               for p in (REPO / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imports(path, name, module_level_only=module_level_only):
            while imported and imported not in modules:  # `from pkg import name` names no module
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def _layer(module: str) -> str:
    if module == "batch_gateway.store" or module.startswith("batch_gateway.store."):
        return "batch_gateway.store"
    if module.startswith("lab."):
        return ".".join(module.split(".")[:2])
    return module.split(".")[0]


GRAPH = _graph()


def test_the_layers_import_only_downwards():
    wrong = sorted(f"{source} imports {target}" for source, targets in GRAPH.items() for target in targets
                   if _layer(source) != _layer(target) and _layer(source) in ALLOWED
                   and _layer(target) not in ALLOWED[_layer(source)])
    assert wrong == []


def test_nothing_imports_the_command_line():
    assert sorted(s for s, targets in GRAPH.items() if _layer(s) != "backfill"
                  and any(_layer(t) == "backfill" for t in targets)) == []


def test_nothing_but_the_command_line_imports_the_measurement_wing():
    assert sorted(f"{s} imports {t}" for s, targets in GRAPH.items() for t in targets
                  if s.split(".")[0] not in {"backfill", "lab"} and t.split(".")[0] == "lab") == []


def test_the_command_line_names_the_measurement_wing_only_lazily():
    """``backfill --help`` and ``backfill bench --help`` import nothing from ``lab``: the command line
    names it by ``"module:command"`` strings or imports it inside a function."""
    top = _graph(module_level_only=True)
    assert sorted(f"{s} imports {t}" for s, targets in top.items() for t in targets
                  if _layer(s) == "backfill" and t.split(".")[0] == "lab") == []


def test_module_level_imports_leave_out_those_inside_functions_and_classes():
    tree = ast.parse("import lab.x\ndef f():\n    import lab.y\nclass C:\n    import lab.w\n"
                     "if True:\n    import lab.z\n")
    names = {a.name for n in _module_level(tree) if isinstance(n, ast.Import) for a in n.names}
    assert names == {"lab.x", "lab.z"}


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def test_there_is_no_import_circle():
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def _lines() -> dict[str, int]:
    lines: dict[str, int] = defaultdict(int)
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py") if (REPO / pkg).is_dir() else ():
            lines[pkg] += len(path.read_text().splitlines())
    return lines


@pytest.mark.parametrize("package", [p for p in PACKAGES if p != "migrations"])
def test_no_top_level_package_holds_more_than_a_third_of_the_code(package):
    lines = _lines()
    assert lines[package] <= sum(lines.values()) / 3, dict(lines)


def test_the_command_line_stays_small():
    """``backfill/`` is the command line and composition only: the measuring code lives in ``lab``."""
    assert _lines()["backfill"] < 3_000
