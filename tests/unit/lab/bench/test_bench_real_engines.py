"""``--engine real-vllm`` of the shared-fleet benchmarks, run with the twin only (no vLLM here): the
commands start the twin, run the wall-clock scenario against it and write ``{"engines": {...}}``."""

import json
import math

from click.testing import CliRunner

from lab.bench.frontier import frontier_command
from lab.bench.interference import interference_command
from lab.bench.pollution import pollution_command
from lab.bench.real_engines import run_frontier


def test_interference_real_vllm_writes_each_engines_stall_ratio(tmp_path):
    out = tmp_path / "interference.json"
    result = CliRunner().invoke(interference_command, ["--engine", "real-vllm", "--variants", "twin",
                                                       "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["time"] == "wall seconds" and list(data["engines"]) == ["twin"]
    twin = data["engines"]["twin"]
    assert len(twin["runs"]) == 3
    assert twin["stall_ratio"] == sorted(r["stall_ratio"] for r in twin["runs"])[1]
    assert twin["largest_gap_ms"] >= twin["idle_gap_ms"] > 0
    assert data["sizes"]["max_num_batched_tokens"] == 2048 and data["model"]["hidden_size"] == 512


def test_pollution_real_vllm_on_the_twin_keeps_the_interactive_prefixes(tmp_path):
    out = tmp_path / "pollution.json"
    result = CliRunner().invoke(pollution_command, ["--engine", "real-vllm", "--variants", "twin", "--json", str(out)])
    assert result.exit_code == 0, result.output
    twin = json.loads(out.read_text())["engines"]["twin"]
    # the twin's retention guard (the fleet's flags) keeps the conversations through a sweep twice the cache
    assert twin["sweep_tokens"] > 384 * 32
    assert twin["reference"]["hit_pct_after"] > 80
    assert twin["interactive_hit_rate_drop_points"] <= 2


def test_frontier_real_vllm_figures_per_engine(tmp_path):
    out = tmp_path / "frontier.json"
    data = run_frontier("twin", None, out, seconds=3.0, capacity_seconds=3.0)
    assert json.loads(out.read_text()) == json.loads(json.dumps(data))
    twin = data["engines"]["twin"]
    assert twin["capacity_rps"] > 0 and twin["alone"]["requests"] == twin["with_batch"]["requests"] > 0
    assert twin["ttft_p99_ratio"] == round(twin["with_batch"]["ttft_ms_p99"] / twin["alone"]["ttft_ms_p99"], 2)
    assert math.isfinite(twin["batch_vs_spare"])


def test_an_unknown_variant_is_a_usage_error():
    result = CliRunner().invoke(frontier_command, ["--engine", "real-vllm", "--variants", "twin,sglang"])
    assert result.exit_code == 2 and "unknown variant" in result.output
