"""The director's decision rules as plain functions: no I/O, no clock, no state of their own.

:meth:`router.director.Director.forward` makes its choices through these, so anything that replays
the router's request flow without HTTP (the virtual-time fleet simulator) calls the same rules
instead of copying them:

* the P/D legs of a decision: what the decode endpoint's share counts (:func:`decode_share_tokens`)
  and, when the prefill leg fails for good, what it counts after all (:func:`fallback_prefill_tokens`);
* whether a failed prefill leg is tried on another prefill engine (:func:`should_retry_prefill`,
  :data:`MAX_PREFILL_TRIES`);
* make-room: why to evict for a non-sheddable request (:func:`make_room_reason`) and whom
  (:func:`pick_victim`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, TypeVar

from router.scheduling.saturation import effective_waiting, free_slots, unseen_requests
from router.scheduling.scheduler import SINGLE_PROFILE
from router.scheduling.types import Endpoint, LLMRequest, PDDecision, PrefixMatchInfo, SchedulingResult

#: Prefill legs a disaggregated request tries at most (the decision's pick, then one other).
MAX_PREFILL_TRIES = 2

#: A prefill leg's failure of a 4xx answer other than 408 / 429: the request itself is at fault,
#: so no other prefill engine is tried; the decode engine runs it whole and answers the client.
PREFILL_CLIENT_ERROR = "client_error"

#: Reasons of an eviction for a non-sheddable request (``RouterObserver.evicted``; :func:`make_room_reason`).
NO_FREE_SLOT = "no_free_slot"
BATCH_PREFILL = "batch_prefill"
ENGINE_QUEUE = "engine_queue"


def prefix_info(result: SchedulingResult) -> PrefixMatchInfo | None:
    """The prefix matches the decision's producer found (whatever its name), None without one."""
    return result.state.first(PrefixMatchInfo)


def uncached_tokens(result: SchedulingResult, request: LLMRequest) -> int:
    """Prompt tokens the chosen endpoint is expected to compute (tokens): the prompt minus the
    prefix the decision's producer found there; the whole prompt when no producer ran."""
    info = prefix_info(result)
    if info is None:
        return request.prompt_tokens
    return info.uncached_tokens(result.endpoint.name, request.prompt_tokens)


def decode_share_tokens(decision: PDDecision, request: LLMRequest) -> int:
    """Uncached prompt tokens the decode endpoint's in-flight share counts from the decision on:
    none when a prefill engine computes the prompt (the decode engine receives its KV); the
    decision's own count for a P/D handler's decision; for one profile's pick, the prompt minus
    the prefix its producer found there (:func:`uncached_tokens`)."""
    if decision.prefill is not None:
        return 0
    if decision.reason == SINGLE_PROFILE:
        return uncached_tokens(decision.decode, request)
    return decision.uncached_tokens


def fallback_prefill_tokens(decision: PDDecision) -> int:
    """Tokens the decode endpoint computes after all when no prefill leg answered (the request runs
    aggregated there; they join its share, ``PoolState.add_prefill``)."""
    return decision.uncached_tokens


def prefill_failure_retryable(failure: str | None) -> bool:
    """Another prefill engine may do better after ``failure`` (anything but a 4xx about the
    request itself, :data:`PREFILL_CLIENT_ERROR`)."""
    return failure != PREFILL_CLIENT_ERROR


def should_retry_prefill(failure: str | None, tries: int) -> bool:
    """Whether a prefill leg that failed with ``failure`` (a ``PrefillAnswer.failure``) after
    ``tries`` legs (≥ 1) is tried on another prefill engine: fewer than :data:`MAX_PREFILL_TRIES`
    tries and a retryable failure (:func:`prefill_failure_retryable`)."""
    return tries < MAX_PREFILL_TRIES and prefill_failure_retryable(failure)


def no_free_slot(endpoint: Endpoint) -> bool:
    """The endpoint's slot count is known (:attr:`Endpoint.slots`) and they are all taken:
    ``running + unseen ≥ slots`` (the last scrape's running requests plus the router's requests the
    scrape does not show yet, :func:`router.scheduling.saturation.unseen_requests`) and the router's
    own requests in flight there fill the slots too."""
    slots = endpoint.slots
    return slots is not None and free_slots(endpoint) <= unseen_requests(endpoint) \
        and endpoint.in_flight_requests >= slots


V = TypeVar("V")


def make_room_reason(endpoint: Endpoint, victims: Sequence[V], *, make_room: bool, evict_on_wait: bool,
                     prefilling: Callable[[Sequence[V]], list[V]]) -> tuple[str, Sequence[V]] | None:
    """Why a non-sheddable request about to go to ``endpoint`` evicts one of ``victims`` (the
    sheddable requests running there, none interrupted yet), and among which; None: no eviction.

    In order: ``no_free_slot`` with ``make_room`` when :func:`no_free_slot`; else, with
    ``evict_on_wait``, ``batch_prefill`` among the victims still in prefill (``prefilling(victims)``,
    asked only then), else ``engine_queue`` when requests wait there
    (:func:`router.scheduling.saturation.effective_waiting` > 0). The director's docstring of
    ``make_room`` gives the reasoning.
    """
    if not victims:
        return None
    if make_room and no_free_slot(endpoint):
        return NO_FREE_SLOT, victims
    if evict_on_wait:
        in_prefill = prefilling(victims)
        if in_prefill:
            return BATCH_PREFILL, in_prefill
        if effective_waiting(endpoint) > 0:
            return ENGINE_QUEUE, victims
    return None


class Victim(Protocol):
    """A running request make-room may evict."""

    @property
    def priority(self) -> int:
        """Its band's priority (higher first)."""

    @property
    def started_at(self) -> float:
        """When it was forwarded (the pool's clock)."""


W = TypeVar("W", bound=Victim)


def pick_victim(victims: Iterable[W]) -> W:
    """The request to evict: lowest band priority first, then the most recently started (the least
    work lost: llm-d's eviction order).

    Raises:
        ValueError: ``victims`` is empty.
    """
    return min(victims, key=lambda v: (v.priority, -v.started_at))
