"""Continuous batching, priority order, aborts and the latency model."""

import asyncio

import pytest

from engine_twin.kv_cache import TieredPrefixCache, none_hash
from engine_twin.scheduler import EngineScheduler, LatencyModel
from engine_twin.settings import build_settings


def scheduler(**overrides):
    s = build_settings(**{"block_size": 4, "num_gpu_blocks": 64, "max_model_len": 64, "time_scale": 0.0,
                          **overrides})
    return EngineScheduler(s, TieredPrefixCache(s.num_gpu_blocks, s.block_size), none_hash("0"))


def test_latency_model_matches_the_documented_formula():
    m = LatencyModel.from_settings(build_settings())
    assert m.prefill_seconds(16_000, 0, 0) == pytest.approx(0.030 + 1.0)
    assert m.prefill_seconds(0, 10, 2) == pytest.approx(0.030 + 10 * 0.00008 + 2 * 0.0004)
    assert m.itl_seconds(0) == pytest.approx(0.012)
    assert m.itl_seconds(256) == pytest.approx(0.024)  # itl_load_factor 2 at a full batch
    assert m.itl_seconds(128) == pytest.approx(0.018)


def test_max_num_seqs_makes_requests_wait_and_finishing_admits_them():
    sched = scheduler(max_num_seqs=2)
    a, b, c = (sched.submit([i] * 8, 4) for i in range(3))
    assert a.alloc and b.alloc and c.alloc is None
    assert (sched.running_seqs, sched.waiting) == (2, 1)
    sched.finish(a)
    assert c.alloc is not None and sched.waiting == 0


@pytest.mark.parametrize(("policy", "admitted"), [("priority", "high"), ("fcfs", "low")])
def test_priority_policy_admits_lower_values_first_and_fcfs_ignores_it(policy, admitted):
    sched = scheduler(max_num_seqs=1, scheduling_policy=policy)
    first = sched.submit([1] * 8, 4)
    waiting = {"low": sched.submit([2] * 8, 4, priority=5), "high": sched.submit([3] * 8, 4, priority=-1)}
    sched.finish(first)
    assert [name for name, req in waiting.items() if req.alloc is not None] == [admitted]


def test_aborting_a_waiting_or_running_request_frees_everything():
    sched = scheduler(max_num_seqs=1)
    running = sched.submit(list(range(20)), 4)
    waiting = sched.submit(list(range(30, 50)), 4)
    sched.finish(waiting, "abort")
    assert sched.waiting == 0
    sched.finish(running, "abort")
    assert sched.running_seqs == 0 and sched.cache.usage == 0.0


def test_kv_blocks_gate_admission_too():
    sched = scheduler(max_num_seqs=10, num_gpu_blocks=20)
    big = sched.submit(list(range(40)), 20)  # 15 blocks of 4
    other = sched.submit(list(range(100, 160)), 4)  # 16 blocks: cannot fit beside it
    assert big.alloc and other.alloc is None
    sched.finish(big)
    assert other.alloc is not None


def test_wait_admitted_returns_once_a_slot_frees():
    async def scenario():
        sched = scheduler(max_num_seqs=1)
        first = sched.submit([1] * 8, 4)
        second = sched.submit([2] * 8, 4)
        waiter = asyncio.ensure_future(sched.wait_admitted(second))
        await asyncio.sleep(0)
        assert not waiter.done()
        sched.finish(first)
        await waiter
        return second

    assert asyncio.run(scenario()).alloc is not None
