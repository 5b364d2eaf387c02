"""Saturation: max(waiting / 5, kv / 0.8) per endpoint; stale metrics saturated; the scrape-lag
credit per endpoint; the per-engine gate (least saturated) against the pool's mean; the router's
runtime reading one computation for flow control and /admin/state."""

import time
from types import SimpleNamespace

import pytest

from router.app import RouterRuntime
from router.scheduling.saturation import (
    SaturationThresholds,
    endpoint_saturation,
    fleet_saturation,
    gate_saturation,
    pool_saturation,
    slot_reserve,
)
from router.scheduling.types import Endpoint
from router.settings import RouterSettings

NOW = 100.0


def fresh(**fields) -> Endpoint:
    return Endpoint("http://e", metrics_updated_at=NOW - 0.05, **fields)


def test_each_endpoint_takes_its_most_constrained_resource():
    assert endpoint_saturation(fresh(num_requests_waiting=2, kv_cache_usage_perc=0.2), NOW) == pytest.approx(0.4)
    assert endpoint_saturation(fresh(num_requests_waiting=1, kv_cache_usage_perc=0.6), NOW) == pytest.approx(0.75)
    assert endpoint_saturation(fresh(num_requests_waiting=10, kv_cache_usage_perc=0.0), NOW) == pytest.approx(2.0)


def test_pool_is_the_average_over_endpoints():
    pool = [fresh(num_requests_waiting=2, kv_cache_usage_perc=0.2), fresh(kv_cache_usage_perc=0.6), fresh()]
    assert pool_saturation(pool, NOW) == pytest.approx((0.4 + 0.75 + 0.0) / 3)


def test_stale_or_missing_metrics_count_as_saturated():
    stale = Endpoint("http://s", metrics_updated_at=NOW - 0.201)
    never = Endpoint("http://n")
    idle = fresh()
    assert endpoint_saturation(stale, NOW) == 1.0
    assert endpoint_saturation(never, NOW) == 1.0
    assert pool_saturation([stale, never, idle], NOW) == pytest.approx(2 / 3)
    assert pool_saturation([stale], NOW, SaturationThresholds(max_metrics_age_s=0.5)) == 0.0


def test_empty_pool_is_saturated_and_thresholds_must_be_positive():
    assert pool_saturation([], NOW) == 1.0
    with pytest.raises(ValueError):
        SaturationThresholds(queue_threshold=0)


def test_in_flight_credit_adds_dispatches_the_scrape_does_not_show_yet():
    ep = fresh(num_requests_waiting=1, num_requests_running=2, in_flight_requests=6)
    assert endpoint_saturation(ep, NOW) == pytest.approx(0.2)
    assert endpoint_saturation(ep, NOW, SaturationThresholds(in_flight_credit=True)) == pytest.approx((1 + 3) / 5)


CREDIT = SaturationThresholds(in_flight_credit=True)


def test_in_flight_credit_spends_the_engines_free_slots_first():
    # seen running 4 at once, running 2 now: 2 free slots; 5 forwarded, 2 shown → 3 unseen, 1 waits
    ep = fresh(num_requests_running=2, peak_running=4, in_flight_requests=5)
    assert endpoint_saturation(ep, NOW, CREDIT) == pytest.approx(1 / 5)
    ep.in_flight_requests = 4  # 2 unseen fit the 2 free slots
    assert endpoint_saturation(ep, NOW, CREDIT) == 0.0


def test_the_gate_opens_on_one_idle_engine_while_the_mean_reads_saturated():
    full = Endpoint("http://full", metrics_updated_at=NOW, num_requests_running=4, num_requests_waiting=10,
                    peak_running=4, in_flight_requests=14)
    idle = Endpoint("http://idle", metrics_updated_at=NOW, peak_running=4)
    values = fleet_saturation([full, idle], NOW, CREDIT)
    assert values == [pytest.approx(2.0), 0.0]
    assert pool_saturation([full, idle], NOW, CREDIT) == pytest.approx(1.0)  # the mean: "closed"
    assert gate_saturation(values) == 0.0  # per engine: open, the idle one has room
    assert gate_saturation([]) == 1.0


def test_pending_requests_fill_free_slots_then_queue_on_the_least_saturated_engines():
    a = Endpoint("http://a", metrics_updated_at=NOW, num_requests_running=4, peak_running=4, in_flight_requests=4)
    b = Endpoint("http://b", metrics_updated_at=NOW, num_requests_running=1, peak_running=4, in_flight_requests=1)
    stale = Endpoint("http://stale", metrics_updated_at=NOW - 10)
    # b has 3 free slots: 3 pending go there free; the next 10 queue, 5 on each engine, in turn
    assert fleet_saturation([a, b, stale], NOW, CREDIT, pending=3) == [0.0, 0.0, 1.0]
    assert fleet_saturation([a, b, stale], NOW, CREDIT, pending=13) == [pytest.approx(1.0), pytest.approx(1.0), 1.0]
    assert gate_saturation(fleet_saturation([a, b], NOW, CREDIT, pending=12)) == pytest.approx(4 / 5)


class FakePool:
    def __init__(self, endpoints: list[Endpoint]) -> None:
        self.eps = endpoints

    def candidates(self) -> list[Endpoint]:
        return self.eps

    def expire_prefills(self) -> None:
        pass


def test_router_runtime_gates_flow_control_per_engine_and_counts_released_requests():
    now = time.monotonic() + 60  # fresh for the test's duration
    full = Endpoint("http://full", metrics_updated_at=now, num_requests_running=4, num_requests_waiting=10,
                    peak_running=4, in_flight_requests=14)
    idle = Endpoint("http://idle", metrics_updated_at=now, peak_running=4)
    rt = RouterRuntime(RouterSettings(engines=[]))
    rt.pool = FakePool([full, idle])  # type: ignore[assignment]
    assert rt.saturation() == pytest.approx(1.0)
    assert rt.gate_saturation() == 0.0
    # flow control released 4 + 5 the scheduler has not forwarded yet: the idle engine's 4 slots,
    # then 5 waiting there → no engine has room
    rt.flow = SimpleNamespace(in_flight_requests=14 + 9)  # type: ignore[assignment]
    assert rt.endpoint_saturations() == {"http://full": pytest.approx(2.0), "http://idle": pytest.approx(1.0)}
    assert rt.gate_saturation() == pytest.approx(1.0)
    assert rt.scheduling_saturation(idle) == 0.0  # placement reads the engine itself


def slotted(name: str = "http://e", *, slots: int = 4, **fields) -> Endpoint:
    """A fresh endpoint whose slot count the router learned (``slots``)."""
    return Endpoint(name, metrics_updated_at=NOW, peak_running=slots, learned_max_num_seqs=slots, **fields)


def test_the_reserve_is_a_tenth_of_the_slots_at_least_one_never_all():
    assert [slot_reserve(n) for n in (1, 2, 4, 10, 11, 256)] == [0, 1, 1, 1, 2, 26]
    assert slot_reserve(4, SaturationThresholds(slot_reserve_fraction=0.5)) == 2
    assert slot_reserve(4, SaturationThresholds(slot_reserve_fraction=0.0, min_slot_reserve=0)) == 0
    with pytest.raises(ValueError):
        SaturationThresholds(slot_reserve_fraction=1.5)


def test_with_slots_known_sheddable_work_stops_at_slots_minus_reserve():
    # 4 slots, reserve 1: the third sheddable request in flight closes the engine to sheddable work
    ep = slotted(num_requests_running=2, in_flight_requests=2, in_flight_sheddable=2)
    assert endpoint_saturation(ep, NOW, CREDIT) == pytest.approx(2 / 3)
    ep.in_flight_requests = ep.in_flight_sheddable = ep.num_requests_running = 3
    assert endpoint_saturation(ep, NOW, CREDIT) == pytest.approx(1.0)
    # interactive requests in flight do not take the sheddable share (they may use every slot)
    ep = slotted(num_requests_running=3, in_flight_requests=3, in_flight_sheddable=1)
    assert endpoint_saturation(ep, NOW, CREDIT) == pytest.approx(1 / 3)
    # a configured max_num_seqs wins over the learned one
    ep = slotted(slots=4, max_num_seqs=11, in_flight_requests=3, in_flight_sheddable=3, num_requests_running=3)
    assert endpoint_saturation(ep, NOW, CREDIT) == pytest.approx(3 / 9)


def test_with_slots_known_any_waiting_request_closes_the_engine_to_sheddable_work():
    ep = slotted(num_requests_running=4, num_requests_waiting=1, in_flight_requests=5, in_flight_sheddable=1)
    assert endpoint_saturation(ep, NOW, CREDIT) == 1.0  # llm-d's detector alone: 1 / 5
    # requests forwarded beyond the free slots that the scrape does not show yet count as waiting
    ep = slotted(num_requests_running=3, in_flight_requests=5, in_flight_sheddable=1)
    assert endpoint_saturation(ep, NOW, CREDIT) == 1.0
    ep.in_flight_requests = 4  # the one unseen fits the free slot
    assert endpoint_saturation(ep, NOW, CREDIT) == pytest.approx(1 / 3)


def test_before_the_slots_are_known_the_detector_is_llm_ds():
    ep = fresh(num_requests_running=4, num_requests_waiting=1, peak_running=4, in_flight_requests=5,
               in_flight_sheddable=5)
    assert endpoint_saturation(ep, NOW, CREDIT) == pytest.approx(1 / 5)


def test_pending_requests_count_as_sheddable_where_they_are_placed():
    a = slotted("http://a", num_requests_running=2, in_flight_requests=2, in_flight_sheddable=2)
    b = slotted("http://b", num_requests_running=1, in_flight_requests=1, in_flight_sheddable=1)
    # the first pending one goes to the less saturated b; 3 fill both engines' 3 sheddable slots
    assert fleet_saturation([a, b], NOW, CREDIT, pending=1) == [pytest.approx(2 / 3), pytest.approx(2 / 3)]
    assert fleet_saturation([a, b], NOW, CREDIT, pending=3) == [pytest.approx(1.0), pytest.approx(1.0)]
    assert gate_saturation(fleet_saturation([a, b], NOW, CREDIT, pending=2)) == pytest.approx(2 / 3)


def test_router_runtime_gate_and_admin_values_read_the_reserve():
    now = time.monotonic() + 60
    a = Endpoint("http://a", metrics_updated_at=now, num_requests_running=3, peak_running=4,
                 learned_max_num_seqs=4, in_flight_requests=3, in_flight_sheddable=3)
    b = Endpoint("http://b", metrics_updated_at=now, num_requests_running=3, peak_running=4,
                 learned_max_num_seqs=4, in_flight_requests=3, in_flight_sheddable=2)
    rt = RouterRuntime(RouterSettings(engines=[]))
    rt.pool = FakePool([a, b])  # type: ignore[assignment]
    assert rt.endpoint_saturations() == {"http://a": pytest.approx(1.0), "http://b": pytest.approx(2 / 3)}
    assert rt.gate_saturation() == pytest.approx(2 / 3)
    rt.flow = SimpleNamespace(in_flight_requests=6 + 1)  # type: ignore[assignment]  # one released, unforwarded
    assert rt.gate_saturation() == pytest.approx(1.0)  # it takes b's last sheddable slot
    rt = RouterRuntime(RouterSettings(engines=[], slot_reserve_fraction=0.0, min_slot_reserve=0))
    rt.pool = FakePool([a, b])  # type: ignore[assignment]
    assert rt.endpoint_saturations() == {"http://a": pytest.approx(3 / 4), "http://b": pytest.approx(2 / 4)}


# ---- issue 13: the reserve sized by Little's law, the batch prefill share ----------------------


def test_little_reserve_is_the_p99_of_the_interactive_requests_on_the_engine():
    from router.scheduling.saturation import little_reserve

    # L = 5/s × 0.2 s = 1: ⌈1 + 2.326 × 1⌉ = 4; L = 25/s × 0.4 s = 10: ⌈10 + 2.326 × √10⌉ = ⌈17.36⌉ = 18
    assert little_reserve(5.0, 0.2) == 4 and little_reserve(25.0, 0.4) == 18
    assert little_reserve(0.0, 0.3) == 0 and little_reserve(25.0, 0.4, slots=8) == 7  # sheddable keeps one


def test_reserve_from_arrivals_raises_the_reserve_with_the_measured_interactive_load():
    from router.scheduling.saturation import endpoint_reserve, reserve_in_use

    on = SaturationThresholds(in_flight_credit=True, reserve_from_arrivals=True)
    ep = slotted(slots=32, max_num_seqs=32, interactive_rate_per_s=5.0, interactive_rate_at=NOW,
                 mean_interactive_duration_s=0.2, in_flight_requests=10, in_flight_sheddable=8)
    assert endpoint_reserve(ep, NOW, CREDIT) == 4  # the fixed tenth: ⌈3.2⌉
    assert endpoint_reserve(ep, NOW, on) == 4  # Little: L = 1 → 4
    ep.interactive_rate_per_s = 25.0
    ep.mean_interactive_duration_s = 0.4
    assert endpoint_reserve(ep, NOW, on) == 18 and reserve_in_use(ep, NOW, on) == 2
    # the sheddable share is 32 − 18 = 14 slots: 8 sheddable in flight read 8/14
    assert endpoint_saturation(ep, NOW, on) == pytest.approx(8 / 14)
    # the rate decays with the 10-s time constant when no interactive request comes
    assert ep.interactive_rate(NOW + 10.0) == pytest.approx(25.0 / 2.718281828, rel=1e-6)


def test_the_batch_prefill_share_bounds_sheddable_prompt_tokens_in_prefill():
    share = SaturationThresholds(in_flight_credit=True, batch_prefill_share=0.125)  # 1,024 of 8,192 tokens
    ep = fresh(in_flight_sheddable_prefill_tokens=512)
    assert endpoint_saturation(ep, NOW, share) == pytest.approx(0.5)
    ep.in_flight_sheddable_prefill_tokens = 1024
    assert endpoint_saturation(ep, NOW, share) == pytest.approx(1.0)
    assert endpoint_saturation(ep, NOW, share, reserve=False) == 0.0  # interactive work is never held by it
    assert endpoint_saturation(ep, NOW, CREDIT) == 0.0  # off by default
    with pytest.raises(ValueError):
        SaturationThresholds(batch_prefill_share=0.0)


def test_scheduling_saturation_reads_the_same_working_set_entry_as_the_whole_map():
    """RouterRuntime.scheduling_saturation with the session plugin's per-endpoint read equals the
    value from the whole map (a plain callable source), endpoint by endpoint."""
    from scheduling_helpers import FakeClock, request

    from router.scheduling.interfaces import PluginHandle
    from router.scheduling.plugins.session import build_session_filter, working_set_of
    from router.scheduling.scheduler import SchedulingResult
    from router.scheduling.types import CycleState

    clock = FakeClock(NOW)
    eps = [Endpoint(f"http://e{i}", metrics_updated_at=NOW, block_size=16, num_gpu_blocks=100,
                    kv_cache_usage_perc=0.1 * i, peak_running=4) for i in range(4)]
    plugin = build_session_filter("session", None, PluginHandle(clock=clock))
    for i, ep in enumerate(eps[:3]):
        req = request(list(range(300 * (i + 1))), session_id=f"s{i}")
        plugin.pre_request(req, SchedulingResult("default", ep, [ep], [0.0], {}, CycleState()))
        plugin.response_complete(req, ep, None)
    fast, slow = RouterRuntime(RouterSettings(engines=[]), clock=clock), RouterRuntime(RouterSettings(engines=[]), clock=clock)
    for rt in (fast, slow):
        rt.pool = FakePool(eps)  # type: ignore[assignment]
    fast.working_set = working_set_of([plugin])
    slow.working_set = lambda: plugin.working_set_tokens()
    values = [fast.scheduling_saturation(ep) for ep in eps]
    assert values == [slow.scheduling_saturation(ep) for ep in eps]
    assert values[1] > eps[1].kv_cache_usage_perc / 0.8  # the working set counts
    assert values[3] == pytest.approx(eps[3].kv_cache_usage_perc / 0.8)  # none there


@pytest.mark.parametrize("seed", range(6))
def test_the_gate_reads_equal_the_gate_over_the_admin_values(seed):
    """gate_saturation / unreserved_gate_saturation (computed without the name map) equal the gate
    over endpoint_saturations(), on randomized fleets, split into P/D pools or not."""
    import random

    rng = random.Random(seed)
    eps = [Endpoint(f"http://e{i}", metrics_updated_at=NOW - rng.choice((0.0, 0.05, 1.0)),
                    num_requests_running=rng.randrange(5), num_requests_waiting=rng.choice((0, 0, 2, 6)),
                    kv_cache_usage_perc=rng.random(), peak_running=4, in_flight_requests=rng.randrange(8),
                    in_flight_sheddable=rng.randrange(3), learned_max_num_seqs=rng.choice((None, 4, 8)),
                    role=rng.choice(("both", "both", "prefill", "decode")) if seed % 2 else "both")
           for i in range(12)]
    rt = RouterRuntime(RouterSettings(engines=[]), clock=lambda: NOW)
    rt.pool = FakePool(eps)  # type: ignore[assignment]
    rt.flow = SimpleNamespace(in_flight_requests=sum(ep.in_flight_requests for ep in eps) + rng.randrange(6))  # type: ignore[assignment]
    assert rt.gate_saturation() == rt._gate(rt.endpoint_saturations())
    assert rt.unreserved_gate_saturation() == rt._gate(rt.endpoint_saturations(reserve=False))
    assert 0.0 < rt.gate_saturation()


# --- the idle sessions' working set, capped (issue 27: small fleets) ---------------------------------


def _idle_sessions_fleet(cap: float | None):
    """Two fresh engines of 1,000 blocks × 16 tokens, 10 % KV in use, and a session plugin with
    forty one-turn sessions idle on each (40 × 2,000 tokens: five times the cache)."""
    from scheduling_helpers import FakeClock, request

    from router.scheduling.interfaces import PluginHandle
    from router.scheduling.plugins.session import build_session_filter, working_set_of
    from router.scheduling.scheduler import SchedulingResult
    from router.scheduling.types import CycleState

    clock = FakeClock(NOW)
    eps = [Endpoint(f"http://e{i}", metrics_updated_at=NOW, block_size=16, num_gpu_blocks=1000,
                    kv_cache_usage_perc=0.1, peak_running=8) for i in range(2)]
    plugin = build_session_filter("session", None, PluginHandle(clock=clock))
    for i in range(80):
        ep = eps[i % 2]
        req = request(list(range(2000)), session_id=f"s{i}")
        plugin.pre_request(req, SchedulingResult("default", ep, [ep], [0.0], {}, CycleState()))
        plugin.response_complete(req, ep, None)
    settings = RouterSettings(engines=[]) if cap is None else RouterSettings(engines=[], working_set_cap=cap)
    rt = RouterRuntime(settings, clock=clock)
    rt.pool = FakePool(eps)  # type: ignore[assignment]
    rt.working_set = working_set_of([plugin])
    return rt, eps, clock


def test_uncapped_idle_sessions_close_the_gate_on_an_idle_fleet_and_say_so():
    rt, eps, _ = _idle_sessions_fleet(cap=1.0)
    saturations = rt.endpoint_saturations()
    assert rt.gate_saturation() == pytest.approx((0.1 + 1.0) / 0.8)  # the whole cache counted as used
    reasons = rt.gate_reasons(saturations)
    assert set(reasons.values()) == {"idle_session_working_set"}
    assert rt.gate_reason_over(saturations, reasons) == "idle_session_working_set"
    assert rt.reserved_working_set() == {ep.name: 16_000 for ep in eps}  # as much as the whole cache


def test_the_default_cap_leaves_room_for_sheddable_work_and_only_half_the_cache_reserved():
    rt, eps, _ = _idle_sessions_fleet(cap=None)
    assert rt.settings.working_set_cap == 0.5
    assert rt.session_working_set() == {ep.name: 80_000 for ep in eps}  # still all known (the dashboard's)
    assert rt.reserved_working_set() == {ep.name: 8_000 for ep in eps}  # 0.5 × 16,000 tokens
    assert rt.gate_saturation() == pytest.approx((0.1 + 0.5) / 0.8)  # open: 0.75
    saturations = rt.endpoint_saturations()
    assert rt.gate_reason_over(saturations, rt.gate_reasons(saturations)) == "open"
    assert rt.scheduling_saturation(eps[0]) == pytest.approx(0.75)  # the spare-capacity filter reads the same
    # the engine's own running requests still close it: 0.35 + 0.5 reserved ≥ 0.8
    eps[0].kv_cache_usage_perc = eps[1].kv_cache_usage_perc = 0.35
    saturations = rt.endpoint_saturations()
    assert rt.gate_reason_over(saturations, rt.gate_reasons(saturations)) == "idle_session_working_set"
    eps[0].kv_cache_usage_perc = eps[1].kv_cache_usage_perc = 0.85  # full without any session
    saturations = rt.endpoint_saturations()
    assert set(rt.gate_reasons(saturations).values()) == {"kv_cache"}


def test_a_working_set_under_the_cap_is_reserved_whole_and_ends_with_the_window():
    rt, eps, clock = _idle_sessions_fleet(cap=None)
    from router.runtime import reserved_working_set

    assert reserved_working_set(eps[0], 3_000, 0.5) == 3_000 and reserved_working_set(eps[0], 0, 0.5) == 0
    unknown = Endpoint("http://new", metrics_updated_at=NOW)  # sizes not scraped: left as is
    assert reserved_working_set(unknown, 3_000, 0.5) == 3_000
    clock.now += 121  # past workingSetWindowSeconds: nothing idle is counted
    for ep in eps:
        ep.metrics_updated_at = clock.now
    assert rt.reserved_working_set() == {} and rt.gate_saturation() == pytest.approx(0.1 / 0.8)


def test_gate_reasons_name_the_term_that_closes_each_engine():
    from router.runtime import gate_reason
    from router.scheduling.saturation import SaturationThresholds

    t = SaturationThresholds(in_flight_credit=True)
    base = dict(metrics_updated_at=NOW, block_size=16, num_gpu_blocks=1000, peak_running=4)
    assert gate_reason(Endpoint("http://a", **base), NOW, t, 0, 0.2) == "open"
    assert gate_reason(Endpoint("http://a", **{**base, "metrics_updated_at": NOW - 5}), NOW, t, 0, 1.0) == "stale_metrics"
    assert gate_reason(Endpoint("http://a", **base, num_requests_waiting=6), NOW, t, 0, 1.2) == "waiting_queue"
    assert gate_reason(Endpoint("http://a", **base, kv_cache_usage_perc=0.9), NOW, t, 0, 1.1) == "kv_cache"
    assert gate_reason(Endpoint("http://a", **base, kv_cache_usage_perc=0.5), NOW, t, 8000, 1.25) == \
        "idle_session_working_set"
    slots = Endpoint("http://a", **base, learned_max_num_seqs=4, in_flight_sheddable=3, in_flight_requests=3,
                     num_requests_running=3)
    assert gate_reason(slots, NOW, t, 0, 1.0) == "sheddable_slots"
    assert gate_reason(Endpoint("http://a", **base), NOW, t, 0, 1.0) == "pending_dispatches"


def test_the_gate_reason_of_a_prefill_decode_fleet_is_the_closed_pools():
    eps = [Endpoint("http://p0", metrics_updated_at=NOW, role="prefill", num_requests_waiting=6),
           Endpoint("http://d0", metrics_updated_at=NOW, role="decode", kv_cache_usage_perc=0.1)]
    rt = RouterRuntime(RouterSettings(engines=[]), clock=lambda: NOW)
    rt.pool = FakePool(eps)  # type: ignore[assignment]
    saturations = rt.endpoint_saturations()
    reasons = rt.gate_reasons(saturations)
    assert reasons == {"http://p0": "waiting_queue", "http://d0": "open"}
    # the decode pool has room, the prefill pool none: closed, for the prefill engine's reason
    assert rt.gate_over(saturations) >= 1.0 and rt.gate_reason_over(saturations, reasons) == "waiting_queue"
    assert rt.gate_reason_over({}, {}) == "no_healthy_endpoint"
