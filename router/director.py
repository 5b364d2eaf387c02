"""The router's decisions for one request: admit → schedule → forward (ROUTING.md "Request path").

:class:`Director` knows nothing of HTTP; :mod:`router.proxy` reads the request, asks the director,
and writes what it decides. For one parsed request:

1. :meth:`Director.precheck`: no healthy endpoint → :class:`Rejected` 503 at once with
   ``Retry-After`` (RELIABILITY.md F10: fast 503); no endpoint serving the model → 404;
2. :meth:`Director.admit`: flow control admits it (waiting while the pool is saturated) →
   :class:`Admitted`, or refuses it → :class:`Rejected` 429 (503 when no engine exists) with
   ``Retry-After`` and ``x-llm-d-request-dropped-reason``;
3. :meth:`Director.forward`: the scheduler picks an endpoint among the healthy ones, the plugins
   learn (``pre_request``), the pool's in-flight counters rise, and the :class:`Forwarder` (the
   transport) sends it there. A non-sheddable request bound for an endpoint with no free sequence
   slot first **makes room** there (:meth:`Director.make_room`): the newest sheddable request this
   router runs on that endpoint is evicted. A connection refused before anything ran, or the endpoint declared
   down before any byte reached the client, retries once on another endpoint; an eviction by flow
   control or the endpoint going down later ends the request (:class:`Interruption`). The client
   going away cancels the request's task, which ends the forward as a cancellation;
4. when a try ends the counters fall and the ``response_complete`` hooks get the cached prompt
   tokens the engine reported (:attr:`Attempt.cached_tokens`).

Prefill/decode disaggregation (a ``pd-profile-handler`` in the scheduling config, a
:class:`PDForwarder` transport): :meth:`Director.decide` gives the decode endpoint and, for a
long enough uncached prompt, a prefill endpoint. The decode try holds its endpoint's slot from
the decision (no prefill tokens); the prefill leg (:meth:`Director._prefill`) runs first, as its
own task counted on the prefill endpoint until its answer, and is tried once more on another
prefill endpoint when it fails; with no ``kv_transfer_params`` after that the decode endpoint runs
the request whole (its uncached tokens join its counters). Eviction, the client going away or the
decode endpoint going down cancel the request with its prefill leg; the prefill endpoint going
down cancels the leg alone.

The rules behind these choices — the decode share's tokens, whether a failed prefill leg is
retried, the aggregated fallback, make-room's reason and victim — are the I/O-free functions of
:mod:`router.decisions`, which a replay of this flow without HTTP (the fleet simulator) calls too.

What happens is reported to a :class:`router.observer.RouterObserver`; the admin page's decision
rate is :attr:`Director.decisions`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from common.contracts.errors import ErrorType
from router.decisions import (
    MAX_PREFILL_TRIES,
    NO_FREE_SLOT,
    decode_share_tokens,
    fallback_prefill_tokens,
    make_room_reason,
    pick_victim,
    prefill_failure_retryable,
    prefix_info,
    should_retry_prefill,
    uncached_tokens,
)
from router.flow_control import Admission, DropReason, FlowController, FlowItem, RequestDropped
from router.flow_control.config import FLEX_OBJECTIVE
from router.observer import RouterObserver
from router.parsing import ParsedRequest
from router.pool.state import InFlight, PoolState
from router.scheduling.errors import NoCandidatesError
from router.scheduling.plugins.disagg import PDReason
from router.scheduling.scheduler import SINGLE_PROFILE, Scheduler
from router.scheduling.types import Endpoint, LLMRequest, PDDecision, SchedulingResult
from router.service_tier import flex_eviction, flex_objective, flex_refusal, is_flex
from router.tokenizers import Prompt, to_llm_request

#: Drop reason header (shared/contracts/queue-and-headers.md).
DROPPED_REASON = "x-llm-d-request-dropped-reason"


@dataclass(frozen=True, slots=True)
class Rejected:
    """The router will not run the request: the error the client gets.

    Attributes:
        status: HTTP status.
        message, code, param: the OpenAI error envelope's fields.
        error_type: the envelope's ``type``; None: OpenAI's type for the status.
        headers: response headers (``Retry-After``, the drop reason).
    """

    status: int
    message: str
    code: str
    error_type: str | None = None
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def dropped(cls, drop: RequestDropped) -> Rejected:
        """Flow control's refusal, in vLLM's words (contract)."""
        return cls(drop.status, drop.message, drop.reason.value, error_type=drop.error_type, headers=drop.headers())


#: No healthy endpoint (or none left to try): 503 with ``Retry-After``.
NO_ENDPOINT = Rejected(503, "no healthy inference endpoint is available", "no_healthy_endpoints",
                       headers={"Retry-After": "1", DROPPED_REASON: DropReason.CAPACITY.value})


@dataclass(frozen=True, slots=True)
class Admitted:
    """Flow control let the request run (``admission`` None: flow control is off)."""

    admission: Admission | None = None

    def release(self) -> None:
        """The request ended: give its place back."""
        if self.admission is not None:
            self.admission.release()


@dataclass(frozen=True, slots=True)
class Interruption:
    """Why a running request was ended by the router: the status and envelope fields it answers
    (an error response when nothing was sent yet, else an SSE ``error`` event)."""

    status: int
    message: str
    code: str
    reason: str = ""

    @property
    def drop_reason(self) -> str:
        """The ``x-llm-d-request-dropped-reason`` of the error response: ``reason`` when set, else
        ``evicted`` for an eviction and ``rejected-capacity`` otherwise."""
        if self.reason:
            return self.reason
        return DropReason.EVICTED.value if self.code == DropReason.EVICTED.value else DropReason.CAPACITY.value


EVICTED = Interruption(429, "evicted to make room for higher-priority work; retry later", DropReason.EVICTED.value)
#: A flex request evicted mid-flight: OpenAI's flex 429 (code ``resource_unavailable``), the drop
#: reason still ``evicted`` (:func:`router.service_tier.flex_eviction`).
FLEX_EVICTED = Interruption(429, *flex_eviction(), reason=DropReason.EVICTED.value)
ENDPOINT_DOWN = Interruption(503, "the inference endpoint went down", "upstream_failed")

_EVICTED = "evicted"
_ENDPOINT_DOWN = "endpoint_down"


class Attempt:
    """One try of a request on one endpoint: its share of the endpoint's in-flight counters,
    whether anything reached the client, and why the router interrupted it, if it did."""

    __slots__ = ("task", "pool", "endpoint", "share", "admission", "priority", "reason", "sent", "cached_tokens",
                 "chunks")

    def __init__(self, task: asyncio.Task[Any], pool: PoolState, share: InFlight,
                 admission: Admission | None = None, priority: int = 0) -> None:
        self.task = task
        self.pool = pool
        self.endpoint: Endpoint = share.endpoint
        self.share = share
        self.admission = admission  # flow control's slot of the request (None: flow control is off)
        self.priority = priority  # its band's priority (higher first)
        self.reason: str | None = None
        self.sent = False
        self.cached_tokens: int | None = None
        self.chunks = 0  # stream chunks relayed (about one generated token each)

    @property
    def started_at(self) -> float:
        """When the try was forwarded (the pool's clock)."""
        return self.share.started_at

    def chunk_sent(self) -> None:
        """A body chunk of a stream reached the client: the prefill is over."""
        self.chunks += 1
        if not self.sent:
            self.sent = True
            self.pool.first_chunk(self.share)

    def engine_failed(self, error: str) -> None:
        """Talking to the endpoint failed: the pool checks its health now."""
        self.pool.report_failure(self.endpoint.name, error)

    def interrupt(self, reason: str) -> None:
        """Cancel the request's task, remembering why (first reason wins)."""
        if self.reason is None:
            self.reason = reason
            self.task.cancel()


R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class Forwarder(Protocol[R_co]):
    """The transport of one request, as the director drives it (``R_co``: its response type)."""

    async def send(self, attempt: Attempt, retry: bool) -> R_co | None:
        """Send the request to ``attempt.endpoint`` and relay the answer; None: nothing ran there
        and ``retry`` allows another endpoint."""

    async def interrupted(self, attempt: Attempt, interruption: Interruption) -> R_co:
        """End the request the router interrupted."""

    def rejected(self, rejected: Rejected) -> R_co:
        """Answer a refusal."""


@dataclass(frozen=True, slots=True)
class PrefillAnswer:
    """What the prefill leg of a disaggregated request got (:meth:`PDForwarder.prefill`).

    Attributes:
        kv_transfer_params: the prefill engine's ``kv_transfer_params`` (opaque), None when it failed.
        failure: why it failed (``connect``, ``timeout``, ``status``, ``client_error``,
            ``no_kv_transfer_params``, ``stream``), None on success; a metric label.
        cached_tokens: the cached prompt tokens the prefill engine reported, if any.
    """

    kv_transfer_params: dict[str, Any] | None
    failure: str | None = None
    cached_tokens: int | None = None

    @property
    def retryable(self) -> bool:
        """Another prefill engine may do better (not a 4xx about the request itself)."""
        return prefill_failure_retryable(self.failure)


#: :attr:`PrefillAnswer.failure` of a prefill engine declared down while it ran the prefill.
PREFILL_ENDPOINT_DOWN = "endpoint_down"


class PDForwarder(Forwarder[R_co], Protocol[R_co]):
    """A transport that can also run the prefill leg of a disaggregated request.

    Attributes:
        disaggregable: the request may be disaggregated (a chat or completions generation of one
            sequence: :func:`router.disagg.single_sequence`).
        not_disaggregable_reason: the decision's reason when it may not (a :class:`PDReason`
            value: ``not_generation``, ``multiple_outputs``); read only when ``disaggregable`` is
            False, ``not_generation`` for a transport without it.
    """

    disaggregable: bool
    not_disaggregable_reason: str

    async def prefill(self, attempt: Attempt) -> PrefillAnswer:
        """Send the prefill leg to ``attempt.endpoint`` and read its answer; never raises for
        an engine's failure (it is in the answer)."""

    def use_kv_transfer(self, params: dict[str, Any] | None, prefill_cached_tokens: int | None = None) -> None:
        """The next :meth:`send` carries ``params`` as ``kv_transfer_params`` (None: the
        original request, the decode engine computing the prompt too); ``prefill_cached_tokens``
        (the prefill engine's report, None: unknown) is the ``cached_tokens`` the client gets."""


class DecisionRate:
    """Decisions per second over the last ``window_s`` seconds (for the admin page)."""

    def __init__(self, window_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._times: deque[float] = deque()

    def record(self) -> None:
        """Count one decision now."""
        now = self.clock()
        self._times.append(now)
        self._trim(now)

    def rate(self) -> float:
        """Decisions per second over the window."""
        self._trim(self.clock())
        return len(self._times) / self.window_s

    def _trim(self, now: float) -> None:
        cutoff = now - self.window_s
        while self._times and self._times[0] < cutoff:
            self._times.popleft()


class Director:
    """Admission, scheduling and the forward decisions of every request.

    Args:
        pool: the endpoint pool (health, metrics, candidates, in-flight counters).
        scheduler: the scheduling profiles; ``profile`` picks one (None: the first).
        flow: the flow controller, or None to skip flow control.
        observer: where what happens is reported (the Prometheus series).
        objective_priority: objective name → priority (llm-d convention, higher first).
        default_objective: the objective of a request that names none (or an unknown one).
        sheddable_objectives: objectives whose flow-control band is sheddable (the scheduler's
            ``spare-capacity-filter`` places them on engines with room only).
        make_room: evict a sheddable request to make room for a non-sheddable one on an endpoint
            with no free slot (:meth:`make_room`; the router's ``make_room`` setting, default on).
        evict_on_wait: evict-and-resume also when the endpoint has a free slot but the
            non-sheddable request would still wait there (:meth:`make_room`; the router's
            ``evict_on_wait`` setting, default off).
        clock: monotonic seconds of the decision rate (:attr:`decisions`).
    """

    def __init__(self, *, pool: PoolState, scheduler: Scheduler, profile: str | None,
                 flow: FlowController | None, observer: RouterObserver, objective_priority: dict[str, int],
                 default_objective: str, sheddable_objectives: frozenset[str] = frozenset(),
                 make_room: bool = False, evict_on_wait: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.scheduler = scheduler
        self.profile = profile
        self.flow = flow
        self.observer = observer
        self.objective_priority = objective_priority
        self.default_objective = default_objective
        self.sheddable_objectives = sheddable_objectives
        self.make_room_enabled = make_room
        self.evict_on_wait = evict_on_wait
        self.decisions = DecisionRate(clock=clock)
        self._attempts: dict[str, set[Attempt]] = {}  # endpoint name → tries running there
        self._prefills: dict[str, set[Attempt]] = {}  # endpoint name → prefill legs running there

    # ---- admit ---------------------------------------------------------------------------------------
    def objective(self, parsed: ParsedRequest) -> str:
        """The request's objective (band): ``flex`` for OpenAI's ``service_tier: "flex"``
        (:mod:`router.service_tier`), else its own when known, else the default.

        Raises:
            RequestError: 400, a flex request on a router with no ``flex`` band.
        """
        if is_flex(parsed):
            return flex_objective(self.objective_priority)
        name = parsed.objective or self.default_objective
        return name if name in self.objective_priority else self.default_objective

    def llm_request(self, parsed: ParsedRequest, prompt: Prompt, objective: str) -> LLMRequest:
        """What the scheduler reads of the request, with its objective's priority."""
        llm_request = to_llm_request(parsed, prompt, self.objective_priority[objective])
        llm_request.objective = objective
        llm_request.sheddable = objective in self.sheddable_objectives
        return llm_request

    def precheck(self, parsed: ParsedRequest) -> Rejected | None:
        """Refuse at once what no endpoint could serve."""
        if not self.pool.candidates():
            return NO_ENDPOINT
        if not self.pool.candidates_for(parsed.model):
            return Rejected(404, f"The model `{parsed.model}` does not exist.", "model_not_found",
                            error_type=ErrorType.VLLM_NOT_FOUND, param="model")
        return None

    async def admit(self, parsed: ParsedRequest, objective: str, received: float) -> Admitted | Rejected:
        """Wait for flow control's word (at once when flow control is off).

        Raises:
            asyncio.CancelledError: the client went away while its request waited.
        """
        if self.flow is None:
            return Admitted()
        deadline = received + parsed.slo_ttft_ms / 1000.0 if parsed.slo_ttft_ms is not None else None
        item = FlowItem(request_id=parsed.request_id, fairness_id=parsed.fairness_id or "",
                        objective=objective, byte_size=len(parsed.raw), deadline=deadline,
                        session_id=parsed.session_id)
        try:
            admission = await self.flow.admit(item)
        except asyncio.CancelledError:
            self.observer.shed(objective, DropReason.CONTEXT_CANCELLED.value)
            raise
        except RequestDropped as exc:
            self.observer.shed(objective, exc.reason)
            if objective == FLEX_OBJECTIVE and is_flex(parsed):
                return self._flex_rejected(exc)
            return Rejected.dropped(exc)
        self.observer.admitted(objective, time.monotonic() - received)
        return Admitted(admission)

    def _flex_rejected(self, drop: RequestDropped) -> Rejected:
        """A flex request's refusal: OpenAI's 429 "Resource Unavailable" when there was no room
        (:func:`router.service_tier.flex_refusal`), else flow control's."""
        wait_s = self.flow.config.band(FLEX_OBJECTIVE).ttl_s if self.flow is not None else None
        refusal = flex_refusal(drop, wait_s)
        if refusal is None:
            return Rejected.dropped(drop)
        message, code = refusal
        return Rejected(drop.status, message, code, error_type=ErrorType.RATE_LIMIT, headers=drop.headers())

    # ---- schedule ------------------------------------------------------------------------------------
    def schedule(self, llm_request: LLMRequest, exclude: set[str]) -> SchedulingResult | None:
        """Pick an endpoint serving the model, not in ``exclude``; None when there is none."""
        candidates = self.pool.candidates_for(llm_request.model)
        if exclude:
            candidates = [ep for ep in candidates if ep.name not in exclude]
        started = time.perf_counter()
        try:
            result = self.scheduler.schedule(llm_request, candidates, self.profile)
        except NoCandidatesError:
            return None
        self.observer.scheduled(time.perf_counter() - started, any(_matched(result)))
        self.decisions.record()
        self.scheduler.pre_request(llm_request, result)
        return result

    def decide(self, llm_request: LLMRequest, exclude: set[str], disaggregable: bool = True,
               not_disaggregable_reason: str = PDReason.NOT_GENERATION.value) -> PDDecision | None:
        """The whole decision (:meth:`Scheduler.decide`: with a P/D profile handler a decode pick
        and, for a long enough uncached prompt, a prefill pick) among the endpoints serving the
        model and not in ``exclude``; None when there is no decode candidate. The plugins learn
        from both picks (``pre_request``: the prefill engine now holds the prompt's prefix, the
        decode engine receives it). A request that cannot be disaggregated (``disaggregable``
        False: embeddings, responses, n > 1) gets the default profile's pick (reason
        ``not_disaggregable_reason``)."""
        candidates = self.pool.candidates_for(llm_request.model)
        if exclude:
            candidates = [ep for ep in candidates if ep.name not in exclude]
        # a scheduler without a P/D handler is only asked for schedule() (in-process users may pass
        # any object with schedule / pre_request / response_complete)
        handler = getattr(self.scheduler, "profile_handler", None) if self.profile is None else None
        started = time.perf_counter()
        try:
            if handler is not None and disaggregable:
                decision = self.scheduler.decide(llm_request, candidates)
            else:
                result = self.scheduler.schedule(llm_request, candidates, self.profile)
                reason = SINGLE_PROFILE if handler is None else not_disaggregable_reason
                decision = PDDecision(result, None, reason, uncached_tokens(result, llm_request))
        except NoCandidatesError:
            return None
        self.observer.scheduled(time.perf_counter() - started, any(_matched(decision.decode)))
        self.decisions.record()
        if handler is not None:
            self.observer.pd_decision(decision.reason)
        self.scheduler.pre_request(llm_request, decision.decode)
        if decision.prefill is not None:
            self.scheduler.pre_request(llm_request, decision.prefill)
        return decision

    async def _prefill(self, llm_request: LLMRequest, decision: PDDecision, forwarder: PDForwarder[Any],
                       task: asyncio.Task[Any]) -> PrefillAnswer | None:
        """Run the prefill leg, once more on another prefill engine when it fails; the answer
        whose ``kv_transfer_params`` to decode with, or None: fall back to aggregated (counted).

        Each try counts in its prefill endpoint's in-flight counters (its uncached prompt tokens
        until the answer) and is interrupted, alone, when that endpoint goes down.

        Raises:
            asyncio.CancelledError: the request itself was cancelled (client gone, evicted, its
                decode endpoint down).
        """
        prefill = decision.prefill
        excluded = [decision.decode.endpoint.name]
        failure = "none"
        for number in range(MAX_PREFILL_TRIES):
            if prefill is None:
                break
            name = prefill.endpoint.name
            share = self.pool.started(prefill.endpoint, uncached_tokens(prefill, llm_request),
                                      sheddable=llm_request.sheddable)
            attempt = Attempt(task, self.pool, share, None, llm_request.priority)
            leg = asyncio.get_running_loop().create_task(forwarder.prefill(attempt), name=f"prefill {name}")
            attempt.task = leg  # an interruption (its endpoint down) cancels the leg alone
            self._prefills.setdefault(name, set()).add(attempt)
            answer = PrefillAnswer(None, PREFILL_ENDPOINT_DOWN)
            try:
                answer = await leg
            except asyncio.CancelledError:
                if task.cancelling() or attempt.reason is None:
                    leg.cancel()
                    raise  # the request itself was cancelled
            finally:
                self.pool.finished(share, completed=answer.kv_transfer_params is not None)
                self._prefills.get(name, set()).discard(attempt)
                self.scheduler.response_complete(llm_request, prefill, answer.cached_tokens)
            if answer.kv_transfer_params is not None:
                return answer
            failure = answer.failure or "unknown"
            self.observer.prefill_failed(name, failure)
            excluded.append(name)
            if not should_retry_prefill(answer.failure, number + 1):
                break
            prefill = self.scheduler.schedule_prefill(llm_request, self.pool.candidates_for(llm_request.model), excluded)
            if prefill is not None:
                self.observer.prefill_retried()
                self.scheduler.pre_request(llm_request, prefill)
        self.observer.pd_fallback(failure)
        return None

    # ---- forward -------------------------------------------------------------------------------------
    async def forward(self, llm_request: LLMRequest, objective: str, admitted: Admitted,
                      forwarder: Forwarder[R]) -> R:
        """Schedule and send the request, once more on another endpoint when nothing ran.

        Raises:
            asyncio.CancelledError: the client went away (the transport closed the upstream
                connection, so the engine aborts the request).
        """
        tried: set[str] = set()
        task = asyncio.current_task()
        assert task is not None
        attempt: Attempt | None = None

        def evict() -> None:
            if attempt is not None:
                attempt.interrupt(_EVICTED)

        if admitted.admission is not None:
            admitted.admission.on_evict(evict)
        made_room = False
        pd_forwarder: PDForwarder[R] | None = forwarder if getattr(forwarder, "disaggregable", False) else None  # type: ignore[assignment]
        for number in range(2):
            decision = self.decide(llm_request, tried, pd_forwarder is not None,
                                   getattr(forwarder, "not_disaggregable_reason", PDReason.NOT_GENERATION.value))
            if decision is None:
                return forwarder.rejected(NO_ENDPOINT)
            result = decision.decode
            tried.add(result.endpoint.name)
            if (self.make_room_enabled or self.evict_on_wait) and not llm_request.sheddable and not made_room:
                made_room = self.make_room(result.endpoint) is not None
            share = self.pool.started(result.endpoint, decode_share_tokens(decision, llm_request),
                                      sheddable=llm_request.sheddable)
            attempt = Attempt(task, self.pool, share, admitted.admission, llm_request.priority)
            self._attempts.setdefault(result.endpoint.name, set()).add(attempt)
            retry = number == 0
            completed = False
            try:
                if pd_forwarder is not None:
                    prefilled = None
                    if decision.prefill is not None:
                        prefilled = await self._prefill(llm_request, decision, pd_forwarder, task)
                        if prefilled is None:  # aggregated after all: the decode engine computes the prompt
                            self.pool.add_prefill(share, fallback_prefill_tokens(decision))
                    if prefilled is None:
                        pd_forwarder.use_kv_transfer(None)
                    else:
                        pd_forwarder.use_kv_transfer(prefilled.kv_transfer_params, prefilled.cached_tokens)
                response = await forwarder.send(attempt, retry)
                completed = response is not None
            except asyncio.CancelledError:
                if attempt.reason is None:
                    raise  # the client went away
                task.uncancel()
                if attempt.reason is _EVICTED:
                    self.observer.shed(objective, DropReason.EVICTED.value)
                    return await forwarder.interrupted(attempt, FLEX_EVICTED if objective == FLEX_OBJECTIVE else EVICTED)
                # the endpoint was declared down while this request ran on it
                self.observer.upstream_error("endpoint_down")
                if retry and not attempt.sent:
                    continue
                return await forwarder.interrupted(attempt, ENDPOINT_DOWN)
            finally:
                self.pool.finished(attempt.share, completed=completed)
                self._attempts.get(result.endpoint.name, set()).discard(attempt)
                self.scheduler.response_complete(llm_request, result, attempt.cached_tokens)
            if response is not None:
                return response
        return forwarder.rejected(NO_ENDPOINT)

    def make_room(self, endpoint: Endpoint) -> Attempt | None:
        """Evict a sheddable request from ``endpoint`` for a non-sheddable one about to go there,
        when the endpoint has no free sequence slot (reason ``no_free_slot``, with ``make_room``) or,
        with ``evict_on_wait``, when the request would wait there all the same: sheddable prefills
        in flight there (reason ``batch_prefill``: the router's ``in_flight_sheddable_prefill_tokens``
        > 0; vLLM V1 puts every waiting prefill into the next step up to its token budget, so the
        interactive prefill shares its step with them) or requests waiting there (reason
        ``engine_queue``: :func:`router.scheduling.saturation.effective_waiting` > 0). For
        ``batch_prefill`` the victim is the newest sheddable request still in prefill; returns the
        evicted try, or None.

        Tokens wasted (``RouterObserver.evicted``): what the engine computed for the victim that
        its redo computes again is not knowable here (the redo finds the victim's full prompt blocks
        cached, if they were computed and stay cached); the router reports the victim's uncached
        prompt tokens as estimated at its dispatch plus the stream chunks it relayed (about one
        generated token each; none for a non-streamed request): an upper bound of the prompt work
        lost, exact for its generated tokens when streamed.

        On a slot-bound engine scheduled first come first served (vLLM without priority
        scheduling never preempts a running request; with it, priority orders only the waiting
        queue) a non-sheddable request that meets full slots waits for a whole request to finish.
        No free slot means its slot count is known (:attr:`Endpoint.slots`) and ``running +
        unseen ≥ slots``: the last scrape's running requests (including ones the router just
        released, still running there until the engine sees the abort) plus the requests it does
        not show yet (:func:`router.scheduling.saturation.unseen_requests`), and — the router's own,
        fresher view — its requests in flight there (``in_flight_requests``, those already
        finished since the scrape left out) also fill the slots; with several router replicas
        that count is low, which only makes room less often. The victim is one of
        the sheddable requests this router forwarded there and that are still running: lowest band
        priority first, then the most recently started (the least work lost: llm-d's eviction
        order). It is evicted the way flow control's evictor does it (its admission is counted
        ``evicted`` and released, the upstream request is cancelled, so the engine aborts it, and
        its client gets 429 ``evicted`` with ``Retry-After``).
        """
        victims = [a for a in self._attempts.get(endpoint.name, ()) if a.share.sheddable and a.reason is None]
        found = make_room_reason(endpoint, victims, make_room=self.make_room_enabled,
                                 evict_on_wait=self.evict_on_wait, prefilling=self._in_prefill)
        if found is None:
            return None
        reason, candidates = found
        victim = pick_victim(candidates)
        if victim.admission is None or self.flow is None or not self.flow.evict(victim.admission):
            victim.interrupt(_EVICTED)  # no flow control (or its slot is gone already): cancel it here
        if reason is NO_FREE_SLOT:
            self.observer.made_room(endpoint.name)
        self.observer.evicted(endpoint.name, reason, victim.share.dispatched + victim.chunks)
        return victim

    def _in_prefill(self, attempts: Sequence[Attempt]) -> list[Attempt]:
        """The tries among ``attempts`` still counted as in prefill (expired ones first dropped)."""
        self.pool.expire_prefills()
        return [a for a in attempts if self.pool.in_prefill(a.share)]

    def endpoint_down(self, name: str) -> None:
        """Pool hook: ``name`` left the candidate set. Its requests in flight are interrupted
        (the pool reset its counters, so their shares no longer count); so are the prefill legs
        running there, each alone (its request retries the prefill elsewhere or falls back)."""
        for attempt in list(self._attempts.pop(name, ())):
            attempt.interrupt(_ENDPOINT_DOWN)
        for attempt in list(self._prefills.pop(name, ())):
            attempt.interrupt(_ENDPOINT_DOWN)


def _matched(result: SchedulingResult) -> list[float]:
    info = prefix_info(result)
    return list(info.matched.values()) if info is not None else []
