"""``backfill up`` on a busy port is refused before it writes anything (no data directory left)."""

from __future__ import annotations

import socket

import click
import pytest

from backfill.up import run_stack


def test_a_busy_port_is_refused_before_the_data_dir_is_made(tmp_path):
    data_dir = tmp_path / "never-made"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(click.ClickException, match=f"port {port} on 127.0.0.1 is in use"):
            with run_stack(data_dir, "127.0.0.1", port, None):
                pass
    assert not data_dir.exists()
