"""The prefill queue: one prefill at a time, the next in the policy's order, vLLM's waiting/running
counts (queued prefills past one step's token budget are waiting), and cancellation while queued or
prefilling."""

import asyncio

import pytest

from engine_twin.kv_cache import TieredPrefixCache, none_hash
from engine_twin.scheduler import EngineScheduler
from engine_twin.settings import build_settings


def scheduler(**overrides):
    # 1 ms of model time per prefill at most (overhead 0, 1,000,000 tokens/s), scaled by 1
    s = build_settings(**{"block_size": 4, "num_gpu_blocks": 256, "max_model_len": 64, "time_scale": 1.0,
                          "prefill_overhead_ms": 1.0, "prefill_tokens_per_s": 1_000_000.0, **overrides})
    return EngineScheduler(s, TieredPrefixCache(s.num_gpu_blocks, s.block_size), none_hash("0"))


async def _first_tokens(sched, arrivals):
    """Submit ``arrivals`` [(label, priority)] in order while the first one prefills; the labels in
    the order their first token came, and the counts seen just after the last submission."""
    order: list[str] = []

    async def one(label, priority, seed):
        req = sched.submit([seed] * 8, 2, priority=priority)
        await sched.wait_admitted(req)
        await sched.prefill(req)
        order.append(label)
        sched.finish(req)

    tasks = []
    for seed, (label, priority) in enumerate(arrivals):
        tasks.append(asyncio.create_task(one(label, priority, seed)))
        await asyncio.sleep(0)  # each one reaches the prefill queue before the next is submitted
    counts = (sched.num_requests_waiting, sched.num_requests_running, sched.prefill_queued)
    await asyncio.gather(*tasks)
    return order, counts


@pytest.mark.parametrize(("policy", "expected"), [
    ("priority", ["busy", "interactive", "async", "batch-1", "batch-2"]),
    ("fcfs", ["busy", "batch-1", "batch-2", "async", "interactive"]),
])
def test_next_prefill_follows_the_policy_and_a_started_one_finishes_first(policy, expected):
    sched = scheduler(scheduling_policy=policy, max_num_batched_tokens=8)  # one 8-token prompt per step
    arrivals = [("busy", 10), ("batch-1", 10), ("batch-2", 10), ("async", -10), ("interactive", -100)]
    order, (waiting, running, queued) = asyncio.run(_first_tokens(sched, arrivals))
    assert order == expected
    # all five hold a slot; the prefilling one and the next step's one are running, 3 wait (vLLM's meaning)
    assert (waiting, running, queued) == (3, 2, 4)
    assert (sched.num_requests_waiting, sched.num_requests_running, sched.prefill_queued) == (0, 0, 0)


@pytest.mark.parametrize(("budget", "counts"), [(4, (1, 1, 2, 1)), (8192, (1, 1, 1, 2))])
def test_slot_waiting_and_prefills_past_the_step_budget_count_as_waiting(budget, counts):
    async def scenario():
        sched = scheduler(max_num_seqs=2, max_num_batched_tokens=budget)
        reqs = [sched.submit([i] * 8, 2) for i in range(3)]  # the third waits for a slot
        first = asyncio.create_task(sched.prefill(reqs[0]))
        await asyncio.sleep(0)
        second = asyncio.create_task(sched.prefill(reqs[1]))
        await asyncio.sleep(0)
        seen = (sched.waiting, sched.prefill_queued, sched.num_requests_waiting, sched.num_requests_running)
        await asyncio.gather(first, second)
        return seen

    assert asyncio.run(scenario()) == counts


def test_cancelling_a_queued_prefill_leaves_the_queue_and_the_next_one_runs():
    async def scenario():
        sched = scheduler()
        reqs = [sched.submit([i] * 8, 2) for i in range(3)]
        tasks = []
        for req in reqs:
            tasks.append(asyncio.create_task(sched.prefill(req)))
            await asyncio.sleep(0)
        assert sched.prefill_queued == 2
        tasks[1].cancel()
        await asyncio.sleep(0)
        assert sched.prefill_queued == 1
        await tasks[0]
        await tasks[2]
        return [r.first_token_at is not None for r in reqs], sched.prefill_queued, sched._prefill_busy

    assert asyncio.run(scenario()) == ([True, False, True], 0, False)


def test_cancelling_the_running_prefill_hands_the_unit_on():
    async def scenario():
        sched = scheduler(prefill_overhead_ms=60_000.0)  # a prefill that would take a minute
        a, b = sched.submit([1] * 8, 2), sched.submit([2] * 8, 2, priority=0)
        first = asyncio.create_task(sched.prefill(a))
        await asyncio.sleep(0)
        second = asyncio.create_task(sched.prefill(b))
        await asyncio.sleep(0)
        first.cancel()
        await asyncio.sleep(0)
        started = (sched.prefill_queued, sched._prefill_busy)
        second.cancel()
        await asyncio.gather(first, second, return_exceptions=True)
        return started, sched._prefill_busy

    assert asyncio.run(scenario()) == ((0, True), False)
