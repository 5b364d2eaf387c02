"""Queue backends behind one port (:mod:`.base`): the processor's side
(:class:`~async_processor.backends.base.QueueBackend`) in-memory (:mod:`.memory`), on Redis Streams
(:mod:`.redis_streams`) and on Google Pub/Sub (:mod:`.pubsub`, with an in-process gRPC fake of the
Pub/Sub API in :mod:`.pubsub_fake` for machines without the emulator); the producer side
(:class:`~async_processor.backends.base.LaneProducer`, :class:`~async_processor.backends.base.ResultQueue`)
in-memory and on Redis Streams (:mod:`.redis_producer`). :func:`make_backend` builds the processor's
side named in the settings."""

from __future__ import annotations

from typing import TYPE_CHECKING

from async_processor.backends.base import (
    Admission,
    ClaimTable,
    Delivery,
    LaneDepth,
    LaneProducer,
    QueueBackend,
    ResultEntry,
    ResultQueue,
    ResultReader,
)

if TYPE_CHECKING:
    from async_processor.settings import ProcessorSettings

__all__ = ["Admission", "ClaimTable", "Delivery", "LaneDepth", "LaneProducer", "QueueBackend", "ResultEntry",
           "ResultQueue", "ResultReader", "make_backend"]


def make_backend(settings: ProcessorSettings) -> QueueBackend:
    """The backend named by ``settings.backend`` (a :class:`~async_processor.settings.ProcessorSettings`),
    not yet started. Imports the client library of that backend only."""
    if settings.backend == "memory":
        from async_processor.backends.memory import MemoryBackend

        return MemoryBackend(done_ttl_s=settings.dedup_ttl_s)
    if settings.backend == "redis":
        from async_processor.backends.redis_streams import RedisStreamsBackend

        return RedisStreamsBackend.from_settings(settings)
    if settings.backend == "pubsub":
        from async_processor.backends.pubsub import PubSubBackend

        return PubSubBackend.from_settings(settings)
    raise ValueError(f"unknown backend {settings.backend!r}")
