"""The engine-level frontier harness (model time): deterministic points, the background budget and
evict-and-resume acting as the bench says, one plotted line per policy."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from lab.bench.frontier import Policy, Sim, frontier, interactive_request_seconds, svg_frontier

OPTS = {"load": 0.5, "duration": 8.0, "warmup": 1.0, "prompt_tokens": 269, "max_tokens": 16, "seed": 1,
        "max_num_seqs": 256, "capacity_concurrency": 32}


def test_the_background_budget_keeps_interactive_ttft_near_alone_where_plain_v1_does_not():
    figures = frontier(OPTS, [Policy("none"), Policy("bg-cap 512", bg_cap=512)], [16])
    none, capped = figures["points"]
    assert figures["capacity_rps"] > 0 and figures["little_reserve"] >= 1
    assert none["p99_ratio"] > 2.0  # batch prefills share the interactive requests' steps
    assert capped["p99_ratio"] < 1.3 and capped["batch_rps"] > 0
    assert frontier(OPTS, [Policy("none")], [16])["points"][0] == none  # model time: the same every run


def test_evict_and_resume_counts_evictions_and_the_redo_finds_the_prompt_cached():
    rate = 40.0
    sim = Sim(Policy("evict", evict=True), 8, rate, 8.0, 1.0, 269, 16, 1)
    sim.run()
    assert sim.evictions > 0 and sim.batch_done > 0
    # every victim was queued or prefilling: with its full blocks cached, little is lost per eviction
    assert 0 <= sim.wasted / sim.evictions < 269


def test_interactive_request_time_is_its_prefill_step_and_fifteen_decode_steps():
    seconds = interactive_request_seconds(269, 16)
    assert 0.13 < seconds < 0.15  # ≈ 17 ms prefill + 15 × 8.3 ms


def test_the_plot_has_a_line_per_policy_and_the_goal():
    figures = frontier({**OPTS, "duration": 3.0}, [Policy("none"), Policy("evict", evict=True)], [2, 4])
    root = ET.fromstring(svg_frontier(figures))
    assert len(root.findall("{http://www.w3.org/2000/svg}polyline")) == 2
    assert "goal ≤ 1.10" in svg_frontier(figures)
