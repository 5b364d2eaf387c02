"""The one router assembly (router/assembly.py) used without I/O, as the virtual-time simulator will
use it, and the director's decision rules (router/decisions.py) as plain functions."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from director_fakes import Recorder
from scheduling_helpers import FakeClock, prompt, request

from router.assembly import build_router
from router.decisions import (
    BATCH_PREFILL,
    ENGINE_QUEUE,
    NO_FREE_SLOT,
    PREFILL_CLIENT_ERROR,
    decode_share_tokens,
    fallback_prefill_tokens,
    make_room_reason,
    pick_victim,
    should_retry_prefill,
)
from router.flow_control import FlowController
from router.pool import EndpointState, EngineMetrics, PoolState
from router.scheduling.scheduler import SINGLE_PROFILE
from router.scheduling.types import Endpoint
from router.settings import RouterSettings


def engine(name: str, role: str = "both") -> EndpointState:
    return EndpointState(Endpoint(name, role=role), healthy=True, models=["m"])


def test_the_assembly_runs_on_the_given_clock_with_no_event_loop_and_no_network() -> None:
    clock = FakeClock(500.0)
    settings = RouterSettings(engines=[], flow_control_enabled=False, make_room=False)
    parts = build_router(settings, clock, observer=Recorder(), rng=random.Random(0))
    assert type(parts.pool) is PoolState and parts.flow is None and parts.index is None
    assert parts.pool.clock is clock and parts.runtime.clock is clock and parts.director.decisions.clock is clock
    assert parts.runtime.pool is parts.pool and parts.director.pool is parts.pool
    a, b = engine("http://a"), engine("http://b")
    parts.pool.add(a)
    parts.pool.add(b)
    assert parts.runtime.gate_saturation() == 1.0  # never scraped: stale, saturated
    for state in (a, b):
        parts.pool.record_metrics(state, EngineMetrics(num_requests_running=1, kv_cache_usage_perc=0.1))
    assert a.endpoint.metrics_updated_at == 500.0
    assert parts.runtime.gate_saturation() < 1.0
    decision = parts.director.decide(request(prompt(1, 512)), set())
    assert decision is not None and decision.reason == SINGLE_PROFILE and decision.prefill is None
    share = parts.pool.started(decision.decode.endpoint, decode_share_tokens(decision, request(prompt(1, 512))))
    assert share.started_at == 500.0
    parts.pool.mark_down(decision.decode.endpoint.name)  # the pool's on_down hooks reach the director
    assert decision.decode.endpoint not in parts.pool.candidates()
    assert decision.decode.endpoint.in_flight_requests == 0


def test_flow_control_and_the_kv_index_follow_the_settings() -> None:
    parts = build_router(RouterSettings(engines=[]), observer=Recorder(), kv_index=True)
    assert isinstance(parts.flow, FlowController) and parts.runtime.flow is parts.flow
    assert parts.index is not None
    assert parts.director.objective_priority == {b.objective: b.priority for b in parts.flow_config.bands}
    # flex is spare-capacity work: the spare-capacity filter places it, make-room may evict it
    assert parts.director.sheddable_objectives == frozenset({"async", "flex", "batch"})
    with pytest.raises(ValueError, match="not in"):
        build_router(RouterSettings(engines=[], profile="nope"), observer=Recorder())


def test_a_pd_fleet_disaggregates_a_long_prompt_and_the_decode_share_counts_no_prefill() -> None:
    settings = RouterSettings(prefill_engines=["http://p:1"], decode_engines=["http://d:1"], flow_control_enabled=False)
    clock = FakeClock(10.0)
    parts = build_router(settings, clock, observer=Recorder(), rng=random.Random(0))
    for state in (engine("http://p:1", "prefill"), engine("http://d:1", "decode")):
        parts.pool.add(state)
        parts.pool.record_metrics(state, EngineMetrics())
    long = request(prompt(2, 2048))
    decision = parts.director.decide(long, set())
    assert decision is not None and decision.prefill is not None
    assert (decision.decode.endpoint.name, decision.prefill.endpoint.name) == ("http://d:1", "http://p:1")
    assert decode_share_tokens(decision, long) == 0
    assert fallback_prefill_tokens(decision) == decision.uncached_tokens == 2048


def test_a_prefill_refused_as_a_client_error_is_not_retried_and_no_leg_is_tried_a_third_time() -> None:
    assert should_retry_prefill("connect", 1) and should_retry_prefill("status", 1)
    assert should_retry_prefill(None, 1)  # an unknown failure is retried too
    assert not should_retry_prefill(PREFILL_CLIENT_ERROR, 1)
    assert not should_retry_prefill("connect", 2)


def test_make_room_takes_the_lowest_band_then_the_newest_and_names_its_reason() -> None:
    victims = [SimpleNamespace(priority=p, started_at=t, name=n)
               for p, t, n in ((10, 1.0, "batch-old"), (10, 3.0, "batch-new"), (50, 9.0, "async"))]
    assert pick_victim(victims).name == "batch-new"
    full = Endpoint("http://e", max_num_seqs=4, num_requests_running=4, in_flight_requests=4)
    room = Endpoint("http://e", max_num_seqs=4, num_requests_running=2, in_flight_requests=2)
    waiting = Endpoint("http://e", max_num_seqs=4, num_requests_running=2, num_requests_waiting=1, in_flight_requests=2)

    def none(vs):
        return []

    assert make_room_reason(full, victims, make_room=True, evict_on_wait=False, prefilling=none) == (NO_FREE_SLOT, victims)
    assert make_room_reason(full, victims, make_room=False, evict_on_wait=False, prefilling=none) is None
    assert make_room_reason(room, victims, make_room=True, evict_on_wait=False, prefilling=none) is None
    assert make_room_reason(room, [], make_room=True, evict_on_wait=True, prefilling=none) is None
    assert make_room_reason(room, victims, make_room=True, evict_on_wait=True,
                            prefilling=lambda vs: vs[:1]) == (BATCH_PREFILL, victims[:1])
    assert make_room_reason(waiting, victims, make_room=True, evict_on_wait=True, prefilling=none) == (ENGINE_QUEUE, victims)
    assert make_room_reason(room, victims, make_room=True, evict_on_wait=True, prefilling=none) is None
