"""Beat on an idle stack sends (almost) nothing (``workers.schedule``): the frequent lifecycle tasks
only while there is work, a catch-up at start and once a minute; a batch still completes with beat
driving it, and the steps go quiet again once it has ended. Tasks are counted on the real broker
(the task queue's Redis list) against entries counted as due, not against a clock."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import orjson
import redis

from tests.integration.test_lifecycle import StandInProcessor, _line
from workers.app import WorkerCelery, create_celery
from workers.schedule import CATCH_UP, WHEN_BUSY, QuietScheduler, work_pending
from workers.settings import WorkerSettings, load_settings

FAST = {"collect_interval_seconds": 0.02, "feed_interval_seconds": 0.02, "finalize_interval_seconds": 0.02,
        "webhook_interval_seconds": 0.02, "relay_interval_seconds": 0.02, "sweep_interval_seconds": 0.02}
"""Intervals short enough that many entries fall due within a fraction of a second."""


class CountingScheduler(QuietScheduler):
    """The quiet scheduler counting the frequent entries that fell due and the tasks it sent, asking
    its probe afresh at every due entry."""

    due = 0
    sent = 0
    probe_seconds = 0.0

    def apply_async(self, entry, producer=None, advance=True, **kwargs):
        self.sent += 1
        return super().apply_async(entry, producer=producer, advance=advance, **kwargs)

    def apply_entry(self, entry, producer=None) -> None:
        if entry.name in WHEN_BUSY:
            self.due += 1
        super().apply_entry(entry, producer=producer)


def _app(gateway_settings, **overrides) -> WorkerCelery:
    settings = gateway_settings
    return create_celery(load_settings(
        database_url=settings.database_url, redis_url=settings.redis_url, data_dir=settings.data_dir,
        task_queue=settings.task_queue, pool=settings.task_queue,
        result_stream=f"backfill:results:{settings.task_queue}", **{**FAST, **overrides}))


@contextmanager
def _beat(app: WorkerCelery, tmp_path) -> Iterator[CountingScheduler]:
    """Beat's loop (tick, wait until the next entry is due) in a thread until the block ends."""
    scheduler = CountingScheduler(app=app, schedule_filename=str(tmp_path / "beat-schedule"), lazy=False)
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            stop.wait(min(scheduler.tick(), 0.02))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield scheduler
    finally:
        stop.set()
        thread.join(10)
        scheduler.close()


def _wait(predicate, what: str, seconds: float = 30.0) -> None:
    done = threading.Event()
    for _ in range(int(seconds / 0.02)):
        if predicate():
            return
        done.wait(0.02)
    raise AssertionError(f"not {what} within {seconds} s")


def test_an_idle_stack_gets_only_the_catch_up(gateway_settings, tmp_path):
    broker = redis.Redis.from_url(gateway_settings.redis_url)
    queue = gateway_settings.task_queue
    with _beat(_app(gateway_settings), tmp_path) as beat:
        _wait(lambda: beat.due >= 100, "100 frequent entries due")
        sent = [orjson.loads(m)["headers"]["task"] for m in broker.lrange(queue, 0, -1)]
    assert sent == ["backfill.catch_up"], sent  # sent at start; 100+ frequent entries skipped


def test_the_default_schedule_sends_under_a_tenth_of_a_task_a_second_when_idle():
    settings = WorkerSettings(database_url="postgresql://u@h/db", redis_url="redis://h")
    app = create_celery(settings)
    idle = [entry for name, entry in app.conf.beat_schedule.items() if name not in WHEN_BUSY]
    assert CATCH_UP in app.conf.beat_schedule and all(name in app.conf.beat_schedule for name in WHEN_BUSY)
    assert sum(1 / entry["schedule"] for entry in idle) < 0.1
    busy = sum(1 / app.conf.beat_schedule[name]["schedule"] for name in WHEN_BUSY)
    assert busy > 4  # what beat sent idle or not before


def test_beat_drives_a_batch_to_completed_then_goes_quiet(gateway, gateway_settings, tmp_path):
    app = _app(gateway_settings)
    client = gateway.client()
    uploaded = client.files.create(file=("in.jsonl", b"\n".join(_line(f"r{i}") for i in range(3)) + b"\n"),
                                   purpose="batch")
    with _beat(app, tmp_path) as beat:
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        proc = StandInProcessor(app.backfill)

        def answered_and_done() -> bool:
            for request in proc.take():
                proc.ok(request)
            return client.batches.retrieve(batch.id).status == "completed"

        _wait(answered_and_done, "completed")
        assert beat.sent > 10  # the frequent tasks went out while the batch ran
        _wait(lambda: not work_pending(app.backfill), "idle")
        sent, due = beat.sent, beat.due
        _wait(lambda: beat.due >= due + 100, "100 more frequent entries due")
        assert beat.sent == sent  # idle again: none sent
    done = client.batches.retrieve(batch.id)
    assert (done.request_counts.completed, done.request_counts.total) == (3, 3)
