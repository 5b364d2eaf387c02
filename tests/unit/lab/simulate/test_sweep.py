"""``backfill simulate --sweep``: the spread over seeds and the paired precise − approximate
difference, by hand; one tiny sweep through the production simulator."""

from __future__ import annotations

import click
import pytest

from lab.simulate.sweep import fleet_of, parse_loads, spread, summarize, sweep


def _run(policy: str, seed: int, reuse: float, p50: float = 0.1, p99: float = 1.0) -> dict:
    return {"shape": "agentic", "load": 1.0, "seed": seed, "policy": policy, "captured_reuse": reuse,
            "ttft_p50_s": p50, "ttft_p99_s": p99}


def test_spread_is_the_mean_the_sample_sd_and_the_range_of_the_known_values():
    s = spread([0.9, 1.0, None, 0.8])
    assert s["n"] == 3 and s["mean"] == pytest.approx(0.9) and s["sd"] == pytest.approx(0.1)
    assert (s["min"], s["max"]) == (0.8, 1.0)
    assert spread([0.5])["sd"] == 0.0
    assert spread([None])["mean"] is None


def test_summary_pairs_precise_with_approximate_by_seed():
    runs = [_run("approximate", 0, 0.90), _run("precise", 0, 0.95), _run("approximate", 1, 0.80),
            _run("precise", 1, 0.80), _run("precise", 2, 0.99)]  # seed 2 has no approximate run: unpaired
    summary = summarize(runs)
    cells = {c["policy"]: c for c in summary["cells"]}
    assert cells["precise"]["captured_reuse"]["n"] == 3
    diff = summary["paired"][0]["precise_minus_approximate_reuse"]
    assert diff["n"] == 2 and diff["mean"] == pytest.approx(0.025) and diff["max"] == pytest.approx(0.05)


def test_loads_parse_or_are_refused():
    assert parse_loads("1, 2.5") == [1.0, 2.5]
    for bad in ("", "0", "x", "1,-2"):
        with pytest.raises(click.BadParameter):
            parse_loads(bad)


def test_a_tiny_sweep_runs_every_policy_on_every_seed_and_load():
    result = sweep(["shared-prefix"], 2, [1.0, 2.0], ["round-robin", "approximate", "cache-aware-model"])
    assert len(result["runs"]) == 2 * 2 * 3
    assert all(r["completed"] == r["requests"] for r in result["runs"])
    assert {(c["load"], c["policy"]) for c in result["summary"]["cells"]} == {
        (load, p) for load in (1.0, 2.0) for p in ("round-robin", "approximate", "cache-aware-model")}
    assert fleet_of("conversation").num_gpu_blocks == 16384
