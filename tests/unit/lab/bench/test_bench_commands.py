"""`backfill bench prefix --quick` writes the JSON shape of ``docs/benchmarks.md``; a router that is
not installed is reported missing, not a failure. (``router-overhead --quick``, and ``prefix`` on a
trace file and on every shape, are in files of their own so they run on separate test workers.)"""

from __future__ import annotations

import json

from click.testing import CliRunner

from lab.bench.prefix import (
    FIGURES,
    build_trace,
    engine_options,
    prefix_command,
    run_policy,
    versus_best_peer,
)
from lab.toolkit import launch
from lab.toolkit.launch import POLICIES
from lab.toolkit.workloads import oracle_reusable_tokens


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def test_prefix_quick_writes_every_policy_with_the_four_figures(tmp_path):
    out = tmp_path / "prefix.json"
    result = CliRunner().invoke(prefix_command, ["--quick", "--json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    assert list(payload["policies"]) == ["round-robin", "approximate", "precise", "vllm-router-cache_aware",
                                         "vllm-router-kv_aware", "sglang-router-cache_aware"]
    for name, figures in payload["policies"].items():
        assert set(FIGURES) <= figures.keys(), name
        if "missing" in figures:
            assert all(figures[key] is None for key in FIGURES), name
            continue
        assert figures["errors"] == 0, (name, figures.get("first_error"))
        assert all(_number(figures[key]) for key in FIGURES), name
        assert 0 < figures["captured_reuse"] <= 1.0
        assert figures["ttft_p50_s"] <= figures["ttft_p99_s"]
        assert sum(figures["engines"]["requests_per_engine"]) == payload["trace"]["requests"]
    # vllm-router is a dev dependency: round-robin always runs
    assert "missing" not in payload["policies"]["round-robin"], payload["policies"]["round-robin"]["missing"]
    assert payload["trace"]["working_set_blocks"] > 0 and payload["fleet"]["engines"] == 2
    assert set(payload["goals"]) >= {"approximate_captured_reuse", "precise_captured_reuse",
                                     "precise_ttft_p50_vs_round_robin", "approximate_ttft_p99_s_vs_best_peer"}


def test_a_peer_that_is_not_installed_is_reported_missing(monkeypatch):
    monkeypatch.setattr(launch, "peer_binary", lambda name: None)
    trace = build_trace(quick=True)
    figures = run_policy("sglang-router-cache_aware", trace, oracle_reusable_tokens(trace).reusable_tokens,
                         engine_options(True, None, None))
    assert "sglang-router is not installed" in figures["missing"]
    assert all(figures[key] is None for key in FIGURES)
    assert POLICIES["vllm-router-kv_aware"].available() is not None


def test_versus_best_peer_picks_the_best_figure_of_any_peer():
    results = {"approximate": {"captured_reuse": 0.9, "ttft_p50_s": 0.5},
               "precise": {"captured_reuse": 0.95, "ttft_p50_s": 0.3},
               "vllm-router-cache_aware": {"captured_reuse": 0.93, "ttft_p50_s": 0.6},
               "sglang-router-cache_aware": {"captured_reuse": 0.8, "ttft_p50_s": 0.4},
               "vllm-router-kv_aware": {"missing": "not installed", "captured_reuse": None, "ttft_p50_s": None}}
    v = versus_best_peer(results)
    assert (v["best_peer_reuse"], v["best_peer_reuse_by"]) == (0.93, "vllm-router-cache_aware")
    assert (v["best_peer_ttft_p50_s"], v["best_peer_ttft_p50_by"]) == (0.4, "sglang-router-cache_aware")
    assert v["approximate"]["reuse_beats"] is False and v["approximate"]["p50_beats"] is False
    assert v["precise"]["reuse_beats"] is True and v["precise"]["p50_beats"] is True
    assert v["precise_reuse_at_least_approximate"] is True
