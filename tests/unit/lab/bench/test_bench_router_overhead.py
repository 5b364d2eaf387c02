"""``backfill bench router-overhead --quick`` writes the JSON shape of ``docs/benchmarks.md`` (split
from ``test_bench_commands.py`` so the files run on separate test workers)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from lab.bench.router_overhead import router_overhead_command


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def test_router_overhead_quick_writes_the_headline_figures(tmp_path):
    out = tmp_path / "overhead.json"
    result = CliRunner().invoke(router_overhead_command, ["--quick", "--json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    for key in ("decision_p50_ms", "decision_p99_ms", "added_latency_p50_ms", "throughput_ratio_vs_vllm_router"):
        assert key in payload
    assert _number(payload["decision_p50_ms"]) and payload["decision_p50_ms"] <= payload["decision_p99_ms"]
    assert {(d["endpoints"], d["prompt_tokens"]) for d in payload["decision"]} == {(16, 1000), (16, 8000)}
    targets = payload["targets"]
    assert list(targets) == ["direct", "ours", "vllm-router-cache_aware", "vllm-router-round_robin"]
    assert targets["direct"]["errors"] == 0 and targets["direct"]["requests_per_s"] > 0
    for name, target in targets.items():
        if "missing" in target:
            assert target["requests_per_s"] is None, name
        else:
            assert target["errors"] == 0 and target["requests_per_s"] > 0, name
    if "missing" not in targets["ours"] and "missing" not in targets["vllm-router-cache_aware"]:
        assert payload["throughput_ratio_vs_vllm_router"] == (targets["ours"]["requests_per_s"]
                                                              / targets["vllm-router-cache_aware"]["requests_per_s"])
