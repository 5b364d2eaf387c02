"""Fixtures of the scheduling tests."""

from __future__ import annotations

import pytest
from scheduling_helpers import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
