"""The workers' side of the request and result queues: a thin synchronous adapter over the queue
port's producer side (:class:`~async_processor.backends.base.LaneProducer`,
:class:`~async_processor.backends.base.ResultQueue`), on Redis Streams
(:mod:`async_processor.backends.redis_producer`; names and formats from :mod:`common.contracts.queue`).

- :meth:`BatchQueue.publish` puts request messages on the ``batch`` lane and returns their stream
  entry ids; :meth:`BatchQueue.whereabouts` says, read-only, where such messages are now (waiting,
  held by a processor, answered, or gone), so the sweeper re-publishes only what is really lost;
- :meth:`BatchQueue.read_results` reads the batch result queue through the consumer group
  ``collectors`` (entries another collector left pending longer than ``reclaim_idle_seconds`` first,
  then new ones); :meth:`BatchQueue.ack` acknowledges and deletes them once their outcome is committed
  in Postgres (the collectors are the stream's only group, so it holds only what is not collected);
- :meth:`BatchQueue.mark_cancelled` sets the cancel marker the processor checks.

Transport failures raise :class:`~async_processor.errors.BackendError`.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from async_processor.backends.base import ResultEntry, ResultQueue, TrackedLaneProducer, Whereabouts
from async_processor.backends.redis_producer import RedisLaneProducer, RedisResultQueue
from common.contracts.queue import (
    BATCH_LANE,
    BATCH_RESULT_STREAM,
    COLLECTOR_GROUP,
    PROCESSOR_GROUP,
    RequestMessage,
)

CANCEL_MARKER_TTL_SECONDS = 7 * 24 * 3600


class BatchQueue:
    """Queue I/O of the batch lifecycle over Redis Streams. ``redis_url`` in redis-py form.
    ``redis``: the client (owned here, closed by :meth:`close`); ``request_stream`` and
    ``result_stream``: the streams in use; ``processor_group``: the processors' consumer group on the
    request stream; ``lanes`` and ``results``: the port objects it delegates to."""

    def __init__(self, redis_url: str, *, pool: str = "default", result_stream: str = BATCH_RESULT_STREAM,
                 consumer: str = "collector", reclaim_idle_seconds: float = 60.0,
                 processor_group: str = PROCESSOR_GROUP):
        self.redis = redis.Redis.from_url(redis_url)
        producer = RedisLaneProducer(self.redis, pool=pool)
        self.request_stream = producer.stream(BATCH_LANE)
        self.result_stream = result_stream
        self.consumer = consumer
        self.processor_group = processor_group
        self.lanes: TrackedLaneProducer = producer
        self.results: ResultQueue = RedisResultQueue(self.redis, result_stream, group=COLLECTOR_GROUP,
                                                     consumer=consumer, reclaim_idle_s=reclaim_idle_seconds,
                                                     delete_acked=True)

    def publish(self, messages: Sequence[RequestMessage]) -> list[str]:
        """Put each message on the batch lane (one round trip); their stream entry ids, in order."""
        return self.lanes.publish_tracked(BATCH_LANE, messages)

    def whereabouts(self, messages: Sequence[tuple[str, str]]) -> list[Whereabouts]:
        """Where each ``(entry_id, message_id)`` published on the batch lane is now (read-only, one
        round trip; ``entry_id`` "" when it was never recorded)."""
        return self.lanes.whereabouts(BATCH_LANE, self.processor_group, messages)

    def read_results(self, count: int = 1000) -> list[ResultEntry]:
        """Up to ``count`` result entries as ``(entry_id, result)``; ``result`` is None for an entry
        that is not a result message or was trimmed (ack it and move on). A consumer group lost
        with its Redis (restarted empty) is created again."""
        return self.results.read(count)

    def ack(self, entry_ids: Sequence[bytes]) -> None:
        """Acknowledge result entries whose outcome is committed, and delete them from the stream."""
        self.results.ack(entry_ids)

    def mark_cancelled(self, batch_id: str, ttl_seconds: int = CANCEL_MARKER_TTL_SECONDS) -> None:
        """Tell processors to drop the batch's queued messages (answered ``CANCELLED``)."""
        self.lanes.mark_cancelled(batch_id, ttl_seconds)

    def close(self) -> None:
        """Close the connection pool."""
        self.redis.close()
