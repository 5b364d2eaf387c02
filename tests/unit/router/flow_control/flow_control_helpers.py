"""Helpers of the flow-control tests: small configs, items, saturation signals."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from router.flow_control import FlowControlConfig, FlowControlCore, FlowItem, Ticket


def config(*, eviction: bool = False, eviction_interval_s: float = 1.0, **bands: dict[str, Any]) -> FlowControlConfig:
    """Three bands (interactive 100 bypassing up to 2, async 10 and batch −10 sheddable), roomy
    limits, 60 s TTL; ``bands[objective]`` overrides that band's fields."""
    base = {
        "interactive": {"priority": 100, "bypass_saturation": True, "max_in_flight": 2},
        "async": {"priority": 10, "sheddable": True},
        "batch": {"priority": -10, "sheddable": True},
    }
    specs = []
    for objective, spec in base.items():
        merged = {"objective": objective, "ttl_s": 60.0, "max_queued_requests": 1000,
                  "max_queued_bytes": 10**9, **spec, **bands.get(objective, {})}
        specs.append(merged)
    return FlowControlConfig.from_mapping({"bands": specs, "eviction": eviction,
                                           "eviction_interval_s": eviction_interval_s})


def item(rid: str, tenant: str = "t", objective: str | None = "batch", size: int = 10,
         deadline: float | None = None) -> FlowItem:
    return FlowItem(rid, tenant, objective, size, deadline)


def ids(tickets: Iterable[Ticket]) -> list[str]:
    return [t.item.request_id for t in tickets]


def open_pool() -> float:
    return 0.0


def full_pool() -> float:
    return 1.0


class Slots:
    """A pool with ``capacity`` request slots: saturation = in flight in the core / capacity, so it
    changes with every dispatch the way the router's signal does between scrapes."""

    def __init__(self, core: FlowControlCore, capacity: int) -> None:
        self.core, self.capacity = core, capacity

    def __call__(self) -> float:
        in_flight = sum(b["in_flight"] for b in self.core.stats(0.0)["bands"])
        return in_flight / self.capacity


def band_stats(core_or_stats: Any, objective: str, now: float = 0.0) -> dict[str, Any]:
    stats = core_or_stats if isinstance(core_or_stats, dict) else core_or_stats.stats(now)
    return next(b for b in stats["bands"] if b["objective"] == objective)


class Clock:
    """A fake monotonic clock, seconds."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Level:
    """A saturation signal the test sets by hand (``value``); raises if ``error`` is set."""

    def __init__(self, value: float) -> None:
        self.value = value
        self.error: Exception | None = None

    def __call__(self) -> float:
        if self.error is not None:
            raise self.error
        return self.value
