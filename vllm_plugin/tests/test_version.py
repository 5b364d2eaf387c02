"""register() refuses an untested vLLM: a real server start in a fresh interpreter, and the entry point
vLLM loads."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from backfill_vllm import (
    ALLOW_UNTESTED_ENV,
    TESTED_VLLM_VERSIONS,
    UntestedVLLMVersion,
    check_vllm_version,
    release_line,
)


def _run(code: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != ALLOW_UNTESTED_ENV}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=full_env,
                          timeout=300)


def _entry_point() -> Callable[[], None]:
    """The ``backfill`` entry point of ``vllm.general_plugins``, loaded as vLLM loads it
    (``vllm/plugins/__init__.py`` ``load_plugins_by_group``: ``plugin.load()``, then vLLM calls it)."""
    (plugin,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "backfill"]
    return plugin.load()


def test_the_installed_vllm_is_a_tested_one() -> None:
    import vllm

    assert release_line(vllm.__version__) in TESTED_VLLM_VERSIONS
    _entry_point()()  # raises on an untested version


def test_vllm_server_refuses_to_start_on_an_untested_version(tiny_model: Path) -> None:
    start = ("import vllm, sys, runpy; vllm.__version__ = '0.31.4'; "
             "sys.argv = ['vllm', '--model', sys.argv[1], '--skip-tokenizer-init']; "
             "runpy.run_module('vllm.entrypoints.openai.api_server', run_name='__main__')")
    result = _run(start, str(tiny_model))
    assert result.returncode != 0
    assert "backfill-vllm was tested on vLLM 0.32.x" in result.stderr
    assert "this is vLLM 0.31.4" in result.stderr
    assert f"{ALLOW_UNTESTED_ENV}=1" in result.stderr


def test_the_override_lets_an_untested_version_load(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    register = _entry_point()
    with pytest.raises(UntestedVLLMVersion, match="0.34.0"):
        register()
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    register()


@pytest.mark.parametrize(("version", "line"), [("0.32.0", "0.32"), ("0.32.1+cpu", "0.32"),
                                               ("0.33.0.dev12+g1234", "0.33"), ("1.0.0", "1.0")])
def test_release_line(version: str, line: str) -> None:
    assert release_line(version) == line


def test_check_without_override_raises_and_with_it_passes() -> None:
    with pytest.raises(RuntimeError, match="refuses to start"):
        check_vllm_version("0.30.0", {})
    check_vllm_version("0.30.0", {ALLOW_UNTESTED_ENV: "1"})
    check_vllm_version("0.32.3", {})
