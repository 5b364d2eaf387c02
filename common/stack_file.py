"""``DATA_DIR/stack.json``: where a running ``backfill up`` can be reached — the reading side.

The file is a contract between ``backfill up`` (which writes it: :mod:`backfill.stack_file`) and its
readers (the client commands, the benchmarks that run the stack as a user does); reading it needs
nothing of the command line, so it lives here.

``backfill up`` writes it once the stack is ready and removes it when it stops; client commands
(``submit``, ``batches``, ``files``, ``enqueue``, ``keys`` …) read it to find the gateway, the API
key, Redis and the database of the stack on their ``--data-dir`` (default ``.data``, as ``up``'s).

The file is one JSON object (mode 0600: it holds the API key of the ``default`` tenant)::

    {"status": "running", "pid": 1234, "pid_started": 1764626400.12, "started_at": "2026-12-01T22:00:00+00:00",
     "gateway_url": "http://127.0.0.1:8000/v1", "admin_url": "http://127.0.0.1:8000/admin" | null,
     "api_key": "sk-bf-…", "router_url": "http://127.0.0.1:…" | null, "engine_urls": [...],
     "redis_url": "unix:///…/redis/redis.sock", "celery_broker_url": "redis+socket:///…/redis/redis.sock",
     "database_url": "postgresql://…", "metrics": {"gateway": "http://…/metrics", …},
     "health": {"gateway": "http://…/health", "processor": "http://…/health", …},
     "data_dir": "/abs/data", "logs": "/abs/data/logs",
     "children": {"engine-0": 1240, "router": 1242, "processor": 1243, "worker": 1244, …}}

``children``: the pid of each child ``up`` started, as the file was written (a child ``up``
restarts later gets a new one). A file whose ``pid`` no longer runs (the stack was killed with SIGKILL), or now belongs to another
process (``pid_started``, the process's start time, differs), is reported as stale, never used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

STACK_FILE = "stack.json"


class NoStack(Exception):
    """No running stack is recorded in the data directory; the message says why and what to do."""


def stack_path(data_dir: Path) -> Path:
    """``DATA_DIR/stack.json``."""
    return Path(data_dir) / STACK_FILE


def load_stack(data_dir: Path) -> dict[str, Any]:
    """The stack recorded in ``DATA_DIR/stack.json``.

    Raises :class:`NoStack` when the file is missing, unreadable, not marked running, or names a
    process that no longer runs."""
    import psutil

    path = stack_path(data_dir)
    start = f"start one with `backfill up --data-dir {data_dir}`"
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        raise NoStack(f"no running stack in {Path(data_dir).resolve()} ({path} not found); {start}") from None
    except (OSError, ValueError) as exc:
        raise NoStack(f"cannot read {path}: {exc}") from None
    if not isinstance(info, dict) or info.get("status") != "running":
        raise NoStack(f"{path} does not describe a running stack; {start}")
    pid = info.get("pid")
    if not isinstance(pid, int) or not psutil.pid_exists(pid) or info.get("pid_started") not in (None, started(pid)):
        raise NoStack(f"{path} is stale: the stack that wrote it (pid {pid}) is not running; {start}")
    return info


def started(pid: int) -> float | None:
    """When process ``pid`` started (``psutil``'s ``create_time``), to tell a reused pid apart."""
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None
