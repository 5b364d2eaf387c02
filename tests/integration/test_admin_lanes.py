"""The lanes and fleet pages against a fake router serving ``GET /admin/state`` and real Redis
streams: queue depth, pending and dead letters per lane, dispatch rate and shed counts per objective,
gate state from the pool saturation, engines with KV use and prefix-cache hit rate, charts over
time; and a router that is down, failing or talking nonsense is reported on the page (never a 500)."""

from __future__ import annotations

import html
import re
import secrets
import threading
import time
from pathlib import Path

import pytest
import redis
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.testclient import TestClient

from backfill.up import free_port
from batch_gateway.admin.charts import line_chart
from batch_gateway.admin.router_sampler import Sample, rates
from batch_gateway.app import create_app
from common.contracts.queue import dead_letter_stream, request_stream
from common.contracts.router_state import RouterState
from tests.conftest import serve

ADMIN = {"authorization": "Bearer admin-lanes-key-0123456789"}
DISPATCH_STEP = 30
TIME_STEP = 2.0


class FakeRouter:
    """Answers the router's admin state; every read advances its clock by TIME_STEP seconds and the
    batch band's dispatched counter by DISPATCH_STEP (15 requests/s, whatever the wall clock)."""

    def __init__(self):
        self.reads = 0
        self.saturation = 1.3
        self.gate_saturation = 1.3
        self.mode = "ok"
        self.released = threading.Event()
        self.app = FastAPI()
        self.app.get("/admin/state")(self.state)

    def state(self):
        if self.mode == "hang":  # a stopped process (SIGSTOP): the connection opens, no answer comes
            self.released.wait(30)
        if self.mode == "error":
            return PlainTextResponse("boom", status_code=500)
        if self.mode == "garbage":
            return JSONResponse({"pool_saturation": "high", "gate_saturation": "high"})
        self.reads += 1
        # the shape of router.app.admin_state (models a list, saturation null while unhealthy)
        engine = {"name": "engine-0", "healthy": True, "models": ["sim-model"], "num_requests_waiting": 3,
                  "num_requests_running": 7, "kv_cache_usage_perc": 0.42, "in_flight_requests": 10,
                  "in_flight_uncached_tokens": 5120, "saturation": 0.9, "gate_open": True, "headroom": 0.1,
                  "metrics_age_s": 0.2,
                  "cache_blocks": {"gpu": 812, "cpu": 96, "disk": 0}, "prefix_cache_hit_rate": 0.8,
                  "external_prefix_cache_hit_rate": 0.15, "last_error": None,
                  "slot_reserve": 26, "reserve_in_use": 3, "batch_prefill_tokens": 1024, "num_preemptions": 4,
                  "evictions": {"batch_prefill": 5, "no_free_slot": 2}, "evicted_tokens": 1900,
                  "idle_session_tokens": 0, "reserved_session_tokens": 0, "gate_reason": "open"}
        hot = {**engine, "name": "engine-1", "role": "prefill", "models": ["sim-model", "sim-lora"], "kv_cache_usage_perc": 0.95,
               "saturation": 1.7, "gate_open": False, "headroom": 0.0, "prefix_cache_hit_rate": None, "external_prefix_cache_hit_rate": None,
               "idle_session_tokens": 300_000, "reserved_session_tokens": 65_536, "gate_reason": "idle_session_working_set"}
        sick = {**engine, "name": "engine-2", "healthy": False, "saturation": None, "gate_open": False,
                "headroom": None, "last_error": "refused"}
        return {"pool_saturation": self.saturation, "gate_saturation": self.gate_saturation, "time": 1_800_000_000 + TIME_STEP * self.reads,
                "gate_reason": "open" if self.gate_saturation < 1 else "idle_session_working_set",
                "decisions_per_s": 42.0, "endpoints": [engine, hot, sick],
                "bands": [{"objective": "interactive", "priority": 100, "queued_requests": 0, "queued_bytes": 0,
                           "in_flight": 4, "dispatched_total": 500, "refused_total": {}, "shed_total": {}},
                          {"objective": "flex", "priority": 0, "queued_requests": 3, "queued_bytes": 900,
                           "in_flight": 2, "dispatched_total": 40, "shed_total": {"rejected_ttl_expired": 1}},
                          {"objective": "batch", "priority": -10, "queued_requests": 12, "queued_bytes": 9000,
                           "in_flight": 6, "dispatched_total": DISPATCH_STEP * self.reads,
                           "refused_total": {"rejected_saturated": 5, "rejected_capacity": 0},
                           "shed_total": {"rejected_ttl_expired": 2, "evicted": 0}}]}


@pytest.fixture
def fake_router():
    router = FakeRouter()
    port = free_port()
    with serve(router.app, port):
        router.url = f"http://127.0.0.1:{port}"
        yield router
        router.released.set()


def _client(gateway_settings, router_url: str | None):
    settings = gateway_settings.model_copy(update={
        "admin_key": ADMIN["authorization"].split()[1], "router_url": router_url, "router_poll_seconds": 0.05,
        "queue_pool": f"test-{secrets.token_hex(4)}"})
    client = TestClient(create_app(settings))
    client.settings = settings
    return client


def _wait(client, condition, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = client.get("/admin/api/state", headers=ADMIN).json()
        if condition(state):
            return state
        assert time.monotonic() < deadline, state
        time.sleep(0.05)


def _row(html: str, attribute: str, name: str) -> list[str]:
    row = re.search(rf'<tr {attribute}="{name}">(.*?)</tr>', html, re.S).group(1)
    return [re.sub(r"<[^>]+>", " ", cell).split() for cell in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]


def test_lanes_page_shows_queues_rates_sheds_gate_and_saturation_over_time(gateway_settings, stores, fake_router):
    with _client(gateway_settings, fake_router.url) as client:
        pool = client.settings.queue_pool
        r = redis.Redis.from_url(stores.redis_url)
        batch_stream = request_stream("batch", pool)
        for _ in range(5):
            r.xadd(batch_stream, {"message": b"{}"})
        r.xgroup_create(batch_stream, "backfill-processors", id="0")
        r.xreadgroup("backfill-processors", "p1", {batch_stream: ">"}, count=2)  # 2 delivered, unacked
        r.xadd(dead_letter_stream(batch_stream), {"message": b"{}"})
        r.xadd(request_stream("interactive", pool), {"message": b"{}"})
        _wait(client, lambda s: fake_router.reads >= 3 and s["router"] is not None)

        page = client.get("/admin/lanes", headers=ADMIN)
        assert page.status_code == 200
        batch = _row(page.text, "data-lane", "batch")
        assert batch[0][:2] == ["batch", batch_stream]
        assert [c[0] for c in batch[1:7]] == ["-10", "5", "2", "1", "12", "6"]
        assert batch[7] == ["15.0/s"]  # 30 more dispatched every 2 s of router time
        # backpressure the processor re-sends apart from work dropped, spelled as the metrics spell it
        assert batch[9] == ["5", "rejected_saturated", "5"] and batch[10] == ["2", "rejected_ttl_expired", "2"]
        assert [c[0] for c in _row(page.text, "data-lane", "interactive")[1:5]] == ["100", "1", "0", "0"]
        assert _row(page.text, "data-lane", "async")[2] == ["0"]
        # the flex band (OpenAI's service_tier "flex") has no stream: its row sits between async and batch
        flex = _row(page.text, "data-lane", "flex")
        assert flex[0][0] == "flex" and [c[0] for c in flex[1:7]] == ["0", "—", "—", "—", "3", "2"]
        assert flex[10] == ["1", "rejected_ttl_expired", "1"]
        assert re.findall(r'<tr data-lane="(\w+)">', page.text) == ["interactive", "async", "flex", "batch"]
        assert 'id="gate-state">' in page.text and "closed" in page.text.split('id="gate-state">')[1][:40]
        assert 'id="pool-saturation">1.30<' in page.text
        assert page.text.count("<svg class=\"chart\"") == 2 and "<polyline" in page.text
        assert 'class="threshold"' in page.text  # the 1.0 line on the saturation chart

        assert 'id="gate-saturation">1.30<' in page.text
        assert _row(page.text, "data-engine", "engine-0")[1:4] == [["open"], ["0.90"], ["10%"]]
        # why the gate and a closed engine take no sheddable work (issue 27): the idle sessions' reserve
        why = html.unescape(page.text.split('id="gate-reason">')[1].split("</p>")[0])
        assert why.startswith("Why: <strong>KV kept for idle sessions' next turns (working set)</strong>")
        hot = _row(page.text, "data-engine", "engine-1")
        assert hot[1][:2] == ["closed", "KV"] and "idle sessions'" in html.unescape(" ".join(hot[1])) and hot[2:4] == [["1.70"], ["0%"]]
        assert hot[7] == ["65,536", "/", "300,000"]  # reserved (capped) / all idle sessions' tokens
        # issue 13's protection per engine: reserve in use / kept, batch prefill tokens, preemptions,
        # evictions by reason, wasted tokens
        assert _row(page.text, "data-engine", "engine-0")[9:14] == [
            ["3", "/", "26"], ["1024"], ["4"], ["7", "batch_prefill", "5", "no_free_slot", "2"], ["1900"]]
        assert _row(page.text, "data-engine", "engine-2")[1:3] == [["unhealthy"], ["—"]]

        # one engine has room while the pool's mean is past the threshold: the gate is open
        fake_router.gate_saturation = 0.4
        _wait(client, lambda s: s["router"]["gate_saturation"] == 0.4)
        fragment = client.get("/admin/fragments/lanes", headers=ADMIN).text
        assert "open" in fragment.split('id="gate-state">')[1][:40] and "<html" not in fragment
        assert 'id="gate-reason"' not in fragment
        assert 'id="pool-saturation">1.30<' in fragment

        state = client.get("/admin/api/state", headers=ADMIN).json()
        assert {q["lane"]: q["length"] for q in state["queues"]} == {"interactive": 1, "async": 0, "batch": 5}


def test_fleet_page_shows_engines_load_kv_prefix_hits_and_health(gateway_settings, fake_router):
    with _client(gateway_settings, fake_router.url) as client:
        _wait(client, lambda s: s["router"] is not None)
        page = client.get("/admin/fleet", headers=ADMIN)
        assert page.status_code == 200
        healthy = _row(page.text, "data-engine", "engine-0")
        assert healthy[1] == ["sim-model"]  # the router's "models" list
        assert healthy[2] == ["healthy"] and healthy[3:5] == [["3"], ["7"]] and healthy[5] == ["42%"]
        assert healthy[8] == ["0.90"] and healthy[9] == ["812", "/", "96", "/", "0"]
        assert healthy[10] == ["80%", "/", "15%"]  # prefix-cache hit rate: GPU / CPU and disk tiers
        hot = _row(page.text, "data-engine", "engine-1")
        assert hot[1] == ["sim-model,", "sim-lora"] and hot[10] == ["—", "/", "—"]
        assert hot[0] == ["engine-1", "prefill"] and healthy[0] == ["engine-0"]  # a P/D role; "both" is not shown
        assert 'class="num hot">1.70' in page.text  # over the saturation threshold
        sick = _row(page.text, "data-engine", "engine-2")  # no saturation while unhealthy
        assert sick[2] == ["unhealthy"] and sick[8] == ["—"]
        assert "Saturation per engine" in page.text and "KV-cache use per engine" in page.text


@pytest.mark.parametrize("mode", ["down", "error", "garbage"])
def test_a_router_that_is_down_or_wrong_is_reported_not_a_500(gateway_settings, fake_router, mode):
    url = fake_router.url if mode != "down" else f"http://127.0.0.1:{free_port()}"
    fake_router.mode = mode
    with _client(gateway_settings, url) as client:
        state = _wait(client, lambda s: s["router_error"] and "Waiting" not in s["router_error"])
        expected = {"down": "unreachable", "error": "HTTP 500", "garbage": "malformed"}[mode]
        assert expected in state["router_error"] and state["router"] is None
        for path in ("/admin/lanes", "/admin/fleet", "/admin/fragments/lanes"):
            page = client.get(path, headers=ADMIN)
            assert page.status_code == 200 and expected in page.text, path
        assert "No engines known" in client.get("/admin/fleet", headers=ADMIN).text
        assert "no data yet" in client.get("/admin/lanes", headers=ADMIN).text


def test_without_a_router_url_the_pages_say_how_to_set_one(gateway_settings):
    with _client(gateway_settings, None) as client:
        page = client.get("/admin/lanes", headers=ADMIN)
        assert page.status_code == 200 and "BACKFILL_ROUTER_URL" in page.text


def _sample(t: float, dispatched: int, shed: int = 0, interactive: int = 0) -> Sample:
    return Sample(at=t, state=RouterState(pool_saturation=0.5, time=t, bands=[
        {"objective": "batch", "dispatched_total": dispatched, "shed_total": {"evicted": shed}},
        {"objective": "interactive", "dispatched_total": interactive}]))


def test_rates_skip_a_counter_reset_and_the_chart_scales_to_its_data():
    series = rates([_sample(10, 0), _sample(12, 20), _sample(13, 25), _sample(15, 5), _sample(17, 15),
                    _sample(19, 35), _sample(21, 45)])
    # 15: the router restarted (counter went down): no point. Once the new counters pass the old ones
    # (19) they may continue the old track for one point (a known limitation), never negative.
    assert series["batch"][:3] == [(12, 10.0), (13, 5.0), (17, 5.0)]
    assert series["batch"][-1] == (21, 5.0) and all(rate >= 0 for _, rate in series["batch"])
    svg = str(line_chart(series, title="t", now=18))
    xs_ys = [tuple(map(float, p.split(","))) for p in re.search(r'points="([^"]+)"', svg).group(1).split()]
    assert xs_ys[0][1] < xs_ys[1][1] and xs_ys[0][0] < xs_ys[1][0]  # 10/s drawn above 5/s, earlier on the left
    assert "no data yet" in str(line_chart({}, title="t", now=0))


def test_rates_with_two_router_replicas_use_only_samples_of_the_same_replica():
    """Two replicas behind one Service, polled alternately and irregularly: replica A dispatches
    10 batch requests/s from 1000, B 2/s from 300 (and sheds); a rate never mixes their counters."""
    def a(t):
        return _sample(t, 1000 + 10 * t, shed=40, interactive=700 + t)

    def b(t):
        return _sample(t, 300 + 2 * t, shed=90 + t, interactive=900 + 3 * t)

    polls = [a(0), b(2), b(4), a(6), b(8), a(10), a(12), b(14)]
    series = rates(polls)
    assert series["batch"] == [(4, 2.0), (6, 10.0), (8, 2.0), (10, 10.0), (12, 10.0), (14, 2.0)]
    assert all(rate >= 0 for _, rate in series["interactive"])


def test_a_router_that_stops_answering_turns_the_gate_and_engines_unknown(gateway_settings, fake_router):
    """SIGSTOP's effect: the last reading (gate open, engines healthy) is older than its refresh, so
    the pages show unknown with the reading's age, never the old OPEN as live."""
    fake_router.gate_saturation = 0.4
    with _client(gateway_settings, fake_router.url) as client:
        _wait(client, lambda s: s["router"] is not None and s["router_error"] is None)
        live = client.get("/admin/fragments/lanes", headers=ADMIN).text
        assert "open" in live.split('id="gate-state">')[1][:20] and 'id="router-live"' in live
        fake_router.mode = "hang"
        _wait(client, lambda s: s["router_error"] is not None)
        lanes = client.get("/admin/lanes", headers=ADMIN).text
        assert 'class="gate unknown" id="gate-state">unknown<' in lanes and 'id="router-live"' not in lanes
        assert "said\n      open" in lanes  # what the last reading said, with its age
        assert _row(lanes, "data-engine", "engine-0")[1] == ["unknown"]
        assert [c[0] for c in _row(lanes, "data-lane", "batch")[5:11]] == ["unknown"] * 6
        assert 'class="card stale-reading"' in lanes  # the last reading's figures, greyed and said so
        assert 'id="router-error"' in lanes and "ago" in lanes.split('id="router-error"')[1][:400]
        fleet = client.get("/admin/fleet", headers=ADMIN).text
        assert "unknown now: the last reading" in fleet
        # the engine's metrics age now: 0.2 s at the reading, plus the reading's own age, which is
        # past its refresh (poll 0.05 s + the sampler's 0.5-s read bound) since the pages call it unknown
        (age,) = re.findall(r'<tr data-engine="engine-0">.*?class="num metrics-age"[^>]*>([0-9.]+) s<', fleet, re.S)
        assert float(age) >= 0.2 + 0.55
        assert _row(fleet, "data-engine", "engine-0")[2] == ["unknown"] and "healthy" not in \
            " ".join(_row(fleet, "data-engine", "engine-0")[2])


def test_the_health_page_shows_every_service_with_its_last_answer_age(gateway_settings, fake_router, tmp_path):
    """The router answers /health, the processor's port answers 503, nothing listens on the
    worker's; beat's schedule file was written just now. The page's rows say so, each with its age."""
    health = FastAPI()
    health.get("/health")(lambda: JSONResponse({"status": "unavailable"}, status_code=503))
    fake_router.app.get("/health")(lambda: {"status": "ok"})
    port = free_port()
    (tmp_path / "celerybeat-schedule").write_bytes(b"")
    with serve(health, port):
        settings = gateway_settings.model_copy(update={
            "processor_metrics_port": port, "worker_metrics_port": free_port(), "health_poll_seconds": 0.05,
            "data_dir": tmp_path})
        with _client(settings, fake_router.url) as client:
            deadline = time.monotonic() + 20
            while True:
                page = client.get("/admin/health", headers=ADMIN).text
                states = {name: _row(page, "data-service", name)[1][0]
                          for name in ("gateway", "router", "processor", "worker", "beat")}
                if states["router"] == "up" and states["processor"] == "down" and "no answer" in page:
                    break
                assert time.monotonic() < deadline, states
                time.sleep(0.05)
            # nothing ever answered on the worker's port: unknown, down once that lasted 3 refreshes
            assert states["worker"] in ("unknown", "down")
            assert {**states, "worker": None} == {"gateway": "up", "router": "up", "processor": "down", "worker": None,
                                                  "beat": "up"}
            assert _row(page, "data-service", "worker")[2] == ["never"]
            assert "answered HTTP 503" in " ".join(_row(page, "data-service", "processor")[4])
            assert client.get("/admin/fragments/health", headers=ADMIN).text.count("<tr data-service=") == 5
            assert 'href="/admin/health"' in page and 'data-refresh="/admin/fragments/health"' in page


def test_a_frozen_service_turns_unknown_then_down_within_the_bound_the_page_states(gateway_settings, fake_router,
                                                                                  tmp_path):
    """SIGSTOP's effect on the health view: the router's /health stops answering (the connection
    opens, nothing comes back). Its row turns unknown once its last answer is older than its
    refresh, then down once three refreshes passed without an answer, the bound the page states."""
    def router_health():
        if fake_router.mode == "hang":
            fake_router.released.wait(30)
        return {"status": "ok"}

    fake_router.app.get("/health")(router_health)
    settings = gateway_settings.model_copy(update={"health_poll_seconds": 0.05, "data_dir": tmp_path})
    with _client(settings, fake_router.url) as client:
        def router_row() -> tuple[str, str]:
            page = client.get("/admin/fragments/health", headers=ADMIN).text
            row = _row(page, "data-service", "router")
            return row[1][0], page

        seen = [router_row()[0]]
        deadline = time.monotonic() + 60
        while seen[-1] != "up":
            assert time.monotonic() < deadline, seen
            time.sleep(0.05)
            seen.append(router_row()[0])
        fake_router.mode = "hang"
        while seen[-1] != "down":
            assert time.monotonic() < deadline, seen
            time.sleep(0.05)
            state, page = router_row()
            seen.append(state)
        after_up = seen[len(seen) - seen[::-1].index("up"):]
        assert after_up[0] == "unknown" and set(after_up) == {"unknown", "down"}  # never up, never down first
        assert "no answer" in " ".join(_row(page, "data-service", "router")[4])
        stale, down = 0.05 + 2.0, 3 * (0.05 + 2.0)  # poll + the 2-s read bound, then three of them
        rule = re.sub(r"<[^>]+>", "", page.split('id="health-rule">')[1])
        assert f"({stale:g} s) is unknown" in rule and f"not answered for {down:g} s" in rule


def test_a_service_is_down_after_its_bound_without_an_answer_unknown_before():
    """The rule itself, at given instants: a fresh answer decides up (200) or down (another
    status); past the refresh, or with the last read unanswered, it is unknown; once three
    refreshes passed without an answer, the last read failing, it is down (a service that never
    answered counts from its first read); beat's file goes the same way on its own bounds."""
    from batch_gateway.admin.health import HealthSampler, ServiceHealth

    service = ServiceHealth("router", "http://r/health", stale_after_s=7.0, status=200, answered_at=100.0)
    assert service.down_after_s == 21.0 and service.state(107.0) == "up" and service.state(107.5) == "unknown"
    assert ServiceHealth("p", "u", 7.0, status=503, answered_at=100.0, error="answered HTTP 503").state(101) == "down"
    service.error = "no answer (ReadTimeout)"
    assert [service.state(t) for t in (104.0, 120.9, 121.0, 500.0)] == ["unknown", "unknown", "down", "down"]
    never = ServiceHealth("worker", "http://w/health", stale_after_s=7.0, error="no answer (ConnectError)",
                          watched_since=50.0)
    assert never.state(70.9) == "unknown" and never.state(71.0) == "down"
    beat = HealthSampler({}, Path("/nonexistent"), 5.0).beat
    assert (beat.stale_after_s, beat.down_after_s) == (210.0, 420.0)
    beat.status, beat.answered_at, beat.error = 200, 100.0, "no answer: schedule file not rewritten for 250 s"
    assert beat.state(350.0) == "unknown" and beat.state(520.0) == "down"


def test_an_idle_chart_has_a_zero_to_one_axis_not_1e_09():
    svg = str(line_chart({"batch": [(10, 0.0), (12, 0.0)]}, title="Dispatch rate", unit="requests/s", now=12))
    ticks = re.findall(r'class="tick">([^<]+)<', svg)
    assert ticks[:3] == ["0", "0.5", "1"] and not [t for t in ticks if "e-" in t]


def test_every_page_names_its_icon_so_no_favicon_request_404s(gateway_settings):
    with _client(gateway_settings, None) as client:
        for path in ("/admin", "/admin/lanes", "/admin/health", "/admin/login"):
            page = client.get(path, headers=ADMIN)
            assert '<link rel="icon" href="data:,">' in page.text, path
