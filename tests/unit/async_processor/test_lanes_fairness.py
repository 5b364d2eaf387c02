"""Strict, fair lanes of the processor's buffer and gates (issue 12): a buffer share per lane,
reserved slots, fair shares over tenants and batches with weights, deadlines at risk first."""

from __future__ import annotations

import asyncio
import random
import secrets
from collections import Counter

import httpx
import pytest

from async_processor.backends.base import Delivery
from async_processor.gates import AllGates, ConcurrencyGate, SaturationGate, effective_reserves
from async_processor.lanes import LaneBuffer, Work
from async_processor.retry import is_held_refusal, parse_retry_after, saturated_hold
from async_processor.settings import build_settings
from async_processor.testing import mock_target
from common.contracts.queue import RequestMessage

NOW = 1_000_000.0  # Unix seconds the deadlines below are relative to


def work(lane="batch", deadline_in=10_000, tenant="t", batch="", id=None) -> Work:
    meta = {"tenant": tenant, **({"batch_id": batch} if batch else {})}
    req = RequestMessage(id=id or secrets.token_hex(4), deadline=int(NOW + deadline_in), payload={}, metadata=meta)
    return Work(req, Delivery(lane, b"", 1, "x"), lane)


def always(w: Work) -> bool:
    return True


def drain_order(buf: LaneBuffer, n: int | None = None) -> list[Work]:
    out = []
    while (n is None or len(out) < n) and (w := buf.pop(0, always, NOW)) is not None:
        out.append(w)
    return out


# buffer shares


def test_each_lane_has_its_own_share_of_the_buffer():
    buf = LaneBuffer(["interactive", "async", "batch"], {"interactive": 4, "batch": 3})
    for _ in range(3):
        buf.push(work("batch"))
    assert (buf.free("batch"), buf.free("interactive"), buf.free("async")) == (0, 4, 0)
    buf.push(work("batch"))  # a retry coming back is never refused
    assert buf.depth("batch") == 4 and buf.free("batch") == 0 and buf.free("interactive") == 4


def test_settings_give_buffer_size_per_lane_with_overrides():
    settings = build_settings(backend="memory", buffer_size=100, lane_buffer_sizes={"batch": 7})
    assert settings.lane_capacity() == {"interactive": 100, "async": 100, "batch": 7}
    with pytest.raises(ValueError):
        build_settings(backend="memory", lane_buffer_sizes={"bulk": 7})
    with pytest.raises(ValueError):
        build_settings(backend="memory", tenant_weights={"a": 0})


# fair shares


def test_a_later_tenant_interleaves_with_an_older_backlog_despite_its_earlier_deadlines():
    buf = LaneBuffer(["batch"], 10_000)
    a = [work(tenant="A", batch="a1", deadline_in=100 + i, id=f"a{i}") for i in range(1000)]
    for w in a:
        buf.push(w)
    first = drain_order(buf, 5)
    assert [w.request.id for w in first] == ["a0", "a1", "a2", "a3", "a4"]  # EDF inside A's flow
    b = [work(tenant="B", batch="b1", deadline_in=86_400, id=f"b{i}") for i in range(5)]
    for w in b:
        buf.push(w)
    order = [w.request.metadata["tenant"] for w in drain_order(buf, 10)]
    assert order.count("B") == 5 and order.count("A") == 5
    assert order == ["B", "A"] * 5  # joined at the lane's virtual time: B first, then turns


def test_a_tenant_waiting_out_a_backoff_banks_no_credit():
    buf = LaneBuffer(["batch"], 100)
    for i in range(20):
        buf.push(work(tenant="A", deadline_in=i))
    for _ in range(5):
        w = work(tenant="B")
        w.not_before = 5.0  # held back (a retry backoff) while A is served
        buf.push(w)
    assert {w.tenant for w in (buf.pop(0, always, NOW) for _ in range(10))} == {"A"}
    order = []
    while len(order) < 6 and (w := buf.pop(5.0, always, NOW)) is not None:
        order.append(w.tenant)
    assert order == ["B", "A"] * 3  # B rejoins at the lane's virtual time, not with ten turns banked


def test_weights_give_proportional_shares():
    buf = LaneBuffer(["batch"], 10_000, weights={"A": 3})
    for i in range(200):
        buf.push(work(tenant="A", deadline_in=i))
        buf.push(work(tenant="B", deadline_in=i))
    served = Counter(w.tenant for w in drain_order(buf, 100))
    assert 74 <= served["A"] <= 76 and served["A"] + served["B"] == 100


def test_batches_of_one_tenant_alternate_and_work_without_a_batch_is_one_flow():
    buf = LaneBuffer(["batch"], 100)
    for i in range(3):
        buf.push(work(tenant="A", batch="x", deadline_in=i, id=f"x{i}"))
    for i in range(3):
        buf.push(work(tenant="A", batch="y", deadline_in=1000 + i, id=f"y{i}"))
    for i in range(3):
        buf.push(work(tenant="A", deadline_in=2000 + i, id=f"n{i}"))
    assert [w.request.id for w in drain_order(buf)] == ["x0", "y0", "n0", "x1", "y1", "n1", "x2", "y2", "n2"]


def test_a_deadline_at_risk_goes_before_fair_shares():
    def scenario(at_risk_s: float) -> str:
        buf = LaneBuffer(["batch"], 100, at_risk_s=at_risk_s)
        for i in range(3):
            buf.push(work(tenant="A", deadline_in=10_000 + i))
            buf.push(work(tenant="B", deadline_in=20_000 + i))
        assert buf.pop(0, always, NOW).tenant == "A"  # B's turn next
        buf.push(work(tenant="A", deadline_in=60, id="urgent"))
        return buf.pop(0, always, NOW).request.id

    assert scenario(300) == "urgent"
    assert scenario(0) != "urgent"  # without the override, fairness gives B its turn


def test_higher_lanes_first_and_admits_is_asked_about_flow_heads_only():
    buf = LaneBuffer(["interactive", "batch"], 10_000)
    for i in range(2000):
        buf.push(work("batch", tenant=f"t{i % 2}", deadline_in=i))
    buf.push(work("interactive", tenant="t0"))
    asked: list[Work] = []

    def deny(w: Work) -> bool:
        asked.append(w)
        return False

    assert buf.pop(0, deny, NOW) is None
    assert len(asked) == 3  # one interactive flow, two batch flows: not 2,001 items
    assert buf.pop(0, always, NOW).lane == "interactive"


def test_operations_keep_the_buffer_consistent_under_random_use():
    rng = random.Random(7)
    buf = LaneBuffer(["interactive", "async", "batch"], 10_000, weights={"t1": 2}, at_risk_s=50)
    held: set[int] = set()
    now = 0.0
    for _ in range(3000):
        op = rng.random()
        if op < 0.5:
            w = work(rng.choice(["interactive", "async", "batch"]), deadline_in=rng.randint(1, 500),
                     tenant=f"t{rng.randint(0, 3)}", batch=rng.choice(["", "b1", "b2"]))
            w.not_before = rng.choice([0.0, now + rng.random()])
            buf.push(w)
            held.add(id(w))
        elif op < 0.8:
            w = buf.pop(now, lambda w: rng.random() < 0.8, NOW)
            if w is not None:
                assert id(w) in held and w.not_before <= now
                held.discard(id(w))
                if rng.random() < 0.3:  # a retry comes back with a backoff
                    w.not_before = now + rng.random()
                    buf.push(w)
                    held.add(id(w))
        elif op < 0.85:
            victims = [w for w in buf if rng.random() < 0.1]
            assert buf.remove(victims) == victims
            held -= {id(w) for w in victims}
        elif op < 0.9:
            for w in buf.expired(NOW + rng.randint(0, 100)):
                held.remove(id(w))
        elif op < 0.92:
            for w in buf.remove_batches({"b2"}):
                assert w.batch_id == "b2"
                held.remove(id(w))
        now += 0.01
        assert len(buf) == len(held) == sum(buf.depth(lane) for lane in buf.order)
        assert {id(w) for w in buf} == held
        ready_at = buf.next_ready_at(now)
        assert ready_at is None or ready_at > now
    rest = buf.drain()
    assert {id(w) for w in rest} == held and len(buf) == 0 and buf.pop(1e9, always, NOW) is None


# reserved slots


def test_a_lower_lane_never_takes_the_reserved_slots_and_the_top_lane_takes_all():
    gate = ConcurrencyGate(8, {"interactive": 2, "async": 1})
    started = []
    while gate.admits(w := work("batch")):
        gate.acquire(w)
        started.append(w)
    assert len(started) == 5  # 8 - 2 - 1
    assert gate.admits(work("async"))
    gate.acquire(work("async"))
    assert not gate.admits(work("async"))  # the last two slots are interactive's
    for _ in range(2):
        assert gate.admits(w := work("interactive"))
        gate.acquire(w)
    assert gate.in_flight == 8 and not gate.admits(work("interactive"))
    gate.release(started[0])
    assert gate.admits(work("batch"))  # every reserve is in use by its own lane: a freed slot is anyone's


def test_an_idle_top_lane_still_leaves_its_reserve_free():
    gate = ConcurrencyGate(4, {"interactive": 1})
    for _ in range(3):
        gate.acquire(work("batch"))
    assert not gate.admits(work("batch")) and gate.admits(work("interactive"))


def test_reserves_follow_the_lanes_read_and_leave_the_lowest_lane_a_slot():
    assert effective_reserves(64, ["interactive", "async", "batch"], {"interactive": 16, "async": 8}) == {
        "interactive": 16, "async": 8}
    assert effective_reserves(64, ["batch"], {"interactive": 16, "async": 8}) == {}
    assert effective_reserves(64, ["interactive", "async"], {"interactive": 16, "async": 8}) == {"interactive": 16}
    assert effective_reserves(4, ["interactive", "async", "batch"], {"interactive": 16, "async": 8}) == {
        "interactive": 3}
    assert effective_reserves(1, ["interactive", "batch"], {"interactive": 16}) == {}
    with pytest.raises(ValueError):
        ConcurrencyGate(4, {"interactive": 4})
    with pytest.raises(ValueError):
        effective_reserves(4, ["batch"], {"bulk": 1})


# the saturation gate and the router's fast refusal


def test_a_fast_refusal_is_told_by_its_header_and_held_for_its_fractional_retry_after():
    assert is_held_refusal(429, "rejected-saturated") and is_held_refusal(503, " Rejected-Saturated")
    assert is_held_refusal(429, "evicted")  # evicted for higher-priority work: held the same way
    assert not is_held_refusal(429, "rejected-capacity") and not is_held_refusal(429, None)
    assert not is_held_refusal(500, "rejected-saturated") and not is_held_refusal(500, "evicted")
    rng = random.Random(1)
    holds = [saturated_hold(60, parse_retry_after("0.5"), rng=rng) for _ in range(200)]
    assert all(h is not None and 0.5 <= h < 0.6 for h in holds) and len(set(holds)) > 1  # jittered
    assert 1.0 <= (saturated_hold(60, None, rng=rng) or 0) < 1.2  # no Retry-After: the router's usual 1 s
    assert (saturated_hold(60, 0.0, rng=rng) or 0) >= 0.05  # never a busy loop
    assert saturated_hold(0.4, 0.5, rng=rng) is None  # past the deadline: not held


def test_a_refusal_shuts_the_saturation_gate_until_a_reading_asked_for_after_it():
    async def main():
        clock = [0.0]
        gate: SaturationGate | None = None
        refuse_during_read = [True]

        async def state(request: httpx.Request) -> httpx.Response:
            if refuse_during_read[0]:  # the refusal lands while this reading is on its way
                clock[0] += 0.1
                assert gate is not None
                gate.refused(work("batch"))
            return httpx.Response(200, json={"gate_saturation": 0.2})

        client = mock_target(state)
        gate = SaturationGate(client, "http://router", clock=lambda: clock[0])
        refuse_during_read[0] = False
        await gate.refresh()
        assert gate.admits(work("batch"))
        gate.refused(work("interactive"))  # an exempt lane's refusal changes nothing
        assert gate.admits(work("batch"))
        gate.refused(work("batch"))
        assert not gate.admits(work("batch")) and gate.admits(work("interactive"))
        refuse_during_read[0] = True
        await gate.refresh()  # asked before the refusal it raced with: not used
        assert not gate.admits(work("batch"))
        refuse_during_read[0] = False
        await gate.refresh()
        assert gate.admits(work("batch"))
        all_gates = AllGates([ConcurrencyGate(2), gate])
        all_gates.refused(work("async"))
        assert not all_gates.admits(work("async"))
        await client.aclose()

    asyncio.run(main())
