"""Settings of ``backfill processor``: one pydantic-settings class, environment prefix
``BACKFILL_PROCESSOR_``, built by :func:`build_settings` (never at import).

Durations are seconds. Defaults come from ``shared/contracts/queue-and-headers.md`` (backoff base 2 s,
cap 60 s) and ``shared/RELIABILITY.md`` (dead-letter after 5 deliveries, leases in tens of seconds).

Strict lanes ("batch takes only the spare capacity"): each lane read holds up to
``buffer_size`` messages (``lane_buffer_sizes`` overrides it per lane), so a full ``batch`` share
never stops ``interactive`` messages from being read; ``reserved_slots`` keeps slots of
``concurrency`` for the higher lanes (:class:`~async_processor.gates.ConcurrencyGate`); inside a
lane, tenants share by ``tenant_weights`` and deadlines nearer than ``deadline_at_risk_s`` go first
(:mod:`async_processor.lanes`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.contracts.queue import (
    DEFAULT_POOL,
    DEFAULT_RESULT_STREAM,
    DEFAULT_RESULT_TOPIC,
    LANE_PRIORITIES,
    LLMD_RESULT_CHANNEL,
    LLMD_TENANT_ATTRIBUTE,
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
    router_token: SecretStr | None = Field(None, description="the router's trusted token "
                                           "(BACKFILL_ROUTER_TRUSTED_TOKEN), sent as x-backfill-router-token so the "
                                           "router honours the fairness id and objective; environment only")

    concurrency: int = Field(64, ge=1, description="requests in flight at most (fixed gate)")
    tenant_limit: int = Field(0, ge=0, description="in flight per tenant; 0 = no tenant gate")
    saturation_gate: bool = Field(False, description="gate lanes below interactive on the router's saturation")
    saturation_poll_s: float = Field(0.25, gt=0)
    running_report_s: float = Field(1.0, gt=0, description="how often the batch requests in flight are "
                                    "reported for the dashboard's job page (Redis backend: async_processor/running.py)")
    cancel_poll_s: float = Field(1.0, gt=0, description="how often held work is checked against "
                                 "batch cancel markers (dropped with a CANCELLED result)")
    saturation_max_age_s: float = Field(2.0, gt=0, description="older readings count as saturated")

    reserved_slots: dict[str, int] = Field(
        default_factory=lambda: {"interactive": 8, "async": 4},
        description="slots of concurrency only that lane (and higher ones) may use, so batch gets at most "
        "64 - 8 - 4 = 52 by default. Sizing: 8 interactive slots start a burst of 8 queued interactive "
        "requests at once (at 0.3-1 s each, 8-25 requests/s before any waits for a batch slot to free; "
        "freed slots go to the highest lane first anyway), 4 do so for async; more would cost batch "
        "throughput where the processor's slots, not the engines', are the limit (16 + 8 leaves batch "
        "62 % of the slots, 8 + 4 leaves 81 %). Reserves of lanes not read, and of the lowest lane "
        "read, are ignored; they are cut, highest lane first, to leave the lowest lane >= 1 slot")
    tenant_weights: dict[str, float] = Field(default_factory=dict, description="tenant (metadata.tenant) -> "
                                             "its weight in a lane's fair share (> 0; tenants not named: 1)")
    deadline_at_risk_s: float = Field(300.0, ge=0, description="held work whose deadline is nearer than this "
                                      "goes before fair shares, earliest deadline first (0: never): five minutes "
                                      "leave room for a few attempts of a long generation and are a sliver of a "
                                      "24 h batch window, so fairness decides nearly all of the time")

    buffer_size: int = Field(1024, ge=1, description="messages held in memory per lane read (leased, not "
                             "yet started): at least the workers' feed window (1,000), so all of a batch's "
                             "queued lines fit here and another tenant's are never stuck behind them in the "
                             "stream (see workers.settings.WorkerSettings.feed_window)")
    lane_buffer_sizes: dict[str, int] = Field(default_factory=dict, description="lane -> its own buffer_size")
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

    llmd_sorted_sets: list[str] = Field(default_factory=list, description="Redis sorted sets of llm-d-async's "
                                        "sorted-set producer to read (its default: request-sortedset; backfill up "
                                        "reads it); members are moved into the llmd_lane stream, earliest deadline "
                                        "first, and answered by LPUSH to their result list")
    llmd_retry_sorted_sets: list[str] = Field(default_factory=list, description="Redis sorted sets where "
                                              "llm-d-async's own consumer parks retries until due (its default: "
                                              "retry-sortedset; backfill up reads it); due members are moved into "
                                              "the llmd_lane stream")
    llmd_channels: list[str] = Field(default_factory=list, description="Redis Pub/Sub channels of llm-d-async's "
                                     "redis-pubsub transport to subscribe to (its default: request-queue)")
    llmd_result_channel: str = Field(LLMD_RESULT_CHANNEL, description="channel the results of llmd_channels "
                                     "messages are PUBLISHed on (llm-d-async's default result-queue)")
    llmd_lane: str = Field("async", description="lane llm-d-async's messages run in")
    tenant_attribute: str = Field(LLMD_TENANT_ATTRIBUTE, description="metadata key (a Pub/Sub attribute "
                                  "merged into metadata) naming the tenant when metadata.tenant is absent; "
                                  "llm-d-async's default userid; \"\" for none")
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

    @field_validator("llmd_lane")
    @classmethod
    def _known_lane(cls, lane: str) -> str:
        if lane not in LANE_PRIORITIES:
            raise ValueError(f"llmd_lane must be among {sorted(LANE_PRIORITIES)}, got {lane!r}")
        return lane

    @field_validator("lanes")
    @classmethod
    def _known_lanes(cls, lanes: list[str]) -> list[str]:
        unknown = [lane for lane in lanes if lane not in LANE_PRIORITIES]
        if unknown or not lanes:
            raise ValueError(f"lanes must be among {sorted(LANE_PRIORITIES)}, got {lanes}")
        return lanes

    @field_validator("reserved_slots")
    @classmethod
    def _reserves(cls, counts: dict[str, int]) -> dict[str, int]:
        return _per_lane(counts, least=0)

    @field_validator("lane_buffer_sizes")
    @classmethod
    def _buffer_sizes(cls, counts: dict[str, int]) -> dict[str, int]:
        return _per_lane(counts, least=1)

    @field_validator("tenant_weights")
    @classmethod
    def _positive_weights(cls, weights: dict[str, float]) -> dict[str, float]:
        bad = {t: w for t, w in weights.items() if not (0 < w < float("inf"))}
        if bad:
            raise ValueError(f"tenant weights must be finite and > 0, got {bad}")
        return weights

    @model_validator(mode="after")
    def _llmd_lane_read(self) -> ProcessorSettings:
        if (self.llmd_sorted_sets or self.llmd_retry_sorted_sets or self.llmd_channels) \
                and self.llmd_lane not in self.lanes:
            raise ValueError(f"llmd_lane {self.llmd_lane!r} must be among the lanes read {self.lanes}")
        return self

    def lane_capacity(self) -> dict[str, int]:
        """Buffer size of each lane read: ``lane_buffer_sizes`` where given, else ``buffer_size``."""
        return {lane: self.lane_buffer_sizes.get(lane, self.buffer_size) for lane in self.lanes}


def _per_lane(counts: dict[str, int], least: int) -> dict[str, int]:
    unknown = [lane for lane in counts if lane not in LANE_PRIORITIES]
    if unknown or any(n < least for n in counts.values()):
        raise ValueError(f"keys must be among {sorted(LANE_PRIORITIES)}, values >= {least}, got {counts}")
    return counts


def build_settings(**overrides) -> ProcessorSettings:
    """Settings from the environment (``BACKFILL_PROCESSOR_*``, ``REDIS_URL``) with ``overrides``
    (``None`` values ignored) on top. Raises ``pydantic.ValidationError`` on bad values."""
    return ProcessorSettings(**{k: v for k, v in overrides.items() if v is not None})
