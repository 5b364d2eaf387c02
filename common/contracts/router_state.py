"""The router's ``GET /admin/state`` JSON: written by the router, read by the processor's saturation
gate and the admin dashboard. Units: requests, tokens, blocks, seconds; fractions are 0..1::

    {"pool_saturation": float ≥ 0 (mean over the endpoints; ≥ 1.0: the pool on average at its limits),
     "gate_saturation": float ≥ 0 (the least saturated healthy endpoint's; ≥ 1.0: no endpoint has
                        room, sheddable work is held; for a prefill/decode fleet — some endpoint of
                        role "prefill" — the larger of the two pools' values below: room needs a
                        prefill-capable AND a decode-capable endpoint with room), "time": Unix s,
     "gate_reason": str (why the gate is closed: the least saturated endpoint's "gate_reason";
                        "open" when it is open, "no_healthy_endpoint" with none),
     "pool_gate_saturation": {"prefill": float, "decode": float} (least saturated healthy endpoint
                        of each pool: prefill-capable = roles prefill and both, decode-capable =
                        decode and both; 1.0 for an empty pool),
     "disaggregation": {"decisions": {"disaggregated" | "below_threshold" | "no_prefill_endpoint" |
                        "not_generation" | "multiple_outputs": n}, "prefill_failures": {reason: n}, "prefill_retries": n,
                        "fallbacks": {reason: n}} (counters since start; no decisions without a
                        P/D profile handler),
     "decisions_per_s": float, "profile": str, "tokenizer": str,
     "endpoints": [{"name", "healthy", "role": "prefill" | "decode" | "both", "models": [str],
                    "num_requests_waiting", "num_requests_running",
                    "kv_cache_usage_perc", "in_flight_requests", "in_flight_uncached_tokens",
                    "idle_session_tokens" (prompt tokens of sessions idle there within the router's
                                           working-set window),
                    "reserved_session_tokens" (the part of them ``saturation`` counts as used KV:
                                           at most the router's ``working_set_cap`` of the GPU KV),
                    "gate_reason": str (why it takes no sheddable work: "open" | "stale_metrics" |
                                   "waiting_queue" | "kv_cache" | "idle_session_working_set" |
                                   "sheddable_slots" | "batch_prefill" | "pending_dispatches";
                                   "" while unhealthy),
                    "saturation": float | null (null while unhealthy), "metrics_age_s": s | null,
                    "gate_open": bool (healthy and saturation < 1.0: takes sheddable work now),
                    "headroom": float | null (max(0, 1 − saturation); null while unhealthy),
                    "block_size", "num_gpu_blocks", "num_cpu_blocks",
                    "cache_blocks": {"gpu", "cpu", "disk"} (blocks the router's prefix index holds),
                    "prefix_cache_hit_rate": float | null (GPU hits ÷ queries, tokens),
                    "external_prefix_cache_hit_rate": float | null (CPU / disk tiers),
                    "last_error": str | null}],
     "bands": [{"objective", "priority", "queued_requests", "queued_bytes", "in_flight",
                "dispatched_total", "refused_total": {reason: n} (backpressure: refused at once, to
                be sent again, :data:`BACKPRESSURE_REASONS`), "shed_total": {reason: n} (work
                dropped after it waited or ran), "oldest_wait_s", "flows"}],
                (reasons spelled as the metric labels: :func:`reason_label`)
     "index": {"kind": "kv-events" | "approximate" | null, "tiers": {tier: blocks}, …}}

Readers ignore fields they do not know (the models are lenient), so the router may add fields.
:func:`parse_gate_saturation` is the processor gate's strict read of the one number it needs: the
gate opens when any engine has room (per-engine spare capacity, not the pool's mean, which reads
1.0 when one engine is full and another idle).
"""

from __future__ import annotations

import math
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field

SATURATION_THRESHOLD = 1.0
"""Saturation at or above which an endpoint takes no sheddable (batch) work, and at or above which
``gate_saturation`` holds it everywhere (llm-d's saturation detector: 1.0 = at the queue-depth or
KV-use limit)."""


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CacheBlocks(_Lenient):
    """KV-cache blocks the router's prefix index holds for one endpoint, per tier."""

    gpu: int = 0
    cpu: int = 0
    disk: int = 0


class EndpointState(_Lenient):
    """One engine as the router sees it; ``saturation`` is None while the engine is unhealthy; the hit
    rates are hits ÷ queries in tokens (None before any query)."""

    name: str
    healthy: bool = False
    models: list[str] = Field(default_factory=list)
    num_requests_waiting: int = 0
    num_requests_running: int = 0
    kv_cache_usage_perc: float = 0.0
    in_flight_requests: int = 0
    in_flight_uncached_tokens: int = 0
    idle_session_tokens: int = 0
    reserved_session_tokens: int = 0
    """The part of ``idle_session_tokens`` the sheddable saturation counts as used KV (capped)."""
    gate_reason: str = ""
    """Why the endpoint takes no sheddable work (``open`` when it does; module docstring)."""
    saturation: float | None = None
    gate_open: bool = False
    headroom: float | None = None
    metrics_age_s: float | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None
    cache_blocks: CacheBlocks = Field(default_factory=CacheBlocks)
    prefix_cache_hit_rate: float | None = None
    external_prefix_cache_hit_rate: float | None = None
    last_error: str | None = None
    max_num_seqs: int | None = None
    """The engine's sequence slots the router assumes (vLLM's ``max_num_seqs``; None: unknown)."""
    slots_source: str | None = None
    """Where that figure comes from: ``configured`` (router setting), ``stated`` (the engine's
    ``backfill:engine_config_info`` or ``/server_info``), ``learned`` (from its scrapes), None."""
    slot_reserve: int | None = None
    """Slots kept for non-sheddable work (None while the slot count is unknown)."""
    reserve_in_use: int = 0
    interactive_rate_per_s: float = 0.0
    batch_prefill_tokens: int = 0
    """Sheddable prompt tokens the router counts as in prefill there (the batch prefill share's term)."""
    num_preemptions: int = 0
    """``vllm:num_preemptions_total`` at the last scrape."""
    evictions: dict[str, int] = Field(default_factory=dict)
    """Sheddable requests evicted there for non-sheddable ones, by reason, since the router started."""
    evicted_tokens: int = 0
    """The router's estimate of the tokens those evictions wasted."""
    role: str = "both"
    """``prefill``, ``decode`` or ``both`` (prefill/decode disaggregation; llm-d's ``llm-d.ai/role``)."""


class BandState(_Lenient):
    """One priority band (objective) of the router's flow control; ``*_total`` are counters."""

    objective: str
    priority: int = 0
    queued_requests: int = 0
    queued_bytes: int = 0
    in_flight: int = 0
    dispatched_total: int = 0
    refused_total: dict[str, int] = Field(default_factory=dict)
    """Requests refused at once (backpressure the caller re-sends), by reason label
    (:data:`BACKPRESSURE_REASONS`): ``backfill_router_refused_total``."""
    shed_total: dict[str, int] = Field(default_factory=dict)
    """Requests dropped after they waited or ran, by reason label (:data:`SHED_REASONS`):
    ``backfill_router_shed_total``."""
    oldest_wait_s: float = 0.0
    flows: int = 0

    @property
    def refused(self) -> int:
        """Requests refused at once, every reason."""
        return sum(self.refused_total.values())

    @property
    def shed(self) -> int:
        """Requests shed (work dropped), every reason."""
        return sum(self.shed_total.values())


class RouterState(_Lenient):
    """One answer of ``GET /admin/state``."""

    pool_saturation: float
    time: float
    gate_saturation: float = 1.0
    gate_reason: str = ""
    """Why the gate is closed (``open`` when it is not; module docstring)."""
    pool_gate_saturation: dict[str, float] = Field(default_factory=dict)
    disaggregation: dict[str, Any] = Field(default_factory=dict)
    decisions_per_s: float = 0.0
    profile: str = ""
    tokenizer: str = ""
    endpoints: list[EndpointState] = Field(default_factory=list)
    bands: list[BandState] = Field(default_factory=list)
    index: dict[str, Any] = Field(default_factory=dict)

    @property
    def gate_open(self) -> bool:
        """Whether sheddable work may dispatch: some endpoint's saturation (``gate_saturation``) is
        below :data:`SATURATION_THRESHOLD`."""
        return self.gate_saturation < SATURATION_THRESHOLD


def parse_gate_saturation(body: bytes | str) -> float:
    """``gate_saturation`` of an ``/admin/state`` body, for the processor's saturation gate.

    Raises:
        ValueError: the body is not a JSON object, or ``gate_saturation`` is missing, not a number
            (a boolean is not), not finite or negative; a gate reading it fails closed.
    """
    try:
        value = orjson.loads(body).get("gate_saturation")
    except (orjson.JSONDecodeError, AttributeError) as exc:
        raise ValueError(f"not a router state: {exc}") from None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"gate_saturation={value!r}")
    return float(value)


BACKPRESSURE_REASONS = ("rejected_saturated", "rejected_capacity", "rejected_quota")
"""Reason labels of backpressure, counted in ``backfill_router_refused_total`` (and the state's
``refused_total``): the request was refused at once, before any wait or engine work, with 429 (503
while the router stops) and ``Retry-After``, and the caller sends it again later (the processor
always does: ``async_processor.retry``). Nothing is lost."""

SHED_REASONS = ("rejected_ttl_expired", "evicted", "rejected_context_cancelled")
"""Reason labels of shedding, counted in ``backfill_router_shed_total`` (and the state's
``shed_total``): work dropped after it waited in the router's queue or ran on an engine (the time
spent is lost). ``BackfillShedRateHigh`` fires on these only (deploy/prometheus/alerts.yaml)."""


def is_backpressure(reason: str) -> bool:
    """Whether a drop reason (llm-d's header value or its label) is backpressure
    (:data:`BACKPRESSURE_REASONS`) rather than shedding."""
    return reason_label(reason) in BACKPRESSURE_REASONS


GATE_REASON_TEXT: dict[str, str] = {
    "open": "open",
    "no_healthy_endpoint": "no healthy engine",
    "stale_metrics": "no fresh metrics from the engine",
    "waiting_queue": "requests waiting in the engine's queue",
    "kv_cache": "KV cache use at the threshold",
    "idle_session_working_set": "KV kept for idle sessions' next turns (working set)",
    "sheddable_slots": "slots kept for interactive work",
    "batch_prefill": "batch prompt tokens in prefill at their bound",
    "pending_dispatches": "requests released but not yet forwarded",
}
"""``gate_reason`` values (the router's and each endpoint's) in words, for the dashboard."""


def reason_label(reason: str) -> str:
    """A drop reason as a metric label: llm-d's header value (``rejected-saturated``,
    ``router.flow_control.errors.DropReason``) with underscores (``rejected_saturated``), the
    one spelling of labels across the router and the processor (STYLE.md 8)."""
    return reason.replace("-", "_")
