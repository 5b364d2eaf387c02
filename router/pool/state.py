"""The pool's state and accounting: which endpoints exist, which are healthy, their load. No I/O.

:class:`PoolState` holds one :class:`EndpointState` per engine (its scheduler-facing
:class:`~router.scheduling.types.Endpoint` plus health) and is changed only through its public
calls: membership (:meth:`~PoolState.set_endpoints`, :meth:`~PoolState.add`,
:meth:`~PoolState.remove`), health (:meth:`~PoolState.mark_up`, :meth:`~PoolState.mark_down`,
:meth:`~PoolState.set_models`), scrapes (:meth:`~PoolState.record_metrics`) and the request path's
counters below. Who calls them: in the router process the probes (:mod:`router.pool.probes`) and
the discovery (:mod:`router.pool.discovery`); in the fleet simulator the simulation itself, on its
virtual clock. Going down (:meth:`~PoolState.mark_down` or removal) resets the endpoint's in-flight
counters, its learned slot count (:mod:`router.pool.slots`) and EWMAs, and calls the ``on_down``
hooks, which drop its prefix-index entries and interrupt its requests (RELIABILITY.md F9).

The in-flight counters on each :class:`~router.scheduling.types.Endpoint` (requests forwarded,
uncached prompt tokens still to prefill, sheddable requests) change only through
:meth:`PoolState.started`, :meth:`PoolState.first_chunk` and :meth:`PoolState.finished`.

**Sheddable prefills in flight** (the batch prefill share, ``router/scheduling/saturation.py``):
a sheddable request's uncached prompt tokens count in ``in_flight_sheddable_prefill_tokens`` from
:meth:`PoolState.started` until its first streamed chunk, its end, or ``batch_prefill_window_s``
after it was sent (:meth:`PoolState.expire_prefills`), whichever comes first: batch requests are
not streamed, so the router cannot see their prefill end; the window (default 0.25 s, about one
full-budget step of an 8B model on an H100: 8,192 tokens × 32 µs) stands for it.

**Interactive arrivals and durations** (the reserve sized by Little's law): each non-sheddable
request forwarded adds to the endpoint's exponentially weighted arrival rate
(``rate ← rate × e^(−Δt/τ) + 1/τ``, τ = ``interactive_rate_tau_s``, 10 s: the rate of a Poisson
stream is estimated within about ±1/√(λτ), ±14 % at 5 requests/s), and each completed one to
``mean_interactive_duration_s`` (the same EWMA as ``mean_request_duration_s``).

Endpoints are named by their base URL, the key of every per-endpoint index.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from router.pool.engine_metrics import EngineMetrics
from router.pool.slots import forget_slots, learn_slots, state_slots
from router.scheduling.types import ROLE_BOTH, ROLES, Endpoint

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class EndpointState:
    """The pool's record of one engine: the scheduler's :class:`Endpoint` plus health.

    Attributes:
        endpoint: what the scheduler reads (updated in place).
        healthy: in the candidate set.
        failures: failed health checks / connections in a row.
        models: model names from the engine's ``/v1/models`` (empty until read).
        metrics: the last successful scrape.
        last_error: text of the last failure, for the admin page.
        server_info_max_num_seqs: ``max_num_seqs`` per data-parallel rank as the engine's
            ``/server_info`` answered it (vLLM with ``VLLM_SERVER_DEV_MODE=1``), requests; None
            when not read or not served (:mod:`router.pool.slots`).
        server_info_read: ``/server_info`` was asked once since the endpoint came up.
    """

    endpoint: Endpoint
    healthy: bool = False
    failures: int = 0
    models: list[str] = field(default_factory=list)
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    last_error: str | None = None
    server_info_max_num_seqs: int | None = None
    server_info_read: bool = False

    @property
    def name(self) -> str:
        """The endpoint's base URL."""
        return self.endpoint.name


#: A hook told an endpoint's name (``on_down``, ``on_join``, ``on_leave``, ``on_failure``).
OnDown = Callable[[str], None]
EndpointHook = OnDown


class InFlight:
    """One forwarded request's share of its endpoint's in-flight counters (from
    :meth:`PoolState.started`; changed only by the pool).

    The endpoint's ``in_flight_uncached_tokens`` carries the tokens the router expects the engine
    still has to compute for the request, removed when its first streamed chunk arrives (the
    prefill is over, :meth:`PoolState.first_chunk`) or when it ends (:meth:`PoolState.finished`),
    so the counter is the endpoint's queued prefill work, which the load-aware plugins
    (``token-load-scorer``, ``prefix-cache-affinity-filter``) turn into a wait estimate. When the
    endpoint goes down the pool resets its counters; the shares taken before no longer count.
    """

    __slots__ = ("endpoint", "tokens", "sheddable", "counted", "generation", "started_at", "prefill", "dispatched")

    def __init__(self, endpoint: Endpoint, tokens: int, generation: int, started_at: float,
                 sheddable: bool = False) -> None:
        self.endpoint = endpoint
        self.tokens = tokens
        self.dispatched = tokens  # uncached prompt tokens estimated at dispatch (kept after the prefill)
        self.sheddable = sheddable
        self.counted = True
        self.generation = generation
        self.started_at = started_at
        self.prefill = sheddable  # counted in the endpoint's in_flight_sheddable_prefill_tokens


class PoolState:
    """Engines, their health and load, with no I/O; :meth:`candidates` is what the scheduler
    chooses among.

    Args:
        clock: the monotonic clock (seconds) ``metrics_updated_at`` and the in-flight shares are
            stamped with (the saturation detector's clock; a simulation passes its virtual clock).
        on_change: called with no argument whenever fresh metrics arrived or the candidate set
            changed (flow control re-checks saturation).
        duration_ewma_alpha: weight of the newest completed request in each endpoint's
            ``mean_request_duration_s`` (0 < alpha ≤ 1; default 0.1, ours: about the last ten
            requests, so a change of load shows within a few seconds on a busy engine).
        max_num_seqs: every engine's sequence slots (vLLM's ``--max-num-seqs``) when configured;
            None: each endpoint's is learned from its scrapes (:mod:`router.pool.slots`).
        batch_prefill_window_s: seconds a sheddable request's tokens count as in prefill at most
            (module docstring).
        interactive_rate_tau_s: time constant of the interactive arrival rate, seconds.

    Raises:
        ValueError: ``duration_ewma_alpha`` outside (0, 1] or ``max_num_seqs`` below 1.
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[], None] | None = None,
        duration_ewma_alpha: float = 0.1,
        max_num_seqs: int | None = None,
        batch_prefill_window_s: float = 0.25,
        interactive_rate_tau_s: float = 10.0,
    ) -> None:
        if not 0.0 < duration_ewma_alpha <= 1.0:
            raise ValueError(f"duration_ewma_alpha must be in (0, 1], got {duration_ewma_alpha}")
        if max_num_seqs is not None and max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        self.max_num_seqs = max_num_seqs
        self.batch_prefill_window_s = batch_prefill_window_s
        self.interactive_rate_tau_s = interactive_rate_tau_s
        self._prefills: dict[str, deque[InFlight]] = {}  # endpoint → sheddable shares in prefill, oldest first
        self.duration_ewma_alpha = duration_ewma_alpha
        self.clock = clock
        self.on_change = on_change or (lambda: None)
        self.states: dict[str, EndpointState] = {}
        self._candidates: list[Endpoint] = []
        self._by_model: dict[str, list[Endpoint]] = {}
        self._on_down: list[OnDown] = []
        self._on_join: list[EndpointHook] = []
        self._on_leave: list[EndpointHook] = []
        self._on_failure: list[EndpointHook] = []
        self._generation: dict[str, int] = {}  # endpoint name → how many times its counters were reset

    # ---- hooks ---------------------------------------------------------------------------------
    def add_on_down(self, hook: OnDown) -> None:
        """Call ``hook(endpoint_name)`` when an endpoint leaves the candidate set or the pool."""
        self._on_down.append(hook)

    def add_on_join(self, hook: EndpointHook) -> None:
        """Call ``hook(endpoint_name)`` when an endpoint joins the pool (the probes start probing it)."""
        self._on_join.append(hook)

    def add_on_leave(self, hook: EndpointHook) -> None:
        """Call ``hook(endpoint_name)`` when an endpoint leaves the pool (the probes stop)."""
        self._on_leave.append(hook)

    def add_on_failure(self, hook: EndpointHook) -> None:
        """Call ``hook(endpoint_name)`` when the request path reports a healthy endpoint
        unreachable (:meth:`report_failure`; the probes check its health at once)."""
        self._on_failure.append(hook)

    # ---- membership --------------------------------------------------------------------------
    def set_endpoints(self, urls: Iterable[str], roles: Mapping[str, str] | None = None) -> None:
        """Make the pool hold exactly ``urls`` (base URLs): new ones join unhealthy (the ``on_join``
        hooks start probing them), gone ones are removed (:meth:`remove`).

        ``roles``: base URL → ``prefill`` | ``decode`` | ``both`` (:data:`~router.scheduling.types.ROLES`);
        an endpoint not named is ``both``. A known endpoint whose role changed takes the new one
        in place (its counters stay).

        Must be called from the event loop when probes are attached. New endpoints join the
        candidate set after their first healthy check.

        Raises:
            ValueError: a role that is not one of the three.
        """
        role_of = {u.rstrip("/"): r for u, r in (roles or {}).items()}
        for role in role_of.values():
            if role not in ROLES:
                raise ValueError(f"engine role must be one of {', '.join(ROLES)}, got {role!r}")
        wanted = {u.rstrip("/") for u in urls}
        for name in list(self.states):
            if name not in wanted:
                self.remove(name)
        changed = False
        for name in wanted:
            role = role_of.get(name, ROLE_BOTH)
            if name not in self.states:
                self._join(EndpointState(Endpoint(name, role=role)))
            elif self.states[name].endpoint.role != role:
                self.states[name].endpoint.role = role
                changed = True
        if changed:
            self._rebuild()

    def add(self, state: EndpointState) -> None:
        """Add one endpoint as ``state`` says (healthy or not, its models known or not), e.g. a
        simulated engine that joins healthy at once; a configured ``max_num_seqs`` is applied."""
        self._join(state)
        self._rebuild()

    def remove(self, name: str) -> None:
        """Drop endpoint ``name`` from the pool (down first when it was healthy).

        Raises:
            KeyError: no such endpoint.
        """
        state = self.states.pop(name)
        for hook in self._on_leave:
            hook(name)
        if state.healthy:
            state.healthy = False
            self._down(name)
        self._rebuild()

    def _join(self, state: EndpointState) -> None:
        if self.max_num_seqs is not None:
            state.endpoint.max_num_seqs = self.max_num_seqs
        self.states[state.name] = state
        for hook in self._on_join:
            hook(state.name)

    # ---- health --------------------------------------------------------------------------------
    def mark_up(self, name: str) -> None:
        """A health check of ``name`` passed: its failures reset, and it joins the candidate set
        when it was out (RELIABILITY.md F10). Unknown names are ignored."""
        state = self.states.get(name)
        if state is None:
            return
        state.failures = 0
        state.last_error = None
        if not state.healthy:
            state.healthy = True
            log.info("endpoint up", extra={"action": "endpoint_up", "endpoint": name})
            self._rebuild()

    def mark_down(self, name: str) -> None:
        """Take ``name`` out of the candidate set (its health checks failed): its models are
        forgotten, its counters reset and the ``on_down`` hooks called. A no-op when it is out
        already or unknown."""
        state = self.states.get(name)
        if state is None or not state.healthy:
            return
        state.healthy = False
        state.models = []
        log.warning("endpoint down", extra={"action": "endpoint_down", "endpoint": name, "error": state.last_error})
        self._down(name)
        self._rebuild()

    def set_models(self, name: str, models: list[str]) -> None:
        """The model names ``name``'s ``/v1/models`` lists (empty: unknown, it counts as serving
        every model)."""
        state = self.states.get(name)
        if state is None:
            return
        state.models = models
        self._by_model = {}

    def report_failure(self, name: str, error: str) -> None:
        """A request could not reach ``name``: remember why and, when it is healthy, call the
        ``on_failure`` hooks (the probes check its health now; a failed check takes it out)."""
        state = self.states.get(name)
        if state is None:
            return
        state.last_error = error
        if state.healthy:
            for hook in self._on_failure:
                hook(name)

    # ---- what others read ---------------------------------------------------------------------
    def candidates(self) -> list[Endpoint]:
        """Healthy endpoints, the scheduler's candidates (a shared list: do not mutate)."""
        return self._candidates

    def candidates_for(self, model: str) -> list[Endpoint]:
        """Healthy endpoints serving ``model`` (by their ``/v1/models``; an endpoint whose model
        list could not be read counts as serving every model). Empty when none does."""
        found = self._by_model.get(model)
        if found is None:
            found = self._by_model[model] = [s.endpoint for s in self.states.values()
                                             if s.healthy and (not s.models or model in s.models)]
        return found

    def get(self, name: str) -> EndpointState | None:
        """The state of endpoint ``name``, or None."""
        return self.states.get(name)

    def models(self) -> list[str]:
        """Model names served by healthy endpoints, sorted, each once."""
        return sorted({m for s in self.states.values() if s.healthy for m in s.models})

    # ---- scrapes -------------------------------------------------------------------------------
    def record_metrics(self, state: EndpointState, metrics: EngineMetrics) -> None:
        """Put one successful scrape into the endpoint's :class:`Endpoint` (counts, the slot count
        stated by the engine — its ``/metrics``, else its ``/server_info`` answer scaled to its
        ranks — and the one learned, block fields), stamp it fresh and call ``on_change``."""
        ep = state.endpoint
        now = self.clock()
        ep.num_requests_waiting = metrics.num_requests_waiting
        ep.num_requests_running = metrics.num_requests_running
        learn_slots(ep, metrics.num_requests_running, metrics.num_requests_waiting, now)
        stated = metrics.max_num_seqs
        if stated is None and state.server_info_max_num_seqs is not None:
            stated = state.server_info_max_num_seqs * max(1, metrics.engine_ranks)
        state_slots(ep, stated)
        ep.kv_cache_usage_perc = metrics.kv_cache_usage_perc
        ep.num_preemptions = int(metrics.num_preemptions)
        if metrics.block_size is not None:
            ep.block_size = metrics.block_size
        if metrics.num_gpu_blocks is not None:
            ep.num_gpu_blocks = metrics.num_gpu_blocks
        if metrics.num_cpu_blocks is not None:
            ep.num_cpu_blocks = metrics.num_cpu_blocks
        ep.metrics_updated_at = now
        state.metrics = metrics
        self.on_change()

    # ---- in-flight counters ---------------------------------------------------------------------
    def started(self, endpoint: Endpoint, uncached_tokens: int, sheddable: bool = False) -> InFlight:
        """A request was forwarded to ``endpoint`` with ``uncached_tokens`` of prefill work;
        ``sheddable``: it is of a sheddable band (counted in ``in_flight_sheddable`` too)."""
        now = self.clock()
        endpoint.in_flight_requests += 1
        endpoint.in_flight_uncached_tokens += uncached_tokens
        share = InFlight(endpoint, uncached_tokens, self._generation.get(endpoint.name, 0), now, sheddable)
        if sheddable:
            endpoint.in_flight_sheddable += 1
            endpoint.in_flight_sheddable_prefill_tokens += uncached_tokens
            self._prefills.setdefault(endpoint.name, deque()).append(share)
        else:
            tau = self.interactive_rate_tau_s
            endpoint.interactive_rate_per_s = endpoint.interactive_rate(now, tau) + 1.0 / tau
            endpoint.interactive_rate_at = now
        return share

    def expire_prefills(self) -> None:
        """Stop counting as in prefill the sheddable requests sent over ``batch_prefill_window_s`` ago."""
        cutoff = self.clock() - self.batch_prefill_window_s
        emptied = []
        for name, queue in self._prefills.items():
            while queue and (queue[0].started_at <= cutoff or not queue[0].prefill):
                self._end_prefill(queue.popleft())
            if not queue:
                emptied.append(name)
        for name in emptied:  # so each read walks only the endpoints with sheddable work in prefill
            del self._prefills[name]

    def in_prefill(self, share: InFlight) -> bool:
        """Whether the request of ``share`` counts as in prefill now (sheddable ones only)."""
        return share.prefill and share.started_at > self.clock() - self.batch_prefill_window_s

    def _end_prefill(self, share: InFlight) -> None:
        if share.prefill:
            share.prefill = False
            if self._counts(share):
                ep = share.endpoint
                ep.in_flight_sheddable_prefill_tokens = max(0, ep.in_flight_sheddable_prefill_tokens - share.dispatched)

    def add_prefill(self, share: InFlight, tokens: int) -> None:
        """The request of ``share`` will prefill there after all (a disaggregated request whose
        prefill leg failed falls back to its decode endpoint): its ``tokens`` uncached prompt
        tokens join the endpoint's queued prefill work until its first chunk or its end."""
        if tokens <= 0 or not self._counts(share) or share.tokens:
            return
        share.tokens = share.dispatched = tokens
        share.endpoint.in_flight_uncached_tokens += tokens
        if share.prefill:  # a sheddable request still counted in the batch prefill share
            share.endpoint.in_flight_sheddable_prefill_tokens += tokens

    def first_chunk(self, share: InFlight) -> None:
        """The request's prefill is over: remove its uncached tokens (idempotent)."""
        self._end_prefill(share)
        if share.tokens and self._counts(share):
            ep = share.endpoint
            ep.in_flight_uncached_tokens = max(0, ep.in_flight_uncached_tokens - share.tokens)
        share.tokens = 0

    def finished(self, share: InFlight, completed: bool = False) -> None:
        """The request ended there: remove it from the endpoint's counters (once). With
        ``completed`` (the engine answered it to the end) its duration since :meth:`started` goes
        into the endpoint's ``mean_request_duration_s``."""
        self.first_chunk(share)
        if self._counts(share):
            ep = share.endpoint
            ep.in_flight_requests = max(0, ep.in_flight_requests - 1)
            if share.sheddable:
                ep.in_flight_sheddable = max(0, ep.in_flight_sheddable - 1)
            if completed:
                duration = max(0.0, self.clock() - share.started_at)
                mean = ep.mean_request_duration_s
                ep.mean_request_duration_s = duration if mean is None else \
                    mean + self.duration_ewma_alpha * (duration - mean)
                if not share.sheddable:
                    mean = ep.mean_interactive_duration_s
                    ep.mean_interactive_duration_s = duration if mean is None else \
                        mean + self.duration_ewma_alpha * (duration - mean)
        share.counted = False

    def _counts(self, share: InFlight) -> bool:
        if share.counted and share.generation != self._generation.get(share.endpoint.name, 0):
            share.counted = False  # the counters were reset since: this share is gone
        return share.counted

    # ---- internals ----------------------------------------------------------------------------
    def _rebuild(self) -> None:
        self._candidates = [s.endpoint for s in self.states.values() if s.healthy]
        self._by_model = {}
        self.on_change()

    def _down(self, name: str) -> None:
        state = self.states.get(name)
        self._generation[name] = self._generation.get(name, 0) + 1
        if state is not None:
            ep = state.endpoint
            ep.in_flight_requests = 0
            ep.in_flight_uncached_tokens = 0
            ep.in_flight_sheddable = 0
            ep.metrics_updated_at = None
            forget_slots(ep)  # it may come back as another engine
            state.server_info_max_num_seqs = None
            state.server_info_read = False
            ep.mean_request_duration_s = None
            ep.in_flight_sheddable_prefill_tokens = 0
            ep.interactive_rate_per_s = 0.0
            ep.interactive_rate_at = None
            ep.mean_interactive_duration_s = None
        self._prefills.pop(name, None)
        for hook in self._on_down:
            try:
                hook(name)
            except Exception:  # a hook's bug must not stop the others
                log.exception("on_down hook failed for %s", name)
