"""The virtual-time fleet: determinism, no sleeping, the production plugins, a trace by hand."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine_twin.settings import build_settings
from lab.simulate.clock import VirtualClock
from lab.simulate.sim import SimConfig, Simulation
from lab.simulate.workload import mooncake_requests, synthetic_requests
from lab.toolkit.workloads import MooncakeRecord
from router.scheduling.plugins.affinity_filter import PrefixCacheAffinityFilter
from router.scheduling.plugins.prefix import PrecisePrefixCacheProducer
from router.scheduling.registry import builtin_factories

# figures that depend on the machine (real time), not on the simulation
_REAL_TIME = {"wall_s", "wall_us_per_request", "decision_p50_ms", "decision_p99_ms", "max_rss_mib"}


def _run(policy: str, seed: int = 5, n: int = 300, engines: int = 3, **cfg) -> dict:
    sim = Simulation(SimConfig(engines=engines, seed=seed, **cfg), policy,
                     synthetic_requests(n, seed=seed, rate_per_s=15.0))
    return sim.run()


@pytest.mark.parametrize("policy", ["round-robin", "approximate", "precise"])
def test_same_seed_gives_the_same_figures(policy: str) -> None:
    a, b = _run(policy), _run(policy)
    assert {k: v for k, v in a.items() if k not in _REAL_TIME} == {k: v for k, v in b.items() if k not in _REAL_TIME}
    assert a["completed"] == a["requests"] == 300
    other = _run(policy, seed=6)
    assert other["cached_tokens"] != a["cached_tokens"]  # the seed matters


def test_an_hour_of_virtual_time_never_sleeps_nor_reads_the_monotonic_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the simulation must not sleep or read time.monotonic")

    sim = Simulation(SimConfig(engines=2), "precise", synthetic_requests(150, seed=1, rate_per_s=0.02))
    monkeypatch.setattr(time, "sleep", forbidden)
    monkeypatch.setattr(time, "monotonic", forbidden)
    monkeypatch.setattr(asyncio, "sleep", forbidden)
    figures = sim.run()
    assert figures["virtual_s"] > 3600
    assert figures["completed"] == 150
    # every clock production code was given is the virtual one (defaults bound to time.monotonic
    # at definition time would escape the patch above)
    assert isinstance(sim.clock, VirtualClock)
    assert sim.pool.clock is sim.clock and sim.runtime.clock is sim.clock
    assert sim.index is not None and sim.index._clock is sim.clock
    assert sim.saturation_gate.clock is sim.clock and sim.director.decisions.clock is sim.clock
    for plugin in sim.plugins():
        for attr in ("clock", "_clock"):
            if hasattr(plugin, attr):
                assert getattr(plugin, attr) is sim.clock, plugin


def test_the_production_plugins_are_the_ones_called(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = Simulation(SimConfig(engines=3), "precise", synthetic_requests(120, seed=2, rate_per_s=10.0))
    profile = sim.scheduler.profiles[sim.profile]
    types = {type(p) for p in sim.plugins()}
    assert PrecisePrefixCacheProducer in types and PrefixCacheAffinityFilter in types
    assert {p.plugin_type for p in sim.plugins()} <= set(builtin_factories())  # built by the registry
    affinity = next(f for f in profile.filters if isinstance(f, PrefixCacheAffinityFilter))
    calls = []
    real = affinity.filter

    def spy(state, request, endpoints):  # type: ignore[no-untyped-def]
        calls.append(request.request_id)
        return real(state, request, endpoints)

    monkeypatch.setattr(affinity, "filter", spy)
    producer = next(p for p in profile.producers if isinstance(p, PrecisePrefixCacheProducer))
    assert producer.index is sim.index
    figures = sim.run()
    # one decision per request, and one more for each evicted by make-room and sent again
    assert len(calls) == figures["completed"] + figures["make_room_evictions"] == len(sim.observer.decision_s)
    assert sim.index.stats()["blocks"] > 0  # the engines' KV events reached the router's index


def test_a_tiny_trace_by_hand() -> None:
    """One engine, three requests far apart, one output token each (ends at its first token).

    The step model of engine_twin/step_model.py with the twin's default constants (Llama-3.1-8B on
    an H100): fixed = 8.03e9 × 2 B / (3350e9 B/s × 0.77) + 2 ms; per token 2 × 8.03e9 / (989e12 ×
    0.5); per (query, key) pair 4 × 32 × 32 × 128 / (989e12 × 0.5); per context token 131,072 B /
    (3350e9 × 0.77). A request alone prefills in one step (prompt ≤ 8,192 tokens), so its TTFT is
    that step.
    """
    fixed = 8.03e9 * 2 / (3350e9 * 0.77) + 0.002
    tok = 2 * 8.03e9 / (989e12 * 0.5)
    pair = 4 * 32 * 32 * 128 / (989e12 * 0.5)
    ctx = 131072 / (3350e9 * 0.77)
    records = [MooncakeRecord(0, 512, 1, (1,)),          # 512 new tokens
               MooncakeRecord(10_000, 1024, 1, (1, 2)),  # block 1 cached: 512 tokens computed after 512
               MooncakeRecord(20_000, 256, 1, (3,))]     # unrelated: nothing cached
    sim = Simulation(SimConfig(engines=1, gpu_blocks=1024), "round-robin", mooncake_requests(records))
    figures = sim.run()
    ttft_1 = fixed + 512 * tok + (512 * 513 // 2) * pair
    ttft_2 = fixed + 512 * tok + (512 * 512 + 512 * 513 // 2) * pair + 512 * ctx
    ttft_3 = fixed + 256 * tok + (256 * 257 // 2) * pair
    assert list(sim.ttft) == pytest.approx([ttft_1, ttft_2, ttft_3], rel=1e-9)
    assert list(sim.cached) == [0, 512, 0]
    assert list(sim.oracle) == [0, 512, 0]
    assert figures["captured_reuse"] == 1.0
    assert figures["ttft_p50_s"] == pytest.approx(ttft_1)
    assert build_settings().step_overhead_ms == 2.0  # the constant the hand figures use


def test_a_smaller_cache_loses_reuse_and_precise_reads_the_events() -> None:
    big = _run("precise", n=400, engines=2)
    small = _run("precise", n=400, engines=2, gpu_blocks=1100)
    assert small["captured_reuse"] < big["captured_reuse"]
    assert big["index_bytes"] > 0


def test_batch_lane_goes_through_the_processor_and_every_request_ends() -> None:
    sim = Simulation(SimConfig(engines=2), "approximate", synthetic_requests(400, seed=3, rate_per_s=20.0,
                                                                              batch_share=0.5))
    figures = sim.run()
    lanes = {g["lane"] for g in figures["by_lane_tenant"].values()}
    assert {"interactive", "batch"} <= lanes
    assert sim.gates.admitted >= sum(g["requests"] for g in figures["by_lane_tenant"].values() if g["lane"] != "interactive")
    assert figures["completed"] + sum(figures["dropped"].values()) == figures["requests"]
    assert not sim.live and not sim.held
