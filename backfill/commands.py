"""Service subcommands: ``migrate``, ``gateway``, ``worker``, ``beat``, ``keys``.

``gateway``, ``worker`` and ``beat`` read ``DATABASE_URL`` / ``REDIS_URL`` (``backfill up`` sets
them for its children). ``migrate``, ``keys`` and ``tenants`` use ``DATABASE_URL``, else the
database of the stack running on ``--data-dir`` (its ``stack.json``), else start the embedded
stores under ``--data-dir``, so they work on a fresh machine too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import click

from backfill.client import ADMIN_KEY_OPTION, gateway_options

DATA_DIR_OPTION = click.option(
    "--data-dir", type=click.Path(path_type=Path), default=Path(".data"), show_default=True,
    envvar="BACKFILL_DATA_DIR", help="Where embedded stores and file bytes live.",
)


@contextlib.contextmanager
def database_url(data_dir: Path) -> Iterator[str]:
    """``DATABASE_URL`` if set, else the database of the ``backfill up`` stack running on
    ``data_dir`` (its ``stack.json``), else the URL of an embedded PostgreSQL under ``data_dir``
    (migrated to the newest revision, as ``backfill up`` would) that is stopped on exit."""
    if os.environ.get("DATABASE_URL"):
        yield os.environ["DATABASE_URL"]
        return
    from backfill.stack_file import NoStack, load_stack

    try:
        running = load_stack(data_dir).get("database_url")
    except NoStack:
        running = None
    if isinstance(running, str) and running:
        yield running
        return
    from backfill.stores import start_stores
    from migrations.config import upgrade

    with start_stores(data_dir, environ={"REDIS_URL": "unused"}) as stores:
        upgrade(stores.database_url)
        yield stores.database_url


@click.command("migrate")
@DATA_DIR_OPTION
@click.option("--revision", default="head", show_default=True, help="Target revision.")
def migrate_command(data_dir: Path, revision: str) -> None:
    """Apply database migrations (Alembic) up to REVISION."""
    from migrations.config import upgrade

    with database_url(data_dir) as url:
        upgrade(url, revision)
    click.echo(f"database at revision {revision}")


@click.command("gateway")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--log-level", default="warning", show_default=True)
def gateway_command(host: str, port: int, log_level: str) -> None:
    """Serve the Files + Batches API (reads DATABASE_URL, REDIS_URL, BACKFILL_DATA_DIR)."""
    import uvicorn

    from batch_gateway.app import create_app
    from batch_gateway.server import uvicorn_config
    from batch_gateway.settings import load_settings
    from common.logging import configure_logging

    configure_logging(log_level)
    settings = load_settings()
    uvicorn.Server(uvicorn_config(create_app(settings), settings, host=host, port=port, log_level=log_level)).run()


def _celery(settings=None):
    from workers.app import create_celery
    from workers.settings import load_settings

    return create_celery(settings or load_settings())


def _celery_logging(log_level: str) -> None:
    """JSON or text logs (:func:`common.logging.configure_logging`) instead of Celery's own set-up:
    a receiver of ``setup_logging`` makes Celery leave the logging configuration alone."""
    from celery.signals import setup_logging

    from common.logging import configure_logging

    configure_logging(log_level)
    setup_logging.connect(lambda **_: None, weak=False)
    # Celery's own per-task "received" / "succeeded" lines: our tasks log what they did (action=…)
    for name in ("celery.worker.strategy", "celery.app.trace"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _multiprocess_metrics_dir() -> str:
    """Prepare prometheus-client's multiprocess mode for a prefork worker: ``PROMETHEUS_MULTIPROC_DIR``
    (emptied of an earlier run's files) or a new temporary directory, exported before anything imports
    prometheus-client. Raises ``click.ClickException`` when prometheus-client is already imported."""
    if "prometheus_client" in sys.modules:
        raise click.ClickException("prometheus-client was imported before its multiprocess directory was set")
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or tempfile.mkdtemp(prefix="backfill-worker-metrics-")
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(path):  # values of a previous run would be added to this one's
        if name.endswith(".db"):
            os.unlink(os.path.join(path, name))
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    return path


@click.command("worker")
@click.option("--concurrency", default=2, show_default=True, type=int)
@click.option("--pool", default="prefork", show_default=True,
              type=click.Choice(["prefork", "threads", "solo"]))
@click.option("--log-level", default="WARNING", show_default=True)
def worker_command(concurrency: int, pool: str, log_level: str) -> None:
    """Run a Celery worker of the batch lifecycle; with BACKFILL_WORKER_METRICS_PORT (or
    BACKFILL_METRICS_PORT) set, serve /metrics and /health on that port (/health is 503 while the
    broker does not answer)."""
    from workers.settings import load_settings

    settings = load_settings()
    _celery_logging(log_level)
    own_dir = None  # a temporary multiprocess directory made here, removed on exit
    if settings.metrics_port and pool == "prefork":  # tasks run in child processes
        given = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        path = _multiprocess_metrics_dir()
        own_dir = None if given else path
    celery = _celery(settings)
    if settings.metrics_port:  # served once the pool runs (no fork while its thread runs)
        from celery.signals import worker_ready

        from workers.metrics import broker_health, multiprocess_registry, serve_metrics

        registry = (multiprocess_registry(os.environ["PROMETHEUS_MULTIPROC_DIR"]) if pool == "prefork"
                    else celery.backfill.metrics.registry)
        health = broker_health(settings.redis_url, settings.health_broker_timeout_seconds)
        worker_ready.connect(lambda **_: serve_metrics(registry, settings.metrics_port, settings.metrics_host,
                                                       health), weak=False)
    try:
        celery.worker_main(["worker", f"--loglevel={log_level}", f"--concurrency={concurrency}",
                            f"--pool={pool}", "--without-gossip", "--without-mingle"])
    finally:
        if own_dir:
            shutil.rmtree(own_dir, ignore_errors=True)


@click.command("beat")
@DATA_DIR_OPTION
@click.option("--log-level", default="WARNING", show_default=True)
def beat_command(data_dir: Path, log_level: str) -> None:
    """Run the Celery beat scheduler: outbox relay, stale validations, feed, collect, sweep, finalize
    (expiry), webhook deliveries and file purges, each on its interval."""
    data_dir.mkdir(parents=True, exist_ok=True)
    _celery_logging(log_level)
    _celery().start(["beat", f"--loglevel={log_level}", f"--schedule={data_dir / 'celerybeat-schedule'}"])


@click.group("keys")
def keys_group() -> None:
    """Manage tenants' API keys."""


@contextlib.contextmanager
def _session(data_dir: Path):
    from batch_gateway.store.db import make_engine, make_sessionmaker
    from batch_gateway.store.settings import sqlalchemy_url

    with database_url(data_dir) as url:
        engine = make_engine(sqlalchemy_url(url), pool_size=1)
        try:
            with make_sessionmaker(engine)() as session:
                yield session
                session.commit()
        finally:
            engine.dispose()


@keys_group.command("create")
@click.option("--tenant", required=True, help="Tenant name (created if new).")
@DATA_DIR_OPTION
def keys_create(tenant: str, data_dir: Path) -> None:
    """Print a new API key for TENANT."""
    from batch_gateway.store import queries

    with _session(data_dir) as session:
        key = queries.add_api_key(session, tenant)
    click.echo(key)


@keys_group.command("list")
@click.option("--tenant", help="Only this tenant's keys.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array instead of the table (for scripts).")
@DATA_DIR_OPTION
def keys_list(tenant: str | None, as_json: bool, data_dir: Path) -> None:
    """List API keys as a table: id (key_17; keys revoke accepts it, or the key column), tenant, key (its first 12
    characters — fewer for a short key, so a key is never shown whole), state, and when it was
    created and revoked (UTC); --json: the same as objects (id, tenant_name, key_prefix, state,
    created_at, revoked_at: Unix seconds or null)."""
    from backfill.output import echo_table, format_time
    from batch_gateway.store import queries

    rows = []
    with _session(data_dir) as session:
        for key_id, name, prefix, created_at, revoked_at in queries.list_api_keys(session, tenant):
            shown = queries.shown_prefix(prefix)  # a short key is stored whole: half of it
            rows.append((key_id, name, shown, "revoked" if revoked_at else "active", created_at, revoked_at))
    if as_json:
        def unix(value: datetime | float | None) -> int | None:
            if isinstance(value, datetime):
                return int((value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp())
            return None if value is None else int(value)

        click.echo(json.dumps([{"id": key_id, "tenant_name": name, "key_prefix": shown, "state": state,
                                "created_at": unix(created), "revoked_at": unix(revoked)}
                               for key_id, name, shown, state, created, revoked in rows]))
        return
    echo_table(("ID", "TENANT", "KEY", "STATE", "CREATED", "REVOKED"),
               [(key_id, name, f"{shown}…", state, format_time(created), format_time(revoked))
                for key_id, name, shown, state, created, revoked in rows])


@keys_group.command("revoke")
@click.argument("key")
@DATA_DIR_OPTION
def keys_revoke(key: str, data_dir: Path) -> None:
    """Revoke KEY: the key itself, its id as keys list shows it (key_17), or the start of it keys
    list shows (sk-bf-AbCdEf, with or without the trailing …; refused when it starts several
    active keys)."""
    from batch_gateway.store import queries

    try:
        with _session(data_dir) as session:
            revoked = queries.revoke_api_key(session, key, by_prefix=True)
    except queries.AmbiguousKeyPrefix as exc:
        raise click.ClickException(str(exc)) from None
    if not revoked:
        raise click.ClickException("no such active key")
    click.echo("revoked")


@click.group("tenants")
def tenants_group() -> None:
    """Manage tenants: list them (admin key), webhooks and quotas (enqueued batch tokens, queued
    background responses)."""


@tenants_group.command("list")
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True, help="Tenants to show.")
@click.option("--after", help="Show tenants after this name (the next page; the last line gives it).")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON array instead of the table.")
@ADMIN_KEY_OPTION
@gateway_options
def tenants_list(limit: int, after: str | None, as_json: bool, admin_key: str | None, data_dir: Path,
                 base_url: str | None, api_key: str | None) -> None:
    """List tenants by name with their active batches and enqueued tokens (reserved of the limit),
    through the gateway with the admin key (--admin-key or BACKFILL_ADMIN_KEY)."""
    from backfill.client import Operator, find_gateway
    from backfill.output import echo_table, page_hint

    gateway = find_gateway(data_dir, base_url, api_key, need_key=False)
    page = Operator.of(gateway, admin_key, "tenants list").get("/tenants", limit=limit, after=after)
    if as_json:
        click.echo(json.dumps(page["data"]))
        return
    echo_table(("TENANT", "ACTIVE BATCHES", "ENQUEUED TOKENS", "LIMIT"),
               [(t["name"], t["active_batches"], t["reserved_tokens"], t["enqueued_token_limit"]) for t in page["data"]])
    click.echo(page_hint(len(page["data"]), page["has_more"], page["next"], page["total"]))


@tenants_group.command("webhook")
@click.option("--tenant", required=True, help="Tenant name (created if new).")
@click.option("--url", help="Endpoint receiving signed batch.* events.")
@click.option("--disable", is_flag=True, help="Stop sending webhooks to this tenant.")
@DATA_DIR_OPTION
def tenants_webhook(tenant: str, url: str | None, disable: bool, data_dir: Path) -> None:
    """Set TENANT's webhook URL and print its new signing secret (whsec_…)."""
    from batch_gateway.store import queries
    from workers.webhooks import new_secret

    if disable == bool(url):
        raise click.UsageError("give exactly one of --url or --disable")
    if url and not url.startswith(("http://", "https://")):
        raise click.UsageError("--url must be an http(s) URL")
    secret = None if disable else new_secret()
    with _session(data_dir) as session:
        queries.set_webhook(session, tenant, url, secret)
    click.echo(secret or "webhook disabled")


@tenants_group.command("quota")
@click.option("--tenant", required=True, help="Tenant name (created if new).")
@click.option("--enqueued-tokens", type=click.IntRange(min=1), help="Limit of enqueued batch tokens "
              "(omit to use the default).")
@DATA_DIR_OPTION
def tenants_quota(tenant: str, enqueued_tokens: int | None, data_dir: Path) -> None:
    """Set TENANT's enqueued-token quota (token_limit_exceeded past it)."""
    from batch_gateway.store import queries

    with _session(data_dir) as session:
        queries.set_enqueued_token_limit(session, tenant, enqueued_tokens)
    click.echo(f"{tenant}: enqueued token limit {enqueued_tokens or 'default'}")


@tenants_group.command("queued-responses")
@click.option("--tenant", required=True, help="Tenant name (created if new).")
@click.option("--limit", type=click.IntRange(min=1), help="Background responses the tenant may have queued at once "
              "(omit to use the default, BACKFILL_GATEWAY_MAX_QUEUED_BACKGROUND_RESPONSES).")
@DATA_DIR_OPTION
def tenants_queued_responses(tenant: str, limit: int | None, data_dir: Path) -> None:
    """Set TENANT's cap on queued background responses (one more is 429 rate_limit_exceeded)."""
    from batch_gateway.store import queries

    with _session(data_dir) as session:
        queries.set_queued_response_limit(session, tenant, limit)
    click.echo(f"{tenant}: queued background response limit {limit or 'default'}")
