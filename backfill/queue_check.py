"""Is anybody reading a request stream? The processors' consumer group on a Redis stream.

``backfill enqueue`` refuses to publish to a stream no processor group reads (a message there would
wait forever, or go to a Redis nothing reads), and ``backfill up`` waits until its processor has
created the groups of its lanes before it reports ready.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import redis
from redis.exceptions import RedisError, ResponseError


class QueueUnreachable(Exception):
    """Redis did not answer; the message names the URL."""


def groups_of(client: redis.Redis, stream: str) -> set[str]:
    """Names of the consumer groups of ``stream`` (empty when the stream does not exist)."""
    try:
        infos = client.xinfo_groups(stream)
    except ResponseError as exc:
        if "no such key" in str(exc).lower():
            return set()
        raise
    names = set()
    for info in infos:
        name = info.get("name")  # redis-py: str keys, bytes values
        names.add(name.decode() if isinstance(name, bytes) else str(name))
    return names


def streams_without_group(redis_url: str, streams: Sequence[str], group: str, *,
                          timeout_s: float = 5.0) -> list[str]:
    """The streams among ``streams`` on which ``group`` does not exist, in order.

    Raises :class:`QueueUnreachable` (naming ``redis_url``) when Redis cannot be reached within
    ``timeout_s`` seconds or answers with an error."""
    client = redis.Redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        return [stream for stream in streams if group not in groups_of(client, stream)]
    except RedisError as exc:
        raise QueueUnreachable(f"cannot reach Redis at {redis_url}: {exc}") from None
    finally:
        client.close()


def wait_for_groups(redis_url: str, streams: Sequence[str], group: str, *, timeout_s: float,
                    failed: Callable[[], str | None] = lambda: None) -> None:
    """Return once ``group`` exists on every stream of ``streams``.

    ``failed`` is asked between polls and returns a reason to give up (a child that died), or None.
    Raises ``TimeoutError`` after ``timeout_s`` seconds, ``RuntimeError`` with ``failed``'s reason."""
    deadline = time.monotonic() + timeout_s
    while True:
        reason = failed()
        if reason:
            raise RuntimeError(reason)
        try:
            missing = streams_without_group(redis_url, streams, group, timeout_s=1.0)
        except QueueUnreachable:
            missing = list(streams)
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"no consumer group {group!r} on {', '.join(missing)} after {timeout_s:.0f} s")
        time.sleep(0.2)
