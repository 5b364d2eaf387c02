"""The discrete-event virtual clock: a heap of timed callbacks, never a sleep.

:class:`VirtualClock` is a callable returning the simulated time (seconds), injected wherever
production code takes a ``clock`` (``PluginHandle.clock``, ``KVBlockIndex``, ``PoolState``, the
router runtime, the processor's saturation gate). :class:`EventQueue` runs callbacks in time order
(ties in scheduling order, so a run is deterministic) and moves the clock to each one's time.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class VirtualClock:
    """Simulated seconds since the start; ``clock()`` reads it, only :class:`EventQueue` moves it."""

    __slots__ = ("now",)

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class EventQueue:
    """Timed callbacks. ``background`` events (scrape ticks, gate refreshes) re-arm themselves and do
    not keep the run alive: :meth:`run` stops when only they are left and ``busy()`` is False."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self._heap: list[tuple[float, int, bool, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.foreground = 0
        self.processed = 0

    def at(self, when: float, fn: Callable[..., Any], *args: Any, background: bool = False) -> None:
        """Call ``fn(*args)`` at simulated time ``when`` (never before now)."""
        when = max(when, self.clock.now)
        heapq.heappush(self._heap, (when, next(self._seq), background, fn, args))
        if not background:
            self.foreground += 1

    def run(self, busy: Callable[[], bool], until: float | None = None,
            on_event: Callable[[], None] | None = None) -> None:
        """Process events in time order until none is left that matters (no foreground event and
        ``busy()`` False) or the clock would pass ``until``."""
        heap = self._heap
        clock = self.clock
        pop = heapq.heappop
        while heap:
            if not self.foreground and not busy():
                return
            when, _, background, fn, args = heap[0]
            if until is not None and when > until:
                return
            pop(heap)
            if not background:
                self.foreground -= 1
            clock.now = when
            fn(*args)
            self.processed += 1
            if on_event is not None:
                on_event()
