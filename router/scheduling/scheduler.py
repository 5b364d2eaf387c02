"""The scheduler: producers → filters → weighted scorers → picker, per profile.

One decision (:meth:`SchedulerProfile.run`):

1. every data producer the profile needs writes into a fresh :class:`CycleState`;
2. filters narrow the candidates, in order (an empty result raises :class:`NoCandidatesError`);
3. each scorer scores the remaining candidates; each score is clamped to [0, 1] (NaN → 0), times
   the scorer's weight, and summed per endpoint (llm-d ``scheduler_profile.go``);
4. the picker chooses one endpoint from the totals.

The decision does no I/O and changes no state except random draws and round-robin counters:
learning happens when the router commits to it, through :meth:`Scheduler.pre_request` (call it
just before forwarding), and :meth:`Scheduler.response_complete` when the response has finished.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from router.scheduling.errors import NoCandidatesError
from router.scheduling.interfaces import (
    DataProducer,
    Filter,
    Picker,
    PreRequest,
    ProfileHandler,
    ResponseComplete,
    Scorer,
)
from router.scheduling.types import CycleState, Endpoint, LLMRequest, PDDecision, SchedulingResult

#: :attr:`PDDecision.reason` of a decision made by one profile (no P/D profile handler, or a profile named).
SINGLE_PROFILE = "single_profile"

__all__ = ["Scheduler", "SchedulerProfile", "SchedulingResult", "clamp_unit"]


def clamp_unit(x: float) -> float:
    """``x`` clamped to [0, 1]; NaN becomes 0."""
    if not x > 0.0:  # also catches NaN
        return 0.0
    return 1.0 if x > 1.0 else x


class SchedulerProfile:
    """A named pipeline of plugins (built by :func:`router.scheduling.config.build_scheduler`).

    Args:
        name: profile name.
        producers: data producers to run first, in order.
        filters: filters, in order.
        scorers: (scorer, weight) pairs; weight ≥ 0.
        picker: the picker.
    """

    __slots__ = ("name", "producers", "filters", "scorers", "picker", "pre_request_hooks", "response_hooks",
                 "plugin_timer")

    def __init__(
        self,
        name: str,
        producers: Sequence[DataProducer],
        filters: Sequence[Filter],
        scorers: Sequence[tuple[Scorer, float]],
        picker: Picker,
    ) -> None:
        self.name = name
        self.producers = list(producers)
        self.filters = list(filters)
        self.scorers = list(scorers)
        self.picker = picker
        members: list[object] = [*self.producers, *self.filters, *(s for s, _ in self.scorers), picker]
        unique = list({id(p): p for p in members}.values())
        self.pre_request_hooks = [p for p in unique if isinstance(p, PreRequest)]
        self.response_hooks = [p for p in unique if isinstance(p, ResponseComplete)]
        #: Optional ``timer(plugin instance name, seconds)`` told each plugin's time per decision
        #: (the router's per-plugin decision histogram); a clock read costs ~0.1 µs.
        self.plugin_timer: Callable[[str, float], None] | None = None

    def run(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> SchedulingResult:
        """Decide where ``request`` goes among ``endpoints``.

        Raises:
            NoCandidatesError: ``endpoints`` is empty or a filter removed every endpoint.
        """
        if not endpoints:
            raise NoCandidatesError(f"profile {self.name!r}: no endpoints in the pool")
        timer, clock = self.plugin_timer, time.perf_counter
        state = CycleState()
        for producer in self.producers:
            t0 = clock()
            producer.produce(state, request, endpoints)
            if timer is not None:
                timer(producer.name, clock() - t0)  # type: ignore[attr-defined]
        candidates = list(endpoints)
        for flt in self.filters:
            t0 = clock()
            candidates = flt.filter(state, request, candidates)
            if timer is not None:
                timer(flt.name, clock() - t0)  # type: ignore[attr-defined]
            if not candidates:
                raise NoCandidatesError(f"profile {self.name!r}: filter {getattr(flt, 'name', flt)!r} removed every endpoint")
        n = len(candidates)
        totals = [0.0] * n
        scores: dict[str, list[float]] = {}
        for scorer, weight in self.scorers:
            t0 = clock()
            raw = scorer.score(state, request, candidates)
            if timer is not None:
                timer(scorer.name, clock() - t0)  # type: ignore[attr-defined]
            if len(raw) != n:
                raise ValueError(f"scorer {scorer.name!r} returned {len(raw)} scores for {n} endpoints")  # type: ignore[attr-defined]
            clamped = [clamp_unit(x) for x in raw]
            scores[scorer.name] = clamped  # type: ignore[attr-defined]
            for i in range(n):
                totals[i] += weight * clamped[i]
        t0 = clock()
        chosen = self.picker.pick(state, candidates, totals)
        if timer is not None:
            timer(self.picker.name, clock() - t0)  # type: ignore[attr-defined]
        return SchedulingResult(self.name, chosen, candidates, totals, scores, state)


class Scheduler:
    """The profiles of one configuration; the first is the default.

    Args:
        profiles: the profiles, by name, in config order (at least one).
        profile_handler: a profile handler bound to ``profiles`` (the
            :class:`~router.scheduling.interfaces.ProfileHandler` role; ``pd-profile-handler`` in
            the shipped P/D config): :meth:`decide` asks it; its decode profile becomes the default.
    """

    def __init__(self, profiles: dict[str, SchedulerProfile], profile_handler: ProfileHandler | None = None) -> None:
        if not profiles:
            raise ValueError("a scheduler needs at least one profile")
        self.profiles = profiles
        self.profile_handler = profile_handler
        self.default_profile = profile_handler.decode_profile if profile_handler is not None else next(iter(profiles))

    def decide(self, request: LLMRequest, endpoints: Sequence[Endpoint], profile: str | None = None,
               exclude_prefill: Sequence[str] = ()) -> PDDecision:
        """The whole decision for ``request``: with a P/D profile handler and no ``profile`` named,
        the handler's (decode pick, and a prefill pick when it disaggregates); otherwise one
        profile's pick as :attr:`PDDecision.decode` with reason :data:`SINGLE_PROFILE`.

        Raises:
            KeyError: unknown profile name.
            NoCandidatesError: nothing to route to (no decode candidate).
        """
        if self.profile_handler is not None and profile is None:
            return self.profile_handler.decide(request, endpoints, exclude_prefill)
        result = self.schedule(request, endpoints, profile)
        return PDDecision(result, None, SINGLE_PROFILE, request.prompt_tokens)

    def schedule_prefill(self, request: LLMRequest, endpoints: Sequence[Endpoint],
                         exclude: Sequence[str] = ()) -> SchedulingResult | None:
        """The P/D handler's prefill profile over ``endpoints`` not in ``exclude`` (a retry after a
        failed prefill); None without a handler or a candidate."""
        if self.profile_handler is None:
            return None
        return self.profile_handler.prefill(request, endpoints, exclude)

    def schedule(self, request: LLMRequest, endpoints: Sequence[Endpoint], profile: str | None = None) -> SchedulingResult:
        """Run ``profile`` (default: the first) for ``request`` over ``endpoints``.

        Raises:
            KeyError: unknown profile name.
            NoCandidatesError: nothing to route to.
        """
        return self.profiles[profile or self.default_profile].run(request, endpoints)

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        """The router commits to ``result`` (about to forward): the profile's plugins learn from it."""
        for hook in self.profiles[result.profile].pre_request_hooks:
            hook.pre_request(request, result)

    def response_complete(self, request: LLMRequest, result: SchedulingResult, cached_tokens: int | None) -> None:
        """The response to ``request`` has finished; ``cached_tokens`` from its usage, if reported."""
        for hook in self.profiles[result.profile].response_hooks:
            hook.response_complete(request, result.endpoint, cached_tokens)
