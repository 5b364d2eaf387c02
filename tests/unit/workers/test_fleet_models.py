"""The fleet's model list as validation reads it (``workers.fleet``), over httpx's MockTransport."""

from __future__ import annotations

import httpx
import pytest

from workers.fleet import FleetModels

LIST = {"object": "list", "data": [{"id": "m1", "object": "model"}, {"id": "m2", "object": "model"}, {"x": 1}]}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _fleet(handler, clock=None, url="http://router:8000/") -> tuple[FleetModels, list[httpx.Request]]:
    asked: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        asked.append(request)
        return handler(request)

    fleet = FleetModels(url, timeout_seconds=1.0, cache_seconds=10.0, clock=clock or Clock(),
                        transport=httpx.MockTransport(record))
    return fleet, asked


def test_the_router_s_list_is_read_and_kept_for_the_cache_period():
    clock = Clock()
    fleet, asked = _fleet(lambda r: httpx.Response(200, json=LIST), clock)
    assert fleet.served() == frozenset({"m1", "m2"})
    assert str(asked[0].url) == "http://router:8000/v1/models" and asked[0].method == "GET"
    clock.now += 9.9
    assert fleet.served() == frozenset({"m1", "m2"}) and len(asked) == 1
    clock.now += 0.2
    fleet.served()
    assert len(asked) == 2


@pytest.mark.parametrize("answer", [
    httpx.Response(503, json={"status": "no_healthy_endpoints"}),
    httpx.Response(200, content=b"<html>"),
    httpx.Response(200, json=[1, 2]),
    httpx.Response(200, json={"data": "m1"}),
    httpx.Response(200, json={"object": "list", "data": []}),  # no healthy engine: cannot tell
])
def test_an_answer_that_is_no_model_list_is_unknown(answer, caplog):
    fleet, _ = _fleet(lambda r: answer)
    assert fleet.served() is None
    assert any(getattr(r, "action", None) == "fleet_models_unknown" for r in caplog.records)


def test_a_router_that_does_not_answer_is_unknown_once_per_cache_period(caplog):
    clock = Clock()

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    fleet, asked = _fleet(down, clock)
    assert fleet.served() is None and fleet.served() is None
    assert len(asked) == 1  # a router that is down costs one timeout per period, not one per batch
    assert [r.action for r in caplog.records if hasattr(r, "action")] == ["fleet_models_unknown"]
    clock.now += 11
    fleet.served()
    assert len(asked) == 2


def test_no_router_configured_asks_nothing():
    fleet, asked = _fleet(lambda r: httpx.Response(200, json=LIST), url=None)
    assert fleet.served() is None and asked == []
