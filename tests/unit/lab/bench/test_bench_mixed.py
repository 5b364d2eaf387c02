"""``backfill bench mixed``: its workload and figure helpers, and one ``--quick`` run through the
whole stack (two slot-bound engines behind ``backfill up --engine-url …``) checked for the JSON's
shape and sense."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import click
import orjson
import pytest

from lab.bench.mixed import (
    DEFAULT_SOURCE,
    PROBE_TIMEOUT_SECONDS,
    SMALL_LINES,
    TENANTS,
    jsonl,
    movie_descriptions,
    probe_figures,
    ratio,
    served_names,
    shared_prefix_batch,
    wait_figures,
)

needs_source = pytest.mark.skipif(not DEFAULT_SOURCE.exists(), reason=f"{DEFAULT_SOURCE} is not beside the repository")


def test_movie_descriptions_are_seeded_and_all_different():
    a = movie_descriptions(500, "s")
    assert a == movie_descriptions(500, "s")
    assert a != movie_descriptions(500, "t")
    assert len(set(a)) == 500
    assert all(40 < len(text) < 200 and text.endswith(".") for text in a)


@needs_source
def test_shared_prefix_batch_keeps_the_file_lines_then_varies_only_the_description():
    source = [orjson.loads(raw) for raw in DEFAULT_SOURCE.read_bytes().splitlines() if raw.strip()]
    lines = shared_prefix_batch(DEFAULT_SOURCE, 40, "x")
    assert len(lines) == 40
    assert lines[:len(source)] == source  # the cookbook's own lines first, unchanged
    ids = [line["custom_id"] for line in lines]
    assert len(set(ids)) == 40
    systems = {json.dumps(line["body"]["messages"][:-1]) for line in lines}
    assert len(systems) == 1  # one shared system prompt
    users = [line["body"]["messages"][-1]["content"] for line in lines]
    assert len(set(users)) == 40
    rest = {k: v for k, v in lines[-1]["body"].items() if k != "messages"}
    assert rest == {k: v for k, v in source[0]["body"].items() if k != "messages"}  # model, response_format, …
    assert shared_prefix_batch(DEFAULT_SOURCE, 40, "x") == lines
    small = shared_prefix_batch(DEFAULT_SOURCE, SMALL_LINES, "b", use_file_lines=False)
    assert not {line["body"]["messages"][-1]["content"] for line in small} & {
        line["body"]["messages"][-1]["content"] for line in source}
    assert jsonl(small).count(b"\n") == SMALL_LINES
    assert served_names(lines) == ["sim-model", source[0]["body"]["model"]]


def test_shared_prefix_batch_refuses_a_missing_file(tmp_path):
    with pytest.raises(click.ClickException, match="cannot read"):
        shared_prefix_batch(tmp_path / "absent.jsonl", 10, "x")


def test_probe_figures_count_a_timeout_at_the_timeout():
    figures = probe_figures([(0.2, True), (0.4, True), (PROBE_TIMEOUT_SECONDS, False)], 6.0)
    assert figures["requests"] == 3 and figures["ok"] == 2 and figures["timeouts"] == 1
    assert figures["latency_ms_p50"] == pytest.approx(400.0)
    assert figures["latency_ms_max"] == pytest.approx(PROBE_TIMEOUT_SECONDS * 1000)
    assert figures["offered_rps"] == 0.5
    assert math.isnan(ratio(1.0, 0.0)) and math.isnan(ratio(math.nan, 1.0)) and ratio(3.0, 2.0) == 1.5


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    if not DEFAULT_SOURCE.exists():
        pytest.skip(f"{DEFAULT_SOURCE} is not beside the repository")
    out = tmp_path_factory.mktemp("mixed")
    proc = subprocess.run([sys.executable, "-m", "backfill", "bench", "mixed", "--quick",
                           "--json", str(out / "mixed.json"), "--data-dir", str(out / "data")],
                          capture_output=True, text=True, timeout=480, env=dict(os.environ, COLUMNS="160"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "mixed.json").read_text()), proc.stdout


def test_quick_run_measures_every_part_alone_and_mixed(quick_run):
    figures, stdout = quick_run
    queued, direct, asyncs = figures["queued_interactive"], figures["direct_interactive"], figures["async_trickle"]
    for phase in (queued["idle"], queued["mixed"], asyncs["alone"], asyncs["mixed"]):
        assert phase["requests"] > 0 and phase["ok"] == phase["requests"] and phase["timeouts"] == 0
        assert 0 < phase["latency_ms_p50"] <= phase["latency_ms_max"] < PROBE_TIMEOUT_SECONDS * 1000
    assert direct["alone"]["requests"] == direct["mixed"]["requests"] > 0  # one arrival sequence, replayed
    for phase in direct.values():
        assert phase["errors"] == 0 and 0 < phase["ttft_ms_p50"] <= phase["ttft_ms_p99"]
    assert figures["queued_interactive_ratio"] == pytest.approx(
        queued["mixed"]["latency_ms_p50"] / queued["idle"]["latency_ms_p50"])
    assert figures["direct_ttft_p99_ratio"] == pytest.approx(direct["mixed"]["ttft_ms_p99"] / direct["alone"]["ttft_ms_p99"])
    assert set(figures["small_tenants"]) == set(TENANTS[1:])
    for small in figures["small_tenants"].values():
        assert small["alone"]["completed"] and small["alone"]["lines_done"] == SMALL_LINES
        assert small["ratio"] == pytest.approx(small["mixed"]["seconds"] / small["alone"]["seconds"])
        assert small["lower_bound"] == (not small["mixed"]["completed"])
    for label in ("queued interactive p50", "direct TTFT p99", "tenant-b completion", "served per engine",
                  "batch req/s ÷ spare"):
        assert label in stdout


def test_quick_run_counts_the_batch_against_the_spare_capacity(quick_run):
    figures, _ = quick_run
    served = figures["engine_served_while_batch_runs"]
    assert len(served) == 2 and sum(served) > 0
    assert figures["engine_balance"] == pytest.approx(min(served) / max(served))
    assert figures["interactive_load_rps"] == pytest.approx(
        figures["direct_interactive"]["mixed"]["offered_rps"] + figures["queued_interactive"]["mixed"]["offered_rps"]
        + figures["async_trickle"]["mixed"]["offered_rps"])
    assert figures["spare_capacity_rps"] == pytest.approx(figures["capacity_rps"] - figures["interactive_load_rps"])
    assert figures["batch_completed_in_window"] > 0 and not figures["batch_drained_early"]
    assert figures["batch_vs_spare"] == pytest.approx(figures["batch_throughput_rps"] / figures["spare_capacity_rps"])
    # the engines cannot serve more than their capacity (a loose bound: C is measured on few requests)
    assert 0 < figures["engine_used_vs_capacity"] < 1.5
    assert set(figures["goals_met"]) == {"queued_interactive_ratio", "direct_ttft_p99_ratio", "small_tenant_ratio",
                                         "engine_balance", "batch_vs_spare", "surface_queued_p50_vs_plain",
                                         "surface_direct_ttft_p99_vs_plain", "async_wait_vs_batch_wait"}


def test_quick_run_adds_background_responses_and_flex_beside_the_same_mix(quick_run):
    figures, stdout = quick_run
    surface = figures["async_surface"]
    background, flex = surface["background_responses"], surface["flex"]
    assert background["requests"] > 0 and background["completed"] == background["requests"], background
    assert 0 < background["ended_ms_p50"] <= background["ended_ms_p90"]
    assert flex["requests"] > 0 and flex["ok"] + flex["statuses"].get("429", 0) == flex["requests"], flex
    assert flex["tier_flex"] == flex["ok"]  # every answered flex call says it was served as flex
    assert flex["codes_429"] in ([], ["resource_unavailable"])
    direct = surface["direct_interactive"]
    assert direct["requests"] == figures["direct_interactive"]["mixed"]["requests"] and direct["errors"] == 0
    assert surface["queued_interactive"]["ok"] == surface["queued_interactive"]["requests"] > 0
    assert surface["queued_p50_vs_plain"] == pytest.approx(
        surface["queued_interactive"]["latency_ms_p50"] / figures["queued_interactive"]["mixed"]["latency_ms_p50"])
    assert figures["surface_direct_ttft_p99_vs_plain"] == surface["direct_ttft_p99_vs_plain"] == pytest.approx(
        direct["ttft_ms_p99"] / figures["direct_interactive"]["mixed"]["ttft_ms_p99"])
    waits = surface["lane_waits"]
    # every background response and async probe of the window started on the async lane; batch lines ran too
    assert waits["async"]["started"] >= background["requests"] + surface["async_trickle"]["requests"]
    assert waits["batch"]["started"] > 0 and waits["batch"]["mean_ms"] > 0
    assert figures["async_wait_vs_batch_wait"] == pytest.approx(waits["async"]["mean_ms"] / waits["batch"]["mean_ms"])
    for label in ("mixed with the async surface", "lane wait mean", "background responses:", "flex calls:"):
        assert label in stdout


def test_lane_wait_figures_are_the_histogram_deltas():
    before = {"batch": (2.0, 1.0, [(0.1, 1.0), (1.0, 2.0), (math.inf, 2.0)])}
    after = {"batch": (6.0, 9.0, [(0.1, 1.0), (1.0, 3.0), (math.inf, 6.0)]), "async": (1.0, 0.05, [(0.1, 1.0)])}
    batch = wait_figures(before, after, "batch")
    assert batch["started"] == 4 and batch["mean_ms"] == pytest.approx(2000.0)
    assert batch["p50_bound_ms"] == math.inf and batch["p90_bound_ms"] == math.inf  # 3 of 4 past 1 s
    assert wait_figures(before, after, "async") == {"started": 1, "mean_ms": pytest.approx(50.0),
                                                   "p50_bound_ms": 100.0, "p90_bound_ms": 100.0}
    assert math.isnan(wait_figures({}, {}, "batch")["mean_ms"])
