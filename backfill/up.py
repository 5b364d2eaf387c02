"""``backfill up``: the whole stack on one machine.

Starts the stores (embedded PostgreSQL and Redis under ``--data-dir`` unless ``DATABASE_URL`` /
``REDIS_URL`` are set), applies migrations, starts ``--engines`` simulated vLLM engines (or uses the
real ones given with ``--engine-url``), the router in front of them, the async processor (sending
to the router, gated on its saturation; it also reads llm-d-async's default sorted set
``request-sortedset``, retry sorted set ``retry-sortedset`` and channel ``request-queue``), the Celery worker, beat and the gateway as child
processes, waits until the gateway, the router and the engines answer (each from the port of the
child that was started for it, not from another process that took the port) and the processor has
created its consumer groups (the router and the processor share a generated trusted token,
``BACKFILL_ROUTER_TRUSTED_TOKEN``, so the router honours the processor's fairness ids and
objectives), writes the endpoints to ``DATA_DIR/stack.json`` (:mod:`backfill.stack_file`, removed
on exit) and prints one line beginning ``backfill ready`` with
``gateway=http://HOST:PORT/v1``, ``router=http://…``, ``redis=`` (the embedded Redis listens on
``DATA_DIR/redis/redis.sock``), ``broker=`` (the same Redis as a Celery broker URL, for Flower) and
the ``metrics=`` URLs. On SIGINT, SIGTERM or SIGHUP it stops every child (SIGTERM, then SIGKILL after
the grace period) and the stores, and exits 0; children also get SIGTERM from the
kernel if ``backfill up`` itself is killed. One stack at a time may use a data directory (a lock
file), and a busy port is refused before anything starts. A child that dies on its own is
restarted; one that keeps dying (more than 5 times a minute) stops everything with exit code 1, and
so does the embedded PostgreSQL dying or being restarted underneath the stack (its children's
connections, their locks and in-flight transactions went with it; an operator restarts the stack).
Everything written under the data directory is private to the service user (0600/0700).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import httpx

from common.contracts.queue import LLMD_REQUEST_CHANNEL, LLMD_REQUEST_SORTED_SET, LLMD_RETRY_SORTED_SET
from common.private import PRIVATE_UMASK, open_private, private_dir

GRACE_SECONDS = 15.0
MAX_RESTARTS = 5
RESTART_WINDOW_SECONDS = 60.0
"""A child that exits more than ``MAX_RESTARTS`` times within this window stops the stack."""
DEFAULT_MODELS = ("sim-model",)
"""Model names the simulated engines serve when ``--served-model-name`` is not given (the
examples in ``examples/`` use it)."""
READY_TIMEOUT_SECONDS = 60.0


@dataclass
class Stack:
    """A running stack: its children, URLs and the API key of the ``default`` tenant."""

    gateway_url: str
    api_key: str
    data_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    """Environment of the children (``DATABASE_URL``, ``REDIS_URL``, ``BACKFILL_DATA_DIR``, …)."""
    children: dict[str, subprocess.Popen] = field(default_factory=dict)
    engine_urls: list[str] = field(default_factory=list)
    """Every engine's base URL (prefill, decode and both)."""
    engine_roles: dict[str, str] = field(default_factory=dict)
    """Base URL → ``prefill`` | ``decode`` | ``both`` for the engines started in a role (a P/D
    fleet: its ``--engines`` ones are ``both``); empty without prefill/decode engines."""
    router_url: str | None = None
    argv: dict[str, list[str]] = field(default_factory=dict)
    child_env: dict[str, dict[str, str]] = field(default_factory=dict)
    """Environment of the children started with their own (the P/D engines' NIXL side channels)."""
    restarts: dict[str, list[float]] = field(default_factory=dict)
    postgres_pid: int | None = None
    """The postmaster's pid of the embedded PostgreSQL this stack started (None: ``DATABASE_URL``
    names an external one); :meth:`postgres_lost` watches it."""

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start child ``name`` (output to ``logs/NAME.log``) with ``env`` (default: the stack's),
        remembering how, to restart it."""
        self.argv[name] = argv
        if env is not None:
            self.child_env[name] = env
        self.children[name] = _spawn(argv, self.child_env.get(name, self.env), self.data_dir / "logs", name)
        return self.children[name]

    def metrics_urls(self) -> str:
        """``service:URL`` of every Prometheus endpoint of the stack, comma-separated."""
        host = self.env.get("BACKFILL_METRICS_HOST", "127.0.0.1")
        urls = [f"gateway:{self.gateway_url.removesuffix('/v1')}/metrics"]
        if self.router_url:
            urls.append(f"router:{self.router_url}/metrics")
        for service in ("worker", "processor"):
            port = self.env.get(f"BACKFILL_{service.upper()}_METRICS_PORT")
            if port and service in self.children:
                urls.append(f"{service}:http://{host}:{port}/metrics")
        return ",".join(urls)

    def metrics(self) -> dict[str, str]:
        """``{service: URL}`` of :meth:`metrics_urls`."""
        return dict(item.split(":", 1) for item in self.metrics_urls().split(",") if item)

    def health_urls(self) -> dict[str, str]:
        """``{service: URL}`` of every ``/health`` endpoint of the stack (the worker and the
        processor serve theirs on their metrics ports)."""
        urls = {"gateway": f"{self.gateway_url.removesuffix('/v1')}/health"}
        if self.router_url:
            urls["router"] = f"{self.router_url}/health"
        urls.update({service: url.removesuffix("/metrics") + "/health" for service, url in self.metrics().items()
                     if service in ("worker", "processor")})
        return urls

    @property
    def broker_url(self) -> str:
        """The Celery broker URL of the stack's Redis in kombu's spelling (``redis+socket://…`` for
        a unix socket), the form Celery tools such as Flower accept."""
        from batch_gateway.store.outbox import celery_broker_url

        return celery_broker_url(self.env["REDIS_URL"])

    def describe(self, database_url: str) -> dict:
        """What ``stack.json`` records (see :mod:`backfill.stack_file`)."""
        from datetime import UTC, datetime

        base = self.gateway_url.removesuffix("/v1")
        return {
            "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "gateway_url": self.gateway_url,
            "admin_url": f"{base}/admin" if self.env.get("BACKFILL_ADMIN_KEY") else None,
            "api_key": self.api_key, "router_url": self.router_url, "engine_urls": self.engine_urls,
            "engine_roles": self.engine_roles,
            "redis_url": self.env["REDIS_URL"], "celery_broker_url": self.broker_url,
            "database_url": database_url, "metrics": self.metrics(), "health": self.health_urls(),
            "data_dir": str(self.data_dir), "logs": str(self.data_dir / "logs"),
            "children": {name: proc.pid for name, proc in self.children.items()},
        }

    def dead_child(self) -> str | None:
        """The name of a child that exited, if any."""
        for name, proc in self.children.items():
            if proc.poll() is not None:
                return name
        return None

    def postgres_lost(self) -> str | None:
        """Why the embedded PostgreSQL is no longer the one this stack started (it exited, or
        ``DATA_DIR/postgres/postmaster.pid`` names another process: restarted underneath), or None
        while it runs (and always with an external database)."""
        if self.postgres_pid is None:
            return None
        import psutil

        now = postmaster_pid(self.data_dir / "postgres")
        if now != self.postgres_pid or not psutil.pid_exists(self.postgres_pid):
            if now is not None and psutil.pid_exists(now):
                return f"the embedded PostgreSQL was restarted underneath (pid {self.postgres_pid} -> {now})"
            return f"the embedded PostgreSQL (pid {self.postgres_pid}) exited"
        return None

    def restart_dead(self) -> str | None:
        """Restart every child that exited; returns the name of one that exited more than
        :data:`MAX_RESTARTS` times within :data:`RESTART_WINDOW_SECONDS` (not restarted), or None."""
        now = time.monotonic()
        for name, proc in list(self.children.items()):
            if proc.poll() is None:
                continue
            recent = [t for t in self.restarts.get(name, []) if now - t < RESTART_WINDOW_SECONDS]
            if len(recent) >= MAX_RESTARTS:
                return name
            self.restarts[name] = recent + [now]
            click.echo(f"backfill: {name} exited with status {proc.returncode}; restarting it", err=True)
            self.start(name, self.argv[name], self.child_env.get(name))
        return None

    def stop(self, grace: float = GRACE_SECONDS) -> None:
        """SIGTERM every child, wait up to ``grace`` seconds, SIGKILL the rest."""
        for proc in self.children.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.children.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux to SIGTERM it when ``backfill up`` dies, even by SIGKILL."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _spawn(argv: list[str], env: dict, log_dir: Path, name: str) -> subprocess.Popen:
    with os.fdopen(open_private(log_dir / f"{name}.log", os.O_WRONLY | os.O_APPEND), "ab") as log:
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with_parent if sys.platform == "linux" else None)


def _backfill(*args: str) -> list[str]:
    return [sys.executable, "-m", "backfill", *args]


def _holds_port(proc: subprocess.Popen, port: int) -> bool:
    """Whether ``proc`` (or one of its children) listens on TCP ``port``."""
    import psutil

    try:
        root = psutil.Process(proc.pid)
        for member in (root, *root.children(recursive=True)):
            for conn in member.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
                    return True
    except psutil.Error:
        return False
    return False


def _port_holder(port: int) -> str:
    """Who listens on ``port``, as far as this user may see (``pid N (cmdline)``), for messages."""
    import psutil

    with contextlib.suppress(psutil.Error, OSError):
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                return f"pid {conn.pid} ({' '.join(psutil.Process(conn.pid).cmdline())[:120]})"
    return "another process"


def _wait_ready(url: str, stack: Stack, timeout: float = READY_TIMEOUT_SECONDS, *, owner: str | None = None) -> None:
    """Poll ``url`` until it answers 200. With ``owner`` (a child's name), the answer counts only
    when that child holds the URL's port: a stack whose port was taken by another process between
    the free-port check and the bind must not report the other process as ready. Raises
    ``click.ClickException`` when a child dies (naming its log and, for ``owner``, the port's holder)
    or after ``timeout`` seconds."""
    port = httpx.URL(url).port
    deadline = time.monotonic() + timeout
    answered_by_other = False
    while time.monotonic() < deadline:
        dead = stack.dead_child()
        if dead:
            why = (f"; port {port} answers but is held by {_port_holder(port)}"
                   if dead == owner and answered_by_other and port else "")
            raise click.ClickException(
                f"{dead} exited during start-up{why}; see {stack.data_dir / 'logs' / (dead + '.log')}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0).status_code == 200:
                if owner is None or port is None or _holds_port(stack.children[owner], port):
                    return
                answered_by_other = True
        time.sleep(0.2)
    held = f" (port {port} is held by {_port_holder(port)})" if answered_by_other and port else ""
    raise click.ClickException(f"{url} did not answer within {timeout:.0f} s{held}")


def _wait_processor_groups(stack: Stack) -> None:
    """Wait until the processor has created its consumer group on every lane it reads, so that
    ``backfill enqueue`` right after the ready line finds a reader."""
    from async_processor.settings import build_settings
    from backfill.queue_check import wait_for_groups
    from common.contracts.queue import request_stream

    redis_url = stack.env.get("BACKFILL_PROCESSOR_REDIS_URL") or stack.env["REDIS_URL"]  # as the child reads it
    settings = build_settings(redis_url=redis_url)
    if settings.backend != "redis":  # Pub/Sub subscriptions: the processor's /health tells
        return
    streams = [request_stream(lane, settings.pool, settings.stream_prefix) for lane in settings.lanes]
    log = stack.data_dir / "logs" / "processor.log"
    try:
        wait_for_groups(redis_url, streams, settings.consumer_group, timeout_s=READY_TIMEOUT_SECONDS,
                        failed=lambda: f"processor exited during start-up; see {log}"
                        if stack.children["processor"].poll() is not None else None)
    except (RuntimeError, TimeoutError) as exc:
        raise click.ClickException(f"{exc} (see {log})" if isinstance(exc, TimeoutError) else str(exc)) from None


def start_engines(stack: Stack, count: int, served_model_names: list[str],
                  engine_urls: list[str], *, background_prefill: bool = True,
                  max_background_prefill_tokens: int | None = None, prefill: int = 0, decode: int = 0) -> None:
    """Use ``engine_urls`` (real vLLM servers) when given; otherwise start ``count`` simulated
    engines (children ``engine-N``) plus ``prefill`` prefill and ``decode`` decode engines in their
    prefill/decode roles (``prefill-N``, ``decode-N``: :func:`engine_twin.launch.sim_engine_argv`
    with ``pd_role``, vLLM's NixlConnector between them; with either, the ``engine-N`` run it too, as
    role ``both``: the router may pick them for either leg), all serving ``served_model_names`` on free
    ports (a P/D engine's NIXL side channel on one more free port, :func:`engine_twin.launch.pd_engine_env`),
    and wait until each answers ``/health``. ``background_prefill``: the simulated engines
    bound batch and async prefills per step (``--background-priority-threshold``,
    ``engine_twin/core.py``; ``max_background_prefill_tokens`` None: the twin's default).
    Raises ``click.ClickException`` when an engine does not start."""
    from engine_twin.launch import BACKGROUND_PRIORITY_THRESHOLD, pd_engine_env, sim_engine_argv, wait_ready

    if engine_urls:
        stack.engine_urls = [url.rstrip("/") for url in engine_urls]
        return
    both = "both" if prefill or decode else None
    names = [(f"engine-{i}", both) for i in range(count)] + [(f"prefill-{i}", "prefill") for i in range(prefill)] \
        + [(f"decode-{i}", "decode") for i in range(decode)]
    started: list[tuple[str, str]] = []
    for name, role in names:
        engine_port = free_port()
        stack.start(name, sim_engine_argv(
            engine_port, served_model_names,
            background_priority_threshold=BACKGROUND_PRIORITY_THRESHOLD if background_prefill else None,
            max_background_prefill_tokens=max_background_prefill_tokens, pd_role=role),
            env=pd_engine_env(free_port(), base=stack.env) if role else None)
        url = f"http://127.0.0.1:{engine_port}"
        stack.engine_urls.append(url)
        if role:
            stack.engine_roles[url] = role
        started.append((name, url))
    for name, url in started:
        try:
            wait_ready(url, timeout=READY_TIMEOUT_SECONDS, process=stack.children[name])
        except (RuntimeError, TimeoutError) as exc:
            raise click.ClickException(f"{name}: {exc}; see {stack.data_dir / 'logs'}") from None


def _state_store(env: dict[str, str]) -> list[str]:
    """The router's Responses state store flag: ``BACKFILL_ROUTER_STATE_REDIS_URL``, else the stack's
    ``REDIS_URL``; none (the router keeps no response state) when neither is set."""
    url = env.get("BACKFILL_ROUTER_STATE_REDIS_URL") or env.get("REDIS_URL")
    return ["--state-redis-url", url] if url else []


def start_router(stack: Stack, host: str, *, simulated: bool, engine_priority: bool = True) -> None:
    """Start ``backfill router`` on a free port in front of ``stack.engine_urls`` (those in
    ``stack.engine_roles`` as ``--prefill-engine`` / ``--decode-engine``, so the router runs its
    shipped P/D scheduling config; the rest as ``--engine``) and wait until it has a healthy
    engine. ``engine_priority`` (the default, in every launch mode) makes the router write vLLM's
    ``priority`` field from the trusted objective (``--engine-priority``; a caller's own field is
    dropped either way): simulated engines run vLLM's priority policy; engines given by URL honour
    it when they run ``--scheduling-policy priority`` and ignore it under vLLM's default ``fcfs``
    (vLLM's v1 engine; the old v0 engine refused a non-zero priority under ``fcfs``: ``up
    --no-engine-priority`` for those).

    The router honours fairness ids and objectives only from callers with its trusted token
    (``router/trust.py``): ``stack.env`` gets one (the one already in it, else a new random one) as
    both ``BACKFILL_ROUTER_TRUSTED_TOKEN`` and ``BACKFILL_PROCESSOR_ROUTER_TOKEN``, so a processor
    started later from ``stack.env`` is trusted.

    The router keeps the Responses API state (``store``, ``previous_response_id``) in the stack's
    Redis (``--state-redis-url``; ``BACKFILL_ROUTER_STATE_REDIS_URL`` in the environment wins)."""
    from router.cli import router_argv

    env = stack.env
    token = env.get("BACKFILL_ROUTER_TRUSTED_TOKEN") or env.get("BACKFILL_PROCESSOR_ROUTER_TOKEN") \
        or secrets.token_urlsafe(32)
    env["BACKFILL_ROUTER_TRUSTED_TOKEN"] = env["BACKFILL_PROCESSOR_ROUTER_TOKEN"] = token

    port = free_port(host)
    stack.router_url = f"http://{host}:{port}"
    stack.env["BACKFILL_ROUTER_URL"] = stack.router_url  # the gateway's dashboard reads its admin JSON
    # every engine's slots come from the engine: the twin states its --max-num-seqs in /metrics
    # (backfill:engine_config_info, as backfill's vLLM plugin does); router/pool/slots.py
    by_role = {role: [u for u in stack.engine_urls if stack.engine_roles.get(u) == role]
               for role in ("prefill", "decode")}
    both = [u for u in stack.engine_urls if stack.engine_roles.get(u, "both") == "both"]
    stack.start("router", router_argv(port, both, host=host, engine_priority=engine_priority,
                                      prefill_engines=by_role["prefill"], decode_engines=by_role["decode"],
                                      extra=["--log-level", "INFO", *_state_store(env)]))
    _wait_ready(f"{stack.router_url}/health", stack, owner="router")


def _check_port_free(host: str, port: int) -> None:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            raise click.ClickException(f"port {port} on {host} is in use; choose another with --port") from None


@contextlib.contextmanager
def _private_umask() -> Iterator[None]:
    """Run the block under umask ``0077`` (:data:`common.private.PRIVATE_UMASK`), restoring the
    caller's after: the stores and children started in it inherit it, so what they create under the
    data directory (PostgreSQL's and Redis's files, Celery's schedule, engines' logs) is private."""
    previous = os.umask(PRIVATE_UMASK)
    try:
        yield
    finally:
        os.umask(previous)


@contextlib.contextmanager
def _data_dir_lock(data_dir: Path) -> Iterator[None]:
    """Hold ``DATA_DIR/backfill.lock`` (an exclusive ``flock``) while a stack runs: a second stack on
    the same directory would share, and on exit stop, the first one's embedded stores."""
    import fcntl

    handle = os.fdopen(open_private(data_dir / "backfill.lock", os.O_RDWR | os.O_APPEND), "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "another process"
        handle.close()
        raise click.ClickException(f"the data directory {data_dir} is in use by {owner}; stop it first "
                                   "or give another --data-dir") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"backfill (pid {os.getpid()})")
    handle.flush()
    try:
        yield
    finally:
        handle.close()


def postmaster_pid(pgdata: Path) -> int | None:
    """The pid on the first line of ``PGDATA/postmaster.pid`` (PostgreSQL writes it at start and
    removes it at a clean stop), or None without a readable one."""
    try:
        first = (pgdata / "postmaster.pid").read_text().split("\n", 1)[0].strip()
    except OSError:
        return None
    return int(first) if first.isdigit() else None


@contextlib.contextmanager
def _stores(data_dir: Path):
    from backfill.stores import start_stores

    try:
        stores = start_stores(data_dir)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    with stores:
        yield stores


GENERATED_KEY_FILE = "generated-api-key"
"""``DATA_DIR/generated-api-key`` (0600): the key a stack made for itself (no ``--api-key``) while it
runs; its stop revokes the key and removes the file, and a start finding the file (a stack that died
before its stop) revokes that key first. So every run without ``--api-key`` gets a fresh key that
is active only while its stack runs."""


def _with_session(database_url: str, work: Callable[[Any], Any]) -> Any:
    """``work(session)`` in one committed transaction on ``database_url``."""
    from batch_gateway.store.db import make_engine, make_sessionmaker
    from batch_gateway.store.settings import sqlalchemy_url

    engine = make_engine(sqlalchemy_url(database_url), pool_size=1)
    try:
        with make_sessionmaker(engine)() as session:
            result = work(session)
            session.commit()
            return result
    finally:
        engine.dispose()


def revoke_generated_key(database_url: str, data_dir: Path) -> bool:
    """Revoke the key in ``DATA_DIR/generated-api-key`` and remove the file; returns whether there was
    one. A database error leaves the file (the next start revokes the key)."""
    from batch_gateway.store import queries

    path = data_dir / GENERATED_KEY_FILE
    try:
        key = path.read_text().strip()
    except FileNotFoundError:
        return False
    if key:
        _with_session(database_url, lambda session: queries.revoke_api_key(session, key))
    path.unlink(missing_ok=True)
    return True


def _remember_generated_key(data_dir: Path, api_key: str) -> None:
    with os.fdopen(open_private(data_dir / GENERATED_KEY_FILE, os.O_WRONLY | os.O_TRUNC), "w") as handle:
        handle.write(api_key + "\n")


def _register_key(database_url: str, api_key: str) -> None:
    """Accept ``api_key`` for the ``default`` tenant (refused clearly when another tenant owns it)."""
    from batch_gateway.store import queries
    from batch_gateway.store.db import make_engine, make_sessionmaker
    from batch_gateway.store.settings import sqlalchemy_url

    engine = make_engine(sqlalchemy_url(database_url), pool_size=1)
    try:
        with make_sessionmaker(engine)() as session:
            queries.add_api_key(session, "default", api_key)
            session.commit()
    except ValueError as exc:
        raise click.ClickException(f"--api-key: {exc}") from None
    finally:
        engine.dispose()


@contextlib.contextmanager
def run_stack(data_dir: Path, host: str, port: int, api_key: str | None, *, engines: int = 2,
              served_model_names: list[str] | None = None,
              engine_urls: list[str] | None = None, admin_key: str | None = None,
              prefill_engines: int = 0, decode_engines: int = 0, engine_priority: bool = True,
              progress: Callable[[str], None] | None = None) -> Iterator[Stack]:
    """Start the stack, yield it once the gateway and the engines answer, and stop everything on
    exit. ``engines`` simulated engines serve ``served_model_names`` unless ``engine_urls`` name
    real ones; ``prefill_engines`` / ``decode_engines`` simulated engines more in those roles
    (prefill/decode disaggregation; :func:`check_pd_counts` says which combinations are valid).
    ``admin_key`` opens the gateway's dashboard at ``/admin`` (closed without one).
    ``engine_priority``: the router sends vLLM's ``priority`` (:func:`start_router`). Without
    ``api_key`` the stack makes one for tenant ``default``, active only while it runs
    (:data:`GENERATED_KEY_FILE`). ``progress`` is
    called with one short line (``"router ready http://…"``) as each service becomes ready.
    Raises ``click.UsageError`` for an invalid combination, before anything starts."""
    from backfill.stack_file import remove_stack, write_stack
    from migrations.config import upgrade

    check_pd_counts(prefill_engines, decode_engines, bool(engine_urls))
    _check_port_free(host, port)  # before anything is written: a refused start leaves no data dir
    data_dir = data_dir.resolve()
    private_dir(data_dir)
    private_dir(data_dir / "logs")
    generated = not api_key
    api_key = api_key or "sk-bf-" + secrets.token_urlsafe(24)
    say = progress or (lambda line: None)
    with _private_umask(), _data_dir_lock(data_dir), _stores(data_dir) as stores:
        say(f"redis ready {'(REDIS_URL)' if os.environ.get('REDIS_URL') else 'embedded'}")
        upgrade(stores.database_url)
        say(f"postgres ready {'(DATABASE_URL)' if os.environ.get('DATABASE_URL') else 'embedded'}, migrated")
        revoke_generated_key(stores.database_url, data_dir)  # left by a stack that died before its stop
        if generated:
            _remember_generated_key(data_dir, api_key)
        _register_key(stores.database_url, api_key)
        env = dict(os.environ, DATABASE_URL=stores.database_url, REDIS_URL=stores.redis_url,
                   BACKFILL_DATA_DIR=str(data_dir), BACKFILL_API_KEY=api_key)
        # each service its own Prometheus port on this host unless given (the gateway and the router
        # serve /metrics on their own ports); one shared port for every child cannot work here
        env.pop("BACKFILL_METRICS_PORT", None)
        for service in ("WORKER", "PROCESSOR"):
            env.setdefault(f"BACKFILL_{service}_METRICS_PORT", str(free_port(host)))
        env.setdefault("BACKFILL_METRICS_HOST", host)
        # llm-d-async's producers unchanged: its default sorted set, retry set and redis-pubsub channel
        env.setdefault("BACKFILL_PROCESSOR_LLMD_SORTED_SETS", f'["{LLMD_REQUEST_SORTED_SET}"]')
        env.setdefault("BACKFILL_PROCESSOR_LLMD_RETRY_SORTED_SETS", f'["{LLMD_RETRY_SORTED_SET}"]')
        env.setdefault("BACKFILL_PROCESSOR_LLMD_CHANNELS", f'["{LLMD_REQUEST_CHANNEL}"]')
        if admin_key:
            env["BACKFILL_ADMIN_KEY"] = admin_key
        stack = Stack(gateway_url=f"http://{host}:{port}/v1", api_key=api_key, data_dir=data_dir, env=env,
                      postgres_pid=None if os.environ.get("DATABASE_URL") else postmaster_pid(data_dir / "postgres"))
        try:
            start_engines(stack, engines, served_model_names or list(DEFAULT_MODELS), engine_urls or [],
                          prefill=prefill_engines, decode=decode_engines)
            for url in stack.engine_urls:
                say(f"engine ready {url}" + (f" ({stack.engine_roles[url]})" if url in stack.engine_roles else "")
                    + (" (given)" if engine_urls else ""))
            if stack.engine_urls:
                start_router(stack, host, simulated=not engine_urls, engine_priority=engine_priority)
                assert stack.router_url is not None  # start_router set it
                say(f"router ready {stack.router_url}")
                stack.start("processor", _backfill("processor", "--backend", "redis", "--router-url",
                                                   stack.router_url, "--saturation-gate", "--log-level", "INFO"))
            stack.start("worker", _backfill("worker", "--log-level", "INFO"))
            stack.start("beat", _backfill("beat", "--data-dir", str(data_dir), "--log-level", "INFO"))
            say("beat started")
            stack.start("gateway", _backfill("gateway", "--host", host, "--port", str(port), "--log-level", "info"))
            _wait_ready(f"http://{host}:{port}/health", stack, owner="gateway")
            say(f"gateway ready {stack.gateway_url}")
            if "processor" in stack.children:
                _wait_processor_groups(stack)
                say("processor ready (reading every lane)")
            worker_health = stack.health_urls().get("worker")
            if worker_health:  # served once the worker's pool runs and its broker answers
                _wait_ready(worker_health, stack)
            say("worker ready" if worker_health else "worker started")
            write_stack(data_dir, stack.describe(stores.database_url))
            yield stack
        finally:
            remove_stack(data_dir)
            stack.stop()
            with contextlib.suppress(Exception):  # the database may be gone: the next start revokes it
                revoke_generated_key(stores.database_url, data_dir)


def check_pd_counts(prefill: int, decode: int, engine_urls: bool) -> None:
    """Refuse prefill/decode counts that cannot make a fleet: prefill engines without a decode
    engine (nothing would generate the answers), decode engines without a prefill engine (that is
    the aggregated fleet: use ``--engines``), negative counts, or either with ``--engine-url``
    (the roles are flags of the simulated engines ``up`` starts; run real engines with vLLM's
    ``--kv-transfer-config`` and ``backfill router --prefill-engine/--decode-engine`` yourself).
    Raises ``click.UsageError``."""
    if prefill < 0 or decode < 0:
        raise click.UsageError("--prefill-engines and --decode-engines must be 0 or more")
    if (prefill or decode) and engine_urls:
        raise click.UsageError("--prefill-engines/--decode-engines start simulated engines in those roles; they "
                               "cannot be combined with --engine-url")
    if prefill and not decode:
        raise click.UsageError(f"--prefill-engines {prefill} needs --decode-engines (at least 1): prefill engines "
                               "only compute prompts, decode engines generate the answers")
    if decode and not prefill:
        raise click.UsageError(f"--decode-engines {decode} needs --prefill-engines (at least 1); for engines that "
                               "do both, use --engines")


def _role_fields(stack: Stack) -> str:
    """``prefill_engines=URL,… decode_engines=URL,… `` of the ready line (empty without roles)."""
    out = ""
    for role in ("prefill", "decode"):
        urls = [u for u in stack.engine_urls if stack.engine_roles.get(u) == role]
        if urls:
            out += f"{role}_engines={','.join(urls)} "
    return out


def ready_line(stack: Stack, admin_key: str | None) -> str:
    """The one line ``up`` prints on stdout once the stack is ready: ``backfill ready gateway=URL
    admin=URL|- api_key=KEY engines=URL,… stack_file=PATH`` (the rest of the map, the router, Redis,
    the broker, metrics and logs, is in ``stack.json``)."""
    admin = stack.gateway_url.removesuffix("/v1") + "/admin" if admin_key else "-"  # closed without a key
    return (f"backfill ready gateway={stack.gateway_url} admin={admin} api_key={stack.api_key} "
            f"engines={','.join(stack.engine_urls) or '-'} stack_file={stack.data_dir / 'stack.json'}")


def summary(stack: Stack, admin_key: str | None) -> list[str]:
    """The short lines on stderr after the ready line: the dashboard and how to log in, the key, and
    where the full map is."""
    base = stack.gateway_url.removesuffix("/v1")
    dashboard = (f"dashboard {base}/admin (log in with the --admin-key)" if admin_key
                 else "dashboard closed (start with --admin-key KEY to open it at /admin)")
    return [f"  {dashboard}", f"  API key {stack.api_key} (tenant default) at {stack.gateway_url}",
            f"  the full map (router, Redis, broker, metrics, logs) is in {stack.data_dir / 'stack.json'}"]


class Stop(Exception):
    """Raised in the main thread by SIGINT, SIGTERM or SIGHUP while :func:`stop_on_signals` is active."""


def _raise_stop(signum, frame) -> None:
    raise Stop(signum)


def stop_on_signals() -> None:
    """Turn SIGINT, SIGTERM and SIGHUP (a closed terminal) into :class:`Stop`, so ``with`` blocks
    unwind and every child and store is stopped."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _raise_stop)


@click.command("up")
@click.option("--data-dir", type=click.Path(path_type=Path), default=Path(".data"), show_default=True,
              envvar="BACKFILL_DATA_DIR", help="Embedded stores, file bytes and logs live here.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--api-key", envvar="BACKFILL_API_KEY",
              help="Key accepted for the 'default' tenant (a new one is made if not given).")
@click.option("--admin-key", envvar="BACKFILL_ADMIN_KEY",
              help="Key of the admin dashboard at /admin (the dashboard is closed without one).")
@click.option("--engines", default=2, show_default=True, type=click.IntRange(0, 64),
              help="Simulated engines to start when no --engine-url is given.")
@click.option("--served-model-name", "served_model_names", multiple=True,
              help="Model name the simulated engines serve (repeat, or separate with commas). "
                   "Default: sim-model.")
@click.option("--engine-url", "engine_urls", multiple=True,
              help="URL of a running (real vLLM) engine to use instead of simulated ones (repeat).")
@click.option("--prefill-engines", default=0, show_default=True, type=click.IntRange(0, 64),
              help="Simulated prefill engines (prefill/decode disaggregation; needs --decode-engines). "
                   "With them, --engines counts only engines doing both and defaults to 0.")
@click.option("--decode-engines", default=0, show_default=True, type=click.IntRange(0, 64),
              help="Simulated decode engines (needs --prefill-engines).")
@click.option("--engine-priority/--no-engine-priority", default=True, show_default=True,
              help="The router writes vLLM's request priority from the band (interactive first) on every "
                   "request, for simulated and --engine-url engines alike; vLLM honours it with "
                   "--scheduling-policy priority and ignores it under fcfs. Off only for old (v0) vLLM "
                   "engines that refuse a priority under fcfs.")
@click.pass_context
def up_command(ctx: click.Context, data_dir: Path, host: str, port: int, api_key: str | None,
               admin_key: str | None, engines: int, served_model_names: tuple[str, ...],
               engine_urls: tuple[str, ...], prefill_engines: int, decode_engines: int,
               engine_priority: bool) -> None:
    """Run the whole stack on this machine until SIGINT/SIGTERM."""
    names = [name.strip() for value in served_model_names for name in value.split(",") if name.strip()]
    check_pd_counts(prefill_engines, decode_engines, bool(engine_urls))
    if (prefill_engines or decode_engines) and \
            ctx.get_parameter_source("engines") is not click.core.ParameterSource.COMMANDLINE:
        engines = 0  # a P/D fleet: engines doing both only when asked for
    stop_on_signals()
    code = 0
    try:
        with run_stack(data_dir, host, port, api_key, engines=engines, served_model_names=names,
                       engine_urls=list(engine_urls), admin_key=admin_key, prefill_engines=prefill_engines,
                       decode_engines=decode_engines, engine_priority=engine_priority,
                       progress=lambda line: click.echo(f"backfill: {line}", err=True),
                       ) as stack:
            click.echo(ready_line(stack, admin_key))
            for line in summary(stack, admin_key):
                click.echo(line, err=True)
            sys.stdout.flush()
            while True:
                lost = stack.postgres_lost()
                if lost:  # the children's connections and the stack's state went with it
                    click.echo(f"backfill: {lost}; stopping (start backfill up again)", err=True)
                    code = 1
                    break
                failing = stack.restart_dead()
                if failing:
                    click.echo(f"backfill: {failing} keeps exiting; stopping", err=True)
                    code = 1
                    break
                time.sleep(0.5)
    except Stop:
        pass
    click.echo("backfill stopped", err=True)
    sys.exit(code)
