"""The simulator uses the router through its public names only (``router/assembly.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

import lab.simulate

SIMULATE = Path(lab.simulate.__file__).parent


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _offences(source: str) -> list[str]:
    """Imports of a private router name or module, and ``x._name`` on anything but ``self``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "router":
            parts = [*(node.module or "").split("."), *(a.name for a in node.names)]
            found += [f"from {node.module} import {p}" for p in parts if _private(p)]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "router" and any(map(_private, a.name.split(".")))]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_the_simulator_imports_no_private_router_name_and_reads_no_private_attribute() -> None:
    offences = {path.name: _offences(path.read_text()) for path in sorted(SIMULATE.glob("*.py"))}
    assert {name: found for name, found in offences.items() if found} == {}


def test_the_check_finds_what_it_forbids() -> None:
    assert _offences("from router.director import _EVICTED\n") == ["from router.director import _EVICTED"]
    assert _offences("from router._x import y\n") == ["from router._x import _x"]
    assert _offences("pool._rebuild()\n") == ["line 1: ._rebuild"]
    assert _offences("self._ids += 1\nfrom router.assembly import build_router\nx.__class__\n") == []
