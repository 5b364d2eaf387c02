"""Settings of the gateway, built by :func:`load_settings` (never at import).

Environment variables use the prefix ``BACKFILL_GATEWAY_`` except the shared ones
(:class:`batch_gateway.store.settings.SharedSettings`): ``DATABASE_URL`` (or
``BACKFILL_DATABASE_URL``), ``REDIS_URL`` (or ``BACKFILL_REDIS_URL``), ``BACKFILL_DATA_DIR``, and
``BACKFILL_API_KEY``.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from batch_gateway.store.settings import MB, SharedSettings
from common.contracts.queue import PROCESSOR_GROUP


class GatewaySettings(SharedSettings):
    """Everything the gateway reads from its environment (prefix ``BACKFILL_GATEWAY_``).

    Sizes are bytes, durations seconds. Defaults follow OpenAI's published limits
    (contracts/openai-batch.md): 200 MB per batch input file, 512 MB per file, batch files
    expiring after 30 days.
    """

    model_config = SettingsConfigDict(env_prefix="BACKFILL_GATEWAY_", extra="ignore", populate_by_name=True)

    api_key: str | None = Field(default=None, validation_alias="BACKFILL_API_KEY")
    default_tenant: str = "default"
    max_file_bytes: int = 512 * MB
    max_batch_file_bytes: int = 200 * MB
    max_json_body_bytes: int = 1 * MB
    batch_file_ttl_seconds: int = 30 * 24 * 3600
    body_idle_timeout_seconds: float = 60.0
    """An upload whose body sends nothing for this long is answered 408 and discarded."""
    max_concurrent_uploads: int = Field(default=64, ge=1)
    """Uploads in progress at once; one more is answered 503 with ``Retry-After`` before its body is
    read. 64 bounds the S3 store's buffers (up to two 8 MiB parts per upload) at 1 GiB."""

    header_timeout_seconds: float = Field(default=20.0, gt=0)
    """Deadline of a request's line and headers, from the connection opening (or the next request's
    first byte on a kept-alive one); 408 and closed past it (``batch_gateway.server``). 20 s is
    Apache ``mod_reqtimeout``'s default first header timeout."""
    request_timeout_seconds: float = Field(default=1800.0, gt=0)
    """Deadline of a whole request, headers and body; 408 (or closed once an answer has started)
    past it. 1,800 s takes a 200 MB batch file at 1 Mbit/s."""
    max_connections: int | None = Field(default=None, ge=1)
    """Open connections at most; past it the connection idle the longest is closed, or the new one
    is answered 503 when none is idle. None: half the process's open-file limit (``ulimit -n``)."""

    broker_timeout_seconds: float = 2.0
    """Bound of each broker call the gateway makes (connect, one command's reply) when it hands
    outbox events to Celery after a commit. Requests never wait on it (the hand-off runs in a
    thread); it bounds how long a frozen broker holds that thread before the relay takes over."""

    admin_key: str | None = Field(default=None, validation_alias="BACKFILL_ADMIN_KEY")
    """Key of the admin dashboard at ``/admin`` (``backfill up --admin-key``); None keeps it closed
    (503). Tenants' API keys never open it."""
    admin_session_seconds: int = 12 * 3600
    """How long a dashboard login lasts (the cookie's and the signed token's lifetime)."""
    router_url: str | None = Field(default=None, validation_alias="BACKFILL_ROUTER_URL")
    """Base URL of the router whose ``GET /admin/state`` feeds the lanes and fleet pages."""
    router_poll_seconds: float = 5.0
    """How often the dashboard's sampler reads the router's state."""
    health_poll_seconds: float = 5.0
    """How often the dashboard reads every service's ``/health`` (its health view)."""
    metrics_host: str = Field(default="127.0.0.1", validation_alias="BACKFILL_METRICS_HOST")
    """Host of the worker's and the processor's metrics ports (``backfill up`` sets it)."""
    worker_metrics_port: int | None = Field(default=None, validation_alias="BACKFILL_WORKER_METRICS_PORT")
    processor_metrics_port: int | None = Field(default=None, validation_alias="BACKFILL_PROCESSOR_METRICS_PORT")
    """The worker's and the processor's ``/metrics`` and ``/health`` ports, read by the dashboard's
    health view (None: not shown)."""
    router_history: int = 720
    """Samples kept for the charts (720 x 5 s = the last hour)."""
    queue_pool: str = "default"
    """Pool of the processors' request streams shown on the lanes page (``backfill:requests:POOL:LANE``)."""
    queue_consumer_group: str = PROCESSOR_GROUP
    """Consumer group of the processors on those streams (their ``XPENDING`` is shown)."""
    background_queue_seconds: int = Field(default=3600, ge=60)
    """How long a background response may stay ``queued`` before it expires (``failed``, code
    ``rate_limit_exceeded``): the deadline of its async-lane message. OpenAI states no such bound;
    one hour keeps a client's polling loop finite when spare capacity never frees up."""
    max_queued_background_responses: int = Field(default=1000, ge=1)
    """Background responses a tenant may have ``queued`` at once, unless its
    ``queued_response_limit`` says otherwise; one more is answered 429 ``rate_limit_exceeded``."""
    """Consumer group of the processors on those streams (their ``XPENDING`` is shown)."""


def load_settings(**overrides) -> GatewaySettings:
    """Build the settings from the environment, with keyword ``overrides`` taking precedence.

    Raises ``pydantic.ValidationError`` when ``DATABASE_URL`` or ``REDIS_URL`` is missing or bad.
    """
    return GatewaySettings(**overrides)
