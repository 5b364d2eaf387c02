"""``spare-capacity-filter``: sheddable work only on engines with spare capacity.

For a sheddable request — its flow-control band is marked ``sheddable`` (the director sets
:attr:`LLMRequest.sheddable`), or its priority is below 0 (llm-d: negative priorities are
sheddable) — keeps only the endpoints whose saturation is below ``saturationThreshold``, when any
is; when none is (flow control off, or the gate let it through on a stale reading) every endpoint
is kept, so the filter never fails a decision. Other requests pass untouched.

Saturation is the router's detector, the same per-endpoint number flow control's per-engine gate
and ``/admin/state`` read (:mod:`router.scheduling.saturation`, with the scrape-lag credit): the
gate opens when some engine has room, and this filter sends the work there rather than to the
engine the prefix affinity prefers. Put it first in a profile, before the affinity filter.

Each decision's outcome (:class:`SpareCapacityOutcome`) goes into the CycleState under
``spare-capacity-outcome/<name>``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pydantic import Field

from router.scheduling.interfaces import PluginHandle
from router.scheduling.plugins.params import PluginParams, parse_params
from router.scheduling.saturation import SATURATED, SaturationThresholds, endpoint_saturation
from router.scheduling.types import CycleState, Endpoint, LLMRequest

SPARE_CAPACITY_FILTER_TYPE = "spare-capacity-filter"


class SpareCapacityOutcome(enum.StrEnum):
    """What the filter did for one decision (doubles as a metric label)."""

    NOT_SHEDDABLE = "not_sheddable"
    KEPT_SPARE = "kept_spare"
    NONE_SPARE = "none_spare"


class SpareCapacityParams(PluginParams):
    """``saturationThreshold`` (default 1.0: the saturation detector's "at a threshold", the
    value at which the per-engine gate holds sheddable work)."""

    saturation_threshold: float = Field(SATURATED, gt=0.0)


class SpareCapacityFilter:
    """See the module docstring.

    Args:
        name: instance name.
        params: the parameters.
        saturation: one endpoint's saturation now (the router's detector).
    """

    plugin_type = SPARE_CAPACITY_FILTER_TYPE

    def __init__(self, name: str, params: SpareCapacityParams, saturation: Callable[[Endpoint], float]) -> None:
        self.name = name
        self.params = params
        self._saturation = saturation
        self._outcome_key = f"spare-capacity-outcome/{name}"

    @staticmethod
    def is_sheddable(request: LLMRequest) -> bool:
        """A sheddable band's request, or a negative priority."""
        return request.sheddable or request.priority < 0

    def filter(self, state: CycleState, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        """The endpoints with spare capacity for a sheddable request, else all (module docstring)."""
        if not self.is_sheddable(request):
            state.write(self._outcome_key, SpareCapacityOutcome.NOT_SHEDDABLE)
            return list(endpoints)
        threshold = self.params.saturation_threshold
        kept = [ep for ep in endpoints if self._saturation(ep) < threshold]
        if not kept:
            state.write(self._outcome_key, SpareCapacityOutcome.NONE_SPARE)
            return list(endpoints)
        state.write(self._outcome_key, SpareCapacityOutcome.KEPT_SPARE)
        return kept


def build_spare_capacity_filter(name: str, raw: Mapping[str, Any] | None, handle: PluginHandle) -> SpareCapacityFilter:
    """Factory of ``spare-capacity-filter``; saturation from ``handle.saturation``, else the
    detector with llm-d's thresholds and the scrape-lag credit on ``handle.clock``."""
    params = parse_params(SpareCapacityParams, name, raw)
    saturation = handle.saturation
    if saturation is None:
        thresholds = SaturationThresholds(in_flight_credit=True)
        clock = handle.clock

        def saturation(endpoint: Endpoint) -> float:
            return endpoint_saturation(endpoint, clock(), thresholds)

    return SpareCapacityFilter(name, params, saturation)
