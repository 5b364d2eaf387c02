"""``BackfillScheduler`` without ``BACKFILL_BACKGROUND_PRIORITY_THRESHOLD``: vLLM's behaviour, every rule off."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import SCHEDULER, Engine, _start, _stop
from scenarios import background_budget, retention

from backfill_vllm.scheduler import BackfillScheduler


@pytest.fixture(scope="module")
def rules_off_engine(tiny_model: Path) -> Iterator[Engine]:
    engine = _start(tiny_model, {}, scheduler_cls=SCHEDULER)
    yield engine
    _stop(engine)


def test_unset_threshold_keeps_vllms_scheduling_and_eviction(rules_off_engine: Engine) -> None:
    sched = rules_off_engine.scheduler
    assert isinstance(sched, BackfillScheduler)
    assert sched.retention is None  # vLLM's own free queue
    run = background_budget(rules_off_engine, "bud")
    assert run.alone == [512, 388, 0, 0]  # as test_rules_plain.py's vLLM alone
    assert run.interactive_first_step == 0
    assert retention(rules_off_engine, "ret") == 0
    totals = sched.counter_totals()
    assert totals["backfill:deferred_background_prefill_tokens"] == 0
    assert totals["backfill:preemptions:background"] == totals["backfill:preemptions:foreground"] == 0
