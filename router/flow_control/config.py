"""Flow-control configuration: priority bands keyed by objective, limits, TTLs, quotas, eviction.

YAML (or a dict) of this shape; every field is optional and defaults to the values below::

    default_objective: interactive     # band for requests with no or an unknown objective
    eviction: false                    # evict sheddable in-flight work for a blocked higher band
    eviction_interval_s: 1.0           # at most one eviction per this many seconds
    poll_interval_s: 0.01              # saturation re-read period while something waits
    tenant_weights: {}                 # fairness id → DRR weight (share of its band's dispatches)
    default_tenant_weight: 1.0         # weight of a fairness id not in tenant_weights
    deadline_at_risk_s: 1.0            # a queued item this close to its deadline goes first
    turn_priority:                     # order inside a flow by session turn (llm-d's turn-priority)
      enabled: false
      time_weight_per_s: 0.5           # score = turn number + this × seconds waited
      inactivity_s: 120                # a session idle longer than this is back at turn 1
      max_turn: 16                     # turns count up to this (bounds every wait by aging)
      max_sessions: 100000             # sessions whose turns are remembered (LRU)
    bands:
    - objective: interactive           # x-llm-d-inference-objective value
      priority: 100                    # higher dispatches first (llm-d convention)
      max_queued_requests: 10000
      max_queued_bytes: 1000000000
      ttl_s: 30                        # longest wait in the queue; null = no limit; 0 = never queue
      sheddable: false                 # may be evicted while in flight
      bypass_saturation: true          # may dispatch while the pool is saturated ...
      max_in_flight: 64                # ... while the band has fewer than this in flight
      tenant_max_in_flight: 16         # per fairness id, this band; null = no quota
      tenant_max_queued: 16            # per fairness id, this band; null = no quota

Where the defaults come from:

* priorities ``interactive`` 100, ``async`` 10, ``batch`` −10: the project's objectives (DESIGN.md),
  spaced around 0 as llm-d's priority bands are ("highest value first, centred on 0").
* ``flex`` (OpenAI's ``service_tier: "flex"``, ``router/service_tier.py``): priority 0, below
  ``async`` and above ``batch``. OpenAI prices flex at its Batch API rates and promises "slower
  response times and occasional resource unavailability" (platform.openai.com/docs/guides/
  flex-processing), so it is spare-capacity work like the other sheddable bands; it goes before
  batch files (a client holds its connection open; a batch has a 24 h window) and after the async
  lane (queued work with deadlines, and the lane background responses run in). Sheddable and gated
  by saturation: no interactive slot, no bypass, evictable by make-room.
* ``flex`` TTL 600 s: the longest a flex request waits in the router for room before OpenAI's 429
  "Resource Unavailable" (``rejected-ttl-expired``). OpenAI's own client default timeout is 10 min
  and its flex guide tells clients to raise it to 15 min; 600 s answers before either, leaving the
  difference for the generation itself. Set ``ttl_s`` of the ``flex`` band to change it.
* ``max_queued_bytes`` 1 GB per band: llm-d's ``defaultPriorityBandMaxBytes``. Lower it on a small
  router host: queued bodies live in the router's memory.
* ``max_queued_requests`` 10,000 per band: ours; at llm-d's byte limit that is 100 kB per request, and
  it keeps a queue scan (stats, shutdown) cheap.
* ``interactive`` TTL 30 s: ours; an interactive caller left waiting longer is better served by a
  429 and its own retry than by a router queue. ``async``/``batch`` TTL 0, "never queue": sheddable
  work that cannot dispatch now (no engine has room) is answered at once with 429
  ``rejected-saturated`` and ``Retry-After: 1``, so it never sits in the router's queue holding a
  slot of the async processor, which holds and re-sends it itself (measured in ``bench mixed``: batch attempts spent
  7 of their 12 s parked here). ``Retry-After`` is whole seconds (RFC 9110 delta-seconds; the
  processor would parse a fraction, other clients may not).
* ``interactive`` bypasses saturation up to 64 in flight: ROUTING.md lets the highest band reach the
  engines' own queues "up to a bound"; 64 is ours (llm-d's per-engine queue threshold of 5 × about a
  dozen engines) — set it near 5 × the number of engines.
* ``interactive`` ``tenant_max_in_flight`` 16 and ``tenant_max_queued`` 16: ours; a quarter of the
  band's ``max_in_flight`` (as ``tenant_max_queued`` is a quarter of the sheddable bands' queue), so
  one tenant's flood holds at most 16 of the 64 bypass slots and waits with at most 16 more; the
  rest is answered at once with 429 ``rejected-quota`` and ``Retry-After`` (the band's TTL, 30 s)
  while other tenants keep dispatching. Callers the router does not trust all share the fairness
  id ``anonymous`` (``router/trust.py``), so a flood cannot escape the quota by varying the header.
  Raise both (or set null) for a router whose interactive traffic is one tenant. The
  ``BackfillInteractiveShed`` alert leaves ``rejected-quota`` out: a tenant's own flood pages nobody.
* ``async``/``batch`` are sheddable and gated by saturation: they run on spare capacity only.
* ``tenant_max_queued`` 2,500 for ``async``/``batch``: a quarter of the band, so one flooding tenant
  cannot fill the band's queue and turn the others' requests into ``rejected-capacity`` (F11);
  it binds only when the band is configured to queue (``ttl_s`` > 0).
* ``eviction`` off: llm-d's default evictor is the no-op one; evicting wastes the victim's work.
* ``eviction_interval_s`` 1 s: ours; about the time an abort takes to show in scraped engine metrics,
  so one eviction's effect is seen before the next.
* ``poll_interval_s`` 10 ms: ours; well below llm-d's 200 ms metrics-staleness bound.
* ``tenant_weights`` empty, ``default_tenant_weight`` 1: every tenant an equal share (llm-d's
  round-robin fairness is the equal-weight case of the deficit round-robin used here).
* ``deadline_at_risk_s`` 1 s: ours; the ``Retry-After`` the router advertises and about the
  processor's shortest backoff, so an item with less than that left would not survive another
  round of waiting for its turn. 0 turns the override off (an item past its deadline is shed).
* ``turn_priority`` (``router/flow_control/core.py``: the policy): ``time_weight_per_s`` 0.5 is the
  anchor llm-d's issue proposed (llm-d/llm-d-router#2088: "prio = turn_number +
  turnPriorityTimeWeight * elapsed_seconds", default 0.5); llm-d merged 0.05 (PR #2116) for its
  unbounded queues. Here the interactive band sheds after its 30 s TTL, so the weight must let
  aging act within it: at 0.5 a first turn overtakes a lead of 15 turns in 30 s (at 0.05 only 1.5
  turns: the TTL, not aging, would end a new session's wait). ``inactivity_s`` 120: llm-d's
  ``turnPriorityInactivitySeconds`` (PR #2116). ``max_turn`` 16: ours (llm-d counts without a
  bound, so a session whose turn count grows faster than the weight ages a waiting one can hold it
  back for ever): a first turn that has waited ``(max_turn − 1) / time_weight_per_s`` = 30 s, the
  interactive TTL, outranks every new arrival. ``max_sessions`` 100,000: ours, the session
  plugin's bound. Off by default because it did not measure better: in ``backfill bench
  sessions`` (docs/benchmarks.md, "sessions") later turns' TTFT p99 was 0.99× off's at 32
  sessions (the router's queue barely formed), 1.76× at 64 (p50 0.38×: depth ordering helps the
  typical later turn and makes the shallow ones wait), 1.01× with ``max_turn`` 2 (later turns
  merely ahead of first turns), and first turns' p99 rose 1.9–2.8× whenever the queue formed.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from router.flow_control.errors import ConfigError

DEFAULT_MAX_QUEUED_BYTES = 1_000_000_000
DEFAULT_MAX_QUEUED_REQUESTS = 10_000
#: ``interactive``'s bypass bound (``max_in_flight``) and its per-tenant share (module docstring).
DEFAULT_INTERACTIVE_MAX_IN_FLIGHT = 64
DEFAULT_INTERACTIVE_TENANT_MAX = DEFAULT_INTERACTIVE_MAX_IN_FLIGHT // 4
#: The band of OpenAI's ``service_tier: "flex"`` requests (``router/service_tier.py``).
FLEX_OBJECTIVE = "flex"
#: ``flex``'s TTL: the longest a flex request waits for spare capacity before its 429 (module docstring).
DEFAULT_FLEX_WAIT_S = 600.0


class BandConfig(BaseModel):
    """One priority band (module docstring: fields and defaults).

    Raises:
        pydantic.ValidationError: a limit is out of range, or ``bypass_saturation`` without
            ``max_in_flight``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    objective: str = Field(min_length=1)
    priority: int
    max_queued_requests: int = Field(default=DEFAULT_MAX_QUEUED_REQUESTS, ge=0)
    max_queued_bytes: int = Field(default=DEFAULT_MAX_QUEUED_BYTES, ge=0)
    ttl_s: float | None = Field(default=None, ge=0)
    sheddable: bool = False
    bypass_saturation: bool = False
    max_in_flight: int | None = Field(default=None, ge=1)
    tenant_max_in_flight: int | None = Field(default=None, ge=1)
    tenant_max_queued: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _bypass_needs_bound(self) -> BandConfig:
        if self.bypass_saturation and self.max_in_flight is None:
            raise ValueError(f"band {self.objective!r}: bypass_saturation needs a max_in_flight bound")
        return self


def default_bands() -> list[BandConfig]:
    """The four default bands (module docstring explains each number)."""
    tenant_max_queued = DEFAULT_MAX_QUEUED_REQUESTS // 4
    return [
        BandConfig(objective="interactive", priority=100, ttl_s=30.0, bypass_saturation=True,
                   max_in_flight=DEFAULT_INTERACTIVE_MAX_IN_FLIGHT, tenant_max_in_flight=DEFAULT_INTERACTIVE_TENANT_MAX,
                   tenant_max_queued=DEFAULT_INTERACTIVE_TENANT_MAX),
        BandConfig(objective="async", priority=10, ttl_s=0.0, sheddable=True, tenant_max_queued=tenant_max_queued),
        BandConfig(objective=FLEX_OBJECTIVE, priority=0, ttl_s=DEFAULT_FLEX_WAIT_S, sheddable=True,
                   tenant_max_queued=tenant_max_queued),
        BandConfig(objective="batch", priority=-10, ttl_s=0.0, sheddable=True, tenant_max_queued=tenant_max_queued),
    ]


class TurnPriorityConfig(BaseModel):
    """Turn priority inside a flow (module docstring: fields and defaults).

    Raises:
        pydantic.ValidationError: a negative weight or inactivity, or ``max_turn`` or
            ``max_sessions`` < 1.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    time_weight_per_s: float = Field(default=0.5, ge=0)
    inactivity_s: float = Field(default=120.0, ge=0)
    max_turn: int = Field(default=16, ge=1)
    max_sessions: int = Field(default=100_000, ge=1)


class FlowControlConfig(BaseModel):
    """The flow controller's configuration (module docstring: shape and defaults).

    Raises:
        pydantic.ValidationError: duplicate objectives or priorities, no band, a
            ``default_objective`` that names no band, or a tenant weight that is not positive.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    bands: list[BandConfig] = Field(default_factory=default_bands, min_length=1)
    default_objective: str = "interactive"
    eviction: bool = False
    eviction_interval_s: float = Field(default=1.0, ge=0)
    poll_interval_s: float = Field(default=0.01, gt=0)
    tenant_weights: dict[str, float] = Field(default_factory=dict)
    default_tenant_weight: float = Field(default=1.0, gt=0)
    deadline_at_risk_s: float = Field(default=1.0, ge=0)
    turn_priority: TurnPriorityConfig = Field(default_factory=TurnPriorityConfig)

    @model_validator(mode="after")
    def _consistent(self) -> FlowControlConfig:
        objectives = [b.objective for b in self.bands]
        priorities = [b.priority for b in self.bands]
        if len(set(objectives)) != len(objectives):
            raise ValueError(f"duplicate band objective in {objectives}")
        if len(set(priorities)) != len(priorities):
            raise ValueError(f"duplicate band priority in {priorities}")
        if self.default_objective not in objectives:
            raise ValueError(f"default_objective {self.default_objective!r} is not one of {objectives}")
        bad = {k: v for k, v in self.tenant_weights.items() if not v > 0}
        if bad:
            raise ValueError(f"tenant_weights must be positive: {bad}")
        return self

    def tenant_weight(self, fairness_id: str) -> float:
        """The DRR weight of ``fairness_id`` (``tenant_weights``, else ``default_tenant_weight``)."""
        return self.tenant_weights.get(fairness_id, self.default_tenant_weight)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> FlowControlConfig:
        """Build from a parsed mapping (``None`` or empty → all defaults).

        Raises:
            ConfigError: the mapping is not a valid config (the message lists the fields at fault).
        """
        try:
            return cls.model_validate(dict(data or {}))
        except ValidationError as exc:
            raise ConfigError(f"invalid flow-control config: {exc}") from exc

    @classmethod
    def from_yaml(cls, text: str) -> FlowControlConfig:
        """Build from YAML text (empty → all defaults).

        Raises:
            ConfigError: not YAML, not a mapping, or not a valid config.
        """
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"flow-control config is not valid YAML: {exc}") from exc
        if data is not None and not isinstance(data, Mapping):
            raise ConfigError("flow-control config must be a mapping")
        return cls.from_mapping(data)

    @classmethod
    def from_file(cls, path: str | Path) -> FlowControlConfig:
        """Build from a YAML file. Raises :class:`ConfigError` (and ``OSError`` if unreadable)."""
        return cls.from_yaml(Path(path).read_text(encoding="utf-8"))

    def band(self, objective: str | None) -> BandConfig:
        """The band for ``objective``; the default objective's band when it is None or unknown."""
        for band in self.bands:
            if band.objective == objective:
                return band
        return next(b for b in self.bands if b.objective == self.default_objective)
