"""The pump: queue -> lanes -> gates -> POST to the router -> publish result -> ack.

One :class:`Processor` runs five asyncio tasks around one :class:`~async_processor.lanes.LaneBuffer`:

- **reader**: receives from each lane in priority order while that lane's share of the buffer has
  room (a full ``batch`` share never stops ``interactive`` from being read); decodes; an
  undecodable message gets an ``INVALID_REQUEST`` result and is dead-lettered; a message delivered
  more than ``max_deliveries`` times gets an ``INFERENCE_ERROR`` result and is dead-lettered; the
  rest are claimed by id (:meth:`~async_processor.backends.base.QueueBackend.admit`): duplicates
  of finished ids are acked, of running ids handed back, of cancelled batches answered ``CANCELLED``.
- **dispatcher**: answers ``DEADLINE_EXCEEDED`` for held work past its deadline without dispatching,
  and starts an attempt for each item the gates admit: highest lane first (lower lanes never take
  the higher lanes' reserved slots), then deadlines at risk, then fair shares over tenants and
  their batches, earliest deadline first inside one (:mod:`async_processor.lanes`).
- **attempts**: one POST ``{router_url}{endpoint}`` each, with the llm-d headers; a retryable answer
  releases the gate slot and puts the work back with a backoff (:mod:`async_processor.retry`).
  The router's fast refusal of sheddable work (429 ``rejected-saturated``), and its eviction of a
  running one for higher-priority work (429 ``evicted``), is held instead: back in
  the buffer after its ``Retry-After`` (plus jitter), no attempt counted, no backoff growth, and
  the saturation gate shut until its next reading of the router, so the lane does not hammer it.
  429/503 retry until the deadline; a server error or no answer at all ends the request with its
  last answer after ``max_error_attempts`` (a poison request never runs to its deadline). Each
  attempt's timeout follows the request (:mod:`async_processor.attempt_timeout`: a base plus a
  bound per output token asked for, or an idle bound for a stream, within the deadline); an
  attempt that timed out after reaching the router is not run again: it ends with
  ``INFERENCE_TIMEOUT`` (or the router's 504 ``upstream_timeout``).
- **settler**: publishes results in batches (which marks their ids done), then acks (never before).
  A publish that fails (Redis down, restarting) keeps its results and is tried again, backing off
  from :data:`PUBLISH_RETRY_MIN_S` to :data:`PUBLISH_RETRY_MAX_S`: an answer is never run again on
  an engine for want of Redis. Only on stop are results still unpublished handed back.
- **lease keeper** and **gate refresher**: extend leases of held messages every ``lease/3`` seconds,
  re-read gate signals every ``saturation_poll_s``.
- **cancel watcher**: every ``cancel_poll_s``, held work of batches whose cancel marker appeared
  after admission, and of llm-d-async requests cancelled since (``request-cancel:{id}`` holding
  their ``request_token``), is dropped with a ``CANCELLED`` result (it never reaches the router).

On stop (SIGTERM in the CLI): the reader stops, held work not started is handed back at once, work
in flight may finish within ``grace_s`` and is then cancelled and handed back.

One result per id across processors: a processor that stalled past its lease (SIGSTOP, a blocked
loop) may find its work taken over by another. The backend's lease extension
(:meth:`~async_processor.backends.base.QueueBackend.extend`) reports claims lost; held work whose lease is older than :data:`RECHECK_AFTER` of the lease is
re-checked before it is dispatched and before its result is published; lost work is dropped (not
run, not published, not acked: it belongs to the other processor), counted and logged
(``taken_over``). The backend refuses a result of an id done already (Redis: or claimed by another
processor, in the publishing script itself); a refused result's message is not acked either.

Health (:meth:`Processor.health`, ``/health``): unhealthy while stopping, while the last receive
round failed (Redis down, or restarted empty until the group is made again), or when no round
completed for ``health_stall_s`` (a frozen broker).

Every count, series and per-request log line goes through the observer
(:class:`~async_processor.observer.ProcessorObserver`); the control flow here keeps no books.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from async_processor.attempt_timeout import attempt_timeout
from async_processor.backends.base import Admission, Delivery, QueueBackend
from async_processor.errors import ProcessorError
from async_processor.gates import (
    AllGates,
    ConcurrencyGate,
    Gate,
    SaturationGate,
    TenantQuotaGate,
    effective_reserves,
)
from async_processor.lanes import LaneBuffer, Work
from async_processor.metrics import ProcessorMetrics
from async_processor.observer import ProcessorObserver, Shed
from async_processor.retry import (
    backoff_delay,
    is_held_refusal,
    is_retryable,
    parse_retry_after,
    saturated_hold,
)
from async_processor.router_client import NoAnswer, RouterClient, make_router_client
from async_processor.running import RedisRunningReporter, RunningReporter
from async_processor.settings import ProcessorSettings
from common.contracts.queue import (
    ErrorCode,
    InvalidMessage,
    RequestMessage,
    ResultMessage,
    decode_request,
    error_result,
    http_result,
    invalid_request_result,
    with_tenant,
)

log = logging.getLogger(__name__)

RECHECK_AFTER = 0.5
"""Held work whose lease was last renewed longer ago than this fraction of the lease (the keeper
renews at a third) has its claim confirmed before dispatch and before its result is published."""

PUBLISH_RETRY_MIN_S = 0.5
PUBLISH_RETRY_MAX_S = 5.0
"""Waits between tries of a result publish that failed (doubling from the first to the second): a
Redis restart takes a second or two, and a longer outage is not hammered."""

NOT_NOW = frozenset({429, 503})
"""The router's "not now" answers: retried until the deadline, never counted against
``max_error_attempts``."""

#: Header names sent to the router (llm-d names; shared/contracts/queue-and-headers.md).
OBJECTIVE_HEADER = "x-llm-d-inference-objective"
FAIRNESS_HEADER = "x-llm-d-inference-fairness-id"
SLO_TTFT_HEADER = "x-llm-d-slo-ttft-ms"
SESSION_HEADER = "x-session-id"
TRACEPARENT_HEADER = "traceparent"
#: The shared secret that makes the router honour the fairness id and objective (router/trust.py).
ROUTER_TOKEN_HEADER = "x-backfill-router-token"


def router_timed_out(status: int, body: bytes) -> bool:
    """The router's answer says its own attempt timeout fired (504 ``upstream_timeout``): the
    engine had the request all that time, so it is not run again."""
    if status != 504:
        return False
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") == "upstream_timeout"


@dataclass(eq=False)
class _Settle:
    delivery: Delivery
    result: ResultMessage | None  # None: ack only (a duplicate of a finished id)
    queue: str = ""
    request_id: str = ""  # the decoded id, its claim released on a failed publish ("" for undecodable messages)
    dead_reason: str = ""  # dead-letter instead of ack
    work: Work | None = None  # the held work it ends (its claim re-checked before publishing)


#: Framing and hop-by-hop headers a message may not set (the HTTP client writes its own).
NOT_FORWARDED = frozenset({"host", "content-length", "transfer-encoding", "connection"})


def request_headers(request: RequestMessage, lane: str, time_left_s: float,
                    router_token: str | None = None) -> dict[str, str]:
    """Headers of one attempt, names in lower case: the message's ``headers`` (less
    :data:`NOT_FORWARDED` and any ``x-backfill-router-token``), then the objective
    (``metadata.objective`` or the lane), the fairness id (``metadata.tenant``, replacing any
    producer value), the ms left to the deadline, ``x-session-id`` and ``traceparent`` from
    metadata when present, and ``router_token`` (the processor's ``router_token`` setting) as
    ``x-backfill-router-token`` when given: without it the router ignores the fairness id and
    objective (``router/trust.py``)."""
    headers = {k.lower(): v for k, v in request.headers.items()
               if k.lower() not in NOT_FORWARDED and k.lower() != ROUTER_TOKEN_HEADER}
    headers["content-type"] = "application/json"
    meta = request.metadata
    headers[OBJECTIVE_HEADER] = meta.get("objective") or lane
    if meta.get("tenant"):
        headers[FAIRNESS_HEADER] = meta["tenant"][:256]
    headers[SLO_TTFT_HEADER] = str(max(0, int(time_left_s * 1000)))
    if meta.get("session_id"):
        headers[SESSION_HEADER] = meta["session_id"]
    if meta.get("traceparent"):
        headers[TRACEPARENT_HEADER] = meta["traceparent"]
    if router_token:
        headers[ROUTER_TOKEN_HEADER] = router_token
    return headers


def build_gates(settings: ProcessorSettings, client: RouterClient) -> AllGates:
    """The gates the settings ask for: always the fixed concurrency with the lanes' reserved slots
    (:func:`~async_processor.gates.effective_reserves` of ``reserved_slots``); a tenant quota when
    ``tenant_limit`` > 0; the router saturation gate when ``saturation_gate``."""
    reserves = effective_reserves(settings.concurrency, settings.lanes, settings.reserved_slots)
    if reserves != effective_reserves(2**31, settings.lanes, settings.reserved_slots):
        log.warning("reserved slots cut to leave the lowest lane a slot",
                    extra={"action": "reserves_cut", "reserved": reserves, "concurrency": settings.concurrency})
    gates: list[Gate] = [ConcurrencyGate(settings.concurrency, reserves)]
    if settings.tenant_limit:
        gates.append(TenantQuotaGate(settings.tenant_limit))
    if settings.saturation_gate:
        gates.append(SaturationGate(client, settings.router_url, max_age_s=settings.saturation_max_age_s))
    return AllGates(gates)


class Processor:
    """See the module docstring. ``backend`` must be started; ``http`` (the router client, see
    :mod:`async_processor.router_client`) and ``backend`` belong to the caller. ``metrics``: the
    observer every count, series and per-request log line goes to
    (:class:`~async_processor.metrics.ProcessorMetrics` on a private registry by default)."""

    def __init__(self, settings: ProcessorSettings, backend: QueueBackend, http: RouterClient,
                 gate: Gate | None = None, *, rng: random.Random | None = None,
                 metrics: ProcessorObserver | None = None, running: RunningReporter | None = None):
        self.settings = settings
        self._router_token = settings.router_token.get_secret_value() if settings.router_token else None
        self.backend = backend
        self.http = http
        self.gate = gate or build_gates(settings, http)
        self.rng = rng or random.Random()
        self.buffer = LaneBuffer(settings.lanes, settings.lane_capacity(), weights=settings.tenant_weights,
                                 at_risk_s=settings.deadline_at_risk_s)
        self.router_url = settings.router_url.rstrip("/")
        self.in_flight: dict[Work, asyncio.Task] = {}
        self._settle: list[_Settle] = []
        self._settle_event = asyncio.Event()
        self._wake = asyncio.Event()
        self._stopping = False
        self._closed = asyncio.Event()
        self._receive_ok_at = time.monotonic()
        self._receive_error = ""
        self.metrics: ProcessorObserver = metrics or ProcessorMetrics()
        self.metrics.watch(self)
        self.running = running

    @property
    def counts(self) -> Counter[str]:
        """The observer's tally of outcomes (``success``, ``http_error``, ``retried``, ``duplicate``, …;
        see :mod:`async_processor.observer`)."""
        return self.metrics.counts

    def health(self) -> tuple[bool, str]:
        """``(True, "")`` while it consumes; else ``(False, why)``: stopping, the last receive round
        failed, or none completed within ``health_stall_s``."""
        if self._stopping:
            return False, "stopping"
        if self._receive_error:
            return False, f"receive failing: {self._receive_error}"
        stalled = time.monotonic() - self._receive_ok_at
        if stalled > self.settings.health_stall_s:
            return False, f"no receive completed for {stalled:.0f} s"
        return True, ""

    # ---------------------------------------------------------------- run

    async def run(self, stop: asyncio.Event) -> None:
        """Pump until ``stop`` is set, then shut down within ``grace_s`` (see module docstring).

        Loops end on flags rather than by cancellation (redis-py may swallow a cancellation that
        lands inside a command); a task still running a second after its flag is cancelled."""
        helpers = [asyncio.create_task(self._settler(), name="settler"),
                   asyncio.create_task(self._lease_keeper(), name="lease-keeper"),
                   asyncio.create_task(self._gate_refresher(), name="gate-refresher"),
                   asyncio.create_task(self._cancel_watcher(), name="cancel-watcher")]
        if self.running is not None:
            helpers.append(asyncio.create_task(self._running_reporter(self.running), name="running-reporter"))
        reader = asyncio.create_task(self._reader(stop), name="reader")
        dispatcher = asyncio.create_task(self._dispatcher(), name="dispatcher")
        try:
            await stop.wait()
        finally:
            self._stopping = True
            self._wake.set()
            await _finish_tasks([reader, dispatcher])
            await self._hand_back(self.buffer.drain())
            if self.in_flight:
                await asyncio.wait(list(self.in_flight.values()), timeout=self.settings.grace_s)
            leftover = list(self.in_flight)
            await _finish_tasks(list(self.in_flight.values()), patience_s=0)
            await self._hand_back(leftover + self.buffer.drain())
            self._closed.set()
            self._settle_event.set()
            await _finish_tasks(helpers)
            await self._flush()

    async def _hand_back(self, works: Sequence[Work]) -> None:
        if not works:
            return
        self.metrics.handed_back(len(works))
        try:
            await self.backend.release([w.request.id for w in works])
            await self.backend.nack([w.delivery for w in works])
        except ProcessorError as exc:
            log.warning("hand back failed; leases will lapse", extra={"action": "hand_back_failed", "error": str(exc)})

    # ---------------------------------------------------------------- reader

    async def _reader(self, stop: asyncio.Event) -> None:
        settings = self.settings
        while not stop.is_set():
            got = 0
            try:
                for lane in self.buffer.order:
                    free = self.buffer.free(lane)
                    if free <= 0:  # this lane's share is full; the others are still read
                        continue
                    deliveries = await self.backend.receive(lane, min(free, settings.receive_batch),
                                                            settings.lease_s)
                    got += len(deliveries)
                    await self._intake(deliveries)
            except ProcessorError as exc:
                self._receive_error = str(exc) or type(exc).__name__
                log.warning("receive failed", extra={"action": "receive_failed", "error": str(exc)})
                await asyncio.sleep(min(1.0, settings.lease_s / 4))
                continue
            self._receive_ok_at, self._receive_error = time.monotonic(), ""
            if not got and not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), settings.poll_interval_s)

    async def _intake(self, deliveries: Sequence[Delivery]) -> None:
        settings = self.settings
        fresh: list[tuple[RequestMessage, Delivery]] = []
        held: dict[str, Work] | None = None
        for d in deliveries:
            try:
                request = with_tenant(decode_request(d.body), settings.tenant_attribute)
            except InvalidMessage as exc:
                self.metrics.shed(d.lane, Shed.INVALID)
                self._add_settle(_Settle(d, invalid_request_result(exc), exc.result_queue_name, "",
                                         dead_reason=ErrorCode.INVALID_REQUEST))
                continue
            d.request_id = request.id
            if d.delivery_count > 1:  # a redelivery of work held here (its lease lapsed while we stalled)
                if held is None:
                    held = {w.request.id: w for w in (*self.buffer, *self.in_flight) if not w.taken_over}
                mine = held.get(request.id)
                if mine is not None and mine.lane == d.lane:
                    mine.delivery = d  # the newest handle; the lease keeper renews it
                    continue
            if d.delivery_count > settings.max_deliveries:
                self.metrics.shed(d.lane, Shed.DEAD_LETTERED)
                message = f"dead-lettered after {d.delivery_count - 1} deliveries"
                self._add_settle(_Settle(d, error_result(request.id, ErrorCode.INFERENCE_ERROR, message,
                                                         request.metadata),
                                         request.result_queue_name, request.id, dead_reason=message))
                continue
            fresh.append((request, d))
        if not fresh:
            return
        admissions = await self.backend.admit([r for r, _ in fresh], settings.lease_s)
        running: list[Delivery] = []
        for (request, d), admission in zip(fresh, admissions):
            if admission is Admission.NEW:
                self.buffer.push(Work(request, d, d.lane))
            elif admission is Admission.DONE:
                self.metrics.duplicate(d.lane)
                self._add_settle(_Settle(d, None))
            elif admission is Admission.CANCELLED:
                self.metrics.shed(d.lane, Shed.CANCELLED)
                reason = "cancelled" if request.request_token else "batch cancelled"
                self._add_settle(_Settle(d, error_result(request.id, ErrorCode.CANCELLED, reason,
                                                         request.metadata), request.result_queue_name,
                                         request.id))
            else:
                running.append(d)
        if running:
            self.metrics.handed_back(len(running))
            await self.backend.nack(running, delay_s=settings.lease_s / 2)
        self._wake.set()

    # ---------------------------------------------------------------- dispatcher

    async def _dispatcher(self) -> None:
        while not self._stopping:
            for work in self.buffer.expired(time.time()):
                self._finish(work, self._deadline_result(work))
            now, now_unix = time.monotonic(), time.time()
            while (ready := self.buffer.pop(now, self.gate.admits, now_unix)) is not None:
                self.gate.acquire(ready)
                ready.sends += 1
                self.metrics.dispatched(ready)
                ready.started = True
                self.in_flight[ready] = asyncio.create_task(self._checked_attempt(ready))
            next_at = self.buffer.next_ready_at(now)
            timeout = 0.1 if next_at is None else max(0.001, min(0.1, next_at - now))
            self._wake.clear()
            if self._stopping:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _deadline_result(self, work: Work) -> ResultMessage:
        self.metrics.shed(work.lane, Shed.DEADLINE_EXCEEDED)
        if work.last_status:  # retries ran out: the last answer is the most useful result
            return http_result(work.request, work.last_status, work.last_body)
        return error_result(work.request.id, ErrorCode.DEADLINE_EXCEEDED, "deadline exceeded",
                            work.request.metadata)

    def _finish(self, work: Work, result: ResultMessage) -> None:
        if work.taken_over:
            return
        self._add_settle(_Settle(work.delivery, result, work.request.result_queue_name, work.request.id,
                                 work=work))

    def _lease_stale(self, delivery: Delivery) -> bool:
        return time.monotonic() - delivery.extended_at > self.settings.lease_s * RECHECK_AFTER

    async def _confirm(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        """Renew these leases now; returns those lost (an extension that fails loses nothing: the
        publishing side still refuses a second result)."""
        if not deliveries:
            return []
        now = time.monotonic()  # the renewed lease runs from about now (never later)
        try:
            lost = await self.backend.extend(deliveries, self.settings.lease_s)
        except ProcessorError as exc:
            log.warning("lease extension failed", extra={"action": "extend_failed", "error": str(exc)})
            return []
        for d in deliveries:
            if d not in lost:
                d.extended_at = now
        return lost

    def _drop_taken_over(self, lost: Sequence[Delivery]) -> None:
        """Drop held and in-flight work of these deliveries (cancelling attempts other than the
        current task's): another processor holds them now."""
        ids = {id(d) for d in lost}
        current = asyncio.current_task()
        for work in self.buffer.remove([w for w in self.buffer if id(w.delivery) in ids]):
            self._mark_taken_over(work, "held")
        for work, task in list(self.in_flight.items()):
            if id(work.delivery) in ids and self._mark_taken_over(work, "held" if task is current else "in_flight"):
                if task is not current:
                    task.cancel()
        self._wake.set()

    def _mark_taken_over(self, work: Work, stage: str) -> bool:
        """Mark ``work`` as another processor's now and count it once (``stage``: where it was
        found: ``held``, ``in_flight`` or ``result``); False when it was marked already."""
        if work.taken_over:
            return False
        work.taken_over = True
        self.metrics.taken_over(work, stage)
        return True

    async def _checked_attempt(self, work: Work) -> None:
        """:meth:`_attempt`, after confirming the claim of work whose lease is stale."""
        if self._lease_stale(work.delivery) and await self._confirm([work.delivery]):
            self._drop_taken_over([work.delivery])
            self.gate.release(work)
            self.in_flight.pop(work, None)
            self._wake.set()
            return
        await self._attempt(work)

    async def _attempt(self, work: Work) -> None:
        request = work.request
        released = False
        try:
            time_left = request.deadline - time.time()
            if time_left <= 0:
                self._finish(work, self._deadline_result(work))
                return
            if not work.body:
                work.body = orjson.dumps(request.payload)
            work.attempts += 1
            bound = attempt_timeout(request.payload, time_left, base_s=self.settings.request_timeout_s,
                                    per_token_s=self.settings.attempt_per_token_s)
            status, body, retry_after, dropped_reason, timed_out = 0, b"", None, None, False
            started = time.monotonic()
            try:
                answer = await self.http.post(self.router_url + request.endpoint, work.body,
                                              request_headers(request, work.lane, time_left, self._router_token),
                                              bound.total_s, bound.idle_s)
                status, body = answer.status, answer.body
                retry_after = parse_retry_after(answer.retry_after)
                dropped_reason = answer.dropped_reason
            except NoAnswer as exc:
                body = str(exc).encode()
                timed_out = exc.timed_out
            elapsed = time.monotonic() - started
            self.metrics.attempt_finished(work.lane, status, elapsed)
            if is_held_refusal(status, dropped_reason):
                # the router would have queued it, or evicted it for higher-priority work: not an
                # attempt, no backoff growth, and the saturation gate shuts until it reads the
                # router again
                work.attempts -= 1
                hold = saturated_hold(request.deadline - time.time(), retry_after, rng=self.rng)
                if hold is None:
                    self._finish(work, self._deadline_result(work))
                    return
                self.gate.refused(work)
                self.metrics.held_saturated(work.lane)
                released = self._put_back(work, hold)
                return
            if not is_retryable(status) or router_timed_out(status, body):
                # an answer, or the router's own attempt timeout (504 upstream_timeout): final
                self.metrics.answered(work.lane, status)
                self._finish(work, http_result(request, status, body))
                return
            if timed_out and not (bound.capped and elapsed >= bound.total_s * 0.99):
                # the router had the request for the whole attempt bound: running it again from
                # scratch would cost as much again, so it ends here (the deadline path is below)
                self.metrics.answered(work.lane, status)
                self._finish(work, error_result(
                    request.id, ErrorCode.INFERENCE_TIMEOUT,
                    f"no answer within the attempt timeout of "
                    f"{bound.describe(self.settings.request_timeout_s, self.settings.attempt_per_token_s)}; "
                    f"not retried: {body.decode(errors='replace')}", request.metadata))
                return
            if status not in NOT_NOW and work.attempts >= self.settings.max_error_attempts:
                # a poison request: end it with its last answer instead of retrying to the deadline
                self.metrics.answered(work.lane, status)
                self._finish(work, http_result(request, status, body) if status else error_result(
                    request.id, ErrorCode.INFERENCE_ERROR, f"no answer after {work.attempts} attempts: "
                    f"{body.decode(errors='replace')}", request.metadata))
                return
            if status:
                work.last_status, work.last_body = status, body
            delay = backoff_delay(work.attempts, request.deadline - time.time(), retry_after,
                                  base_s=self.settings.backoff_base_s, cap_s=self.settings.backoff_cap_s,
                                  rng=self.rng)
            if delay is None:
                if not status:
                    self.metrics.shed(work.lane, Shed.DEADLINE_EXCEEDED)
                    self._finish(work, error_result(request.id, ErrorCode.INFERENCE_ERROR,
                                                    f"no answer before the deadline: {body.decode()}",
                                                    request.metadata))
                else:
                    self._finish(work, self._deadline_result(work))
                return
            self.metrics.retried(work.lane, status)
            released = self._put_back(work, delay)
        finally:
            if not released:
                self.gate.release(work)
                self.in_flight.pop(work, None)
                self._wake.set()

    def _put_back(self, work: Work, delay_s: float) -> bool:
        """Release ``work``'s slot and hold it again for ``delay_s`` seconds; returns True."""
        self.gate.release(work)
        del self.in_flight[work]
        work.not_before = time.monotonic() + delay_s
        self.buffer.push(work)
        self._wake.set()
        return True

    # ---------------------------------------------------------------- settling

    def _add_settle(self, item: _Settle) -> None:
        if item.result is not None:
            self.metrics.result(item.delivery.lane, item.result)
        self._settle.append(item)
        self._settle_event.set()

    async def _settler(self) -> None:
        """Publish and ack settled work as it comes; while publishing fails (Redis down or
        restarting), keep the results and try again after :data:`PUBLISH_RETRY_MIN_S`, doubling up
        to :data:`PUBLISH_RETRY_MAX_S`, until they are out or the processor closes."""
        delay = 0.0
        while not self._closed.is_set():
            if delay:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._closed.wait(), delay)
                if self._closed.is_set():
                    return
            else:
                await self._settle_event.wait()
                self._settle_event.clear()
            published = await self._flush(hand_back_on_failure=False)
            delay = 0.0 if published else min(max(2 * delay, PUBLISH_RETRY_MIN_S), PUBLISH_RETRY_MAX_S)

    async def _still_ours(self, batch: list[_Settle]) -> list[_Settle]:
        """``batch`` less the results of work taken over by another processor (claims re-checked
        where the lease is stale)."""
        lost = {id(d) for d in await self._confirm([s.delivery for s in batch
                                                    if s.work is not None and self._lease_stale(s.delivery)])}
        keep = []
        for s in batch:
            if s.work is not None and (s.work.taken_over or id(s.delivery) in lost):
                self._mark_taken_over(s.work, "result")
                continue
            keep.append(s)
        return keep

    async def _flush(self, *, hand_back_on_failure: bool = True) -> bool:
        """Publish the settled results, then ack their messages. Returns False when a publish failed
        and ``hand_back_on_failure`` is False: the results are kept (``_settle``) to be published
        again, as the engines' answers cost far more than waiting for Redis (a Redis restarted
        empty has lost the messages, so a hand-back would only run them again after the workers'
        lease). With ``hand_back_on_failure`` (the last flush, on stop) they are handed back."""
        while self._settle:
            batch, self._settle = self._settle, []
            batch = await self._still_ours(batch)
            publishing = [s for s in batch if s.result is not None]
            try:
                published = await self.backend.publish_results([(s.result, s.queue) for s in publishing
                                                                if s.result is not None])
            except ProcessorError as exc:
                if not hand_back_on_failure:
                    log.warning("result publish failed; holding the results to publish again",
                                extra={"action": "publish_failed", "results": len(publishing), "error": str(exc)})
                    self._settle = batch + self._settle
                    return False
                log.warning("result publish failed; handing back", extra={"action": "publish_failed",
                                                                          "error": str(exc)})
                with contextlib.suppress(ProcessorError):
                    await self.backend.release([s.request_id for s in batch if s.request_id])
                    await self.backend.nack([s.delivery for s in batch], delay_s=1.0)
                continue
            # a refused result of held work: its id is done or another processor's, which acks the
            # message; a refused one of a message not admitted (dead-lettered) is acked as before
            refused = {id(s) for s, ok in zip(publishing, published) if not ok and s.work is not None}
            for s in publishing:
                if id(s) in refused and s.work is not None:
                    self._mark_taken_over(s.work, "result")
            batch = [s for s in batch if id(s) not in refused]
            try:
                await self.backend.ack([s.delivery for s in batch if not s.dead_reason])
                by_reason: dict[str, list[Delivery]] = {}
                for s in batch:
                    if s.dead_reason:
                        by_reason.setdefault(s.dead_reason, []).append(s.delivery)
                for reason, deliveries in by_reason.items():
                    await self.backend.dead_letter(deliveries, reason)
            except ProcessorError as exc:  # results are out and ids done: a redelivery is acked as duplicate
                log.warning("ack failed", extra={"action": "ack_failed", "error": str(exc)})
        return True

    # ---------------------------------------------------------------- leases and gates

    async def _lease_keeper(self) -> None:
        lease = self.settings.lease_s
        while not self._closed.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closed.wait(), lease / 3)
                return
            cutoff = time.monotonic() - lease / 3
            held = [w.delivery for w in (*self.buffer, *self.in_flight)
                    if w.delivery.extended_at <= cutoff and not w.taken_over]
            held += [s.delivery for s in self._settle  # results kept while their publish fails
                     if s.work is not None and not s.work.taken_over and s.delivery.extended_at <= cutoff]
            lost = await self._confirm(held)
            if lost:
                self._drop_taken_over(lost)

    async def _running_reporter(self, running: RunningReporter) -> None:
        """Report the batch requests in flight (by batch) every ``running_report_s`` for the job
        page (:mod:`async_processor.running`); withdraw the report at stop."""
        try:
            while not self._closed.is_set():
                batches = Counter(w.batch_id for w in list(self.in_flight) if w.batch_id)
                try:
                    await running.report(batches)
                except Exception as exc:  # only the dashboard's running count waits for the next round
                    log.debug("running report failed", extra={"action": "running_report_failed", "error": str(exc)})
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._closed.wait(), self.settings.running_report_s)
        finally:
            await running.close()

    async def _gate_refresher(self) -> None:
        while not self._closed.is_set():
            try:
                await self.gate.refresh()
            except Exception as exc:  # a gate's bug must not stop the pump; the gate stays closed
                log.warning("gate refresh failed", extra={"action": "gate_refresh_failed", "error": str(exc)})
            self._wake.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closed.wait(), self.settings.saturation_poll_s)

    async def _cancel_watcher(self) -> None:
        """Drop held work of batches cancelled after it was admitted, and of llm-d-async requests
        cancelled since (their cancel key holds their token): answered ``CANCELLED``."""
        while not self._closed.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closed.wait(), self.settings.cancel_poll_s)
                return
            batch_ids = {w.request.metadata["batch_id"] for w in self.buffer if w.request.metadata.get("batch_id")}
            tokened = [w for w in self.buffer if w.request.request_token]
            if not batch_ids and not tokened:
                continue
            try:
                cancelled = await self.backend.cancelled_batches(sorted(batch_ids)) if batch_ids else set()
                ids = await self.backend.cancelled_requests([w.request for w in tokened]) if tokened else set()
            except Exception as exc:  # a failed check only delays the drop to the next round
                log.warning("cancel check failed", extra={"action": "cancel_check_failed", "error": str(exc)})
                continue
            dropped = [(w, "batch cancelled") for w in self.buffer.remove_batches(cancelled)]
            dropped += [(w, "cancelled") for w in self.buffer.remove([w for w in tokened if w.request.id in ids])]
            for work, reason in dropped:
                request = work.request
                self.metrics.shed(work.lane, Shed.CANCELLED)
                self._add_settle(_Settle(work.delivery, error_result(request.id, ErrorCode.CANCELLED, reason,
                                                                     request.metadata),
                                         request.result_queue_name, request.id))


async def _finish_tasks(tasks: Sequence[asyncio.Task], patience_s: float = 1.0) -> None:
    """Wait up to ``patience_s`` for ``tasks`` to end by themselves, then cancel the rest and wait."""
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=patience_s) if patience_s else (set(), set(tasks))
    for task in pending:
        task.cancel()
    for task in pending:
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(task), 5)
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            log.error("processor task failed", exc_info=task.exception(), extra={"action": "task_failed"})


async def run_processor(settings: ProcessorSettings, stop: asyncio.Event, backend: QueueBackend | None = None,
                        http: RouterClient | None = None, metrics: ProcessorObserver | None = None) -> Processor:
    """Build the backend and the router client (:func:`~async_processor.router_client.make_router_client`)
    unless given, and the gates, from ``settings``; pump until ``stop`` (series into ``metrics``);
    close what was built here; return the processor (for its ``counts``)."""
    from async_processor.backends import make_backend

    own_backend, own_http = backend is None, http is None
    backend = backend or make_backend(settings)
    await backend.start()
    http = http or make_router_client(settings.concurrency)
    running = RedisRunningReporter(settings.redis_url, settings.pool, settings.consumer_name) \
        if settings.backend == "redis" and own_backend else None
    try:
        processor = Processor(settings, backend, http, metrics=metrics, running=running)
        await processor.run(stop)
        return processor
    finally:
        if own_http:
            await http.aclose()
        if own_backend:
            await backend.close()
