"""The workers' composition root (``workers.app``), no broker or database: apps build offline."""

from __future__ import annotations

from celery.signals import worker_ready

from batch_gateway.store import task_names
from workers.app import WorkerCelery, create_celery
from workers.context import WorkerContext
from workers.settings import WorkerSettings


def _settings() -> WorkerSettings:
    return WorkerSettings(database_url="postgresql://u@localhost/db", redis_url="redis://localhost:1/0",
                          task_queue="q-test")


def test_every_task_name_is_registered_and_scheduled_by_name():
    app = create_celery(_settings())
    names = {value for key, value in vars(task_names).items() if key.endswith("_TASK")}
    assert names <= set(app.tasks)
    scheduled = {entry["task"] for entry in app.conf.beat_schedule.values()}
    assert scheduled == names - {task_names.VALIDATE_BATCH_TASK, task_names.CANCEL_BATCH_TASK}
    assert {entry["options"]["queue"] for entry in app.conf.beat_schedule.values()} == {"q-test"}


def test_the_context_is_a_typed_attribute_of_its_own_app():
    app = create_celery(_settings())
    assert isinstance(app, WorkerCelery) and isinstance(app.backfill, WorkerContext)
    assert app.backfill.celery is app and app.backfill.settings.task_queue == "q-test"
    assert create_celery(_settings()).backfill is not app.backfill


def test_building_apps_does_not_stack_worker_ready_handlers():
    create_celery(_settings())
    before = len(worker_ready.receivers)
    for _ in range(3):
        create_celery(_settings())
    assert len(worker_ready.receivers) == before


def test_the_router_url_comes_from_backfill_up_s_variable_or_the_worker_s_own(monkeypatch):
    base = {"database_url": "postgresql://x@h/db", "redis_url": "redis://h"}
    monkeypatch.delenv("BACKFILL_WORKER_ROUTER_URL", raising=False)
    monkeypatch.delenv("BACKFILL_ROUTER_URL", raising=False)
    assert WorkerSettings(**base).router_url is None
    monkeypatch.setenv("BACKFILL_ROUTER_URL", "http://127.0.0.1:9001")  # what `backfill up` sets
    assert WorkerSettings(**base).router_url == "http://127.0.0.1:9001"
    monkeypatch.setenv("BACKFILL_WORKER_ROUTER_URL", "http://router:8000")
    assert WorkerSettings(**base).router_url == "http://router:8000"
