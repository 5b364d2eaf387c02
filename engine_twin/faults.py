"""Failure injection for fault tests: a random failure rate and runtime faults set over HTTP.

Modes (``POST /sim/fault {"mode": ..., "count": N}``; ``count`` limits how many requests the fault
hits, then it clears itself; omitted = until ``{"mode": "none"}``):

* ``none``: normal service;
* ``429`` / ``500`` / ``503``: inference requests get that status with vLLM's error envelope;
* ``hang``: inference requests never answer (until the fault is cleared or the client gives up);
* ``unhealthy``: ``/health`` answers 503, inference still works (vLLM's dead-engine health check);
* ``die``: the process exits with status 1 right after acknowledging the admin request.

``--failure-rate p`` makes each inference request fail with 500 with probability ``p`` (seeded by
``--seed`` so runs repeat).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

from engine_twin.errors import BadRequestError, InjectedError

MODES = ("none", "429", "500", "503", "hang", "unhealthy", "die")


@dataclass
class FaultState:
    """The current fault and the random source of ``failure_rate``."""

    failure_rate: float = 0.0
    seed: int = 0
    mode: str = "none"
    remaining: int | None = None
    _rng: random.Random = field(init=False)
    _cleared: asyncio.Event | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def set(self, mode: str, count: int | None = None) -> None:
        """Switch to ``mode``; raises :class:`BadRequestError` for an unknown mode."""
        if mode not in MODES:
            raise BadRequestError(f"unknown fault mode {mode!r}; expected one of {', '.join(MODES)}", "mode")
        self.mode, self.remaining = mode, count
        if mode != "hang" and self._cleared is not None:
            self._cleared.set()
            self._cleared = None

    @property
    def healthy(self) -> bool:
        return self.mode != "unhealthy"

    async def before_request(self) -> None:
        """Apply the fault to one inference request: raise, hang, or return normally."""
        mode = self.mode
        if mode in ("429", "500", "503", "hang"):
            self._consume()
            if mode == "hang":
                if self._cleared is None:
                    self._cleared = asyncio.Event()
                await self._cleared.wait()
                return
            raise InjectedError(int(mode), f"simulated {mode} (fault injection)")
        if self.failure_rate and self._rng.random() < self.failure_rate:
            raise InjectedError(500, "simulated engine failure (--failure-rate)")

    def _consume(self) -> None:
        if self.remaining is not None:
            self.remaining -= 1
            if self.remaining <= 0:
                self.mode, self.remaining = "none", None
