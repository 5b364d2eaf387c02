"""The asyncio facade: admit/wait/release, cancellation, TTL, eviction callbacks, stop, and F11."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from flow_control_helpers import Clock, Level, band_stats, config, item

from router.flow_control import Admission, DropReason, FlowControlConfig, FlowController, RequestDropped


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


async def started(cfg: FlowControlConfig | None = None, saturation: Callable[[], float] = lambda: 0.0,
                  clock: Clock | None = None, **kwargs) -> FlowController:
    controller = FlowController(cfg or config(), saturation, clock or Clock(), **kwargs)
    await controller.start()
    return controller


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_admit_dispatches_at_once_and_release_is_idempotent():
    async def scenario():
        controller = await started()
        admission = await controller.admit(item("r1", objective="batch"))
        assert (admission.band_name, admission.priority, admission.request_id) == ("batch", -10, "r1")
        assert band_stats(controller.stats(), "batch")["in_flight"] == 1
        admission.release()
        admission.release()
        stats = controller.stats()
        assert band_stats(stats, "batch")["in_flight"] == 0 and stats["dispatched_total"] == 1
        default = await controller.admit(item("r2", objective=None))
        assert (default.band_name, default.priority) == ("interactive", 100)
        with default:
            pass
        assert band_stats(controller.stats(), "interactive")["in_flight"] == 0
        await controller.stop()
    run(scenario)


def test_admit_waits_while_saturated_and_goes_when_room_appears():
    async def scenario():
        level = Level(1.0)
        controller = await started(saturation=level)
        waiting = asyncio.create_task(controller.admit(item("r1")))
        await settle()
        assert not waiting.done() and band_stats(controller.stats(), "batch")["queued_requests"] == 1
        level.value = 0.5
        controller.kick()
        admission = await waiting
        assert admission.request_id == "r1" and band_stats(controller.stats(), "batch")["queued_requests"] == 0
        admission.release()
        await controller.stop()
    run(scenario)


def test_a_failing_saturation_signal_counts_as_saturated():
    async def scenario():
        level = Level(0.0)
        level.error = RuntimeError("metrics store down")
        controller = await started(saturation=level)
        waiting = asyncio.create_task(controller.admit(item("r1")))
        await settle()
        assert not waiting.done()
        level.error = None
        controller.kick()
        (await waiting).release()
        await controller.stop()
    run(scenario)


def test_cancelling_a_waiting_admit_leaves_no_trace():
    async def scenario():
        level = Level(1.0)
        controller = await started(saturation=level)
        waiting = asyncio.create_task(controller.admit(item("gone", tenant="x", size=500)))
        await settle()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        stats = band_stats(controller.stats(), "batch")
        assert (stats["queued_requests"], stats["queued_bytes"], stats["in_flight"], stats["flows"]) == (0, 0, 0, 0)
        assert stats["shed_total"]["rejected_context_cancelled"] == 1
        assert controller._waiters == {}
        level.value = 0.0
        controller.kick()
        await settle()
        assert controller.stats()["dispatched_total"] == 0
        await controller.stop()
    run(scenario)


def test_cancel_landing_just_after_dispatch_releases_the_slot():
    async def scenario():
        level = Level(1.0)
        controller = await started(saturation=level)
        waiting = asyncio.create_task(controller.admit(item("first", tenant="x")))
        await settle()
        level.value = 0.0
        second = await controller.admit(item("second", tenant="y"))  # its step dispatches both
        assert controller.stats()["dispatched_total"] == 2 and not waiting.done()
        waiting.cancel()  # the waiter's future already holds its admission
        with pytest.raises(asyncio.CancelledError):
            await waiting
        stats = band_stats(controller.stats(), "batch")
        assert stats["in_flight"] == 1 and stats["flows"] == 1
        second.release()
        assert band_stats(controller.stats(), "batch")["flows"] == 0
        await controller.stop()
    run(scenario)


def test_ttl_expiry_raises_with_reason_and_503_when_no_engine_exists():
    async def scenario():
        clock = Clock()
        engines = {"present": True}
        controller = await started(config(batch={"ttl_s": 5.0}), saturation=lambda: 1.0, clock=clock,
                                   has_endpoints=lambda: engines["present"])
        waiting = [asyncio.create_task(controller.admit(item(f"r{n}"))) for n in range(2)]
        await settle()
        clock.advance(5.5)
        controller.kick()
        with pytest.raises(RequestDropped) as exc:
            await waiting[0]
        drop = exc.value
        assert (drop.reason, drop.status, drop.headers()["Retry-After"]) == (DropReason.TTL_EXPIRED, 429, "1")
        with pytest.raises(RequestDropped):
            await waiting[1]
        engines["present"] = False
        late = asyncio.create_task(controller.admit(item("r2")))
        await settle()
        clock.advance(6.0)
        controller.kick()
        with pytest.raises(RequestDropped) as exc:
            await late
        assert (exc.value.reason, exc.value.status) == (DropReason.TTL_EXPIRED, 503)
        assert exc.value.body()["error"]["type"] == "ServiceUnavailableError"
        assert band_stats(controller.stats(), "batch")["shed_total"]["rejected_ttl_expired"] == 3
        await controller.stop()
    run(scenario)


def test_immediate_rejects_are_raised_by_admit():
    async def scenario():
        clock = Clock()
        controller = await started(config(batch={"max_queued_bytes": 100}), saturation=lambda: 1.0, clock=clock)
        with pytest.raises(RequestDropped) as exc:
            await controller.admit(item("huge", size=101))
        assert exc.value.reason is DropReason.CAPACITY and exc.value.status == 429
        with pytest.raises(RequestDropped) as exc:
            await controller.admit(item("late", deadline=clock.now - 1.0))
        assert exc.value.reason is DropReason.TTL_EXPIRED
        assert band_stats(controller.stats(), "batch")["queued_requests"] == 0
        await controller.stop()
    run(scenario)


def test_eviction_calls_the_victims_callback_once():
    async def scenario():
        level = Level(0.0)
        controller = await started(config(eviction=True), saturation=level)
        victim = await controller.admit(item("batch-job", objective="batch"))
        calls: list[str] = []
        victim.on_evict(lambda: calls.append("evicted"))
        assert controller.in_flight_requests == 1
        level.value = 1.0
        blocked = asyncio.create_task(controller.admit(item("async-job", objective="async")))
        await settle()
        assert calls == ["evicted"] and controller.in_flight_requests == 0
        drop = victim.evicted
        assert drop is not None and drop.reason is DropReason.EVICTED
        assert drop.headers()["x-llm-d-request-dropped-reason"] == "evicted"
        victim.on_evict(lambda: calls.append("late"))  # registered after the fact: called at once
        assert calls == ["evicted", "late"]
        victim.release()  # no-op
        controller.kick()
        await settle()
        assert calls == ["evicted", "late"]
        assert band_stats(controller.stats(), "batch")["in_flight"] == 0
        blocked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await blocked
        await controller.stop()
    run(scenario)


def test_stop_drops_waiting_requests_with_503():
    async def scenario():
        controller = await started(saturation=lambda: 1.0)
        waiting = asyncio.create_task(controller.admit(item("r1")))
        await settle()
        await controller.stop()
        with pytest.raises(RequestDropped) as exc:
            await waiting
        assert (exc.value.reason, exc.value.status) == (DropReason.SATURATED, 503)
        with pytest.raises(RuntimeError):
            await controller.admit(item("after-stop"))
    run(scenario)


def test_f11_flooding_batch_tenant_against_interactive_traffic():
    """RELIABILITY F11: interactive first; fair shares in batch; bounded queues; explicit 429s."""
    cfg = config(batch={"tenant_max_queued": 60, "max_queued_requests": 100})

    class Pool:
        capacity = 4
        foreign = 4  # the pool starts full of other work
        serving: list[Admission] = []

        def saturation(self) -> float:
            return (len(self.serving) + self.foreign) / self.capacity

    async def scenario():
        pool = Pool()
        controller = await started(cfg, saturation=pool.saturation)
        order: list[tuple[str, str]] = []
        rejects: list[tuple[str, RequestDropped]] = []

        async def request(rid: str, tenant: str, objective: str) -> None:
            try:
                admission = await controller.admit(item(rid, tenant=tenant, objective=objective))
            except RequestDropped as drop:
                rejects.append((tenant, drop))
                return
            order.append((tenant, objective))
            pool.serving.append(admission)

        tasks = [asyncio.create_task(request(f"f{n}", "flood", "batch")) for n in range(200)]
        tasks += [asyncio.create_task(request(f"b{n}", "quiet", "batch")) for n in range(20)]
        await settle()
        batch = band_stats(controller.stats(), "batch")
        assert batch["queued_requests"] == 80 and batch["queued_requests"] <= 100  # bounded
        tasks += [asyncio.create_task(request(f"i{n}", "human", "interactive")) for n in range(10)]
        await settle()
        assert order == [("human", "interactive")] * 2  # bypass up to its bound while saturated

        pool.foreign = 0
        for _ in range(10_000):  # the engine finishes one request per turn
            if all(t.done() for t in tasks):
                break
            if pool.serving:
                pool.serving.pop(0).release()
            controller.kick()
            await asyncio.sleep(0)
        assert all(t.done() for t in tasks)

        assert [o for _, o in order[:10]] == ["interactive"] * 10 and len(order) == 90
        batch_tenants = [t for t, o in order if o == "batch"]
        for k in range(1, 41):
            assert abs(batch_tenants[:k].count("flood") - batch_tenants[:k].count("quiet")) <= 1
        assert batch_tenants[40:] == ["flood"] * 40
        assert len(rejects) == 140 and {t for t, _ in rejects} == {"flood"}
        assert {(d.reason, d.status, d.headers()["x-llm-d-request-dropped-reason"]) for _, d in rejects} == {
            (DropReason.QUOTA, 429, "rejected-quota")}
        stats = controller.stats()
        assert band_stats(stats, "batch")["refused_total"]["rejected_quota"] == 140
        assert stats["dispatched_total"] == 90
        assert all(b["queued_requests"] == 0 for b in stats["bands"])
        await controller.stop()
    run(scenario)


def test_shipped_sheddable_bands_answer_at_once_never_queue():
    """The default config: batch and async dispatch at once on a real clock when some engine has
    room, and get an immediate 429 ``rejected-saturated`` with ``Retry-After: 1`` when none has."""
    async def scenario():
        level = Level(0.5)
        controller = FlowController(FlowControlConfig(), level)  # time.monotonic: enqueue and step differ
        await controller.start()
        admission = await controller.admit(item("b-room", objective="batch"))
        admission.release()
        level.value = 1.0
        for objective in ("batch", "async"):
            with pytest.raises(RequestDropped) as exc:
                await asyncio.wait_for(controller.admit(item(f"{objective}-full", objective=objective)), 1.0)
            assert (exc.value.status, exc.value.reason) == (429, DropReason.SATURATED)
            assert exc.value.headers() == {"Retry-After": "1", "x-llm-d-request-dropped-reason": "rejected-saturated"}
            assert band_stats(controller.stats(), objective)["queued_requests"] == 0
        interactive = asyncio.create_task(controller.admit(item("i", objective="interactive")))
        (await interactive).release()  # the top band still bypasses up to its bound
        await controller.stop()
    run(scenario)

