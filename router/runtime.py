"""``RouterRuntime``: the router's saturation reads over its assembled parts, one computation for
flow control's gate, the ``spare-capacity-filter`` and ``/admin/state`` (no I/O).

It is built first and given its parts afterwards by :func:`router.assembly.build_router`, because
the parts read it back: the scheduler's ``spare-capacity-filter`` calls
:meth:`RouterRuntime.scheduling_saturation` and flow control :meth:`RouterRuntime.gate_saturation`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from router.flow_control import FlowController
from router.pool.state import PoolState
from router.scheduling.plugins.session import SessionWorkingSet
from router.scheduling.saturation import (
    SaturationThresholds,
    endpoint_saturation,
    gate_saturation,
    pd_fleet_saturation,
    pd_gate_saturation,
)
from router.scheduling.types import Endpoint
from router.settings import RouterSettings


def saturation_thresholds(settings: RouterSettings) -> SaturationThresholds:
    """The saturation detector's thresholds from the router's settings (the scrape-lag credit on)."""
    return SaturationThresholds(
        queue_threshold=settings.queue_threshold, kv_threshold=settings.kv_threshold,
        max_metrics_age_s=settings.max_metrics_age_s, in_flight_credit=True,
        slot_reserve_fraction=settings.slot_reserve_fraction, min_slot_reserve=settings.min_slot_reserve,
        reserve_from_arrivals=settings.reserve_from_arrivals, batch_prefill_share=settings.batch_prefill_share,
        max_num_batched_tokens=settings.max_num_batched_tokens)


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

    def _fleet_values(self, reserve: bool) -> tuple[list[Endpoint], list[float]]:
        """The healthy endpoints and their saturations, aligned (:meth:`endpoint_saturations`)."""
        assert self.pool is not None
        self.pool.expire_prefills()
        candidates = self.pool.candidates()
        pending = 0
        if self.flow is not None:
            pending = max(0, self.flow.in_flight_requests - sum(ep.in_flight_requests for ep in candidates))
        values = pd_fleet_saturation(candidates, self.clock(), self.thresholds, pending, reserve=reserve,
                                     working_set=self.session_working_set() if reserve else None)
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
        Sheddable values count the idle sessions' working set as used KV (:meth:`session_working_set`)."""
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
        return endpoint_saturation(endpoint, self.clock(), self.thresholds, working_set_tokens=tokens)
