"""``backfill bench slots --quick``: one variant through the whole stack (two --max-num-seqs 8
engines that state their slots, behind ``backfill up --engine-url …``, the router restarted
mid-batch), checked for the JSON's shape and the router's view of the slots."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_quick_run_measures_the_batch_before_and_after_a_router_restart(tmp_path):
    out = tmp_path / "slots.json"
    proc = subprocess.run([sys.executable, "-m", "backfill", "bench", "slots", "--quick", "--variant", "stated",
                           "--json", str(out), "--data-dir", str(tmp_path / "data")],
                          capture_output=True, text=True, timeout=400, env=dict(os.environ, COLUMNS="160"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    run = figures["variants"]["stated"]
    assert run["fleet_rps"] > 0 and run["before_rps"] > 0 and run["after_rps"] > 0
    assert run["after_ratio"] == run["after_rps"] / run["fleet_rps"]
    assert run["restart_s"] > 0
    for view in (run["before_router"], run["after_router"]):  # the engines' own figure, before and after
        assert [(e["max_num_seqs"], e["slots_source"], e["slot_reserve"]) for e in view] == [(8, "stated", 1)] * 2
    # the batch holds at most slots − reserve per engine: 7 of 8
    assert 0 < run["before_running"] <= 7 and 0 < run["after_running"] <= 7
    assert figures["goal_after_ratio"] == 0.9
