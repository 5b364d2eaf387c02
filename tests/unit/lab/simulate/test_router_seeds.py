"""Issue 27: on long multi-turn conversations one simulated run is one draw of the router's
tie-breaks (which idle engine a long first turn lands on decides which later turns find their engine
busy with a long prefill and move), so ``backfill simulate --router-seeds N`` runs each policy on the
same workload under N router seeds and reports the spread."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from click.testing import CliRunner

from lab.simulate.cli import seed_spread, simulate_command
from lab.toolkit.workloads import conversation_records, write_mooncake


def test_router_seeds_draw_different_placements_of_the_same_workload(tmp_path: Path) -> None:
    trace, out = tmp_path / "conv.jsonl", tmp_path / "runs.json"
    write_mooncake(conversation_records(7, duration_s=40.0, think_s=4.0), trace)
    ran = CliRunner().invoke(simulate_command, [
        "--trace", str(trace), "--max-output-tokens", "16", "--gpu-blocks", "8192", "--cpu-blocks", "8192",
        "--policy", "approximate", "--router-seeds", "4", "--seed", "3", "--no-progress", "--json", str(out)])
    assert ran.exit_code == 0, ran.output
    data = json.loads(out.read_text())
    runs = data["runs"]
    assert [r["run"] for r in runs] == [f"approximate #{s}" for s in (3, 4, 5, 6)]
    assert [r["router_seed"] for r in runs] == [3, 4, 5, 6]
    # the same requests and oracle every time: only the router's draws differ ...
    assert len({(r["requests"], r["oracle_reusable_tokens"], r["prompt_tokens"]) for r in runs}) == 1
    # ... and they change what it captures (the reason one run per side cannot be compared)
    assert len({r["captured_reuse"] for r in runs}) > 1
    spread = data["router_seed_spread"]["approximate"]["captured_reuse"]
    values = [r["captured_reuse"] for r in runs]
    assert spread["n"] == 4 and spread["mean"] == pytest.approx(statistics.fmean(values))
    assert spread["sd"] == pytest.approx(statistics.stdev(values))
    assert (spread["min"], spread["max"]) == (min(values), max(values))
    assert "mean ± sd over 4 router seeds" in ran.output


def test_seed_spread_groups_by_policy_and_skips_missing_figures() -> None:
    runs = [{"run": "approximate #0", "captured_reuse": 0.9, "ttft_p50_s": 0.2, "ttft_p99_s": None},
            {"run": "approximate #1", "captured_reuse": 0.8, "ttft_p50_s": 0.4, "ttft_p99_s": None},
            {"run": "round-robin #0", "captured_reuse": 0.5, "ttft_p50_s": 0.3, "ttft_p99_s": 1.0}]
    spread = seed_spread(runs)
    assert spread["approximate"]["captured_reuse"]["mean"] == pytest.approx(0.85)
    assert spread["approximate"]["ttft_p50_s"]["sd"] == pytest.approx(statistics.stdev([0.2, 0.4]))
    assert "ttft_p99_s" not in spread["approximate"]
    assert spread["round-robin"]["ttft_p99_s"] == {"mean": 1.0, "sd": 0.0, "min": 1.0, "max": 1.0, "n": 1}
