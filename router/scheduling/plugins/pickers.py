"""Pickers: choose one endpoint from the scored candidates.

* ``max-score-picker`` (llm-d): the highest total score; ties (within 1e-9) broken at random.
* ``weighted-random-picker`` (llm-d): probability proportional to the total score; uniform when
  every score is 0 (llm-d samples with A-Res, which for one pick is the same distribution).
* ``random-picker`` (llm-d): uniform over the candidates.
* ``round-robin-picker`` (ours, the baseline): the candidates in turn, ignoring scores.

All randomness comes from the handle's ``rng`` so a seeded ``random.Random`` makes decisions
reproducible. llm-d's ``maxNumOfEndpoints`` is accepted for config compatibility; only 1 is
supported (the router forwards to one engine).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pydantic import Field

from router.scheduling.interfaces import PluginHandle
from router.scheduling.plugins.params import PluginParams, parse_params
from router.scheduling.types import CycleState, Endpoint

MAX_SCORE_PICKER_TYPE = "max-score-picker"
WEIGHTED_RANDOM_PICKER_TYPE = "weighted-random-picker"
RANDOM_PICKER_TYPE = "random-picker"
ROUND_ROBIN_PICKER_TYPE = "round-robin-picker"

_TIE_EPSILON = 1e-9


class PickerParams(PluginParams):
    """``maxNumOfEndpoints``: must be 1 (llm-d's default)."""

    max_num_of_endpoints: int = Field(1, ge=1, le=1)


class _RandomisedPicker:
    """A picker drawing from the handle's rng."""

    plugin_type = ""

    def __init__(self, name: str, rng: random.Random) -> None:
        self.name = name
        self._rng = rng


class MaxScorePicker(_RandomisedPicker):
    """Highest total wins; ties at random."""

    plugin_type = MAX_SCORE_PICKER_TYPE

    def pick(self, state: CycleState, endpoints: Sequence[Endpoint], totals: Sequence[float]) -> Endpoint:
        """The endpoint with the highest total (a random one among ties)."""
        best = max(totals)
        tied = [i for i, t in enumerate(totals) if best - t <= _TIE_EPSILON]
        return endpoints[tied[0] if len(tied) == 1 else self._rng.choice(tied)]


class WeightedRandomPicker(_RandomisedPicker):
    """Probability proportional to the total score."""

    plugin_type = WEIGHTED_RANDOM_PICKER_TYPE

    def pick(self, state: CycleState, endpoints: Sequence[Endpoint], totals: Sequence[float]) -> Endpoint:
        """A draw weighted by ``max(0, total)``; uniform when all are 0."""
        weights = [t if t > 0.0 else 0.0 for t in totals]
        total = sum(weights)
        if total <= 0.0:
            return self._rng.choice(endpoints)
        point = self._rng.random() * total
        acc = 0.0
        for ep, w in zip(endpoints, weights):
            acc += w
            if point < acc:
                return ep
        return endpoints[max(i for i, w in enumerate(weights) if w > 0.0)]  # float round-off at the top


class RandomPicker(_RandomisedPicker):
    """Uniform over the candidates."""

    plugin_type = RANDOM_PICKER_TYPE

    def pick(self, state: CycleState, endpoints: Sequence[Endpoint], totals: Sequence[float]) -> Endpoint:
        """A uniformly random candidate."""
        return self._rng.choice(endpoints)


class RoundRobinPicker:
    """Candidate ``k mod n`` on the k-th decision (the round-robin baseline)."""

    plugin_type = ROUND_ROBIN_PICKER_TYPE

    def __init__(self, name: str) -> None:
        self.name = name
        self._next = 0

    def pick(self, state: CycleState, endpoints: Sequence[Endpoint], totals: Sequence[float]) -> Endpoint:
        """The next candidate in turn."""
        ep = endpoints[self._next % len(endpoints)]
        self._next += 1
        return ep


def _rng_picker_factory(cls: type[_RandomisedPicker]) -> Callable[..., object]:
    def build(name: str, raw: Mapping[str, Any] | None, handle: PluginHandle) -> object:
        parse_params(PickerParams, name, raw)
        return cls(name, handle.rng)

    build.__doc__ = f"Factory of ``{cls.plugin_type}`` (uses the handle's rng)."
    return build


build_max_score_picker = _rng_picker_factory(MaxScorePicker)
build_weighted_random_picker = _rng_picker_factory(WeightedRandomPicker)
build_random_picker = _rng_picker_factory(RandomPicker)


def build_round_robin_picker(name: str, raw: Mapping[str, Any] | None, handle: PluginHandle) -> RoundRobinPicker:
    """Factory of ``round-robin-picker``."""
    parse_params(PickerParams, name, raw)
    return RoundRobinPicker(name)
