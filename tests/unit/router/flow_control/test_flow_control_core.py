"""The pure flow-control core, driven with explicit times (a fake clock) and saturation callables."""

from __future__ import annotations

import pytest
from flow_control_helpers import Slots, band_stats, config, full_pool, ids, item, open_pool

from router.flow_control import DropReason, FlowControlConfig, FlowControlCore, RequestDropped, TicketState


def test_strict_priority_between_bands():
    core = FlowControlCore(config())
    for rid, objective in [("b1", "batch"), ("a1", "async"), ("b2", "batch"), ("i1", "interactive"), ("a2", "async")]:
        core.enqueue(item(rid, objective=objective), now=0.0)
    result = core.step(1.0, open_pool)
    assert ids(result.dispatched) == ["i1", "a1", "a2", "b1", "b2"]
    assert [t.band.priority for t in result.dispatched] == [100, 10, 10, -10, -10]


def test_one_dispatch_per_free_slot_rereading_saturation_each_time():
    core = FlowControlCore(config())
    for n in range(5):
        core.enqueue(item(f"b{n}"), now=0.0)
    assert ids(core.step(0.0, Slots(core, capacity=3)).dispatched) == ["b0", "b1", "b2"]
    assert core.queued_requests == 2


def test_unknown_or_absent_objective_goes_to_the_default_band():
    core = FlowControlCore(config())
    assert core.enqueue(item("x", objective="nonsense"), 0.0).band.objective == "interactive"
    assert core.enqueue(item("y", objective=None), 0.0).band.objective == "interactive"
    custom = FlowControlCore(config().model_copy(update={"default_objective": "batch"}))
    assert custom.enqueue(item("z", objective="nonsense"), 0.0).band.objective == "batch"


def test_round_robin_gives_a_flooding_tenant_no_more_than_its_share():
    core = FlowControlCore(config())
    for n in range(100):
        core.enqueue(item(f"flood{n}", tenant="flood"), now=0.0)
    for n in range(10):
        core.enqueue(item(f"small{n}", tenant="small"), now=0.0)
    dispatched = []
    for tick in range(20):  # one slot freed per tick
        result = core.step(float(tick), Slots(core, capacity=1))
        dispatched += result.dispatched
        for t in result.dispatched:
            core.release(t)
    tenants = [t.item.fairness_id for t in dispatched]
    assert len(tenants) == 20
    for k in range(1, 21):  # at every prefix, shares are within 1 of equal
        assert abs(tenants[:k].count("flood") - tenants[:k].count("small")) <= 1
    assert tenants[20:] == []
    # once the small tenant is done, the flooding one gets everything
    rest = core.step(30.0, open_pool).dispatched
    assert {t.item.fairness_id for t in rest} == {"flood"} and len(rest) == 90


def test_earliest_deadline_first_within_a_flow_fifo_on_ties_and_without_deadline():
    core = FlowControlCore(config())
    for rid, deadline in [("d50", 50.0), ("d30a", 30.0), ("none1", None), ("d30b", 30.0), ("none2", None),
                          ("d40", 40.0)]:
        core.enqueue(item(rid, deadline=deadline), now=0.0)
    assert ids(core.step(1.0, open_pool).dispatched) == ["d30a", "d30b", "d40", "d50", "none1", "none2"]


def test_ttl_sheds_with_reason_and_retry_after():
    core = FlowControlCore(config(batch={"ttl_s": 5.0}))
    core.enqueue(item("old"), now=0.0)
    core.enqueue(item("young"), now=3.0)
    assert core.step(5.0, full_pool).expired == []  # waiting exactly the TTL is not past it
    result = core.step(5.5, full_pool)
    assert ids(t for t, _ in result.expired) == ["old"]
    ticket, drop = result.expired[0]
    assert ticket.state is TicketState.DROPPED
    assert (drop.reason, drop.status, drop.retry_after_s) == (DropReason.TTL_EXPIRED, 429, 1.0)
    assert drop.headers() == {"Retry-After": "1", "x-llm-d-request-dropped-reason": "rejected-ttl-expired"}
    assert drop.body()["error"]["code"] == "rejected-ttl-expired"
    stats = band_stats(core, "batch", now=5.5)
    assert stats["queued_requests"] == 1 and stats["shed_total"]["rejected_ttl_expired"] == 1
    assert stats["oldest_wait_s"] == pytest.approx(2.5)
    assert core.next_expiry() == 8.0


def test_item_deadline_sheds_before_the_band_ttl_and_a_past_deadline_rejects_at_once():
    core = FlowControlCore(config(batch={"ttl_s": 60.0}))
    core.enqueue(item("soon", deadline=2.0), now=0.0)
    assert core.step(2.0, full_pool).expired == []
    [(ticket, drop)] = core.step(2.1, full_pool).expired
    assert ticket.item.request_id == "soon" and drop.reason is DropReason.TTL_EXPIRED and "deadline" in drop.message
    with pytest.raises(RequestDropped) as exc:
        core.enqueue(item("late", deadline=1.0), now=2.1)
    assert exc.value.reason is DropReason.TTL_EXPIRED
    assert band_stats(core, "batch")["shed_total"]["rejected_ttl_expired"] == 2


def test_a_band_with_zero_ttl_never_queues():
    core = FlowControlCore(config(batch={"ttl_s": 0.0}))
    core.enqueue(item("now-or-never"), now=1.0)
    [(_, drop)] = core.step(1.5, full_pool).expired  # its one chance: the first step after enqueue
    assert (drop.reason, drop.headers()["Retry-After"]) == (DropReason.SATURATED, "1")
    assert core.queued_requests == 0
    core.enqueue(item("room"), now=2.0)
    assert ids(core.step(2.5, open_pool).dispatched) == ["room"]  # later than enqueue: still dispatched


def test_a_zero_ttl_band_sheds_quota_bound_items_as_quota():
    core = FlowControlCore(config(batch={"ttl_s": 0.0, "tenant_max_in_flight": 1}))
    core.enqueue(item("a1"), now=0.0)
    core.enqueue(item("a2"), now=0.0)
    result = core.step(0.1, open_pool)
    assert ids(result.dispatched) == ["a1"]
    assert [(t.item.request_id, d.reason) for t, d in result.expired] == [("a2", DropReason.QUOTA)]


@pytest.mark.parametrize("limits, sizes", [
    ({"max_queued_requests": 2}, [1, 1, 1]),
    ({"max_queued_bytes": 100}, [60, 40, 1]),
])
def test_capacity_limits_reject_at_once_and_free_up_on_dispatch(limits, sizes):
    core = FlowControlCore(config(batch=limits))
    core.enqueue(item("r0", size=sizes[0]), now=0.0)
    core.enqueue(item("r1", size=sizes[1]), now=0.0)
    with pytest.raises(RequestDropped) as exc:
        core.enqueue(item("r2", size=sizes[2]), now=0.0)
    drop = exc.value
    assert (drop.reason, drop.status, drop.retry_after_s) == (DropReason.CAPACITY, 429, 1.0)
    assert drop.headers()["x-llm-d-request-dropped-reason"] == "rejected-capacity"
    stats = band_stats(core, "batch")
    assert stats["queued_requests"] == 2 and stats["queued_bytes"] == sizes[0] + sizes[1]
    assert stats["refused_total"]["rejected_capacity"] == 1
    core.step(1.0, Slots(core, capacity=1))  # one leaves the queue
    core.enqueue(item("r3", size=sizes[2]), now=1.0)


def test_capacity_is_per_band():
    core = FlowControlCore(config(batch={"max_queued_requests": 1}))
    core.enqueue(item("b0"), now=0.0)
    with pytest.raises(RequestDropped):
        core.enqueue(item("b1"), now=0.0)
    core.enqueue(item("a0", objective="async"), now=0.0)


def test_tenant_at_its_in_flight_quota_waits_and_others_pass():
    core = FlowControlCore(config(batch={"tenant_max_in_flight": 1}))
    for rid in ("a1", "a2", "a3"):
        core.enqueue(item(rid, tenant="a"), now=0.0)
    core.enqueue(item("b1", tenant="b"), now=0.0)
    first = core.step(0.0, open_pool).dispatched
    assert ids(first) == ["a1", "b1"]
    assert core.step(1.0, open_pool).dispatched == []  # open pool, but tenant a is at its quota
    assert core.release(first[0])
    assert ids(core.step(2.0, open_pool).dispatched) == ["a2"]


def test_tenant_queued_quota_rejects_with_quota_reason():
    core = FlowControlCore(config(batch={"tenant_max_queued": 2, "ttl_s": 30.0}))
    core.enqueue(item("a1", tenant="a"), now=0.0)
    core.enqueue(item("a2", tenant="a"), now=0.0)
    with pytest.raises(RequestDropped) as exc:
        core.enqueue(item("a3", tenant="a"), now=0.0)
    assert exc.value.reason is DropReason.QUOTA and exc.value.retry_after_s == 30.0
    assert exc.value.headers()["Retry-After"] == "30"
    core.enqueue(item("b1", tenant="b"), now=0.0)  # another tenant is not affected
    assert band_stats(core, "batch")["refused_total"]["rejected_quota"] == 1


def test_quota_retry_after_is_capped_at_a_minute():
    core = FlowControlCore(config(batch={"tenant_max_queued": 1, "ttl_s": 600.0}))
    core.enqueue(item("a1", tenant="a"), now=0.0)
    with pytest.raises(RequestDropped) as exc:
        core.enqueue(item("a2", tenant="a"), now=0.0)
    assert exc.value.retry_after_s == 60.0


def test_saturation_holds_gated_bands_and_the_top_band_bypasses_up_to_its_bound():
    core = FlowControlCore(config())  # interactive: bypass up to 2 in flight
    for n in range(3):
        core.enqueue(item(f"b{n}"), now=0.0)
        core.enqueue(item(f"a{n}", objective="async"), now=0.0)
        core.enqueue(item(f"i{n}", objective="interactive"), now=0.0)
    running = []
    for sat in (1.0, 1.5, float("nan")):
        running += core.step(1.0, lambda s=sat: s).dispatched
    assert ids(running) == ["i0", "i1"]
    assert band_stats(core, "interactive")["in_flight"] == 2
    assert band_stats(core, "async")["queued_requests"] == 3 and band_stats(core, "batch")["queued_requests"] == 3
    i0 = next(t for t in core.queued_tickets() if t.band.objective == "interactive")
    assert i0.item.request_id == "i2"
    core.release(running[0])
    assert ids(core.step(2.0, full_pool).dispatched) == ["i2"]
    assert ids(core.step(3.0, lambda: 0.99).dispatched) == ["a0", "a1", "a2", "b0", "b1", "b2"]


def test_the_slot_reserve_gates_sheddable_bands_only():
    """The router's gate value for sheddable work counts the slots it keeps for interactive work;
    interactive work past its bypass bound is gated on the value without that reserve."""
    core = FlowControlCore(config())  # interactive: bypass up to 2 in flight
    for n in range(4):
        core.enqueue(item(f"i{n}", objective="interactive"), now=0.0)
        core.enqueue(item(f"b{n}"), now=0.0)
    reserved_full = lambda: 1.0  # noqa: E731 - batch's slots are taken, the reserved ones are free
    unreserved_room = lambda: 0.5  # noqa: E731
    dispatched = core.step(1.0, reserved_full, unreserved_room).dispatched
    assert ids(dispatched) == ["i0", "i1", "i2", "i3"]  # past the bypass bound of 2 too
    assert band_stats(core, "batch")["queued_requests"] == 4
    # without the second signal every band reads the first, as before
    core.enqueue(item("i4", objective="interactive"), now=1.0)
    assert core.step(2.0, reserved_full).dispatched == []


def test_eviction_takes_the_newest_in_flight_of_the_lowest_sheddable_band():
    core = FlowControlCore(config(eviction=True, eviction_interval_s=1.0))
    for t, (rid, objective) in enumerate([("b1", "batch"), ("b2", "batch"), ("b3", "batch"), ("a-run", "async")]):
        core.enqueue(item(rid, objective=objective), now=float(t))
        assert ids(core.step(float(t), open_pool).dispatched) == [rid]
    core.enqueue(item("a-wait1", objective="async"), now=4.0)
    first = core.step(4.0, full_pool)
    assert first.dispatched == [] and ids(first.evicted) == ["b3"]
    assert first.evicted[0].state is TicketState.EVICTED and not core.release(first.evicted[0])
    assert core.step(6.0, full_pool).evicted == []  # a-wait1 already caused one: no second
    core.enqueue(item("a-wait2", tenant="u", objective="async"), now=6.5)
    assert ids(core.step(6.5, full_pool).evicted) == ["b2"]
    core.enqueue(item("a-wait3", tenant="v", objective="async"), now=7.0)
    assert core.step(7.0, full_pool).evicted == []  # rate limited: the last one was 0.5 s ago
    assert ids(core.step(7.5, full_pool).evicted) == ["b1"]
    core.enqueue(item("a-wait4", tenant="w", objective="async"), now=9.0)
    assert core.step(9.0, full_pool).evicted == []  # no sheddable work below async is left
    # interactive at its bypass bound is blocked by saturation: async is the lowest band with work
    for n in range(3):
        core.enqueue(item(f"i{n}", tenant="i", objective="interactive"), now=10.0)
    result = core.step(10.0, full_pool)
    assert ids(result.dispatched) == ["i0", "i1"] and ids(result.evicted) == ["a-run"]
    stats = core.stats(10.0)
    assert band_stats(stats, "batch")["shed_total"]["evicted"] == 3
    assert band_stats(stats, "async")["shed_total"]["evicted"] == 1
    assert band_stats(stats, "batch")["in_flight"] == 0 and band_stats(stats, "async")["in_flight"] == 0


def test_no_eviction_unless_enabled_and_never_from_a_non_sheddable_band():
    core = FlowControlCore(config())
    core.enqueue(item("b"), now=0.0)
    core.step(0.0, open_pool)
    core.enqueue(item("a", objective="async"), now=1.0)
    assert core.step(2.0, full_pool).evicted == []
    kept = FlowControlCore(config(eviction=True, batch={"sheddable": False}))
    kept.enqueue(item("b"), now=0.0)
    kept.step(0.0, open_pool)
    kept.enqueue(item("a", objective="async"), now=1.0)
    assert kept.step(2.0, full_pool).evicted == []


def test_cancel_of_a_waiting_item_leaves_no_trace():
    core = FlowControlCore(config())
    ticket = core.enqueue(item("gone", tenant="x", size=123), now=0.0)
    core.enqueue(item("stays", tenant="y"), now=0.0)
    assert core.cancel(ticket) and not core.cancel(ticket)
    stats = band_stats(core, "batch")
    assert stats["queued_requests"] == 1 and stats["queued_bytes"] == 10 and stats["flows"] == 1
    assert stats["shed_total"]["rejected_context_cancelled"] == 1
    assert ids(core.step(1.0, open_pool).dispatched) == ["stays"]
    assert core.next_expiry() is None


def test_release_is_idempotent_and_idle_flows_are_forgotten():
    core = FlowControlCore(config())
    core.enqueue(item("r", tenant="x"), now=0.0)
    [ticket] = core.step(0.0, open_pool).dispatched
    assert band_stats(core, "batch")["in_flight"] == 1 and band_stats(core, "batch")["flows"] == 1
    assert core.release(ticket) is True
    assert core.release(ticket) is False
    stats = band_stats(core, "batch")
    assert stats["in_flight"] == 0 and stats["flows"] == 0 and stats["dispatched_total"] == 1
    assert ticket.state is TicketState.RELEASED


def test_drain_drops_every_waiting_item_with_the_given_status():
    core = FlowControlCore(config())
    core.enqueue(item("a", objective="async"), now=0.0)
    core.enqueue(item("b"), now=0.0)
    dropped = core.drain(DropReason.SATURATED, "stopping", status=503)
    assert sorted(ids(t for t, _ in dropped)) == ["a", "b"]
    assert {(d.reason, d.status) for _, d in dropped} == {(DropReason.SATURATED, 503)}
    assert core.queued_requests == 0


def test_flow_item_validation():
    with pytest.raises(ValueError):
        item("neg", size=-1)
    with pytest.raises(ValueError):
        item("nan", deadline=float("nan"))


def one_per_step(core: FlowControlCore, times: list[float]) -> list[str]:
    """Dispatch one item per step at each of ``times`` (one slot, freed after each step)."""
    out = []
    for now in times:
        result = core.step(now, Slots(core, capacity=1))
        out += ids(result.dispatched)
        for ticket in result.dispatched:
            core.release(ticket)
    return out


def test_weighted_deficit_round_robin_gives_each_tenant_its_weights_share():
    cfg = config().model_copy(update={"tenant_weights": {"heavy": 2.0, "light": 0.5}})
    core = FlowControlCore(cfg)
    for n in range(40):
        for tenant in ("heavy", "plain", "light"):
            core.enqueue(item(f"{tenant}{n}", tenant=tenant), now=0.0)
    order = [rid.rstrip("0123456789") for rid in one_per_step(core, [float(t) for t in range(35)])]
    # per round of two turns: heavy 2 + 2, plain 1 + 1, light 0.5 + 0.5 → 4 : 2 : 1
    assert order[:7] == ["heavy", "heavy", "plain", "heavy", "heavy", "plain", "light"]
    assert (order.count("heavy"), order.count("plain"), order.count("light")) == (20, 10, 5)


def test_default_weight_one_is_plain_round_robin_and_weights_must_be_positive():
    core = FlowControlCore(config())
    for n in range(3):
        core.enqueue(item(f"a{n}", tenant="a"), now=0.0)
        core.enqueue(item(f"b{n}", tenant="b"), now=0.0)
    assert one_per_step(core, [0.0, 1.0, 2.0, 3.0]) == ["a0", "b0", "a1", "b1"]
    with pytest.raises(ValueError):
        config().model_validate({**config().model_dump(), "tenant_weights": {"x": 0.0}})


def test_an_item_whose_deadline_is_at_risk_goes_first_and_its_tenant_repays_the_turn_after():
    def run(at_risk_s: float) -> list[str]:
        core = FlowControlCore(config().model_copy(update={"deadline_at_risk_s": at_risk_s}))
        for tenant in ("A", "B", "D"):
            for n in range(1, 4):
                core.enqueue(item(f"{tenant}{n}", tenant=tenant), now=0.0)
        core.enqueue(item("C1", tenant="C", deadline=3.5), now=0.0)
        core.enqueue(item("C2", tenant="C"), now=0.0)
        return one_per_step(core, [0.0, 1.0, 2.6, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])

    # ring order A, B, D, C (D enqueued before C); at 2.6 C1 has 0.9 s left: at risk, it jumps D.
    # C's next turn (at 4.0, first in the ring then) is spent repaying it, so from there on the
    # order is the plain round-robin's: C gets no more than its share
    assert run(1.0) == ["A1", "B1", "C1", "D1", "A2", "B2", "D2", "C2", "A3", "B3"]
    assert run(0.0) == ["A1", "B1", "D1", "C1", "A2", "B2", "D2", "C2", "A3", "B3"]


def test_eviction_still_works_with_the_shipped_bands():
    core = FlowControlCore(FlowControlConfig.from_mapping({"eviction": True}))
    core.enqueue(item("b1", objective="batch"), now=0.0)
    core.enqueue(item("b2", objective="batch"), now=0.0)
    assert ids(core.step(0.0, open_pool).dispatched) == ["b1", "b2"]
    core.enqueue(item("a", objective="async"), now=1.0)
    result = core.step(1.0, full_pool)  # async never queues: shed now, no eviction for it
    assert result.evicted == [] and [d.reason for _, d in result.expired] == [DropReason.SATURATED]
    for n in range(65):  # interactive bypasses saturation up to 64 in flight; the 65th is blocked
        # (five tenants of 13: below the per-tenant quota of 16)
        core.enqueue(item(f"i{n}", tenant=f"t{n % 5}", objective="interactive"), now=2.0)
    result = core.step(2.0, full_pool)
    assert len(result.dispatched) == 64 and ids(result.evicted) == ["b2"]
