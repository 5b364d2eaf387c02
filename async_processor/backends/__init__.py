"""Queue backends behind one protocol (:class:`~async_processor.backends.base.QueueBackend`):
in-memory (:mod:`.memory`), Redis Streams (:mod:`.redis_streams`) and Google Pub/Sub (:mod:`.pubsub`,
with an in-process gRPC fake of the Pub/Sub API in :mod:`.pubsub_fake` for machines without the
emulator). :func:`make_backend` builds the one named in the settings."""

from __future__ import annotations

from async_processor.backends.base import Admission, ClaimTable, Delivery, QueueBackend, ResultReader

__all__ = ["Admission", "ClaimTable", "Delivery", "QueueBackend", "ResultReader", "make_backend"]


def make_backend(settings) -> QueueBackend:
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
