"""Percentiles and summaries of the lab's figures, with one convention.

**Convention: nearest rank** — the ``q``-th percentile of ``n`` values is the value of rank
``ceil(q/100 × n)`` in ascending order (the smallest value with at least ``q`` % of the values at
or below it; rank 1 for ``q`` = 0). Source: the nearest-rank method of NIST's Engineering
Statistics Handbook and of Wikipedia's "Percentile"; numpy's ``percentile(..., method="inverted_cdf")``.
It always returns one of the measured values (a p99 TTFT is a TTFT some request had) and it is what
the fleet simulator's figures (``backfill simulate``, ``backfill bench simulate-scale``) have always
used, so those stay identical. :class:`LogHistogram` follows it over its bins.

Before this module there were four percentile functions; three other conventions gave way to this
one:

* ``bench/replay.py`` and ``bench/scheduling.py``: rank ``round(q × (n − 1))`` (q in 0..1; numpy's
  ``method="nearest"``) — the replay benchmarks (prefix, sessions, responses, pd, router-ha,
  router-overhead) and the scheduler's decision time; it differs from nearest rank by at most one
  rank (for ``n`` = 100, p50 is the 51st value there, the 50th here);
* ``bench/isolation.py``: linear interpolation between closest ranks (numpy's default,
  ``method="linear"``; NaN when empty) — isolation, mixed and frontier; a p99 of 100 values was
  0.01 of the way from the 99th to the 100th value, here it is the 99th.

A **median** (every ``p50`` figure) is ``percentile(values, 50)``: for an even count the lower of
the two middle values, not their mean as ``statistics.median`` gave before (the pollution bench's
TTFT p50 over 18 and 6 turns, the replay benchmarks' TTFT p50, the scheduler's decision and learn
p50, router-overhead's latency p50, the KV index's lookup p50; the interference bench's idle gap,
whose middle gaps are equal). The KV index's p99 was rank ``floor(0.99 n) + 1``; it is nearest
rank too.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from typing import overload


@overload
def percentile(values: Iterable[float], q: float) -> float | None: ...


@overload
def percentile(values: Iterable[float], q: float, *, default: float) -> float: ...


def percentile(values: Iterable[float], q: float, *, default: float | None = None) -> float | None:
    """The ``q``-th percentile (``q`` in 0..100) of ``values`` by nearest rank (module docstring);
    ``default`` (None, or NaN where a figure must stay a float) when there are no values.
    Raises ``ValueError`` for ``q`` outside 0..100."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in 0..100, got {q}")
    data = sorted(values)
    if not data:
        return default
    return data[max(0, min(len(data) - 1, math.ceil(q / 100 * len(data)) - 1))]


class LogHistogram:
    """Log-binned values (1 % bins from 10 µs up): percentiles of millions of values (the
    simulator's inter-token latencies, seconds) in constant memory. A percentile is the centre of
    the bin holding the value of nearest rank (module docstring), so it is within 0.5 % of it."""

    BASE = 1e-5
    RATIO = math.log(1.01)

    def __init__(self) -> None:
        self.bins: Counter[int] = Counter()
        self.count = 0

    def add(self, value: float) -> None:
        """Count one value (values under :attr:`BASE` count in the first bin)."""
        self.bins[int(math.log(max(value, self.BASE) / self.BASE) / self.RATIO)] += 1
        self.count += 1

    def add_many(self, value: float, n: int) -> None:
        """Count ``value`` ``n`` times."""
        self.bins[int(math.log(max(value, self.BASE) / self.BASE) / self.RATIO)] += n
        self.count += n

    def percentile(self, q: float) -> float | None:
        """The ``q``-th percentile (0..100) by nearest rank over the bins; None when empty."""
        if not self.count:
            return None
        want = q / 100 * self.count
        seen = 0
        for b in sorted(self.bins):
            seen += self.bins[b]
            if seen >= want:
                return self.BASE * math.exp((b + 0.5) * self.RATIO)
        return None
