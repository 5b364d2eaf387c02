"""Shared fixtures: real PostgreSQL and Redis, a template database per session cloned per test, and
a running gateway + Celery worker to drive with the real ``openai`` client.

``DATABASE_URL`` / ``REDIS_URL`` select external servers; otherwise embedded ones are started under
a temporary directory (the same code path as ``backfill up``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psycopg
import pytest

from backfill.up import free_port

SHARED_BATCHES = Path(__file__).resolve().parents[2] / "shared" / "data" / "batches"

#: A busy loop that ends when its parent (pytest) is gone, so a killed run leaves no hog behind:
#: it checks its parent's pid once per million iterations (a few hundredths of a second).
CPU_HOG = """
import os
parent = os.getppid()
while os.getppid() == parent:
    for _ in range(1_000_000):
        pass
"""
_HOGS = pytest.StashKey[list[subprocess.Popen]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--cpu-hogs N``: N busy-loop processes beside the whole run, to prove the verdicts do not
    depend on how busy the machine is (issue 23)."""
    parser.addoption("--cpu-hogs", type=int, default=0, metavar="N",
                     help="start N busy-loop processes (one core each) for the session and stop them at its end")


def pytest_configure(config: pytest.Config) -> None:
    """Start ``--cpu-hogs`` processes once, in the controlling process (not in each xdist worker)."""
    count = config.getoption("cpu_hogs")
    if count and not hasattr(config, "workerinput"):
        config.stash[_HOGS] = [subprocess.Popen([sys.executable, "-c", CPU_HOG]) for _ in range(count)]


def pytest_unconfigure(config: pytest.Config) -> None:
    """Stop the ``--cpu-hogs`` processes."""
    hogs = config.stash.get(_HOGS, [])
    for hog in hogs:
        hog.kill()
    for hog in hogs:
        hog.wait()


def xdist_worker_index() -> int | None:
    """This pytest-xdist worker's number (``gw3`` → 3), or None outside xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else None


def worker_redis_url(url: str, worker: int | None) -> str:
    """An external Redis URL (``redis://`` / ``rediss://``) moved to a database of xdist worker
    ``worker``'s own: the URL's database + 1 + ``worker`` (modulo Redis's default 16), so a test
    that empties its database (``FLUSHDB``) cannot touch another worker's queues. Other URLs, and
    ``worker`` None (no xdist), are returned unchanged."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if worker is None or parts.scheme not in ("redis", "rediss"):
        return url
    base = int(parts.path.strip("/") or 0)
    return urlunsplit(parts._replace(path=f"/{(base + 1 + worker) % 16}"))


@pytest.fixture(scope="session")
def stores():
    """Session-wide PostgreSQL and Redis (embedded unless the URLs are set), in a directory of
    their own: pytest prunes old ``basetemp`` folders, which another concurrent run could do under
    a running server.

    Each pytest-xdist worker has a session of its own, so embedded servers are per worker; on
    external servers a worker's databases carry its pid (template) or a random name (per test) and
    its Redis is a database of its own (:func:`worker_redis_url`)."""
    from backfill.stores import start_stores

    directory = Path(tempfile.mkdtemp(prefix="backfill-test-stores-"))
    try:
        with start_stores(directory, database="postgres") as found:
            if os.environ.get("REDIS_URL"):
                found.redis_url = worker_redis_url(found.redis_url, xdist_worker_index())
            yield found
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def with_database(url: str, name: str) -> str:
    """``url`` pointing at database ``name`` instead."""
    from sqlalchemy.engine import make_url

    return make_url(url).set(database=name).render_as_string(hide_password=False)


def _admin_url(database_url: str) -> str:
    return with_database(database_url, "postgres")


@pytest.fixture(scope="session")
def template_database(stores) -> str:
    """Name of a database migrated to head, used as the template of every test's database."""
    from batch_gateway.store.settings import sqlalchemy_url
    from migrations.config import upgrade

    name = f"bf_template_{os.getpid()}"
    with psycopg.connect(_admin_url(stores.database_url), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    upgrade(sqlalchemy_url(with_database(stores.database_url, name)))
    yield name
    with psycopg.connect(_admin_url(stores.database_url), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def database_url(stores, template_database) -> Iterator[str]:
    """A fresh database for this test, cloned from the migrated template (libpq URL)."""
    name = f"bf_test_{secrets.token_hex(6)}"
    with psycopg.connect(_admin_url(stores.database_url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_database}"')
    yield with_database(stores.database_url, name)
    with psycopg.connect(_admin_url(stores.database_url), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@dataclass
class Gateway:
    """A gateway served by uvicorn in a thread, with a Celery worker consuming its task queue."""

    base_url: str
    api_key: str
    settings: object
    celery: object
    keys: dict[str, str] = field(default_factory=dict)

    def key(self, tenant: str) -> str:
        """An API key of ``tenant`` (created on first use)."""
        if tenant not in self.keys:
            from batch_gateway.store import queries
            from batch_gateway.store.db import make_engine, make_sessionmaker

            engine = make_engine(self.settings.database_url, pool_size=1)
            with make_sessionmaker(engine)() as session:
                self.keys[tenant] = queries.add_api_key(session, tenant)
                session.commit()
            engine.dispose()
        return self.keys[tenant]

    def client(self, tenant: str = "default", **kwargs):
        """The real ``openai`` client, authenticated as ``tenant``."""
        import openai

        key = self.api_key if tenant == "default" else self.key(tenant)
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=key, max_retries=0, **kwargs)

    def http(self, tenant: str | None = "default") -> httpx.Client:
        """A raw HTTP client (for malformed requests the SDK cannot send)."""
        headers = {}
        if tenant is not None:
            key = self.api_key if tenant == "default" else self.key(tenant)
            headers["authorization"] = f"Bearer {key}"
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=30)

    def session(self):
        """A database session on the test's database (commit yourself)."""
        from batch_gateway.store.db import make_engine, make_sessionmaker

        return make_sessionmaker(make_engine(self.settings.database_url, pool_size=1))()

    def wait_status(self, batch_id: str, statuses: tuple[str, ...], tenant: str = "default",
                    timeout: float = 60.0):
        """Poll until the batch is in one of ``statuses``; returns it (raises ``AssertionError``
        after ``timeout`` s: generous, as a passing test waits only as long as the batch takes)."""
        client = self.client(tenant)
        deadline = time.monotonic() + timeout
        while True:
            batch = client.batches.retrieve(batch_id)
            if batch.status in statuses:
                return batch
            if time.monotonic() > deadline:
                raise AssertionError(f"batch {batch_id} still {batch.status}, wanted {statuses}")
            time.sleep(0.05)


@contextlib.contextmanager
def serve(app, port: int) -> Iterator[None]:
    """Run an ASGI app with uvicorn in a thread on 127.0.0.1:``port`` until the block ends."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def gateway_settings(database_url, stores, tmp_path):
    """Gateway settings on this test's database, a private task queue and file directory."""
    from batch_gateway.settings import load_settings

    return load_settings(database_url=database_url, redis_url=stores.redis_url, data_dir=tmp_path / "data",
                         api_key="sk-test-" + secrets.token_hex(8),
                         task_queue=f"test-{secrets.token_hex(4)}")


@pytest.fixture
def gateway(gateway_settings) -> Iterator[Gateway]:
    """A running gateway and a Celery worker (threads pool) on the test's database and queue."""
    from celery.contrib.testing.worker import start_worker

    from batch_gateway.app import create_app
    from workers.app import create_celery
    from workers.settings import load_settings as worker_settings

    settings = gateway_settings
    celery = create_celery(worker_settings(
        database_url=settings.database_url, redis_url=settings.redis_url, data_dir=settings.data_dir,
        task_queue=settings.task_queue, max_requests_per_batch=settings.max_requests_per_batch,
        pool=settings.task_queue, result_stream=f"backfill:results:{settings.task_queue}",
        default_enqueued_token_limit=settings.default_enqueued_token_limit,
    ))
    port = free_port()
    with serve(create_app(settings), port), start_worker(
        celery, pool="threads", concurrency=2, perform_ping_check=False, loglevel="WARNING",
        shutdown_timeout=10,
    ):
        yield Gateway(base_url=f"http://127.0.0.1:{port}", api_key=settings.api_key,
                      settings=settings, celery=celery)


@dataclass
class UpStack:
    """A ``backfill up`` subprocess: its ready line, base URL, API key and process."""

    proc: subprocess.Popen
    ready_line: str
    base_url: str
    api_key: str

    def client(self):
        """The real ``openai`` client on the stack's gateway."""
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0)

    def child(self, name: str):
        """The ``psutil.Process`` of the running child ``name`` (``processor``, ``gateway``,
        ``engine-sim``; ``worker`` and ``beat`` are found by the titles Celery gives them)."""
        import psutil

        marks = {"worker": "[celeryd:", "beat": "[celery beat]"}
        for proc in psutil.Process(self.proc.pid).children():
            try:  # a child just killed may be a zombie until backfill up reaps it
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                cmdline = " ".join(proc.cmdline())
            except psutil.Error:
                continue
            if marks.get(name, f"backfill {name} ") in cmdline + " ":
                return proc
        raise LookupError(f"no child {name!r}")


@contextlib.contextmanager
def backfill_up(data_dir: Path, *args: str, env: dict | None = None) -> Iterator[UpStack]:
    """Run ``backfill up`` as a user would (embedded stores), yield once it printed its ready line,
    and stop it with SIGTERM at the end (it must exit 0)."""
    port = free_port()
    environ = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    environ.update(env or {})
    proc = subprocess.Popen([sys.executable, "-m", "backfill", "up", "--data-dir", str(data_dir),
                             "--port", str(port), "--api-key", "sk-up", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("backfill ready"), line + (proc.stderr.read() if proc.poll() is not None else "")
        yield UpStack(proc, line, f"http://127.0.0.1:{port}/v1", "sk-up")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
