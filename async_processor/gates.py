"""Dispatch gates: which held requests may start now. Gates compose with :class:`AllGates`.

A gate answers :meth:`Gate.admits` for one item, and counts items it let through between
:meth:`Gate.acquire` (when an HTTP attempt starts) and :meth:`Gate.release` (when it ends, before
any retry backoff, so a retry never keeps a slot). :meth:`Gate.refresh` does a gate's I/O, called
periodically by the processor, never on the dispatch path.

Router saturation contract (the router serves it; until it exists, this docstring is the contract)::

    GET {router_url}/admin/state   ->  200, application/json
    {"pool_saturation": 0.42, ...}     # float in [0, inf); >= 1.0 means the pool is saturated

Other fields are ignored. The gate **fails closed**: a reading that is unreadable (connection error,
non-200, not JSON, field missing, not a finite number >= 0) or older than ``max_age_s`` counts as
saturated. Lanes of priority >= ``exempt_priority`` (default 100: ``interactive``) pass regardless,
since the router's own flow control protects them.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Protocol

from async_processor.lanes import Work
from async_processor.router_client import NoAnswer, RouterClient
from common.contracts.router_state import SATURATION_THRESHOLD, parse_gate_saturation

log = logging.getLogger(__name__)


class Gate(Protocol):
    """One dispatch rule (see the module docstring). ``kind`` names it in metrics."""

    kind: str

    def admits(self, work: Work) -> bool:
        """May ``work`` start now?"""
        ...

    def acquire(self, work: Work) -> None:
        """``work`` started an attempt."""
        ...

    def release(self, work: Work) -> None:
        """``work``'s attempt ended."""
        ...

    async def refresh(self) -> None:
        """Re-read external signals (no-op for local gates)."""
        ...


class ConcurrencyGate:
    """At most ``limit`` attempts in flight (>= 1)."""

    kind = "concurrency"

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError("limit must be >= 1")
        self.limit = limit
        self.in_flight = 0

    def admits(self, work: Work) -> bool:
        return self.in_flight < self.limit

    def acquire(self, work: Work) -> None:
        self.in_flight += 1

    def release(self, work: Work) -> None:
        self.in_flight -= 1

    async def refresh(self) -> None:
        return None


class TenantQuotaGate:
    """At most ``limit`` attempts in flight per tenant (``metadata.tenant``; "" is one tenant too);
    ``overrides`` maps tenant -> its own limit."""

    kind = "tenant_quota"

    def __init__(self, limit: int, overrides: dict[str, int] | None = None):
        self.limit = limit
        self.overrides = dict(overrides or {})
        self.in_flight: Counter[str] = Counter()

    def admits(self, work: Work) -> bool:
        return self.in_flight[work.tenant] < self.overrides.get(work.tenant, self.limit)

    def acquire(self, work: Work) -> None:
        self.in_flight[work.tenant] += 1

    def release(self, work: Work) -> None:
        self.in_flight[work.tenant] -= 1
        if self.in_flight[work.tenant] <= 0:
            del self.in_flight[work.tenant]

    async def refresh(self) -> None:
        return None


class SaturationGate:
    """Admits lanes below ``exempt_priority`` only while the router's ``pool_saturation`` < 1.0 and
    the reading is at most ``max_age_s`` seconds old. ``client``: a
    :class:`~async_processor.router_client.RouterClient` owned by the caller. ``clock``: monotonic seconds."""

    kind = "saturation"

    def __init__(self, client: RouterClient, router_url: str, *, max_age_s: float = 2.0,
                 exempt_priority: int = 100, timeout_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.client = client
        self.url = router_url.rstrip("/") + "/admin/state"
        self.max_age_s = max_age_s
        self.exempt_priority = exempt_priority
        self.timeout_s = timeout_s
        self.clock = clock
        self.saturation: float | None = None
        self.read_at = -math.inf

    def saturated(self) -> bool:
        """True unless a fresh reading below 1.0 exists."""
        fresh = self.clock() - self.read_at <= self.max_age_s
        return not (fresh and self.saturation is not None and self.saturation < SATURATION_THRESHOLD)

    def admits(self, work: Work) -> bool:
        return work.priority >= self.exempt_priority or not self.saturated()

    def acquire(self, work: Work) -> None:
        return None

    def release(self, work: Work) -> None:
        return None

    async def refresh(self) -> None:
        """One ``GET /admin/state``; an unusable answer clears the reading (fail closed)."""
        try:
            answer = await self.client.get(self.url, self.timeout_s)
            if answer.status != 200:
                raise ValueError(f"status {answer.status}")
            value = parse_gate_saturation(answer.body)
        except (NoAnswer, ValueError) as exc:
            if self.saturation is not None:
                log.warning("router saturation unreadable; gating closed",
                            extra={"action": "gate_unreadable", "error": str(exc)})
            self.saturation = None
            return
        self.saturation = value
        self.read_at = self.clock()


class AllGates:
    """Admits what every gate admits, asking them in order; acquire/release/refresh go to all.

    Decisions are counted for metrics: ``denied[kind]`` + 1 when the gate of that kind starts
    holding a request back (once per request and gate, however often the dispatcher asks again),
    ``admitted`` + 1 when a request every gate let through starts. ``kinds``: the gates' kinds.
    """

    kind = "all"

    def __init__(self, gates: Sequence[Gate]):
        self.gates = list(gates)
        self.kinds = [getattr(g, "kind", type(g).__name__) for g in self.gates]
        self.admitted = 0
        self.denied: Counter[str] = Counter()

    def admits(self, work: Work) -> bool:
        for gate, kind in zip(self.gates, self.kinds):
            if not gate.admits(work):
                if work.gated_by != kind:
                    work.gated_by = kind
                    self.denied[kind] += 1
                return False
        return True

    def acquire(self, work: Work) -> None:
        for g in self.gates:
            g.acquire(work)
        self.admitted += 1
        work.gated_by = ""

    def release(self, work: Work) -> None:
        for g in self.gates:
            g.release(work)

    async def refresh(self) -> None:
        for g in self.gates:
            await g.refresh()
