"""The pure flow-control core: bands, flows, ordering, limits, TTLs, quotas, gating and eviction.

No asyncio, no I/O, no clock of its own: every call takes ``now`` (seconds, any monotonic clock) and
the saturation signal is a callable, so the same code runs under the router's asyncio facade
(``router/flow_control/controller.py``) and in a discrete-event simulation.

The model is llm-d's flow control (gateway-api-inference-extension ``pkg/epp/flowcontrol``):

* **Bands** by the objective's priority, higher first (llm-d: "highest numeric value is highest
  priority"). An absent or unknown objective goes to the configured default objective's band.
* **Flows** keyed by fairness id (tenant) inside a band: llm-d's flow key is (fairness id, priority).
* **Inter-band: strict priority.** Each dispatch takes from the highest band that has something
  eligible; a band whose flows are all at their tenant quota is skipped (work conserving).
* **Inter-flow: weighted deficit round-robin** (Shreedhar & Varghese, 1995; cost one request) over
  the band's flows with queued work, each tenant's weight from the config's ``tenant_weights``
  (default 1): over a round a flow of weight 2 dispatches twice as often as one of weight 1; a
  flow with nothing eligible (at its ``tenant_max_in_flight``) is skipped and keeps no credit.
  With equal weights this is llm-d's round-robin fairness policy.
* **Deadline at risk**: before the DRR turn, the band's earliest-deadline queued item goes first
  when its deadline is within ``deadline_at_risk_s`` of ``now`` (its flow below quota); it is
  charged to its flow's deficit, so fairness is overridden only while a deadline is at risk.
* **Intra-flow: earliest deadline first**, FIFO on equal deadlines; items without a deadline come
  after those with one, FIFO among themselves (llm-d's EDF ordering policy).
* **Intra-flow with turn priority** (config ``turn_priority.enabled``; llm-d's ``turn-priority``
  strategy, llm-d/llm-d-router PR #2116, ``strategy_turnpriority.go``): instead of EDF, the
  highest ``score = turn + time_weight_per_s × seconds waited`` goes first, FIFO on ties. The turn
  is the number of this session's requests the core dispatched before (``FlowItem.session_id``)
  plus one, at most ``max_turn``, read when the item is enqueued; a request without a session, an unknown session, or
  one with nothing in flight whose last request ended more than ``inactivity_s`` ago is turn 1 (the
  count then restarts: a session idle that long has likely lost its KV cache, llm-d's reason).
  So a session's next turn goes ahead of new sessions' first turns in its flow, and the deeper
  the session the further ahead. **Aging**: every waiting item's score grows at the same rate, so
  an item that has waited ``(T − 1) / time_weight_per_s`` seconds outranks any new arrival of turn
  ≤ T; turns count up to ``max_turn`` (ours; llm-d's are unbounded, so there a session whose
  count grows faster than the weight ages a waiting item could hold it back for ever), so after
  ``(max_turn − 1) / time_weight_per_s`` seconds an item is behind no new arrival: no starvation.
  Since all scores grow alike, the order of two waiting items never changes, and the key is
  fixed at enqueue (``time_weight_per_s × enqueued_at − turn``, smallest first). Differences
  from llm-d: llm-d's flows are the programs themselves (its fairness id is the agent's session)
  and the score picks between flows; here flows stay tenants (weighted DRR between them) and the
  score orders each tenant's own queue, so one tenant's deep sessions never overtake another
  tenant's fair share. The deadline-at-risk override still applies.
* **Capacity**: per-band ``max_queued_requests`` / ``max_queued_bytes``; an item that would exceed
  either is rejected at once (``rejected-capacity``; llm-d rejects over-capacity the same way).
* **TTL**: an item waiting longer than its band's ``ttl_s`` or past its own ``deadline`` is shed
  (``rejected-ttl-expired``). Expiry is strict: at ``now > expiry``. A band with ``ttl_s`` 0 never
  queues: what it cannot dispatch in the first step after it was enqueued is shed at the end of
  that step as ``rejected-saturated`` (``rejected-quota`` when its tenant is at
  ``tenant_max_in_flight``) — the default for the sheddable ``async`` and ``batch`` bands.
* **Tenant quota** per band: a flow with ``tenant_max_in_flight`` requests in flight is not
  dispatched (its items wait, subject to TTL); a tenant with ``tenant_max_queued`` items waiting in
  the band gets ``rejected-quota`` at once (ours; llm-d has per-band limits only).
* **Saturation gating**: a dispatch happens only while ``saturation() < 1.0`` (llm-d's saturation
  detector; ROUTING.md), re-read before every dispatch because the router's signal counts its own
  dispatches since the last scrape. The router passes the per-engine gate, the least saturated
  engine's value (``router/scheduling/saturation.py``): sheddable work dispatches while any engine
  has room, and the scheduler's ``spare-capacity-filter`` sends it there. A band with
  ``bypass_saturation`` dispatches while saturated as long as it has fewer than ``max_in_flight``
  in flight (ROUTING.md: the highest band may go to an engine's own queue up to a bound).
* **Eviction** (optional; llm-d's evictor): when the highest band with an eligible item is held
  back by saturation alone, the most recently dispatched in-flight item of the lowest sheddable band
  below it is evicted (llm-d orders victims lowest priority first, newest dispatch first: the least
  work lost). Each eviction is charged to one waiting item of the blocked band (its oldest not yet
  charged), so there is at most one eviction per blocked item, and at most one per
  ``eviction_interval_s``. A blocked band with ``ttl_s`` 0 causes none: its item is shed in the
  same step, before the room an eviction makes could show.

Retry-After (``retry_after_for``): 1 s for ``rejected-saturated``, ``rejected-capacity``,
``rejected-ttl-expired``, ``evicted`` and ``rejected-context-cancelled`` — room appears as soon as
the engines finish work, which the saturation detector sees within a scrape, so a short wait is
right and the processor's own backoff (base 2 s) dominates anyway; ``rejected-quota``: the band's
TTL capped at 60 s (the processor's backoff cap) — the tenant's own backlog has to drain first,
which takes up to a TTL.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from common.contracts.router_state import is_backpressure, reason_label
from router.flow_control.config import BandConfig, FlowControlConfig
from router.flow_control.errors import DropReason, RequestDropped

QUOTA_RETRY_CAP_S = 60.0
SHORT_RETRY_S = 1.0


@dataclass(frozen=True, slots=True)
class FlowItem:
    """A request asking to run.

    Attributes:
        request_id: the request's id (logs and eviction reports; need not be unique).
        fairness_id: tenant id from ``x-llm-d-inference-fairness-id`` ("" when none).
        objective: objective name from ``x-llm-d-inference-objective``; None or unknown → the
            default objective.
        byte_size: request body size, bytes (≥ 0), counted against ``max_queued_bytes``.
        deadline: time after which the request must not be dispatched, seconds on the same clock as
            ``now`` (the controller's clock), or None.
        session_id: the request's session (``router.parsing.session_id``), or None; read by turn
            priority only.

    Raises:
        ValueError: ``byte_size`` is negative or ``deadline`` is NaN.
    """

    request_id: str
    fairness_id: str
    objective: str | None
    byte_size: int
    deadline: float | None = None
    session_id: str | None = None

    def __post_init__(self) -> None:
        if self.byte_size < 0:
            raise ValueError(f"byte_size must be ≥ 0, got {self.byte_size}")
        if self.deadline is not None and math.isnan(self.deadline):
            raise ValueError("deadline must be a number of seconds or None")


class TicketState(StrEnum):
    """Where an admitted item is."""

    QUEUED = "queued"
    IN_FLIGHT = "in_flight"
    RELEASED = "released"
    DROPPED = "dropped"
    EVICTED = "evicted"


@dataclass(eq=False, slots=True)
class Ticket:
    """The core's handle on one enqueued item (identity, not request id, is the key).

    Attributes:
        item: the item.
        band: the band's config (``band.objective``, ``band.priority``).
        enqueued_at: ``now`` at enqueue, seconds.
        expires_at: time after which it is shed (``math.inf`` when never).
        state: see :class:`TicketState`.
        dispatched_at: ``now`` at dispatch, or None.
        turn: the item's turn number in its session (1 without a session or with turn priority
            off).
    """

    item: FlowItem
    band: BandConfig
    seq: int
    enqueued_at: float
    expires_at: float
    state: TicketState = TicketState.QUEUED
    dispatched_at: float | None = None
    eviction_tried: bool = False
    turn: int = 1
    _flow: _Flow | None = field(default=None, repr=False)


@dataclass(slots=True)
class StepResult:
    """What one :meth:`FlowControlCore.step` did: tickets dispatched (in order), in-flight tickets
    evicted, and queued tickets shed with their drop."""

    dispatched: list[Ticket] = field(default_factory=list)
    evicted: list[Ticket] = field(default_factory=list)
    expired: list[tuple[Ticket, RequestDropped]] = field(default_factory=list)


def retry_after_for(reason: DropReason, band: BandConfig) -> float:
    """Seconds to advertise in ``Retry-After`` for a drop in ``band`` (module docstring: why)."""
    if reason is DropReason.QUOTA:
        return max(SHORT_RETRY_S, min(band.ttl_s if band.ttl_s is not None else QUOTA_RETRY_CAP_S, QUOTA_RETRY_CAP_S))
    return SHORT_RETRY_S


class _SessionTurns:
    """What turn priority remembers of one session: requests dispatched, in flight, and when the
    last one ended (``now`` seconds; None before any)."""

    __slots__ = ("dispatched", "in_flight", "last_done")

    def __init__(self) -> None:
        self.dispatched = 0
        self.in_flight = 0
        self.last_done: float | None = None


class _Flow:
    """One tenant's queue in one band: an EDF heap of ``(deadline, seq, ticket)``, its DRR weight
    and deficit (requests it may still dispatch in its current turn)."""

    __slots__ = ("key", "heap", "queued", "in_flight", "in_ring", "weight", "deficit")

    def __init__(self, key: str, weight: float) -> None:
        self.key = key
        self.heap: list[tuple[float, int, Ticket]] = []
        self.queued = 0
        self.in_flight = 0
        self.in_ring = False
        self.weight = weight
        self.deficit = 0.0

    def head(self) -> Ticket | None:
        heap = self.heap
        while heap and heap[0][2].state is not TicketState.QUEUED:
            heapq.heappop(heap)  # lazily drop entries cancelled or shed while queued
        return heap[0][2] if heap else None


class _Band:
    """One priority band: its flows, the DRR ring, queued and in-flight tickets, counters, and a
    heap of its queued tickets' deadlines (for deadline-at-risk)."""

    __slots__ = ("config", "flows", "ring", "queued", "queued_bytes", "in_flight", "dispatched_total", "shed",
                 "deadlines")

    def __init__(self, config: BandConfig) -> None:
        self.config = config
        self.flows: dict[str, _Flow] = {}
        self.ring: deque[_Flow] = deque()  # exactly the flows with queued work, in turn order
        self.queued: dict[int, Ticket] = {}  # by seq: enqueue order, so the first is the oldest
        self.queued_bytes = 0
        self.in_flight: dict[int, Ticket] = {}  # by seq, in dispatch order: the last is the newest
        self.dispatched_total = 0
        self.shed: Counter[DropReason] = Counter()
        self.deadlines: list[tuple[float, int, Ticket]] = []  # queued tickets with a deadline (lazy)

    def can_bypass(self) -> bool:
        cfg = self.config
        return cfg.bypass_saturation and cfg.max_in_flight is not None and len(self.in_flight) < cfg.max_in_flight

    def at_quota(self, flow: _Flow) -> bool:
        """The flow has ``tenant_max_in_flight`` requests in flight (not dispatched until one ends)."""
        quota = self.config.tenant_max_in_flight
        return quota is not None and flow.in_flight >= quota

    def has_eligible(self) -> bool:
        """Some flow has queued work and is below its in-flight quota."""
        return any(not self.at_quota(flow) for flow in self.ring)

    def at_risk(self, now: float, at_risk_s: float) -> Ticket | None:
        """The band's earliest-deadline queued ticket if its deadline is within ``at_risk_s`` of
        ``now`` and its flow is below quota, else None."""
        heap = self.deadlines
        while heap and heap[0][2].state is not TicketState.QUEUED:
            heapq.heappop(heap)
        if not heap or heap[0][0] - now > at_risk_s:
            return None
        ticket = heap[0][2]
        flow = ticket._flow
        return ticket if flow is not None and not self.at_quota(flow) else None

    def select(self, now: float, at_risk_s: float) -> Ticket | None:
        """Take the next ticket: one whose deadline is at risk (:meth:`at_risk`) first, else by
        deficit round-robin over the flows, or None when every flow is at its in-flight quota.

        DRR (Shreedhar & Varghese, 1995) with a cost of one request: a flow whose turn starts
        (at the front with a deficit below 1) adds its weight to its deficit; it dispatches while
        the deficit is at least 1, then goes to the back keeping the remainder. A flow at its
        quota is skipped and loses its deficit (no credit, as llm-d's round-robin). An at-risk
        ticket is charged to its flow's deficit (which may go negative: the flow repays it in
        later turns). The ticket leaves its flow's heap; :meth:`FlowControlCore._dispatch` ends
        the flow's turn when its deficit is spent.
        """
        ticket = self.at_risk(now, at_risk_s)
        if ticket is not None:
            flow = ticket._flow
            assert flow is not None
            if flow.head() is ticket:  # EDF: always; turn priority: its entry goes lazily otherwise
                heapq.heappop(flow.heap)
            flow.deficit -= 1.0
            return ticket
        if not self.has_eligible():
            return None
        ring = self.ring
        while True:  # ends: every pass over an eligible flow adds its weight (> 0) to its deficit
            flow = ring[0]
            if self.at_quota(flow):
                flow.deficit = 0.0
                ring.rotate(-1)
                continue
            if flow.deficit < 1.0:
                flow.deficit += flow.weight
                if flow.deficit < 1.0:
                    ring.rotate(-1)
                    continue
            head = flow.head()
            assert head is not None
            heapq.heappop(flow.heap)
            flow.deficit -= 1.0
            return head

    def forget_if_idle(self, flow: _Flow) -> None:
        if flow.queued == 0 and flow.in_flight == 0 and not flow.in_ring and self.flows.get(flow.key) is flow:
            del self.flows[flow.key]


class FlowControlCore:
    """Pure flow-control state machine (module docstring: the policy and its sources).

    Typical use: ``enqueue`` each arriving item (may raise :class:`RequestDropped`), call ``step``
    whenever time passed or saturation may have changed, ``release`` a dispatched ticket when its
    request ends, ``cancel`` a queued ticket whose client went away.
    """

    def __init__(self, config: FlowControlConfig) -> None:
        self.config = config
        self._bands = sorted((_Band(b) for b in config.bands), key=lambda b: -b.config.priority)
        self._by_objective = {b.config.objective: b for b in self._bands}
        self._default = self._by_objective[config.default_objective]
        self._expiry: list[tuple[float, int, Ticket]] = []
        self._seq = itertools.count()
        self._last_eviction = -math.inf
        self.dispatched_total = 0
        self._turns = config.turn_priority
        self._sessions: OrderedDict[str, _SessionTurns] = OrderedDict()  # by last use, oldest first

    # --- queries -------------------------------------------------------------------------------

    def band_config(self, objective: str | None) -> BandConfig:
        """The band an item with ``objective`` goes to (unknown or None → the default objective's)."""
        return self._band(objective).config

    @property
    def queued_requests(self) -> int:
        """Items waiting, over all bands."""
        return sum(len(b.queued) for b in self._bands)

    @property
    def in_flight_requests(self) -> int:
        """Items dispatched and not yet released or evicted, over all bands (up to date inside
        :meth:`step`, so a saturation callable can count the dispatches of the step that is running)."""
        return sum(len(b.in_flight) for b in self._bands)

    def queued_tickets(self) -> Iterator[Ticket]:
        """Every waiting ticket, band by band (highest first), oldest first within a band."""
        for band in self._bands:
            yield from list(band.queued.values())

    def turn_number(self, session_id: str | None, now: float) -> int:
        """The turn an item of ``session_id`` enqueued at ``now`` has: this session's requests
        dispatched before + 1, at most ``turn_priority.max_turn``; 1 without a session, for an unknown one, or for one idle (nothing in
        flight) for more than ``turn_priority.inactivity_s`` since its last request ended (module
        docstring). Read-only."""
        turns = self._sessions.get(session_id) if session_id else None
        if turns is None or self._went_cold(turns, now):
            return 1
        return min(turns.dispatched + 1, self._turns.max_turn)

    def _went_cold(self, turns: _SessionTurns, now: float) -> bool:
        inactivity = self._turns.inactivity_s
        return (inactivity > 0 and turns.in_flight == 0 and turns.last_done is not None
                and now - turns.last_done > inactivity)

    def next_expiry(self) -> float | None:
        """The earliest time a waiting item will be shed, or None (for a simulation's next event)."""
        heap = self._expiry
        while heap and heap[0][2].state is not TicketState.QUEUED:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def stats(self, now: float) -> dict[str, Any]:
        """Counters and gauges, bands highest first::

            {"bands": [{"objective", "priority", "queued_requests", "queued_bytes", "in_flight",
                        "dispatched_total", "refused_total": {label: n}, "shed_total": {label: n},
                        "oldest_wait_s"}], "dispatched_total": n}

        ``refused_total`` counts every backpressure reason (refused at once, re-sent by the caller),
        ``shed_total`` every other :class:`DropReason` (work dropped after it waited or ran), each
        keyed by its metric label (``rejected_saturated``:
        :func:`common.contracts.router_state.reason_label`), as the router's ``/metrics`` splits them.

        ``oldest_wait_s`` is ``now`` minus the oldest waiting item's enqueue time (0.0 when none).
        """
        bands = []
        for band in self._bands:
            oldest = next(iter(band.queued.values()), None)
            bands.append({
                "objective": band.config.objective,
                "priority": band.config.priority,
                "queued_requests": len(band.queued),
                "queued_bytes": band.queued_bytes,
                "in_flight": len(band.in_flight),
                "dispatched_total": band.dispatched_total,
                "refused_total": {reason_label(r): band.shed[r] for r in DropReason if is_backpressure(r)},
                "shed_total": {reason_label(r): band.shed[r] for r in DropReason if not is_backpressure(r)},
                "oldest_wait_s": max(0.0, now - oldest.enqueued_at) if oldest else 0.0,
                "flows": len(band.flows),
            })
        return {"bands": bands, "dispatched_total": self.dispatched_total}

    # --- transitions ---------------------------------------------------------------------------

    def enqueue(self, item: FlowItem, now: float) -> Ticket:
        """Queue ``item`` in its band and flow; it dispatches on a later :meth:`step`.

        Returns:
            The ticket (state ``queued``).

        Raises:
            RequestDropped: ``rejected-ttl-expired`` (deadline already past), ``rejected-quota``
                (the tenant has ``tenant_max_queued`` waiting in the band) or ``rejected-capacity``
                (the band's request or byte limit would be exceeded), checked in that order.
        """
        band = self._band(item.objective)
        cfg = band.config
        if item.deadline is not None and item.deadline < now:
            raise self._reject(band, DropReason.TTL_EXPIRED, "the request's deadline has passed")
        flow = band.flows.get(item.fairness_id)
        if cfg.tenant_max_queued is not None and flow is not None and flow.queued >= cfg.tenant_max_queued:
            raise self._reject(band, DropReason.QUOTA, f"tenant queue quota ({cfg.tenant_max_queued}) reached")
        if len(band.queued) >= cfg.max_queued_requests:
            raise self._reject(band, DropReason.CAPACITY, f"queue full ({cfg.max_queued_requests} requests)")
        if band.queued_bytes + item.byte_size > cfg.max_queued_bytes:
            raise self._reject(band, DropReason.CAPACITY, f"queue full ({cfg.max_queued_bytes} bytes)")
        if flow is None:
            flow = band.flows[item.fairness_id] = _Flow(item.fairness_id, self.config.tenant_weight(item.fairness_id))
        ttl = cfg.ttl_s if cfg.ttl_s else None  # 0: never queues, shed at the end of the next step
        expires_at = min(now + ttl if ttl is not None else math.inf,
                         item.deadline if item.deadline is not None else math.inf)
        seq = next(self._seq)
        ticket = Ticket(item, cfg, seq, now, expires_at, _flow=flow)
        if self._turns.enabled:
            ticket.turn = self._session_turn(item.session_id, now)
            key = self._turns.time_weight_per_s * now - ticket.turn  # smallest = highest score, for good
        else:
            key = item.deadline if item.deadline is not None else math.inf
        heapq.heappush(flow.heap, (key, seq, ticket))
        flow.queued += 1
        if not flow.in_ring:
            band.ring.append(flow)
            flow.in_ring = True
        band.queued[seq] = ticket
        band.queued_bytes += item.byte_size
        if expires_at < math.inf:
            heapq.heappush(self._expiry, (expires_at, seq, ticket))
        if item.deadline is not None:
            heapq.heappush(band.deadlines, (item.deadline, seq, ticket))
        return ticket

    def cancel(self, ticket: Ticket) -> bool:
        """Remove a waiting ticket whose client went away (counted as ``rejected-context-cancelled``).

        Returns:
            True if it was waiting; False (and nothing changes) otherwise.
        """
        if ticket.state is not TicketState.QUEUED:
            return False
        band = self._by_objective[ticket.band.objective]
        self._unqueue(band, ticket, TicketState.DROPPED)
        band.shed[DropReason.CONTEXT_CANCELLED] += 1
        return True

    def release(self, ticket: Ticket, now: float | None = None) -> bool:
        """The dispatched request ended: free its in-flight and quota slots. Idempotent.

        Args:
            ticket: the ticket.
            now: when it ended, seconds (turn priority's inactivity clock); None: its dispatch time.

        Returns:
            True if it was in flight; False otherwise (already released, evicted, or never dispatched).
        """
        if ticket.state is not TicketState.IN_FLIGHT:
            return False
        self._end_flight(ticket, TicketState.RELEASED, now)
        return True

    def evict(self, ticket: Ticket) -> bool:
        """Evict an in-flight ticket the caller chose (the router's make-room: a non-sheddable
        request reached an engine with no free slot), counted as ``evicted`` in its band.

        Returns:
            True if it was in flight of a sheddable band; False (and nothing changes) otherwise.
        """
        if ticket.state is not TicketState.IN_FLIGHT or not ticket.band.sheddable:
            return False
        self._end_flight(ticket, TicketState.EVICTED)
        self._by_objective[ticket.band.objective].shed[DropReason.EVICTED] += 1
        return True

    def expire(self, now: float) -> list[tuple[Ticket, RequestDropped]]:
        """Shed every waiting ticket past its TTL or deadline (``now > expires_at``).

        Returns:
            ``(ticket, drop)`` pairs, earliest expiry first; ``drop.reason`` is
            ``rejected-ttl-expired`` (a band with ``ttl_s`` 0 sheds in :meth:`step` instead).
        """
        shed: list[tuple[Ticket, RequestDropped]] = []
        heap = self._expiry
        while heap and heap[0][0] < now:
            _, _, ticket = heapq.heappop(heap)
            if ticket.state is not TicketState.QUEUED:
                continue
            band = self._by_objective[ticket.band.objective]
            self._unqueue(band, ticket, TicketState.DROPPED)
            if ticket.item.deadline is not None and ticket.expires_at == ticket.item.deadline:
                drop = self._reject(band, DropReason.TTL_EXPIRED, "the request's deadline passed while it waited")
            else:
                drop = self._reject(band, DropReason.TTL_EXPIRED, f"waited longer than the TTL ({band.config.ttl_s} s)")
            shed.append((ticket, drop))
        if len(heap) > 1024 and len(heap) > 4 * self.queued_requests:  # drop entries of dispatched tickets
            self._expiry = [e for e in heap if e[2].state is TicketState.QUEUED]
            heapq.heapify(self._expiry)
        for band in self._bands:
            if len(band.deadlines) > 1024 and len(band.deadlines) > 4 * len(band.queued):
                band.deadlines = [e for e in band.deadlines if e[2].state is TicketState.QUEUED]
                heapq.heapify(band.deadlines)
        return shed

    def step(self, now: float, saturation: Callable[[], float],
             unreserved: Callable[[], float] | None = None) -> StepResult:
        """Shed what expired, dispatch as much as the bands, quotas and saturation allow, then shed
        what a band with ``ttl_s`` 0 could not dispatch (``rejected-saturated``, or
        ``rejected-quota`` when its tenant was at ``tenant_max_in_flight``).

        Args:
            now: current time, seconds.
            saturation: the gate's saturation — in the router the least saturated engine's (room
                on some engine: < 1.0; NaN counts as saturated); called before every dispatch, so
                it may count the dispatches made so far in this step.
            unreserved: the saturation non-sheddable bands are gated on past their bypass (in the
                router: without the slot reserve kept for them); None: ``saturation``.

        Returns:
            What was shed, evicted and dispatched (dispatched tickets are now ``in_flight``).
        """
        result = StepResult(expired=self.expire(now))
        self._dispatch_all(now, saturation, unreserved or saturation, result)
        for band in self._bands:
            if band.config.ttl_s == 0 and band.queued:
                for ticket in list(band.queued.values()):
                    quota_bound = ticket._flow is not None and band.at_quota(ticket._flow)
                    self._unqueue(band, ticket, TicketState.DROPPED)
                    if quota_bound:
                        drop = self._reject(band, DropReason.QUOTA, "the tenant's in-flight quota is reached")
                    else:
                        drop = self._reject(band, DropReason.SATURATED, "no engine has room for the request now")
                    result.expired.append((ticket, drop))
        return result

    def _dispatch_all(self, now: float, saturation: Callable[[], float], unreserved: Callable[[], float],
                      result: StepResult) -> None:
        at_risk_s = self.config.deadline_at_risk_s
        while self.queued_requests:
            chosen: Ticket | None = None
            blocked_seen = False
            readings: dict[bool, bool] = {}  # sheddable -> saturated, each signal read once a dispatch
            for band in self._bands:
                if not band.queued:
                    continue
                if band.can_bypass():
                    saturated = False
                else:
                    sheddable = band.config.sheddable
                    if sheddable not in readings:
                        readings[sheddable] = not (saturation() if sheddable else unreserved()) < 1.0
                    saturated = readings[sheddable]
                if saturated:
                    if self.config.eviction and not blocked_seen and band.has_eligible():
                        blocked_seen = True  # the highest band held back by saturation alone
                        if band.config.ttl_s != 0:  # a band that never queues would not wait for the room
                            victim = self._maybe_evict(band, now)
                            if victim is not None:
                                result.evicted.append(victim)
                    continue
                chosen = band.select(now, at_risk_s)
                if chosen is not None:
                    self._dispatch(band, chosen, now)
                    result.dispatched.append(chosen)
                    break
            if chosen is None:
                break

    def drain(self, reason: DropReason, message: str, status: int = 429) -> list[tuple[Ticket, RequestDropped]]:
        """Drop every waiting ticket with ``reason`` (shutdown). Returns ``(ticket, drop)`` pairs."""
        out = []
        for ticket in list(self.queued_tickets()):
            band = self._by_objective[ticket.band.objective]
            self._unqueue(band, ticket, TicketState.DROPPED)
            drop = self._reject(band, reason, message)
            drop.status = status
            out.append((ticket, drop))
        return out

    # --- internals -----------------------------------------------------------------------------

    def _band(self, objective: str | None) -> _Band:
        return self._by_objective.get(objective, self._default) if objective is not None else self._default

    def _reject(self, band: _Band, reason: DropReason, what: str) -> RequestDropped:
        band.shed[reason] += 1
        return RequestDropped(reason, f"{band.config.objective} band: {what}",
                              retry_after_s=retry_after_for(reason, band.config))

    def _unqueue(self, band: _Band, ticket: Ticket, state: TicketState) -> None:
        del band.queued[ticket.seq]
        band.queued_bytes -= ticket.item.byte_size
        ticket.state = state
        flow = ticket._flow
        assert flow is not None
        flow.queued -= 1
        if flow.queued == 0:  # leaves the ring: O(1) on dispatch (it is at the front), O(flows) otherwise
            flow.heap.clear()
            flow.deficit = 0.0  # DRR: an emptied flow keeps no deficit
            if band.ring[0] is flow:
                band.ring.popleft()
            else:
                band.ring.remove(flow)
            flow.in_ring = False
        if state is not TicketState.IN_FLIGHT:
            band.forget_if_idle(flow)

    def _session_turn(self, session_id: str | None, now: float) -> int:
        """:meth:`turn_number`, restarting a session that went cold (its count back to 0)."""
        if not session_id:
            return 1
        turns = self._sessions.get(session_id)
        if turns is not None and self._went_cold(turns, now):
            turns.dispatched = 0
        return self.turn_number(session_id, now)

    def _session_dispatched(self, session_id: str) -> None:
        turns = self._sessions.get(session_id)
        if turns is None:
            turns = self._sessions[session_id] = _SessionTurns()
            while len(self._sessions) > self._turns.max_sessions:
                self._sessions.popitem(last=False)
        else:
            self._sessions.move_to_end(session_id)
        turns.dispatched += 1
        turns.in_flight += 1

    def _session_ended(self, session_id: str, now: float | None) -> None:
        turns = self._sessions.get(session_id)
        if turns is not None and turns.in_flight > 0:
            turns.in_flight -= 1
            if now is not None:
                turns.last_done = now

    def _dispatch(self, band: _Band, ticket: Ticket, now: float) -> None:
        self._unqueue(band, ticket, TicketState.IN_FLIGHT)
        if self._turns.enabled and ticket.item.session_id:
            self._session_dispatched(ticket.item.session_id)
        flow = ticket._flow
        if flow is not None and flow.in_ring and band.ring[0] is flow and flow.deficit < 1.0:
            band.ring.rotate(-1)  # its turn is spent: to the back
        ticket.dispatched_at = now
        band.in_flight[ticket.seq] = ticket
        assert ticket._flow is not None
        ticket._flow.in_flight += 1
        band.dispatched_total += 1
        self.dispatched_total += 1

    def _end_flight(self, ticket: Ticket, state: TicketState, now: float | None = None) -> None:
        if self._turns.enabled and ticket.item.session_id:
            self._session_ended(ticket.item.session_id, now if now is not None else ticket.dispatched_at)
        band = self._by_objective[ticket.band.objective]
        del band.in_flight[ticket.seq]
        ticket.state = state
        flow = ticket._flow
        assert flow is not None
        flow.in_flight -= 1
        band.forget_if_idle(flow)

    def _maybe_evict(self, blocked_band: _Band, now: float) -> Ticket | None:
        """Evict for ``blocked_band`` (held back by saturation alone) if allowed; returns the victim.

        The eviction is charged to the band's oldest eligible waiting item that has not had one yet
        (so each blocked item causes at most one); none left, or the last eviction less than
        ``eviction_interval_s`` ago → no eviction.
        """
        if now - self._last_eviction < self.config.eviction_interval_s:
            return None
        quota = blocked_band.config.tenant_max_in_flight
        blocked = next((t for t in blocked_band.queued.values() if not t.eviction_tried
                        and (quota is None or t._flow is None or t._flow.in_flight < quota)), None)
        if blocked is None:
            return None
        for band in reversed(self._bands):  # lowest priority first
            if band.config.priority >= blocked_band.config.priority:
                return None
            if band.config.sheddable and band.in_flight:
                victim = next(reversed(band.in_flight.values()))  # the most recently dispatched
                self._end_flight(victim, TicketState.EVICTED)
                band.shed[DropReason.EVICTED] += 1
                blocked.eviction_tried = True
                self._last_eviction = now
                return victim
        return None
