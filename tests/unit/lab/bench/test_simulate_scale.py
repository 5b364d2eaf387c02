"""``backfill bench simulate-scale``: lane figures and the summary by hand, bad options, and one
``--quick`` sweep end to end (the virtual-time fleet at 2 and 4 engines, every policy, JSON and plot)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from lab.bench.simulate_scale import ScaleOptions, lane_figures, run_one, simulate_scale_command, summarise

WALL_KEYS = {"wall_s", "wall_us_per_request", "decision_p50_ms", "decision_p99_ms", "max_rss_mib"}


def test_lane_figures_pool_tenants_and_keep_the_worst_tenant():
    groups = [("interactive", "t0"), ("interactive", "t1"), ("batch", "t0")]
    ttft = [0.1, 0.2, 0.3, 1.0, 5.0, 7.0]
    group_of = [0, 0, 0, 1, 2, 2]
    got = lane_figures(ttft, group_of, groups)
    assert set(got) == {"interactive", "batch"}
    inter = got["interactive"]
    assert inter["requests"] == 4 and inter["tenants"] == 2
    assert inter["ttft_p50_s"] == pytest.approx(0.2)  # nearest rank of 0.1, 0.2, 0.3, 1.0
    assert inter["ttft_p99_s"] == pytest.approx(1.0)
    assert inter["worst_tenant_p99_s"] == pytest.approx(1.0)  # t1's only answer
    assert got["batch"] == {"requests": 2, "ttft_p50_s": 5.0, "ttft_p99_s": 7.0, "tenants": 1,
                            "worst_tenant_p99_s": 7.0}


def _run(policy: str, engines: int, p99: float, decision: float, index: int) -> dict:
    return {"policy": policy, "engines": engines, "decision_p50_ms": decision, "index_bytes": index,
            "captured_reuse": 0.9, "wall_us_per_request": 100.0,
            "lanes": {"interactive": {"ttft_p99_s": p99}}}


def test_summary_compares_the_smallest_and_largest_fleet_per_policy():
    runs = [_run("approximate", 64, 0.4, 0.2, 640), _run("approximate", 4, 0.2, 0.05, 40),
            _run("approximate", 16, 9.0, 0.1, 160), _run("precise", 4, 0.1, 0.1, 0)]
    s = summarise(runs)
    assert s["approximate"]["engines"] == [4, 64]
    assert s["approximate"]["interactive_p99_growth"] == pytest.approx(2.0)  # 0.4 / 0.2; the middle ignored
    assert s["approximate"]["decision_p50_ms"] == [0.05, 0.2]
    assert s["approximate"]["index_bytes_per_engine"] == [10.0, 10.0]
    assert s["precise"]["engines"] == [4, 4] and s["precise"]["interactive_p99_growth"] == pytest.approx(1.0)


def test_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match="unknown policies"):
        ScaleOptions(policies=("nope",))
    with pytest.raises(ValueError, match="positive"):
        ScaleOptions(engines=(0, 4))
    result = CliRunner().invoke(simulate_scale_command, ["--engines", "4,x"])
    assert result.exit_code == 2 and "comma-separated" in result.output
    result = CliRunner().invoke(simulate_scale_command, ["--engines", "0"])
    assert result.exit_code == 2 and "positive" in result.output
    result = CliRunner().invoke(simulate_scale_command, ["--system-pieces", "4", "2"])
    assert result.exit_code == 2 and "MAX >= MIN" in result.output


def test_one_size_is_deterministic_for_a_seed():
    opts = ScaleOptions(engines=(2,), requests_per_engine=20, seed=5)
    first, second = (run_one(opts, 2, "approximate") for _ in range(2))
    assert {k: v for k, v in first.items() if k not in WALL_KEYS} == \
        {k: v for k, v in second.items() if k not in WALL_KEYS}
    assert first["requests"] == 40 and first["processor_concurrency"] == 32


def test_quick_sweep_writes_every_size_and_policy_with_json_and_plot(tmp_path):
    out = tmp_path / "scale.json"
    plots = tmp_path / "plots"
    result = CliRunner().invoke(simulate_scale_command, ["--quick", "--json", str(out), "--plots", str(plots)])
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    runs = payload["runs"]
    assert [(r["engines"], r["policy"]) for r in runs] == [
        (n, p) for n in (2, 4) for p in ("round-robin", "approximate", "precise")]
    for r in runs:
        assert r["requests"] == 30 * r["engines"]  # load per engine constant
        assert r["completed"] + sum(r["dropped"].values()) == r["requests"]
        assert r["processor_concurrency"] == 16 * r["engines"]
        assert set(r["lanes"]) == {"interactive", "async", "batch"}
        assert r["lanes"]["interactive"]["tenants"] == 4
        assert r["decision_p50_ms"] > 0 and r["wall_s"] > 0
    by = {(r["engines"], r["policy"]): r for r in runs}
    for n in (2, 4):
        assert by[n, "round-robin"]["index_bytes"] == 0
        assert by[n, "round-robin"]["ttft_p50_vs_round_robin"] == pytest.approx(1.0)
        assert 0 < by[n, "approximate"]["index_bytes"] < by[n, "precise"]["index_bytes"]
        assert by[n, "approximate"]["captured_reuse"] > by[n, "round-robin"]["captured_reuse"]
    assert by[4, "precise"]["index_bytes"] > by[2, "precise"]["index_bytes"]  # one index entry per engine holding a block
    assert set(payload["summary"]) == {"round-robin", "approximate", "precise"}
    assert payload["summary"]["approximate"]["engines"] == [2, 4]
    png = (plots / "simulate-scale.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    assert "TTFT by lane" in result.output
