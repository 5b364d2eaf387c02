"""Settings of ``backfill processor``: one pydantic-settings class, environment prefix
``BACKFILL_PROCESSOR_``, built by :func:`build_settings` (never at import).

Durations are seconds. Defaults come from ``shared/contracts/queue-and-headers.md`` (backoff base 2 s,
cap 60 s) and ``shared/RELIABILITY.md`` (dead-letter after 5 deliveries, leases in tens of seconds).
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.contracts.queue import (
    DEFAULT_POOL,
    DEFAULT_RESULT_STREAM,
    DEFAULT_RESULT_TOPIC,
    LANE_PRIORITIES,
    PROCESSOR_GROUP,
    REQUEST_STREAM_PREFIX,
    REQUEST_TOPIC_PREFIX,
)


class ProcessorSettings(BaseSettings):
    """Everything the processor reads from its environment or command line."""

    model_config = SettingsConfigDict(env_prefix="BACKFILL_PROCESSOR_", extra="forbid", populate_by_name=True)

    backend: Literal["redis", "pubsub", "memory"] = "redis"
    redis_url: str = Field("redis://127.0.0.1:6379/0",
                           validation_alias=AliasChoices("redis_url", "BACKFILL_PROCESSOR_REDIS_URL", "REDIS_URL"))
    pool: str = DEFAULT_POOL
    lanes: list[str] = Field(default_factory=lambda: list(LANE_PRIORITIES))
    router_url: str = "http://127.0.0.1:8000"

    concurrency: int = Field(64, ge=1, description="requests in flight at most (fixed gate)")
    tenant_limit: int = Field(0, ge=0, description="in flight per tenant; 0 = no tenant gate")
    saturation_gate: bool = Field(False, description="gate lanes below interactive on the router's saturation")
    saturation_poll_s: float = Field(0.25, gt=0)
    cancel_poll_s: float = Field(1.0, gt=0, description="how often held work is checked against "
                                 "batch cancel markers (dropped with a CANCELLED result)")
    saturation_max_age_s: float = Field(2.0, gt=0, description="older readings count as saturated")

    buffer_size: int = Field(256, ge=1, description="messages held in memory (leased, not yet started)")
    receive_batch: int = Field(128, ge=1, description="messages asked for per receive call")
    lease_s: float = Field(30.0, gt=0, description="a held message is redelivered after this much silence")
    max_deliveries: int = Field(5, ge=1, description="dead-letter on the delivery after this many")
    max_error_attempts: int = Field(5, ge=1, description="attempts of a request the router answers with "
                                    "a server error (500, 502, 504, 408) or not at all; 429/503 retry until the deadline")
    backoff_base_s: float = Field(2.0, gt=0)
    backoff_cap_s: float = Field(60.0, gt=0)
    request_timeout_s: float = Field(600.0, gt=0, description="base of one attempt's timeout: the whole attempt "
                                     "for a request naming no max_tokens, the longest silence of a streamed "
                                     "answer (every attempt also ends at the deadline)")
    attempt_per_token_s: float = Field(0.25, ge=0, description="added to request_timeout_s per output token "
                                       "asked for (max_tokens x n) of a non-streamed request: 2.5-25x a "
                                       "loaded engine's 10-100 ms per token, so only a stall trips it")
    grace_s: float = Field(20.0, ge=0, description="on SIGTERM, in-flight work may finish this long")
    poll_interval_s: float = Field(0.02, gt=0, description="sleep when every lane was empty")
    dedup_ttl_s: float = Field(86400.0, gt=0, description="how long a finished id is remembered")
    health_stall_s: float = Field(30.0, gt=0, description="/health answers 503 when no receive round "
                                  "completed for this long (a frozen broker; a failing one is 503 at once); "
                                  "above a Pub/Sub pull's 10 s timeout")

    stream_prefix: str = REQUEST_STREAM_PREFIX
    result_stream: str = DEFAULT_RESULT_STREAM
    consumer_group: str = PROCESSOR_GROUP
    consumer_name: str = ""
    delete_acked: bool = Field(True, description="XDEL entries once acknowledged (one group per stream)")

    pubsub_project: str = "backfill-local"
    pubsub_topic_prefix: str = REQUEST_TOPIC_PREFIX
    result_topic: str = DEFAULT_RESULT_TOPIC
    pubsub_emulator_host: str = Field(
        "", validation_alias=AliasChoices("pubsub_emulator_host", "BACKFILL_PROCESSOR_PUBSUB_EMULATOR_HOST",
                                          "PUBSUB_EMULATOR_HOST"))

    metrics_port: int = Field(0, ge=0, le=65535, description="port of /metrics and /health (0: none; the "
                              "Kubernetes manifests use 9090); BACKFILL_PROCESSOR_METRICS_PORT wins over "
                              "the shared BACKFILL_METRICS_PORT",
                              validation_alias=AliasChoices("BACKFILL_PROCESSOR_METRICS_PORT", "BACKFILL_METRICS_PORT"))
    metrics_host: str = Field("0.0.0.0", description="address the metrics port binds",
                              validation_alias=AliasChoices("BACKFILL_PROCESSOR_METRICS_HOST", "BACKFILL_METRICS_HOST"))

    @field_validator("lanes")
    @classmethod
    def _known_lanes(cls, lanes: list[str]) -> list[str]:
        unknown = [lane for lane in lanes if lane not in LANE_PRIORITIES]
        if unknown or not lanes:
            raise ValueError(f"lanes must be among {sorted(LANE_PRIORITIES)}, got {lanes}")
        return lanes


def build_settings(**overrides) -> ProcessorSettings:
    """Settings from the environment (``BACKFILL_PROCESSOR_*``, ``REDIS_URL``) with ``overrides``
    (``None`` values ignored) on top. Raises ``pydantic.ValidationError`` on bad values."""
    return ProcessorSettings(**{k: v for k, v in overrides.items() if v is not None})
