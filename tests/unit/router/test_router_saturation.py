"""Pool saturation: max(waiting / 5, kv / 0.8) per endpoint, averaged; stale metrics saturated."""

import pytest

from router.scheduling.saturation import SaturationThresholds, endpoint_saturation, pool_saturation
from router.scheduling.types import Endpoint

NOW = 100.0


def fresh(**fields) -> Endpoint:
    return Endpoint("http://e", metrics_updated_at=NOW - 0.05, **fields)


def test_each_endpoint_takes_its_most_constrained_resource():
    assert endpoint_saturation(fresh(num_requests_waiting=2, kv_cache_usage_perc=0.2), NOW) == pytest.approx(0.4)
    assert endpoint_saturation(fresh(num_requests_waiting=1, kv_cache_usage_perc=0.6), NOW) == pytest.approx(0.75)
    assert endpoint_saturation(fresh(num_requests_waiting=10, kv_cache_usage_perc=0.0), NOW) == pytest.approx(2.0)


def test_pool_is_the_average_over_endpoints():
    pool = [fresh(num_requests_waiting=2, kv_cache_usage_perc=0.2), fresh(kv_cache_usage_perc=0.6), fresh()]
    assert pool_saturation(pool, NOW) == pytest.approx((0.4 + 0.75 + 0.0) / 3)


def test_stale_or_missing_metrics_count_as_saturated():
    stale = Endpoint("http://s", metrics_updated_at=NOW - 0.201)
    never = Endpoint("http://n")
    idle = fresh()
    assert endpoint_saturation(stale, NOW) == 1.0
    assert endpoint_saturation(never, NOW) == 1.0
    assert pool_saturation([stale, never, idle], NOW) == pytest.approx(2 / 3)
    assert pool_saturation([stale], NOW, SaturationThresholds(max_metrics_age_s=0.5)) == 0.0


def test_empty_pool_is_saturated_and_thresholds_must_be_positive():
    assert pool_saturation([], NOW) == 1.0
    with pytest.raises(ValueError):
        SaturationThresholds(queue_threshold=0)


def test_in_flight_credit_adds_dispatches_the_scrape_does_not_show_yet():
    ep = fresh(num_requests_waiting=1, num_requests_running=2, in_flight_requests=6)
    assert endpoint_saturation(ep, NOW) == pytest.approx(0.2)
    assert endpoint_saturation(ep, NOW, SaturationThresholds(in_flight_credit=True)) == pytest.approx((1 + 3) / 5)
