"""Arrival times of open-loop load."""

from __future__ import annotations

import random


def poisson_arrivals(rate: float, duration: float, seed: int) -> list[float]:
    """Arrival offsets (s, ascending, < ``duration``) of a Poisson process of ``rate`` per second."""
    rng = random.Random(seed)
    out: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append(t)
