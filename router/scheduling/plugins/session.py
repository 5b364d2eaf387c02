"""Sessions: ``session-affinity-filter`` and ``session-affinity-scorer`` keep a session on its engine.

A session is what :func:`router.parsing.session_id` reads (``x-session-id``, or the session header
Claude Code, OpenAI Codex or OpenCode send). Both plugins are stateful, like llm-d's
``session_id_header`` strategy: the router keeps ``session id → endpoint`` bindings, made or moved on
every committed decision (:meth:`pre_request`) and dropped after ``evictionTtlSeconds`` unused, the
least recently used first once there are ``maxSessions``.

* ``session-affinity-filter`` (the shipped profiles): a bound session **stays on the engine holding
  its prefix** — the filter keeps that endpoint alone — **unless that engine is saturated**
  (saturation ≥ ``saturationThreshold``, :mod:`router.scheduling.saturation`: the queue and KV terms
  for an interactive request, the sheddable value for a sheddable one). Then the filter **releases**
  the session: every endpoint stays a candidate and the move is judged by the same cost as any
  other request's — ``prefix-cache-affinity-filter``'s move rule (the session's prefix is on its
  engine, so that engine is a holder: the session leaves only when the saving pays for the
  recompute it costs the fleet; a saturated engine alone is no reason, when every engine is
  busy). When the decision picks another engine the session **moves once, whole**: the binding
  moves there, so the session's later turns follow it (they find their prefix there now) instead
  of going back. A request without a session, an unbound session, or one
  whose endpoint is not a candidate passes the filter untouched (the decision makes the binding).
  Like llm-d's ``session-affinity-filter`` it never empties the candidate set.
* ``session-affinity-scorer``: 1.0 for the bound endpoint, 0.0 elsewhere (llm-d's scorer shape; no
  saturation check — the other scorers weigh load).

**Working set of idle sessions.** An agent between turns (a tool call running) holds no request
on its engine, so the engine counts the session's KV blocks as free (vLLM frees a finished
request's blocks into the prefix cache's free queue, and ``kv_cache_usage_perc`` counts used
blocks), but the session's next turn needs them within seconds. Each binding remembers the prompt
tokens of the session's last request; :meth:`SessionAffinity.working_set_tokens` sums, per
endpoint, those of the sessions with nothing in flight whose last request ended within
``workingSetWindowSeconds``. The router adds that to the KV term of the saturation sheddable work
is gated on (:func:`router.scheduling.saturation.endpoint_saturation`, ``working_set_tokens``), so
batch does not take the capacity those agents are about to need back. The last prompt is a lower
bound of what the next turn reuses (the answer and the new input come on top); sessions that share
a system prompt count it once each (an upper bound for that part); both are estimates.

Default window 120 s: llm-d's ``turnPriorityInactivitySeconds`` (llm-d/llm-d-router PR #2116,
program-aware fairness README), the time after which llm-d counts an idle agent as gone cold, and
well past the pauses agent traces show between turns (tool calls of seconds to tens of seconds,
Continuum, arXiv 2511.02230, fig. 3). 0 turns the term off.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import Field

from router.scheduling.interfaces import PluginHandle
from router.scheduling.plugins.params import PluginParams, parse_params
from router.scheduling.saturation import SATURATED, SaturationThresholds, endpoint_saturation
from router.scheduling.types import CycleState, Endpoint, LLMRequest

if TYPE_CHECKING:
    from router.scheduling.types import SchedulingResult

SESSION_AFFINITY_TYPE = "session-affinity-scorer"
SESSION_FILTER_TYPE = "session-affinity-filter"

#: Default of ``workingSetWindowSeconds`` (module docstring: the reasoning).
DEFAULT_WORKING_SET_WINDOW_S = 120.0


class SessionAffinityParams(PluginParams):
    """``evictionTtlSeconds`` (s, default 600: llm-d's scorer's); ``maxSessions`` (bindings, default
    100000, ours); ``saturationThreshold`` (filter: a bound endpoint at or above it releases the
    session to the move rule; default 1.0, the detector's "at a threshold");
    ``workingSetWindowSeconds`` (s, default 120, module docstring; 0: no working-set term)."""

    eviction_ttl_seconds: float = Field(600.0, gt=0.0)
    max_sessions: int = Field(100_000, ge=1)
    saturation_threshold: float = Field(SATURATED, gt=0.0)
    working_set_window_seconds: float = Field(DEFAULT_WORKING_SET_WINDOW_S, ge=0.0)


class SessionOutcome:
    """What the filter did for one decision (``session-affinity-outcome/<name>`` in the CycleState)."""

    NO_SESSION = "no_session"
    UNBOUND = "unbound"
    KEPT = "kept"
    RELEASED = "released"


@dataclass(slots=True)
class _Binding:
    endpoint: str
    used_at: float  # last decision or last end of a request, router clock seconds
    tokens: int = 0  # prompt tokens of the session's last request
    in_flight: int = 0
    idle_counted: bool = False  # its tokens are in the endpoint's working set


class SessionAffinity:
    """The binding store (module docstring); the roles are its subclasses' (a filter instance is
    no Scorer, the scorer no Filter), one instance one store.

    Args:
        name: instance name.
        params: the parameters.
        clock: seconds, monotonic (the handle's).
        saturation: one endpoint's saturation for sheddable work (the handle's); None: the detector
            with llm-d's thresholds and the scrape-lag credit.
    """

    plugin_type = ""

    def __init__(self, name: str, params: SessionAffinityParams, clock: Callable[[], float],
                 saturation: Callable[[Endpoint], float] | None = None) -> None:
        self.name = name
        self.params = params
        self._clock = clock
        self._sheddable_saturation = saturation
        self._thresholds = SaturationThresholds(in_flight_credit=True)
        self._bindings: OrderedDict[str, _Binding] = OrderedDict()  # by last use, oldest first
        self._idle: OrderedDict[str, None] = OrderedDict()  # sessions counted idle, by idle start
        self._idle_tokens: dict[str, int] = {}  # endpoint → Σ tokens of its counted idle sessions
        self._outcome_key = f"session-affinity-outcome/{name}"
        self.moves_total = 0

    # ---- queries -------------------------------------------------------------------------------
    def bound_endpoint(self, session_id: str) -> str | None:
        """The endpoint name bound to ``session_id``, or None (unbound or expired)."""
        entry = self._bindings.get(session_id)
        if entry is None or self._clock() - entry.used_at > self.params.eviction_ttl_seconds:
            return None
        return entry.endpoint

    def working_set_tokens(self) -> dict[str, int]:
        """Endpoint name → prompt tokens of its idle sessions active within the window (module
        docstring), tokens; endpoints without any are absent. Empty with the window 0."""
        self._expire_idle(self._clock())
        return {name: tokens for name, tokens in self._idle_tokens.items() if tokens > 0}

    def working_set_tokens_at(self, name: str) -> int:
        """``working_set_tokens().get(name, 0)`` without building the map (the saturation read per
        endpoint of a sheddable decision would otherwise cost O(endpoints) each), tokens."""
        self._expire_idle(self._clock())
        tokens = self._idle_tokens.get(name, 0)
        return tokens if tokens > 0 else 0

    @property
    def sessions(self) -> int:
        """Bindings held (expired ones included until the next decision sweeps them)."""
        return len(self._bindings)

    # ---- plugin roles --------------------------------------------------------------------------
    def saturated(self, endpoint: Endpoint, request: LLMRequest) -> bool:
        """Whether ``endpoint`` is too saturated to keep ``request``'s session (module docstring)."""
        if request.sheddable and self._sheddable_saturation is not None:
            value = self._sheddable_saturation(endpoint)
        else:
            value = endpoint_saturation(endpoint, self._clock(), self._thresholds, reserve=request.sheddable)
        return value >= self.params.saturation_threshold

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        """Bind the request's session to the chosen endpoint (moving it when it was elsewhere),
        count the request in flight, and evict bindings unused past the TTL or beyond the cap."""
        sid = request.session_id
        if not sid:
            return
        now = self._clock()
        name = result.endpoint.name
        entry = self._bindings.get(sid)
        if entry is None:
            entry = self._bindings[sid] = _Binding(name, now)
        else:
            self._uncount_idle(sid, entry)
            if entry.endpoint != name:
                self.moves_total += 1
            entry.endpoint = name
            entry.used_at = now
            self._bindings.move_to_end(sid)
        entry.tokens = request.prompt_tokens
        entry.in_flight += 1
        self._evict(now)

    def response_complete(self, request: LLMRequest, endpoint: Endpoint, cached_tokens: int | None) -> None:
        """The session's request ended: with nothing else in flight it is idle from now, and its
        tokens count in its endpoint's working set for the window."""
        sid = request.session_id
        entry = self._bindings.get(sid) if sid else None
        if entry is None or entry.in_flight == 0:
            return
        entry.in_flight -= 1
        now = self._clock()
        entry.used_at = now
        assert sid is not None
        self._bindings.move_to_end(sid)
        if entry.in_flight == 0 and self.params.working_set_window_seconds > 0:
            entry.idle_counted = True
            self._idle[sid] = None
            self._idle.move_to_end(sid)
            self._idle_tokens[entry.endpoint] = self._idle_tokens.get(entry.endpoint, 0) + entry.tokens

    def forget_endpoint(self, name: str) -> None:
        """Pool hook: ``name`` went down; its sessions lose their binding (their next turn is placed
        afresh) and its working set is gone."""
        for sid in [sid for sid, entry in self._bindings.items() if entry.endpoint == name]:
            self._drop(sid)
        self._idle_tokens.pop(name, None)

    # ---- internals -----------------------------------------------------------------------------
    def _uncount_idle(self, sid: str, entry: _Binding) -> None:
        if entry.idle_counted:
            entry.idle_counted = False
            self._idle.pop(sid, None)
            self._idle_tokens[entry.endpoint] = self._idle_tokens.get(entry.endpoint, 0) - entry.tokens

    def _drop(self, sid: str) -> None:
        entry = self._bindings.pop(sid, None)
        if entry is not None:
            self._uncount_idle(sid, entry)

    def _expire_idle(self, now: float) -> None:
        window = self.params.working_set_window_seconds
        while self._idle:
            sid = next(iter(self._idle))
            entry = self._bindings.get(sid)
            if entry is not None and now - entry.used_at <= window:
                break
            if entry is None:
                self._idle.pop(sid)
            else:
                self._uncount_idle(sid, entry)

    def _evict(self, now: float) -> None:
        ttl = self.params.eviction_ttl_seconds
        bindings = self._bindings
        while bindings:
            sid, entry = next(iter(bindings.items()))
            if now - entry.used_at <= ttl and len(bindings) <= self.params.max_sessions:
                break
            self._drop(sid)


class SessionAffinityFilter(SessionAffinity):
    """``session-affinity-filter``: the store playing the Filter role."""

    plugin_type = SESSION_FILTER_TYPE

    def filter(self, state: CycleState, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        """The session's endpoint alone; all endpoints when it is saturated (the move rule decides)
        or the session is unbound (module docstring)."""
        bound = self.bound_endpoint(request.session_id) if request.session_id else None
        target = next((ep for ep in endpoints if ep.name == bound), None) if bound is not None else None
        if target is None:
            state.write(self._outcome_key, SessionOutcome.UNBOUND if request.session_id else SessionOutcome.NO_SESSION)
            return list(endpoints)
        if len(endpoints) > 1 and self.saturated(target, request):
            state.write(self._outcome_key, SessionOutcome.RELEASED)
            return list(endpoints)
        state.write(self._outcome_key, SessionOutcome.KEPT)
        return [target]


class SessionAffinityScorer(SessionAffinity):
    """``session-affinity-scorer``: the store playing the Scorer role."""

    plugin_type = SESSION_AFFINITY_TYPE

    def score(self, state: CycleState, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[float]:
        """1.0 for the session's endpoint, 0.0 elsewhere."""
        bound = self.bound_endpoint(request.session_id) if request.session_id else None
        if bound is None:
            return [0.0] * len(endpoints)
        return [1.0 if ep.name == bound else 0.0 for ep in endpoints]


class SessionWorkingSet:
    """A session plugin's working set as the router reads it: calling it gives the whole map
    (:meth:`SessionAffinity.working_set_tokens`), :meth:`tokens` one endpoint's entry."""

    __slots__ = ("plugin",)

    def __init__(self, plugin: SessionAffinity) -> None:
        self.plugin = plugin

    def __call__(self) -> dict[str, int]:
        """Endpoint name → idle sessions' tokens there (endpoints without any absent)."""
        return self.plugin.working_set_tokens()

    def tokens(self, name: str) -> int:
        """The idle sessions' tokens on endpoint ``name`` (0 when none), in O(1) amortized."""
        return self.plugin.working_set_tokens_at(name)


def working_set_of(plugins: Sequence[object]) -> SessionWorkingSet | None:
    """The working-set source among ``plugins`` (the first session plugin with a window), or None."""
    for plugin in plugins:
        if isinstance(plugin, SessionAffinity) and plugin.params.working_set_window_seconds > 0:
            return SessionWorkingSet(plugin)
    return None


def build_session_affinity(name: str, raw: Mapping[str, Any] | None, handle: PluginHandle) -> SessionAffinityScorer:
    """Factory of ``session-affinity-scorer``."""
    return SessionAffinityScorer(name, parse_params(SessionAffinityParams, name, raw), handle.clock,
                                 handle.saturation)


def build_session_filter(name: str, raw: Mapping[str, Any] | None, handle: PluginHandle) -> SessionAffinityFilter:
    """Factory of ``session-affinity-filter``."""
    return SessionAffinityFilter(name, parse_params(SessionAffinityParams, name, raw), handle.clock,
                                 handle.saturation)


__all__ = ["DEFAULT_WORKING_SET_WINDOW_S", "SESSION_AFFINITY_TYPE", "SESSION_FILTER_TYPE", "SessionAffinity",
           "SessionAffinityFilter", "SessionAffinityParams", "SessionAffinityScorer", "SessionOutcome",
           "SessionWorkingSet", "working_set_of"]
