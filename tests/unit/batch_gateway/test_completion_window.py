"""``completion_window`` is matched whole (``batch_gateway.schemas.window_seconds``)."""

from __future__ import annotations

import pytest

from batch_gateway.schemas import window_seconds


def test_24h_and_the_duration_extension_are_accepted():
    assert (window_seconds("24h"), window_seconds("30m"), window_seconds("7d")) == (86400, 1800, 604800)


@pytest.mark.parametrize("window", ["24h\n", "24h\r\n", " 24h", "24h ", "\n24h", "24hx"])
def test_anything_around_the_window_is_refused(window):
    with pytest.raises(ValueError):
        window_seconds(window)
