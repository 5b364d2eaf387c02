"""The asyncio facade the router's director uses: admit a request, wait for dispatch, release it.

::

    controller = FlowController(config, saturation=detector_value, clock=time.monotonic)
    await controller.start()
    try:
        admission = await controller.admit(FlowItem(request_id, fairness_id, objective, byte_size, deadline))
    except RequestDropped as drop:          # 429/503 + Retry-After + x-llm-d-request-dropped-reason
        return error_response(drop.status, drop.body(), drop.headers())
    admission.on_evict(upstream_task.cancel)     # admission.evicted then holds the drop to answer with
    try:
        ...forward to the engine...
    finally:
        admission.release()
    await controller.stop()

All decisions are made by :class:`~router.flow_control.core.FlowControlCore` (its docstring states
the policy and its llm-d sources); this module only runs it: on every ``admit`` (fast path: a
request that can go at once is dispatched without a task switch), on ``kick()``, on ``release()``,
and on a timer every ``poll_interval_s`` while anything waits — saturation comes from scraped
metrics, so nothing else would tell the controller that room appeared, and TTLs must be enforced.
The saturation callable is re-read before every dispatch; if it raises, every engine counts as
saturated (fail closed, as the detector does for stale metrics).

Status: drops are 429; when ``has_endpoints`` is given and returns False at the time of the drop,
503 (contract: "503 when no engine exists"). Stopping the controller drops every waiting request with
``rejected-saturated`` and 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from router.flow_control.config import FlowControlConfig
from router.flow_control.core import FlowControlCore, FlowItem, Ticket, TicketState, retry_after_for
from router.flow_control.errors import DropReason, RequestDropped

log = logging.getLogger(__name__)

EvictCallback = Callable[[], object]


class Admission:
    """A dispatched request's slot. Release it exactly when the request ends (``release`` is
    idempotent; ``with admission:`` releases on exit).

    Attributes:
        request_id: the item's request id.
        band_name: the band's objective name (after default-objective mapping).
        priority: the band's priority (llm-d convention: higher first); the proxy translates it to
            the engine's priority.
        evicted: the drop (reason ``evicted``) if the controller evicted this request, else None.
    """

    __slots__ = ("_controller", "_ticket", "_callbacks", "evicted")

    def __init__(self, controller: FlowController, ticket: Ticket) -> None:
        self._controller = controller
        self._ticket = ticket
        self._callbacks: list[EvictCallback] = []
        self.evicted: RequestDropped | None = None

    def __repr__(self) -> str:
        return f"Admission({self.request_id!r}, band={self.band_name!r}, state={self._ticket.state.value})"

    @property
    def request_id(self) -> str:
        return self._ticket.item.request_id

    @property
    def band_name(self) -> str:
        return self._ticket.band.objective

    @property
    def priority(self) -> int:
        return self._ticket.band.priority

    def on_evict(self, callback: EvictCallback) -> None:
        """Call ``callback()`` once if the controller evicts this request (at once if it already
        has); :attr:`evicted` then holds the :class:`RequestDropped` (reason ``evicted``) to answer
        the client with. The callback runs inside the controller's dispatch step: it must not block
        (cancel the upstream task, don't await it). Its exceptions are logged, not raised."""
        if self.evicted is not None:
            self._call(callback)
        else:
            self._callbacks.append(callback)

    def release(self) -> None:
        """The request ended: free its in-flight and tenant-quota slots and wake the dispatcher.
        Idempotent; a no-op after eviction."""
        self._controller._release(self._ticket)

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _evict(self, drop: RequestDropped) -> None:
        self.evicted = drop
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            self._call(callback)

    def _call(self, callback: EvictCallback) -> None:
        try:
            callback()
        except Exception:
            log.exception("eviction callback failed", extra={"action": "flow_control.evict_callback_failed",
                                                             "request_id": self.request_id})


class FlowController:
    """Runs a :class:`FlowControlCore` on the event loop (module docstring).

    Args:
        config: the configuration.
        saturation: the gate's saturation, ≥ 0; dispatch only while < 1.0. The router passes
            ``RouterRuntime.gate_saturation``: the least saturated engine's value with the
            dispatches since the last scrape counted (``router/scheduling/saturation.py``), so
            sheddable work goes while any engine has room. Must be cheap.
        unreserved: optional; what non-sheddable bands are gated on past their bypass bound (the
            router: ``gate_saturation`` without the slot reserve kept for them); None:
            ``saturation``.
        clock: seconds, monotonic; ``FlowItem.deadline`` is on this clock.
        has_endpoints: optional; False at a drop's time makes it a 503 instead of 429.
    """

    def __init__(self, config: FlowControlConfig, saturation: Callable[[], float],
                 clock: Callable[[], float] = time.monotonic, *,
                 has_endpoints: Callable[[], bool] | None = None,
                 unreserved: Callable[[], float] | None = None) -> None:
        self.config = config
        self._core = FlowControlCore(config)
        self._saturation = saturation
        self._unreserved = unreserved
        self._clock = clock
        self._has_endpoints = has_endpoints
        self._waiters: dict[Ticket, asyncio.Future[Admission]] = {}
        self._admissions: dict[Ticket, Admission] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def running(self) -> bool:
        """True between :meth:`start` and :meth:`stop`."""
        return self._task is not None and not self._task.done() and not self._stopping

    async def start(self) -> None:
        """Start the background dispatch/TTL task. Idempotent."""
        if not self.running:
            self._stopping = False
            self._task = asyncio.create_task(self._run(), name="flow-control-dispatch")

    async def stop(self) -> None:
        """Stop the background task and drop every waiting request (``rejected-saturated``, 503).
        In-flight admissions stay valid (their release is still accepted)."""
        task, self._task = self._task, None
        if task is not None:
            self._stopping = True
            self._wake.set()
            await task
            self._stopping = False
        for ticket, drop in self._core.drain(DropReason.SATURATED, "the router is shutting down", status=503):
            self._fail(ticket, drop)

    def kick(self) -> None:
        """Saturation may have changed (metrics scraped, a request ended): run a dispatch step soon."""
        self._wake.set()

    def evict(self, admission: Admission) -> bool:
        """Evict ``admission`` now, a request the caller chose (the router's make-room): the core
        counts it ``evicted`` and frees its slot, and its ``on_evict`` callbacks run (they cancel
        the upstream request) with :attr:`Admission.evicted` set, as for the controller's own
        evictions.

        Returns:
            True if it was evicted; False when it is no longer in flight (released, evicted) or
            not of a sheddable band.
        """
        ticket = admission._ticket
        if not self._core.evict(ticket):
            return False
        self._notify_evicted(ticket)
        self._wake.set()
        return True

    @property
    def in_flight_requests(self) -> int:
        """Requests dispatched and not yet released (counts a running step's dispatches at once)."""
        return self._core.in_flight_requests

    def stats(self) -> dict[str, Any]:
        """:meth:`FlowControlCore.stats` at the current time."""
        return self._core.stats(self._clock())

    async def admit(self, item: FlowItem) -> Admission:
        """Queue ``item`` and wait until it is dispatched.

        Returns:
            The :class:`Admission`; release it when the request ends.

        Raises:
            RequestDropped: rejected at once (capacity, quota, deadline past) or later (TTL or
                deadline expired while waiting, controller stopped); ``status`` 429 or 503.
            RuntimeError: the controller is not started.
            asyncio.CancelledError: the caller was cancelled; the item is removed (counted as
                ``rejected-context-cancelled``) or, if it had just been dispatched, released.
        """
        if not self.running:
            raise RuntimeError("FlowController.admit before start()")
        try:
            ticket = self._core.enqueue(item, self._clock())
        except RequestDropped as drop:
            raise self._with_status(drop) from None
        future: asyncio.Future[Admission] = asyncio.get_running_loop().create_future()
        self._waiters[ticket] = future
        self._pump()
        if not future.done():
            self._wake.set()  # the loop starts polling for this waiter
        try:
            return await future
        except asyncio.CancelledError:
            self._abandon(ticket, future)
            raise

    # --- internals -----------------------------------------------------------------------------

    def _abandon(self, ticket: Ticket, future: asyncio.Future[Admission]) -> None:
        self._waiters.pop(ticket, None)
        if future.done() and not future.cancelled():
            future.exception()  # retrieved: no "never retrieved" warning
        if not self._core.cancel(ticket):
            self._release(ticket)  # dispatched just before the cancellation landed
        self._wake.set()

    def _release(self, ticket: Ticket) -> None:
        self._admissions.pop(ticket, None)
        if self._core.release(ticket, self._clock()):
            self._wake.set()

    def _read_unreserved(self) -> float:
        return self._read_saturation(self._unreserved) if self._unreserved is not None else self._read_saturation()

    def _read_saturation(self, source: Callable[[], float] | None = None) -> float:
        try:
            return float((source or self._saturation)())
        except Exception:
            log.exception("saturation read failed; counting the pool as saturated",
                          extra={"action": "flow_control.saturation_failed"})
            return math.inf

    def _with_status(self, drop: RequestDropped) -> RequestDropped:
        if self._has_endpoints is not None and drop.status == 429 and not self._has_endpoints():
            drop.status = 503
        return drop

    def _fail(self, ticket: Ticket, drop: RequestDropped) -> None:
        future = self._waiters.pop(ticket, None)
        if future is not None and not future.done():
            future.set_exception(self._with_status(drop))

    def _pump(self) -> None:
        """One core step: fail the shed, hand out the dispatched, notify the evicted."""
        now = self._clock()
        result = self._core.step(now, self._read_saturation, self._read_unreserved)
        for ticket, drop in result.expired:
            self._fail(ticket, drop)
        for ticket in result.dispatched:
            future = self._waiters.pop(ticket, None)
            if future is None or future.done():  # its waiter was cancelled in the meantime
                self._core.release(ticket)
                self._wake.set()
                continue
            admission = self._admissions[ticket] = Admission(self, ticket)
            future.set_result(admission)
        for ticket in result.evicted:
            self._notify_evicted(ticket)

    def _notify_evicted(self, ticket: Ticket) -> None:
        evicted = self._admissions.pop(ticket, None)
        log.info("evicted", extra={"action": "flow_control.evicted", "request_id": ticket.item.request_id,
                                   "band": ticket.band.objective})
        if evicted is not None:
            evicted._evict(RequestDropped(DropReason.EVICTED,
                                          f"{ticket.band.objective} band: evicted for higher-priority work",
                                          retry_after_s=retry_after_for(DropReason.EVICTED, ticket.band)))

    async def _run(self) -> None:
        poll = self.config.poll_interval_s
        while not self._stopping:
            self._wake.clear()
            try:
                self._pump()
            except Exception:  # keep dispatching: one bad step must not strand every waiter
                log.exception("flow-control step failed", extra={"action": "flow_control.step_failed"})
            if self._stopping:
                break
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that lands
            # as the event fires
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(poll if self._core.queued_requests else None):
                    await self._wake.wait()


__all__ = ["Admission", "FlowController", "TicketState"]
