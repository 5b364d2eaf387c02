"""Settings of the Celery worker and beat (prefix ``BACKFILL_WORKER_``), built by
:func:`load_settings`; the stores and batch limits are shared with the gateway."""

from __future__ import annotations

from pydantic import AliasChoices, Field
from pydantic_settings import SettingsConfigDict

from batch_gateway.store.settings import SharedSettings
from common.contracts.queue import BATCH_RESULT_STREAM, PROCESSOR_GROUP
from workers.validation import DEFAULT_MAX_OUTPUT_TOKENS


class WorkerSettings(SharedSettings):
    """Durations in seconds, sizes in bytes.

    ``visibility_timeout_seconds``: how long Redis keeps an unacknowledged task before giving it to
    another worker (Celery's default is 3,600 s; tasks here are short and idempotent, so a killed
    worker's task comes back sooner). ``relay_interval_seconds``: how often beat resends outbox
    events older than ``relay_after_seconds`` that never reached the broker; ``purge_interval_seconds``:
    how often the bytes of deleted or expired files are removed (and the file store swept of temporary
files older than ``temp_file_max_age_seconds``); ``validation_stale_seconds``: a batch
    ``validating`` for longer has its validate task sent again (checked every relay interval; a
    starting worker resends every ``validating`` batch at once).
    """

    model_config = SettingsConfigDict(env_prefix="BACKFILL_WORKER_", extra="ignore", populate_by_name=True)

    visibility_timeout_seconds: int = 600
    relay_interval_seconds: float = 5.0
    relay_after_seconds: float = 5.0
    read_chunk_bytes: int = 1024 * 1024
    purge_interval_seconds: float = 300.0
    pool: str = "default"
    """Pool of the request streams (``backfill:requests:{pool}:batch``)."""
    result_stream: str = BATCH_RESULT_STREAM
    """Redis stream the processors write batch results to (set in each message)."""
    feed_window: int = Field(default=1000, ge=1)
    """Requests of one batch queued at a time (the rest wait in Postgres, so a cancel or an
    expiry drops little from the queue). Kept no larger than the processor's batch-lane buffer
    (``BACKFILL_PROCESSOR_BUFFER_SIZE``, 1,024 per lane), so a batch's queued lines fit in the
    processor's buffer and slots and none wait in the Redis stream: another tenant's lines
    published later are read at once and the processor's fair shares serve them (with 1,000
    against a 256 buffer, a new tenant's lines sat behind 744 of an older batch's in the stream,
    out of the processor's reach). 1,000 rather than less for throughput: a line holds its place
    from its publish until its result is collected (every ``collect_interval_seconds``) and the next
    feed (every ``feed_interval_seconds``) refills it, seconds on a loaded machine where the Celery
    tasks wait for the CPU. The end-to-end bench (one engine of 256 requests/s, 10,000 requests,
    single runs on a loaded 2-core machine whose spread was about ±0.15) reached 0.84 × its
    capacity with 1,000 and 0.52 × with 512 at 1 s feeds, 0.66-0.85 × with 512 and 0.73 × with
    256 at 0.25 s feeds. Raise it together with the processor's buffer for a faster fleet."""
    lease_seconds: float = 300.0
    """How often the sweeper looks after a queued request that has no result yet (RELIABILITY
    "Request leases" in docs/reliability.md). When the lease lapses the sweeper asks Redis where the
    request's message is: still waiting in the stream, held by a processor or answered, the lease is
    renewed for as long again (no attempt counted, nothing re-published); only a message that is gone
    (Redis emptied, the entry deleted) is handed back to be published again. So waiting for capacity
    never re-runs or fails a request, and a really lost one is published again within lease + sweep
    interval: 300 s keeps that recovery within minutes for one Redis read per queued request per
    lease."""
    processor_group: str = PROCESSOR_GROUP
    """Consumer group of the processors on the request stream (whose pending list the sweeper reads);
    the processors' ``BACKFILL_PROCESSOR_CONSUMER_GROUP``."""
    max_attempts: int = 3
    """Deliveries of one request before it ends as ``request_timeout`` (RELIABILITY.md F6): retryable
    processor errors and messages really lost count, a renewed lease does not."""
    feed_interval_seconds: float = 1.0
    collect_interval_seconds: float = 0.5
    sweep_interval_seconds: float = 10.0
    finalize_interval_seconds: float = 2.0
    webhook_interval_seconds: float = 2.0
    validation_stale_seconds: float = 120.0
    catch_up_interval_seconds: float = Field(default=60.0, gt=0)
    """How often beat sends ``backfill.catch_up`` (every lifecycle step once) whatever its probe says
    (``workers.schedule``): on an idle stack the only lifecycle task, one a minute; the bound on how
    late work a wrong probe hid is picked up."""
    max_output_tokens_per_request: int = Field(default=DEFAULT_MAX_OUTPUT_TOKENS, ge=1)
    """Most output tokens one input line may ask for, ``n`` × ``max_tokens`` (or
    ``max_completion_tokens`` / ``max_output_tokens``); a line asking for more fails validation
    (``invalid_request``). 1,048,576: ``n`` = 128 (OpenAI's cap) × 8,192 tokens (docs/limits.md)."""
    max_response_bytes: int = Field(default=8 * 1024 * 1024, ge=1)
    """Largest engine answer recorded for one request (8 MiB: the default output bound at ~4 bytes
    a token, twice over); a larger one ends the request as ``response_too_large`` in the error file
    instead of a huge output line (docs/limits.md)."""
    temp_file_max_age_seconds: float = Field(default=3600.0, gt=0)
    """A local file store's write in progress (``DATA_DIR/files/tmp``) untouched for this long is
    an orphan (its writer died) and is removed, at start and every ``purge_interval_seconds``
    (an upload writes every few milliseconds, so one hour idle is never a live one)."""
    router_url: str | None = Field(default=None, validation_alias=AliasChoices(
        "BACKFILL_WORKER_ROUTER_URL", "BACKFILL_ROUTER_URL"))
    """The router (``http://host:port``) whose ``GET /v1/models`` says which models the fleet serves:
    validation fails a batch whose model none serves (``model_not_found``). None (the default outside
    ``backfill up``, which sets ``BACKFILL_ROUTER_URL``): not asked, and such a batch's lines end with
    the engines' 404s."""
    fleet_models_timeout_seconds: float = Field(default=2.0, gt=0)
    """Bound of one ``/v1/models`` request (the router answers from memory in milliseconds); past it
    validation goes on without the check."""
    fleet_models_cache_seconds: float = Field(default=10.0, ge=0)
    """How long one ``/v1/models`` answer (or a failure to get one) is reused: a burst of batches asks
    once, and a model an engine starts serving is seen within this long."""
    metrics_port: int = Field(default=0, ge=0, le=65535, validation_alias=AliasChoices(
        "BACKFILL_WORKER_METRICS_PORT", "BACKFILL_METRICS_PORT"))
    """Port of ``/metrics`` and ``/health`` served by ``backfill worker`` (0: none; the Kubernetes
    manifests use 9090). ``BACKFILL_WORKER_METRICS_PORT`` wins over the shared
    ``BACKFILL_METRICS_PORT`` so ``backfill up`` can give the worker and the processor their own."""
    health_broker_timeout_seconds: float = Field(default=2.0, gt=0)
    """Bound of the broker ``PING`` behind the worker's ``/health``: past it (Redis stopped or
    frozen) ``/health`` answers 503. Well under a Kubernetes probe's default 1 s period × failure
    threshold, and far above a healthy Redis's sub-millisecond answer."""
    metrics_host: str = Field(default="0.0.0.0", validation_alias=AliasChoices(
        "BACKFILL_WORKER_METRICS_HOST", "BACKFILL_METRICS_HOST"))
    """Address the metrics port binds (all interfaces, so Prometheus can scrape the pod)."""


def load_settings(**overrides) -> WorkerSettings:
    """Build the settings from the environment, ``overrides`` first. Raises
    ``pydantic.ValidationError`` when ``DATABASE_URL`` or ``REDIS_URL`` is missing or bad."""
    return WorkerSettings(**overrides)
