"""``backfill bench prefix --quick`` on a Mooncake trace file and on every shape at once (split from
``test_bench_commands.py`` so the files run on separate test workers)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from lab.bench.prefix import SHAPES, prefix_command
from lab.toolkit.workloads import read_mooncake


def test_prefix_replays_a_mooncake_trace_file_on_the_long_context_fleet(tmp_path):
    sample = Path(__file__).parent / "data" / "mooncake-sample.jsonl"
    out = tmp_path / "mooncake.json"
    result = CliRunner().invoke(prefix_command, ["--quick", "--trace", str(sample), "--trace-format", "mooncake",
                                                 "--minutes", "1", "--speed", "4", "--policy", "approximate",
                                                 "--policy", "precise", "--json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    assert payload["shape"] == "mooncake" and payload["trace"]["requests"] == 4  # the 400 s record is cut
    for name in ("approximate", "precise"):
        figures = payload["policies"][name]
        if "missing" in figures:
            continue
        assert figures["errors"] == 0, figures.get("first_error")
        assert 0 < figures["captured_reuse"] <= 1.0


def test_prefix_shape_all_quick_prints_a_summary_per_shape(tmp_path):
    out, trace = tmp_path / "all.json", tmp_path / "long-context.jsonl"
    result = CliRunner().invoke(prefix_command, ["--quick", "--shape", "all", "--policy", "round-robin",
                                                 "--write-trace", str(trace), "--json", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    assert list(payload["shapes"]) == list(SHAPES)
    for shape, body in payload["shapes"].items():
        rr = body["policies"]["round-robin"]
        assert rr.get("missing") is None and rr["errors"] == 0, (shape, rr.get("missing"))
        assert set(body["versus_best_peer"]) >= {"best_peer_reuse", "best_peer_ttft_p50_s", "approximate", "precise"}
    assert "ours vs best peer" in result.output
    assert len(read_mooncake(trace)) == payload["shapes"]["long-context"]["trace"]["requests"]
