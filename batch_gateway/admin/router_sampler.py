"""The sampler that keeps the recent past of the router's admin state for the dashboard.

``GET {BACKFILL_ROUTER_URL}/admin/state`` answers :class:`common.contracts.router_state.RouterState`.

:class:`RouterSampler` polls it every ``router_poll_seconds`` into a ring buffer of
``router_history`` samples (a ``deque``), from which the lanes page draws saturation and dispatch
rate over time. A router that is down or answers garbage is recorded as ``last_error``; the pages
say so instead of failing.

Several router replicas behind one Service: each poll may reach another replica, and the state
carries no instance id. :func:`rates` therefore splits the samples into *counter tracks* (each
replica's counters only grow) and takes differences only within a track; see there.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import httpx
from pydantic import ValidationError

from batch_gateway.admin.polling import Poller
from common.contracts.router_state import RouterState

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Sample:
    """A state and the local Unix time it was read at."""

    at: float
    state: RouterState


class RouterSampler(Poller):
    """Reads ``{router_url}/admin/state`` every ``interval_s`` seconds into a ring of ``history``
    samples. :meth:`start` and :meth:`stop` run it as an asyncio task; :meth:`poll_once` reads once."""

    name = "admin-router-sampler"

    def __init__(self, router_url: str, interval_s: float, history: int,
                 transport: httpx.AsyncBaseTransport | None = None):
        super().__init__(interval_s, min(2.0, max(interval_s, 0.5)), transport)
        self.url = router_url.rstrip("/") + "/admin/state"
        self.samples: deque[Sample] = deque(maxlen=history)
        self.last_error: str | None = None
        self.last_error_at: float | None = None

    @property
    def stale_after_s(self) -> float:
        """Age (s) past which the latest sample is unknown, not live: one poll interval and one
        read's timeout."""
        return self.interval_s + float(self._client.timeout.read or 0.0)

    @property
    def latest(self) -> Sample | None:
        """The newest sample, or None before the first one."""
        return self.samples[-1] if self.samples else None

    @property
    def reachable(self) -> bool:
        """Whether the last read succeeded."""
        return self.latest is not None and (self.last_error_at is None or self.last_error_at < self.latest.at)

    async def poll_once(self) -> None:
        """Read the state once; on failure keep the samples and set ``last_error``."""
        try:
            response = await self._client.get(self.url)
            response.raise_for_status()
            state = RouterState.model_validate_json(response.content)
        except httpx.HTTPStatusError as exc:
            self._failed(f"the router answered HTTP {exc.response.status_code}")
        except httpx.HTTPError as exc:
            self._failed(f"the router is unreachable ({type(exc).__name__})")
        except ValidationError as exc:
            self._failed(f"the router's state is malformed ({exc.error_count()} errors)")
        else:
            self.samples.append(Sample(at=time.time(), state=state))

    def _failed(self, message: str) -> None:
        if self.last_error != message:
            log.warning("router state unavailable", extra={"action": "admin_router_poll_failed",
                                                           "url": self.url, "error": message})
        self.last_error, self.last_error_at = message, time.time()


MAX_TRACKS = 8
"""Counter tracks :func:`rates` follows at once (router replicas plus restarts in the window)."""


def _counters(state: RouterState) -> dict[str, int]:
    out = {}
    for band in state.bands:
        out[f"d:{band.objective}"] = band.dispatched_total
        out.update({f"s:{band.objective}:{reason}": n for reason, n in band.shed_total.items()})
        out.update({f"r:{band.objective}:{reason}": n for reason, n in band.refused_total.items()})
    return out


def _growth(before: dict[str, int], after: dict[str, int]) -> int | None:
    """How much the counters grew from ``before`` to ``after``, or None when one went down (not the
    same router instance, or it restarted)."""
    shared = before.keys() & after.keys()
    if not shared or any(after[key] < before[key] for key in shared):
        return None
    return sum(after[key] - before[key] for key in shared)


def rates(samples: list[Sample]) -> dict[str, list[tuple[float, float]]]:
    """Dispatch rate per objective: ``{objective: [(unix_s, requests/s)]}``, one point per sample
    that follows an earlier sample of the same router instance.

    The state has no instance id, so instances are told apart by their counters (every band's
    ``dispatched_total`` and ``shed_total``), which only grow within one router process: each sample
    joins the *track* (the latest sample of a presumed instance, at most :data:`MAX_TRACKS`) whose
    counters it is not below anywhere and grew least from; none fits → a new track (another
    replica, or a restart). Rates are differences within a track over its router clock (``time``).
    Limitations: two replicas whose counters all lie close together can be confused, and a router
    that restarted can continue its old track for one point once its counters pass the old ones;
    either gives a wrong but never negative rate. With several replicas each point is the rate of
    the replica that answered, not the fleet's sum."""
    out: dict[str, list[tuple[float, float]]] = {}
    tracks: list[tuple[Sample, dict[str, int]]] = []
    for sample in samples:
        counters = _counters(sample.state)
        best, best_growth = None, None
        for index, (last, last_counters) in enumerate(tracks):
            growth = _growth(last_counters, counters)
            if growth is not None and sample.state.time > last.state.time and (
                    best_growth is None or growth < best_growth):
                best, best_growth = index, growth
        if best is not None:
            before, _ = tracks.pop(best)
            seconds = sample.state.time - before.state.time
            previous = {band.objective: band.dispatched_total for band in before.state.bands}
            for band in sample.state.bands:
                if band.objective in previous:
                    out.setdefault(band.objective, []).append(
                        (sample.state.time, (band.dispatched_total - previous[band.objective]) / seconds))
        tracks.append((sample, counters))
        del tracks[:-MAX_TRACKS]
    return out
