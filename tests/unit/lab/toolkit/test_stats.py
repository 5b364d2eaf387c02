"""The one percentile convention of the lab (nearest rank) and the log-binned histogram that follows it."""

from __future__ import annotations

import math
import random

import pytest

from lab.toolkit.stats import LogHistogram, percentile


def test_percentile_is_the_value_of_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0  # rank ceil(0.5 × 100) = 50 (linear interpolation gave 50.5)
    assert percentile(values, 99) == 99.0
    assert percentile(values, 99.5) == 100.0
    assert percentile(values, 100) == 100.0
    assert percentile(values, 0) == 1.0
    assert percentile(reversed(values), 90) == 90.0  # any order, any iterable


def test_percentile_is_always_a_measured_value():
    rng = random.Random(0)
    values = [rng.random() for _ in range(37)]
    assert all(percentile(values, q) in values for q in range(101))


def test_percentile_of_nothing_is_the_default():
    assert percentile([], 50) is None
    assert math.isnan(percentile([], 99, default=math.nan))
    assert percentile([7.0], 99, default=math.nan) == 7.0


def test_percentile_refuses_a_fraction_scale_beyond_100():
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_histogram_percentiles_are_within_half_a_bin_of_nearest_rank():
    rng = random.Random(1)
    values = [rng.lognormvariate(-4, 1) for _ in range(5000)]
    hist = LogHistogram()
    for v in values[:-10]:
        hist.add(v)
    hist.add_many(values[-1], 10)
    exact = values[:-10] + [values[-1]] * 10
    for q in (50, 90, 99):
        assert hist.percentile(q) == pytest.approx(percentile(exact, q), rel=0.006)
    assert LogHistogram().percentile(50) is None
