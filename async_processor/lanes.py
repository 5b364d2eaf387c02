"""Priority lanes: the bounded in-memory buffer between the queue and the dispatcher.

Lanes are objectives (:data:`~common.contracts.queue.LANE_PRIORITIES`: ``interactive`` 100,
``async`` 10, ``batch`` -10) served in strict priority order: a lower lane dispatches only when every
higher lane is empty, waiting out a retry backoff, or refused by a gate (e.g. a tenant quota).
Each lane has its own capacity, so a full ``batch`` share never stops the reader from taking
``interactive`` messages.

Inside a lane, fair shares (llm-d flow control's fairness id, served round-robin):

1. **Tenants** (``metadata.tenant``, "" being one tenant too) share the lane by weighted round
   robin: stride scheduling, the equivalent of deficit round-robin with a cost of one per attempt.
   Each tenant has a pass value; the ready tenant with the lowest pass goes next, and its pass
   grows by ``1 / weight`` (``weights``, default 1). A tenant that had nothing ready joins at the
   lane's virtual time (the pass of the last tenant served), so idling banks no credit and an old
   backlog cannot hold the lane: a tenant that arrives behind a 1,000-line backlog is served next.
2. **Batches of a tenant** (``metadata.batch_id``; work without one is one flow per tenant) share
   that tenant's turns the same way, with equal weights.
3. **Inside one (tenant, batch) flow**: earliest deadline first, ties in arrival order (FIFO).

A deadline at risk overrides fairness: when ``at_risk_s`` > 0, ready work whose deadline is less
than ``at_risk_s`` seconds away goes first, earliest deadline first (it is still charged to its
tenant's share).

Cost: :meth:`LaneBuffer.push` is O(log n) plus an insertion into its flow's sorted list;
:meth:`LaneBuffer.pop` looks at the head of each ready flow, O(flows log flows), not at every item:
``admits`` is asked about a flow's head only, so it must decide by what a flow's items share (lane,
tenant, batch), as the processor's gates do. Work in a retry backoff waits in a heap by
``not_before`` and joins its flow when due.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from async_processor.backends.base import Delivery
from common.contracts.queue import LANE_PRIORITIES, RequestMessage


@dataclass(eq=False)
class Work:
    """One admitted request held by the processor.

    ``attempts``: HTTP attempts made so far (a fast refusal is not one). ``sends``: POSTs started,
    refusals included (1 for the first send; more are re-sends). ``not_before``: monotonic seconds before which it is not
    dispatched (retry backoff). ``last_status`` / ``last_body``: the last retryable HTTP answer, given
    back as the result if the deadline ends the retries. ``gated_by``: the kind of the gate holding
    it back now ("" when none), so :class:`~async_processor.gates.AllGates` counts a deny once.
    ``taken_over``: its claim was found lost to another processor; it is dropped, never finished.
    ``started``: an attempt of it was dispatched (a held refusal included), so its lane wait is over.
    """

    request: RequestMessage
    delivery: Delivery
    lane: str
    seq: int = 0
    attempts: int = 0
    sends: int = 0
    not_before: float = 0.0
    last_status: int = 0
    last_body: bytes = b""
    gated_by: str = ""
    taken_over: bool = False
    started: bool = False
    body: bytes = field(default=b"", repr=False)

    @property
    def priority(self) -> int:
        """The lane's priority band."""
        return LANE_PRIORITIES.get(self.lane, 0)

    @property
    def tenant(self) -> str:
        """The request's tenant (``metadata["tenant"]``, may be empty)."""
        return self.request.metadata.get("tenant", "")

    @property
    def batch_id(self) -> str:
        """The request's batch (``metadata["batch_id"]``, "" when none)."""
        return self.request.metadata.get("batch_id", "")


def _key(work: Work) -> tuple[int, int]:
    return (work.request.deadline, work.seq)


class _Flow:
    """One (tenant, batch) flow: ready items sorted by (deadline, arrival); ``held`` counts its
    items in a backoff too."""

    __slots__ = ("items", "pass_", "held", "order")

    def __init__(self, pass_: float, order: int):
        self.items: list[Work] = []
        self.pass_ = pass_
        self.held = 0
        self.order = order


class _Tenant:
    __slots__ = ("flows", "pass_", "vtime", "weight", "ready", "held", "order")

    def __init__(self, pass_: float, weight: float, order: int):
        self.flows: dict[str, _Flow] = {}
        self.pass_ = pass_
        self.vtime = 0.0
        self.weight = weight
        self.ready = 0
        self.held = 0
        self.order = order


class _Lane:
    __slots__ = ("capacity", "tenants", "vtime", "ready", "size")

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.tenants: dict[str, _Tenant] = {}
        self.vtime = 0.0
        self.ready = 0
        self.size = 0


_READY, _WAITING = True, False


class LaneBuffer:
    """Held work per lane, in fair-share order (module docstring).

    ``capacity``: how many items the reader may fill each lane to (:meth:`free`), one number for
    every lane or a mapping lane -> number (lanes not named get 0). :meth:`push` always accepts, so
    work coming back from a retry is never dropped. ``weights``: tenant -> weight (> 0; default 1).
    ``at_risk_s``: work whose deadline is nearer than this goes first (0: never). Raises
    ``ValueError`` for an unknown lane name or a weight <= 0.
    """

    def __init__(self, lanes: Sequence[str], capacity: int | Mapping[str, int], *,
                 weights: Mapping[str, float] | None = None, at_risk_s: float = 0.0):
        unknown = [lane for lane in lanes if lane not in LANE_PRIORITIES]
        if unknown:
            raise ValueError(f"unknown lanes {unknown}")
        self.weights = dict(weights or {})
        bad = {t: w for t, w in self.weights.items() if not (w > 0 and math.isfinite(w))}
        if bad:
            raise ValueError(f"tenant weights must be finite and > 0, got {bad}")
        self.at_risk_s = at_risk_s
        self.order = sorted(lanes, key=lambda lane: -LANE_PRIORITIES[lane])
        sizes = {lane: capacity for lane in self.order} if isinstance(capacity, int) else dict(capacity)
        self.capacity = {lane: sizes.get(lane, 0) for lane in self.order}
        self._lanes: dict[str, _Lane] = {lane: _Lane(self.capacity[lane]) for lane in self.order}
        self._where: dict[Work, bool] = {}  # held work -> ready (in its flow) or waiting (backoff)
        self._waiting: list[tuple[float, int, Work]] = []  # (not_before, push number, work), lazy
        self._deadlines: list[tuple[int, int, Work]] = []  # (deadline, push number, work), lazy
        self._seq = itertools.count()
        self._pushes = itertools.count()
        self._orders = itertools.count()

    def __len__(self) -> int:
        return len(self._where)

    def __iter__(self) -> Iterator[Work]:
        return iter(list(self._where))

    def depth(self, lane: str) -> int:
        """Items held in ``lane``, ready or in a backoff (0 for a lane not read)."""
        held = self._lanes.get(lane)
        return held.size if held is not None else 0

    def free(self, lane: str) -> int:
        """How many more items the reader may take from ``lane``'s queue now (>= 0; 0 for a lane
        not read)."""
        held = self._lanes.get(lane)
        return max(0, held.capacity - held.size) if held is not None else 0

    # ------------------------------------------------------------ adding

    def push(self, work: Work) -> None:
        """Hold ``work`` (a retried item keeps its first arrival number); it is ready at once when
        its ``not_before`` is 0, else once :meth:`pop` is asked at or after ``not_before``."""
        if not work.seq:
            work.seq = next(self._seq) + 1
        lane = self._lanes[work.lane]
        tenant = lane.tenants.get(work.tenant)
        if tenant is None:
            tenant = lane.tenants[work.tenant] = _Tenant(lane.vtime, self.weights.get(work.tenant, 1.0),
                                                         next(self._orders))
        flow = tenant.flows.get(work.batch_id)
        if flow is None:
            flow = tenant.flows[work.batch_id] = _Flow(tenant.vtime, next(self._orders))
        lane.size += 1
        tenant.held += 1
        flow.held += 1
        number = next(self._pushes)
        heapq.heappush(self._deadlines, (work.request.deadline, number, work))
        if work.not_before > 0:
            self._where[work] = _WAITING
            heapq.heappush(self._waiting, (work.not_before, number, work))
        else:
            self._ready(work, lane, tenant, flow)
        self._compact()

    def _ready(self, work: Work, lane: _Lane, tenant: _Tenant, flow: _Flow) -> None:
        if not tenant.ready:  # (re)joins the round at the lane's virtual time: no banked credit
            tenant.pass_ = max(tenant.pass_, lane.vtime)
        if not flow.items:
            flow.pass_ = max(flow.pass_, tenant.vtime)
        bisect.insort(flow.items, work, key=_key)
        self._where[work] = _READY
        tenant.ready += 1
        lane.ready += 1

    def _promote(self, now: float) -> None:
        """Move work whose backoff ended by ``now`` into its flow."""
        waiting = self._waiting
        while waiting and waiting[0][0] <= now:
            not_before, _, work = heapq.heappop(waiting)
            if self._where.get(work) is _WAITING and work.not_before == not_before:
                lane = self._lanes[work.lane]
                tenant = lane.tenants[work.tenant]
                self._ready(work, lane, tenant, tenant.flows[work.batch_id])

    def _compact(self) -> None:
        """Drop stale heap entries once they outnumber the live ones (bounded memory)."""
        live = len(self._where)
        if len(self._deadlines) > 2 * live + 64:
            self._deadlines = [e for e in self._deadlines if e[2] in self._where]
            heapq.heapify(self._deadlines)
        if len(self._waiting) > 2 * live + 64:
            self._waiting = [e for e in self._waiting
                             if self._where.get(e[2]) is _WAITING and e[2].not_before == e[0]]
            heapq.heapify(self._waiting)

    # ------------------------------------------------------------ taking

    def pop(self, now: float, admits: Callable[[Work], bool], now_unix: float | None = None) -> Work | None:
        """The next item to start: lanes in priority order; in a lane, ready work whose deadline is
        at risk (earliest first), then fair-share order (module docstring). Only items whose
        ``not_before`` is reached (``now``: monotonic seconds) and that ``admits`` accepts are
        taken; None if there is none. ``now_unix``: the wall clock the deadlines are compared to
        (default ``time.time()``; only read when ``at_risk_s`` > 0)."""
        self._promote(now)
        horizon = -math.inf  # deadlines before it are at risk
        if self.at_risk_s > 0:
            horizon = (time.time() if now_unix is None else now_unix) + self.at_risk_s
            if self._earliest_deadline() >= horizon:  # nothing held is at risk: skip the scan
                horizon = -math.inf
        for name in self.order:
            lane = self._lanes[name]
            if not lane.ready:
                continue
            tenants = [t for t in lane.tenants.values() if t.ready]
            if horizon > -math.inf:
                heads = sorted((f.items[0] for t in tenants for f in t.flows.values()
                                if f.items and f.items[0].request.deadline < horizon), key=_key)
                for work in heads:
                    if admits(work):
                        return self._take_ready(work, lane)
            for tenant in sorted(tenants, key=lambda t: (t.pass_, t.order)):
                flows = sorted((f for f in tenant.flows.values() if f.items), key=lambda f: (f.pass_, f.order))
                for flow in flows:
                    if admits(flow.items[0]):
                        return self._take_ready(flow.items[0], lane)
        return None

    def _earliest_deadline(self) -> float:
        """The earliest deadline held, ready or not (inf when empty)."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][2] not in self._where:
            heapq.heappop(deadlines)
        return deadlines[0][0] if deadlines else math.inf

    def _take_ready(self, work: Work, lane: _Lane) -> Work:
        """Remove the ready head ``work`` and charge one turn to its tenant and flow."""
        tenant = lane.tenants[work.tenant]
        flow = tenant.flows[work.batch_id]
        lane.vtime = max(lane.vtime, tenant.pass_)
        tenant.pass_ += 1.0 / tenant.weight
        tenant.vtime = max(tenant.vtime, flow.pass_)
        flow.pass_ += 1.0
        self._forget(work)
        return work

    def _forget(self, work: Work) -> None:
        """Remove held ``work`` from every structure but the lazy heaps."""
        state = self._where.pop(work)
        lane = self._lanes[work.lane]
        tenant = lane.tenants[work.tenant]
        flow = tenant.flows[work.batch_id]
        if state is _READY:
            items = flow.items
            i = bisect.bisect_left(items, _key(work), key=_key)
            while items[i] is not work:
                i += 1
            del items[i]
            tenant.ready -= 1
            lane.ready -= 1
        lane.size -= 1
        flow.held -= 1
        tenant.held -= 1
        if not flow.held:
            del tenant.flows[work.batch_id]
        if not tenant.held:
            del lane.tenants[work.tenant]

    def expired(self, now_unix: float) -> list[Work]:
        """Remove and return items whose deadline (Unix seconds) is at or before ``now_unix``."""
        out: list[Work] = []
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now_unix:
            work = heapq.heappop(deadlines)[2]
            if work in self._where:
                self._forget(work)
                out.append(work)
        return out

    def remove_batches(self, batch_ids: set[str]) -> list[Work]:
        """Remove and return held items whose ``metadata.batch_id`` is in ``batch_ids``."""
        return self.remove([w for w in self._where if w.batch_id in batch_ids])

    def remove(self, works: Sequence[Work]) -> list[Work]:
        """Remove and return those of ``works`` held here."""
        out = [w for w in works if w in self._where]
        for work in out:
            self._forget(work)
        self._compact()
        return out

    def next_ready_at(self, now: float) -> float | None:
        """Smallest ``not_before`` still in the future (monotonic seconds), or None."""
        self._promote(now)
        waiting = self._waiting
        while waiting:
            not_before, _, work = waiting[0]
            if self._where.get(work) is _WAITING and work.not_before == not_before:
                return not_before
            heapq.heappop(waiting)
        return None

    def drain(self) -> list[Work]:
        """Remove and return everything."""
        out = list(self._where)
        self._where.clear()
        self._waiting.clear()
        self._deadlines.clear()
        for lane in self._lanes.values():
            lane.tenants.clear()
            lane.ready = lane.size = 0
        return out
