"""workers.app's logging pieces: beat's due-task line demoted to DEBUG, other beat lines kept."""

from __future__ import annotations

import logging

import pytest

from workers.app import BEAT_LOGGER, DUE_TASK_PREFIX, DemoteFilter


class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def beat_logger():
    logger = logging.getLogger(BEAT_LOGGER)
    saved = (logger.level, list(logger.filters), logger.propagate)
    keep = _Keep()
    logger.addHandler(keep)
    logger.propagate = False
    logger.filters[:] = [DemoteFilter(DUE_TASK_PREFIX)]
    try:
        yield logger, keep.records
    finally:
        logger.removeHandler(keep)
        logger.setLevel(saved[0])
        logger.filters[:] = saved[1]
        logger.propagate = saved[2]


def test_due_task_line_is_debug_and_errors_keep_their_level(beat_logger):
    logger, records = beat_logger
    logger.setLevel(logging.INFO)
    logger.info("Scheduler: Sending due task %s (%s)", "feed", "backfill.feed")
    logger.info("beat: Starting...")
    logger.error("Message Error: %s", "boom")
    assert [(r.levelname, r.getMessage()) for r in records] == [("INFO", "beat: Starting..."),
                                                                ("ERROR", "Message Error: boom")]
    logger.setLevel(logging.DEBUG)
    logger.info("Scheduler: Sending due task %s (%s)", "feed", "backfill.feed")
    assert (records[-1].levelname, records[-1].levelno) == ("DEBUG", logging.DEBUG)
