"""``backfill enqueue``: :func:`async_processor.cli.enqueue_command` with the queue found for the
user and checked before anything is published.

The Redis URL is, in this order: ``--redis-url``; ``BACKFILL_PROCESSOR_REDIS_URL`` / ``REDIS_URL``;
the ``redis_url`` of the ``backfill up`` stack recorded in ``--data-dir``'s ``stack.json``. Without
any of them the command fails (it never falls back to a Redis on 127.0.0.1 that nothing may read).
On Redis, it then refuses (exit status 1) to publish to a lane stream on which no processor
consumer group exists, unless ``--no-consumer-check`` is given (to fill a queue before its
processors start).
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import click

from async_processor.cli import enqueue_command as _enqueue
from backfill.client import DEFAULT_DATA_DIR

_OWN = ("redis_url",)


def _redis_url(given: str | None, data_dir: Path) -> str:
    from backfill.stack_file import NoStack, load_stack

    url = given or os.environ.get("BACKFILL_PROCESSOR_REDIS_URL") or os.environ.get("REDIS_URL")
    if url:
        return url
    try:
        found = load_stack(data_dir).get("redis_url")
    except NoStack as exc:
        raise click.ClickException(f"no queue to publish to: {exc}; or give --redis-url") from None
    if not isinstance(found, str) or not found:
        raise click.ClickException(f"the stack in {data_dir} records no redis_url; give --redis-url")
    return found


def _check_consumers(redis_url: str, lane: str, pool: str | None) -> None:
    from async_processor.settings import build_settings
    from backfill.queue_check import QueueUnreachable, streams_without_group
    from common.contracts.queue import request_stream

    settings = build_settings(redis_url=redis_url, pool=pool, lanes=[lane])
    stream = request_stream(lane, settings.pool, settings.stream_prefix)
    try:
        missing = streams_without_group(redis_url, [stream], settings.consumer_group)
    except QueueUnreachable as exc:
        raise click.ClickException(str(exc)) from None
    if missing:
        raise click.ClickException(
            f"no processor reads {stream} on {redis_url} (no consumer group {settings.consumer_group!r}); "
            "start `backfill up` or `backfill processor` on this Redis, check --redis-url/--pool, "
            "or give --no-consumer-check to queue it anyway")


@click.pass_context
def _callback(ctx: click.Context, data_dir: Path, redis_url: str | None, no_consumer_check: bool, **options):
    backend = options.get("backend") or os.environ.get("BACKFILL_PROCESSOR_BACKEND") or "redis"
    if backend == "redis":
        redis_url = _redis_url(redis_url, data_dir)
        if not no_consumer_check:
            _check_consumers(redis_url, options["lane"], options.get("pool"))
    return ctx.invoke(_enqueue, redis_url=redis_url, **options)


enqueue_command = click.Command(
    "enqueue",
    callback=_callback,
    params=[
        *[param for param in _enqueue.params if param.name not in _OWN],
        click.Option(["--redis-url"], help="redis-py URL of the queue (default: BACKFILL_PROCESSOR_REDIS_URL or "
                     "REDIS_URL, else the `backfill up` stack of --data-dir)"),
        click.Option(["--data-dir"], type=click.Path(path_type=Path), default=DEFAULT_DATA_DIR, show_default=True,
                     envvar="BACKFILL_DATA_DIR",
                     help="data directory of the `backfill up` stack whose Redis to use (its stack.json)"),
        click.Option(["--no-consumer-check"], is_flag=True,
                     help="publish even when no processor consumer group exists on the lane's stream"),
    ],
    help=inspect.cleandoc(_enqueue.help or "") + "\n\nRefuses (exit status 1) a lane no processor reads unless "
         "--no-consumer-check is given.",
    short_help="Put one request on a queue lane (--wait: print its result).",
)
