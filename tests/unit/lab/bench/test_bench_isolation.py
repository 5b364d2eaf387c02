"""``backfill bench isolation``: its workload, statistics and plot helpers, and one ``--quick`` run
through the real stack (engines, router, processor, Redis) checked for the JSON's shape and sense."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from lab.bench.isolation import lane_rates
from lab.toolkit.arrivals import poisson_arrivals
from lab.toolkit.charts import svg_line_chart
from lab.toolkit.interactive import LaneSampler, Sample, summarize
from lab.toolkit.prompts import prompt_text

SVG = "{http://www.w3.org/2000/svg}"


def test_poisson_arrivals_are_seeded_ascending_and_near_the_rate():
    a = poisson_arrivals(50.0, 40.0, seed=3)
    assert a == poisson_arrivals(50.0, 40.0, seed=3)
    assert a != poisson_arrivals(50.0, 40.0, seed=4)
    assert all(0 < x < 40.0 for x in a) and a == sorted(a)
    assert 1800 < len(a) < 2200  # 2,000 expected; a Poisson count's sd is about 45


def test_prompts_have_the_asked_length_and_never_repeat():
    import random

    rng = random.Random(0)
    texts = [prompt_text(rng, 64) for _ in range(200)]
    assert {len(t.encode()) for t in texts} == {256}
    assert len({t[:64] for t in texts}) == 200  # different first 16-token block: no prefix-cache hit


def test_summarize_counts_failures_and_measures_ttft_from_the_send():
    ok = [Sample(scheduled=0.0, sent=0.001, first_token=0.001 + k / 1000, done=1.0, status=200, prompt_tokens=10)
          for k in range(1, 101)]
    failed = Sample(scheduled=0.0, sent=0.002, status=429)
    out = summarize(ok + [failed], duration=10.0)
    assert (out["requests"], out["completed"], out["errors"]) == (101, 100, 1)
    assert out["ttft_ms_p50"] == pytest.approx(50.0)  # nearest rank: the 50th of 100 TTFTs (1 … 100 ms)
    assert out["ttft_ms_max"] == pytest.approx(100.0)
    assert out["completed_rps"] == pytest.approx(10.0) and out["offered_rps"] == pytest.approx(10.1)
    assert out["send_lag_ms_p99"] == pytest.approx(1.0)  # 100 sends 1 ms late, one 2 ms: rank 100 of 101


def test_lane_rates_bin_interactive_completions_and_interpolate_batch_results(monkeypatch):
    monkeypatch.setattr("lab.bench.isolation.BIN_SECONDS", 1.0)
    sampler = LaneSampler(redis=None, router_url="")
    sampler.rows = [{"t": 100.0, "batch_done": 0}, {"t": 102.0, "batch_done": 40}, {"t": 104.0, "batch_done": 40}]
    assert sampler.batch_done_at(101.0) == pytest.approx(20.0)
    assert sampler.batch_done_at(99.0) == 0 and sampler.batch_done_at(200.0) == 40
    done = [Sample(scheduled=0, sent=0, first_token=0, done=100.0 + d, status=200) for d in (0.2, 0.4, 1.5, 3.9)]
    rates = lane_rates(done, [Sample(scheduled=0, status=500, done=100.5)], sampler, t0=100.0, end=104.0)
    assert [v for _, v in rates["interactive"]] == [2.0, 1.0, 0.0, 1.0]
    assert [v for _, v in rates["batch"]] == pytest.approx([20.0, 20.0, 0.0, 0.0])
    assert [t for t, _ in rates["batch"]] == [0.5, 1.5, 2.5, 3.5]
    assert [v for _, v in rates["both lanes"]] == pytest.approx([22.0, 21.0, 0.0, 1.0])


def test_svg_chart_is_well_formed_with_a_line_per_series_and_reference_lines():
    svg = svg_line_chart({"interactive": [(0.5, 10.0), (1.5, 12.0)], "batch <&>": [(0.5, 30.0), (1.5, 28.0)]},
                         title="t", x_label="s", y_label="rps", hlines={"C = 45/s": 45.0}, vlines={"B": 1.0})
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    assert len(root.findall(f"{SVG}polyline")) == 2
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "C = 45/s" in texts and "batch <&>" in texts and "B" in texts


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("isolation")
    proc = subprocess.run([sys.executable, "-m", "backfill", "bench", "isolation", "--quick",
                           "--json", str(out / "iso.json"), "--data-dir", str(out / "data")],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "iso.json").read_text()), (out / "iso.svg").read_text(), proc.stdout


def test_quick_run_reports_both_phases_with_the_same_arrivals(quick_run):
    figures, _, stdout = quick_run
    alone, with_batch = figures["interactive_alone"], figures["interactive_with_batch"]
    for phase in (alone, with_batch):
        assert phase["requests"] > 20 and phase["errors"] == 0 and phase["completed"] == phase["requests"]
        assert 0 < phase["ttft_ms_p50"] <= phase["ttft_ms_p90"] <= phase["ttft_ms_p99"] <= phase["ttft_ms_max"]
        assert phase["prompt_tokens_mean"] > 256  # the prompt plus the chat template
    assert alone["requests"] == with_batch["requests"]  # one arrival sequence, replayed
    assert figures["ttft_p99_ratio"] == pytest.approx(with_batch["ttft_ms_p99"] / alone["ttft_ms_p99"])
    assert "TTFT p99" in stdout and "batch throughput" in stdout


def test_quick_run_batch_uses_the_spare_capacity_through_the_processor(quick_run):
    figures, _, _ = quick_run
    capacity = figures["capacity_rps"]
    assert 0.5 * figures["capacity_model_rps"] < capacity < 1.5 * figures["capacity_model_rps"]
    assert figures["spare_capacity"] == pytest.approx(capacity - figures["interactive_alone"]["offered_rps"])
    assert figures["batch_throughput"] > 0 and figures["batch_completed_in_window"] > 0
    assert figures["batch_vs_spare"] == pytest.approx(figures["batch_throughput"] / figures["spare_capacity"])
    statuses = figures["batch_result_statuses"]
    assert set(statuses) == {"200"} and 0 < statuses["200"] <= figures["batch_requests"]
    # the router saw batch work in its batch band during phase B, none during phase A
    assert figures["router_means_with_batch"]["batch_in_flight"] > 0
    assert figures["router_means_alone"]["batch_in_flight"] == 0


def test_quick_run_plot_has_both_lanes_over_the_whole_run(quick_run):
    figures, svg, _ = quick_run
    rates = figures["lane_rps"]
    assert set(rates) == {"interactive", "batch", "both lanes"}
    marks = figures["phase_marks_s"]
    assert 0 <= marks["A"] < marks["batch enqueued"] < marks["B"] < marks["B end"]
    before_batch = [v for t, v in rates["batch"] if t < marks["batch enqueued"]]
    assert before_batch and not any(before_batch)
    assert any(v > 0 for t, v in rates["batch"] if marks["B"] <= t <= marks["B end"])
    root = ET.fromstring(svg)
    assert len(root.findall(f"{SVG}polyline")) == 3
