"""``RouterRuntime``: the router's saturation reads over its assembled parts, one computation for
flow control's gate, the ``spare-capacity-filter`` and ``/admin/state`` (no I/O).

It is built first and given its parts afterwards by :func:`router.assembly.build_router`, because
the parts read it back: the scheduler's ``spare-capacity-filter`` calls
:meth:`RouterRuntime.scheduling_saturation` and flow control :meth:`RouterRuntime.gate_saturation`.

**The idle sessions' working set, capped** (``working_set_cap``, default 0.5). The session plugin
sums, per engine, the last prompt of every session idle within ``workingSetWindowSeconds``
(``router/scheduling/plugins/session.py``) and the saturation of sheddable work counts that sum as
used KV, so batch does not take the room agents between turns are about to need. The sum is an
upper bound of what those sessions can still use, and a loose one: sessions sharing a system
prompt count it once each; a one-turn request carrying a session header (every request of a client
that sends one) counts like an agent between turns, though most never come back; and once the sum
passes what the GPU cache holds beside the running requests, the engine's own LRU eviction is
already dropping the oldest of those sessions' blocks, whatever sheddable work does — holding batch
back then protects nothing. Counted whole, it reads at or above ``kv_threshold`` on every engine
of a busy-but-not-full fleet and closes the gate for the whole window however idle the engines are:
``backfill simulate --synthetic-requests 2000 --engines 8`` held async and batch about 120 s (TTFT
p99 ~132 s against round-robin's 9–10 s, docs/benchmarks.md). So an engine's working set counts at
most ``working_set_cap`` of its GPU KV (:func:`reserved_working_set`): a working set that fits under
the cap is reserved whole, as before; a larger one reserves the cap, which still keeps the larger
share of the cache for the sessions (0.5 against the ``kv_threshold − 0.5`` = 0.3 that sheddable
work may fill on an engine whose running requests use none of it) and lets sheddable work run only
while the engine's own running requests use less than that 0.3. The cap is ours (no peer router
reserves KV for idle sessions; llm-d's session scorer has no such term), chosen for the reasons
above and measured in docs/benchmarks.md; 1.0 restores the uncapped rule.

**Why the gate is closed** (:func:`gate_reason`): the term of an endpoint's sheddable saturation
that reaches 1.0 — ``stale_metrics``, ``waiting_queue`` (queue term), ``kv_cache`` (KV use without
the working set), ``idle_session_working_set`` (the KV term reaches 1.0 only with the idle sessions'
reserve), ``sheddable_slots`` (the slot reserve for non-sheddable work), ``batch_prefill`` (the batch
prefill bound), ``pending_dispatches`` (only with requests released but not yet forwarded), or
``open``. ``/admin/state`` shows it per endpoint and for the gate (the least saturated endpoint's).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from router.flow_control import FlowController
from router.pool.state import PoolState
from router.scheduling.plugins.session import SessionWorkingSet
from router.scheduling.saturation import (
    SATURATED,
    SaturationThresholds,
    effective_waiting,
    endpoint_saturation,
    gate_saturation,
    pd_fleet_saturation,
    pd_gate_saturation,
    sheddable_slots,
)
from router.scheduling.types import ROLE_PREFILL, Endpoint
from router.settings import RouterSettings


def saturation_thresholds(settings: RouterSettings) -> SaturationThresholds:
    """The saturation detector's thresholds from the router's settings (the scrape-lag credit on)."""
    return SaturationThresholds(
        queue_threshold=settings.queue_threshold, kv_threshold=settings.kv_threshold,
        max_metrics_age_s=settings.max_metrics_age_s, in_flight_credit=True,
        slot_reserve_fraction=settings.slot_reserve_fraction, min_slot_reserve=settings.min_slot_reserve,
        reserve_from_arrivals=settings.reserve_from_arrivals, batch_prefill_share=settings.batch_prefill_share,
        max_num_batched_tokens=settings.max_num_batched_tokens)


#: :func:`gate_reason`'s values (module docstring), in the order the terms are checked.
GATE_REASONS = ("open", "stale_metrics", "waiting_queue", "kv_cache", "idle_session_working_set", "sheddable_slots",
                "batch_prefill", "pending_dispatches")


def reserved_working_set(endpoint: Endpoint, tokens: int, cap: float) -> int:
    """The part of an endpoint's idle-session working set (``tokens``) its sheddable saturation
    counts as used KV, tokens: ``min(tokens, cap × block_size × num_gpu_blocks)`` (module
    docstring: the rule); ``tokens`` unchanged while the GPU capacity is not scraped yet (the
    saturation leaves the term out then anyway), 0 for ``tokens`` ≤ 0."""
    if tokens <= 0:
        return 0
    if not endpoint.block_size or not endpoint.num_gpu_blocks:
        return tokens
    return min(tokens, int(cap * endpoint.block_size * endpoint.num_gpu_blocks))


def gate_reason(endpoint: Endpoint, now: float, thresholds: SaturationThresholds, working_set_tokens: int,
                value: float) -> str:
    """Why ``endpoint`` takes no sheddable work (one of :data:`GATE_REASONS`, module docstring):
    ``open`` when ``value`` (its sheddable saturation, pending dispatches placed) is below 1.0,
    else the first term of :func:`router.scheduling.saturation.endpoint_saturation` at or above
    1.0, ``working_set_tokens`` being the reserve it counted (:func:`reserved_working_set`)."""
    if value < SATURATED:
        return "open"
    t = thresholds
    updated = endpoint.metrics_updated_at
    if updated is None or now - updated > t.max_metrics_age_s:
        return "stale_metrics"
    waiting = effective_waiting(endpoint) if t.in_flight_credit else endpoint.num_requests_waiting
    if waiting / t.queue_threshold >= SATURATED:
        return "waiting_queue"
    if endpoint.kv_cache_usage_perc / t.kv_threshold >= SATURATED:
        return "kv_cache"
    if endpoint_saturation(endpoint, now, t, working_set_tokens=working_set_tokens) >= SATURATED and \
            endpoint_saturation(endpoint, now, t) < SATURATED:
        return "idle_session_working_set"
    room = sheddable_slots(endpoint, t, now)
    if room is not None and (endpoint.in_flight_sheddable / room >= SATURATED or waiting > 0):
        return "sheddable_slots"
    if t.batch_prefill_share is not None and endpoint.in_flight_sheddable_prefill_tokens >= \
            t.batch_prefill_share * t.max_num_batched_tokens:
        return "batch_prefill"
    return "pending_dispatches"


class RouterRuntime:
    """The router's saturation reads (module docstring).

    Args:
        settings: the router's settings (the thresholds, :func:`saturation_thresholds`).
        clock: monotonic seconds of the reads (a simulation injects its virtual clock).

    Attributes (the parts it reads, set by :func:`router.assembly.build_router`):
        pool: the pool's state; required before any read.
        flow: flow control, for the requests it released that no endpoint counts yet
            (``in_flight_requests``, the one field read); None: flow control is off.
        working_set: endpoint name → idle sessions' tokens there (the session plugin's,
            :func:`router.scheduling.plugins.session.working_set_of`); None: no session plugin.
    """

    def __init__(self, settings: RouterSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self.thresholds = saturation_thresholds(settings)
        self.pool: PoolState | None = None
        self.flow: FlowController | None = None
        self.working_set: Callable[[], Mapping[str, int]] | None = None

    def session_working_set(self) -> Mapping[str, int]:
        """Endpoint name → tokens of its recently active idle sessions
        (``router/scheduling/plugins/session.py``); empty without a session plugin."""
        return self.working_set() if self.working_set is not None else {}

    def reserved_working_set(self, candidates: Sequence[Endpoint] | None = None) -> dict[str, int]:
        """Endpoint name → the part of :meth:`session_working_set` its sheddable saturation counts
        (:func:`reserved_working_set` with the settings' ``working_set_cap``), tokens, for the
        healthy endpoints (``candidates``; None: the pool's); others are left out."""
        raw = self.session_working_set()
        if not raw:
            return {}
        if candidates is None:
            assert self.pool is not None
            candidates = self.pool.candidates()
        cap = self.settings.working_set_cap
        return {ep.name: reserved_working_set(ep, raw[ep.name], cap) for ep in candidates if raw.get(ep.name, 0) > 0}

    def gate_reasons(self, saturations: Mapping[str, float]) -> dict[str, str]:
        """Endpoint name → :func:`gate_reason` for every endpoint of ``saturations`` (the map of
        :meth:`endpoint_saturations`), for ``/admin/state``."""
        assert self.pool is not None
        candidates = self.pool.candidates()
        reserved = self.reserved_working_set(candidates)
        now = self.clock()
        return {ep.name: gate_reason(ep, now, self.thresholds, reserved.get(ep.name, 0), saturations[ep.name])
                for ep in candidates if ep.name in saturations}

    def gate_reason_over(self, saturations: Mapping[str, float], reasons: Mapping[str, str]) -> str:
        """Why the gate is closed (``open`` when it is not): the reason of the least saturated
        endpoint, the one the gate reads (for a prefill/decode fleet, of the more saturated pool's
        least saturated endpoint); ``no_healthy_endpoint`` with none."""
        if not saturations:
            return "no_healthy_endpoint"
        if self.gate_over(saturations) < SATURATED:
            return "open"
        assert self.pool is not None
        candidates = [ep for ep in self.pool.candidates() if ep.name in saturations]
        pools = [candidates]
        if any(ep.role == ROLE_PREFILL for ep in candidates):
            pools = [[ep for ep in candidates if ep.can_prefill], [ep for ep in candidates if ep.can_decode]]
        least = [min(pool, key=lambda ep: saturations[ep.name]) for pool in pools if pool]
        if not least:
            return "no_healthy_endpoint"
        name = max(least, key=lambda ep: saturations[ep.name]).name  # the pool that holds the gate closed
        return reasons.get(name, "open")

    def _fleet_values(self, reserve: bool) -> tuple[list[Endpoint], list[float]]:
        """The healthy endpoints and their saturations, aligned (:meth:`endpoint_saturations`)."""
        assert self.pool is not None
        self.pool.expire_prefills()
        candidates = self.pool.candidates()
        pending = 0
        if self.flow is not None:
            pending = max(0, self.flow.in_flight_requests - sum(ep.in_flight_requests for ep in candidates))
        values = pd_fleet_saturation(candidates, self.clock(), self.thresholds, pending, reserve=reserve,
                                     working_set=self.reserved_working_set(candidates) if reserve else None)
        return candidates, values

    def endpoint_saturations(self, *, reserve: bool = True) -> dict[str, float]:
        """Every healthy endpoint's saturation for sheddable work now, by name: the detector's value
        from the last scrapes with the scrape-lag credit per endpoint and, once the endpoint's slot
        count is known, the slot reserve for non-sheddable work, and the requests flow control released
        whose handlers have not forwarded them yet (one dispatch step may release several before
        any reaches an engine) placed on the least saturated endpoints
        (:func:`router.scheduling.saturation.fleet_saturation`). Flow control's gate and
        ``/admin/state`` read this one computation, so the dashboard shows what the gate does; the
        ``spare-capacity-filter`` reads the same per-endpoint detector (:meth:`scheduling_saturation`).
        Sheddable values count the idle sessions' working set as used KV, at most ``working_set_cap``
        of each engine's GPU KV (:meth:`reserved_working_set`, module docstring)."""
        candidates, values = self._fleet_values(reserve)
        return {ep.name: value for ep, value in zip(candidates, values)}

    def _gate(self, saturations: Mapping[str, float]) -> float:
        """The gate over ``saturations`` (name → value of the healthy endpoints): per pool for a
        prefill/decode fleet (:func:`router.scheduling.saturation.pd_gate_saturation`)."""
        assert self.pool is not None
        candidates = [ep for ep in self.pool.candidates() if ep.name in saturations]
        return pd_gate_saturation(candidates, [saturations[ep.name] for ep in candidates])

    def gate_over(self, saturations: Mapping[str, float]) -> float:
        """The gate over ``saturations`` (:meth:`endpoint_saturations`' map), what
        :meth:`gate_saturation` computes from them (``/admin/state`` shows both from one read)."""
        return self._gate(saturations)

    def pool_gates(self, saturations: Mapping[str, float]) -> dict[str, float]:
        """Each pool's least saturated value, ``{"prefill": …, "decode": …}`` (prefill-capable:
        roles prefill and both; decode-capable: decode and both; 1.0 for an empty pool)."""
        assert self.pool is not None
        candidates = [ep for ep in self.pool.candidates() if ep.name in saturations]
        return {"prefill": gate_saturation([saturations[ep.name] for ep in candidates if ep.can_prefill]),
                "decode": gate_saturation([saturations[ep.name] for ep in candidates if ep.can_decode])}

    def saturation(self) -> float:
        """Pool saturation: the mean of :meth:`endpoint_saturations` (1.0 with no healthy
        endpoint), for the metric and the dashboard; the gate is :meth:`gate_saturation`."""
        values = self.endpoint_saturations()
        return sum(values.values()) / len(values) if values else 1.0

    def gate_saturation(self) -> float:
        """The least saturated healthy endpoint's saturation (1.0 when none is healthy): below 1.0
        some engine has room for sheddable work (per-engine spare capacity, not the pool's mean).
        Flow control dispatches on this value. For a prefill/decode fleet: per pool, room in both
        a prefill-capable and a decode-capable engine (:meth:`_gate`)."""
        return pd_gate_saturation(*self._fleet_values(True))  # = self._gate(self.endpoint_saturations())

    def unreserved_gate_saturation(self) -> float:
        """:meth:`gate_saturation` without the slot reserve (which is kept FOR non-sheddable work):
        what flow control gates interactive work on once it is past its band's bypass bound."""
        return pd_gate_saturation(*self._fleet_values(False))

    def scheduling_saturation(self, endpoint: Endpoint) -> float:
        """One endpoint's saturation with the scrape-lag credit, for the ``spare-capacity-filter``
        (the request being placed is already counted by its endpoint's in-flight counters once
        forwarded; pending ones are not placed here)."""
        if self.pool is not None:
            self.pool.expire_prefills()
        source = self.working_set
        if source is None:
            tokens = 0
        elif isinstance(source, SessionWorkingSet):
            tokens = source.tokens(endpoint.name)  # one entry, not the map over every endpoint
        else:
            tokens = source().get(endpoint.name, 0)
        tokens = reserved_working_set(endpoint, tokens, self.settings.working_set_cap)
        return endpoint_saturation(endpoint, self.clock(), self.thresholds, working_set_tokens=tokens)
