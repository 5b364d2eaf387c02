"""``session-affinity-scorer``: send a session's requests to the endpoint that served its last one.

Stateful, like llm-d's ``session_id_header`` algorithm: the router keeps ``session id → endpoint``
bindings, made or refreshed on every committed decision (:meth:`pre_request`) and dropped after
``evictionTtlSeconds`` unused. Score 1.0 for the bound endpoint, 0.0 for the others; a request
without a session, or with an unbound one, scores 0.0 everywhere (no opinion: the other scorers
decide, and the decision creates the binding). A bound endpoint that is no longer a candidate simply
gets no score; the next decision rebinds the session. Memory is bounded by ``maxSessions`` (ours),
the least recently used binding going first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import Field

from router.scheduling.interfaces import PluginHandle
from router.scheduling.plugins.params import PluginParams, parse_params
from router.scheduling.types import CycleState, Endpoint, LLMRequest

if TYPE_CHECKING:
    from router.scheduling.types import SchedulingResult

SESSION_AFFINITY_TYPE = "session-affinity-scorer"


class SessionAffinityParams(PluginParams):
    """``evictionTtlSeconds`` (s, default 600: llm-d's); ``maxSessions`` (bindings, default 100000)."""

    eviction_ttl_seconds: float = Field(600.0, gt=0.0)
    max_sessions: int = Field(100_000, ge=1)


class SessionAffinityScorer:
    """See the module docstring. Bindings live in an ``OrderedDict`` ordered by last use."""

    plugin_type = SESSION_AFFINITY_TYPE

    def __init__(self, name: str, params: SessionAffinityParams, clock: Callable[[], float]) -> None:
        self.name = name
        self.params = params
        self._clock = clock
        self._bindings: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def bound_endpoint(self, session_id: str) -> str | None:
        """The endpoint name bound to ``session_id``, or None (unbound or expired)."""
        entry = self._bindings.get(session_id)
        if entry is None or self._clock() - entry[1] > self.params.eviction_ttl_seconds:
            return None
        return entry[0]

    def score(self, state: CycleState, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[float]:
        """1.0 for the session's endpoint, 0.0 elsewhere."""
        bound = self.bound_endpoint(request.session_id) if request.session_id else None
        if bound is None:
            return [0.0] * len(endpoints)
        return [1.0 if ep.name == bound else 0.0 for ep in endpoints]

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        """Bind (or refresh) the request's session to the chosen endpoint; evict expired bindings."""
        if not request.session_id:
            return
        now = self._clock()
        bindings = self._bindings
        bindings[request.session_id] = (result.endpoint.name, now)
        bindings.move_to_end(request.session_id)
        ttl = self.params.eviction_ttl_seconds
        while bindings:
            _, (_, used_at) = next(iter(bindings.items()))
            if now - used_at <= ttl and len(bindings) <= self.params.max_sessions:
                break
            bindings.popitem(last=False)


def build_session_affinity(name: str, raw: Mapping[str, Any] | None, handle: PluginHandle) -> SessionAffinityScorer:
    """Factory of ``session-affinity-scorer``."""
    return SessionAffinityScorer(name, parse_params(SessionAffinityParams, name, raw), handle.clock)
