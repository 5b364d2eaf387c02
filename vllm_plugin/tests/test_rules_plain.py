"""The same scenarios on vLLM's own scheduler (no ``--scheduler-cls``): what the rules change."""

from __future__ import annotations

from conftest import ASYNC, BACKGROUND_SHARE, BATCH, INTERACTIVE, Engine
from scenarios import admit_one, background_budget, fill_blocks, fill_slots, retention


def test_vllm_alone_fills_steps_with_background_prefill(plain_engine: Engine) -> None:
    run = background_budget(plain_engine, "bud")
    print(f"vLLM alone: background prefill tokens per step {run.alone}, while interactive waits "
          f"{run.while_interactive_waits}, interactive {run.interactive_first_step}")
    assert max(run.alone) > BACKGROUND_SHARE
    assert run.interactive_first_step == 0  # three background requests hold the three slots


def test_vllm_alone_keeps_an_interactive_request_waiting_behind_full_slots(plain_engine: Engine) -> None:
    fill_slots(plain_engine, [("sb0", BATCH), ("sf0", INTERACTIVE), ("sb1", ASYNC)])
    assert admit_one(plain_engine, "sf1") == {"sb0", "sf0", "sb1"}
    plain_engine.run_until_idle()


def test_vllm_alone_keeps_an_interactive_request_waiting_for_blocks(plain_engine: Engine) -> None:
    fill_blocks(plain_engine, "k")
    assert admit_one(plain_engine, "ki0", length=400) == {"kb0", "kb1"}
    plain_engine.run_until_idle()


def test_vllm_alone_evicts_the_interactive_prefix_first(plain_engine: Engine) -> None:
    cached = retention(plain_engine, "ret")
    print(f"vLLM alone: interactive prefix cached after the batch sweep: {cached} of 256 tokens")
    assert cached == 0  # LRU: the oldest blocks, the interactive prefix, went first
