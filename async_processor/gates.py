"""Dispatch gates: which held requests may start now. Gates compose with :class:`AllGates`.

A gate answers :meth:`Gate.admits` for one item, and counts items it let through between
:meth:`Gate.acquire` (when an HTTP attempt starts) and :meth:`Gate.release` (when it ends, before
any retry backoff, so a retry never keeps a slot). :meth:`Gate.refresh` does a gate's I/O, called
periodically by the processor, never on the dispatch path. :meth:`Gate.refused` hears of the
router's fast refusal of an attempt (429 ``rejected-saturated``: the router would have queued
sheddable work), so a gate that reads the router's state can hold back until it reads it again.

Gates decide by what the items of one lane-buffer flow share (lane, tenant): the buffer asks them
about each flow's head only (:mod:`async_processor.lanes`).

Router saturation contract (``common/contracts/router_state.py``)::

    GET {router_url}/admin/state   ->  200, application/json
    {"gate_saturation": 0.42, ...}     # float in [0, inf): the least saturated healthy engine's
                                       # saturation (1.0 when none is healthy); >= 1.0 means no
                                       # engine has room for sheddable work

So the gate opens when any engine has room (per-engine spare capacity), not on the pool's mean,
which reads 1.0 when one engine is full and another idle. Other fields are ignored. The gate
**fails closed**: a reading that is unreadable (connection error, non-200, not JSON, field missing,
not a finite number >= 0) or older than ``max_age_s`` counts as saturated, and so does every reading
asked for before the router's last fast refusal. Lanes of priority >= ``exempt_priority`` (default
100: ``interactive``) pass regardless, since the router's own flow control protects them.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from async_processor.lanes import Work
from async_processor.router_client import NoAnswer, RouterClient
from common.contracts.queue import LANE_PRIORITIES
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

    def refused(self, work: Work) -> None:
        """The router refused ``work``'s attempt at once as saturated (no-op for local gates)."""
        ...


def effective_reserves(limit: int, lanes: Sequence[str], reserved: Mapping[str, int]) -> dict[str, int]:
    """The reserves a :class:`ConcurrencyGate` of ``limit`` slots applies for the ``lanes`` read:
    ``reserved`` (lane -> slots) less lanes not read and the lowest lane read (no lane below it
    could take its slots), cut highest lane first so that the lowest lane read keeps at least one
    slot (``limit`` 1 reserves nothing). Raises ``ValueError`` for an unknown lane or a reserve < 0."""
    unknown = [lane for lane in [*lanes, *reserved] if lane not in LANE_PRIORITIES]
    if unknown:
        raise ValueError(f"unknown lanes {unknown}")
    if any(n < 0 for n in reserved.values()):
        raise ValueError(f"reserved slots must be >= 0, got {dict(reserved)}")
    order = sorted(set(lanes), key=lambda lane: -LANE_PRIORITIES[lane])
    left = limit - 1
    out: dict[str, int] = {}
    for lane in order[:-1]:
        n = min(reserved.get(lane, 0), left)
        if n > 0:
            out[lane] = n
            left -= n
    return out


class ConcurrencyGate:
    """At most ``limit`` attempts in flight (>= 1), of which ``reserved`` (lane -> slots) are kept
    for those lanes: an item may start only if, after it, the free slots still cover the unused
    reserve (reserve less that lane's attempts in flight) of every lane of higher priority than its
    own. So the highest lane can use every slot, and a lower lane can never take a higher lane's
    reserve. ``in_flight_by_lane``: attempts running per lane. Raises ``ValueError`` for ``limit``
    < 1 or reserves that leave no slot to the lanes below them (see :func:`effective_reserves`)."""

    kind = "concurrency"

    def __init__(self, limit: int, reserved: Mapping[str, int] | None = None):
        if limit < 1:
            raise ValueError("limit must be >= 1")
        self.limit = limit
        self.reserved = {lane: n for lane, n in (reserved or {}).items() if n > 0}
        if sum(self.reserved.values()) >= limit and self.reserved:
            raise ValueError(f"reserved slots {self.reserved} leave none of {limit} to lower lanes")
        self.in_flight = 0
        self.in_flight_by_lane: Counter[str] = Counter()
        self._above: dict[int, list[tuple[str, int]]] = {}

    def _higher(self, priority: int) -> list[tuple[str, int]]:
        above = self._above.get(priority)
        if above is None:
            above = self._above[priority] = [(lane, n) for lane, n in self.reserved.items()
                                             if LANE_PRIORITIES[lane] > priority]
        return above

    def admits(self, work: Work) -> bool:
        free_after = self.limit - self.in_flight - 1
        if free_after < 0:
            return False
        unused = sum(max(0, n - self.in_flight_by_lane[lane]) for lane, n in self._higher(work.priority))
        return free_after >= unused

    def acquire(self, work: Work) -> None:
        self.in_flight += 1
        self.in_flight_by_lane[work.lane] += 1

    def release(self, work: Work) -> None:
        self.in_flight -= 1
        self.in_flight_by_lane[work.lane] -= 1

    async def refresh(self) -> None:
        return None

    def refused(self, work: Work) -> None:
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

    def refused(self, work: Work) -> None:
        return None


class SaturationGate:
    """Admits lanes below ``exempt_priority`` only while the router's ``gate_saturation`` (the least
    saturated healthy engine's, see the module docstring) is < 1.0, i.e. some engine has room, the
    reading is at most ``max_age_s`` seconds old and it was asked for after the router's last fast
    refusal (:meth:`refused`). ``client``: a :class:`~async_processor.router_client.RouterClient`
    owned by the caller. ``clock``: monotonic seconds."""

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
        self.refused_at = -math.inf

    def saturated(self) -> bool:
        """True unless a fresh reading below 1.0, asked for after the last refusal, exists."""
        fresh = self.clock() - self.read_at <= self.max_age_s
        return not (fresh and self.saturation is not None and self.saturation < SATURATION_THRESHOLD)

    def admits(self, work: Work) -> bool:
        return work.priority >= self.exempt_priority or not self.saturated()

    def acquire(self, work: Work) -> None:
        return None

    def release(self, work: Work) -> None:
        return None

    def refused(self, work: Work) -> None:
        """The router refused an attempt as saturated: closed until a reading asked for from now on
        (the next :meth:`refresh`) says otherwise. An exempt lane's refusal changes nothing."""
        if work.priority >= self.exempt_priority:
            return
        self.refused_at = self.clock()
        self.saturation = None

    async def refresh(self) -> None:
        """One ``GET /admin/state``; an unusable answer clears the reading (fail closed), and one
        asked for before the last refusal is not used."""
        asked_at = self.clock()
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
        if asked_at < self.refused_at:
            return
        self.saturation = value
        self.read_at = asked_at


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

    def refused(self, work: Work) -> None:
        for g in self.gates:
            g.refused(work)
