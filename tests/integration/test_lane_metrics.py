"""The gateway's lane gauges (``backfill_gateway_lane_*``) read from the real Redis streams of a
pool: backlog, delivered, dead letters and the oldest message's age, per lane."""

from __future__ import annotations

import uuid

import redis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from batch_gateway.metrics import LaneBacklogCollector, read_lane_backlogs
from common.contracts.queue import PROCESSOR_GROUP, dead_letter_stream, request_stream


def test_lane_backlog_and_age_come_from_the_streams(stores):
    client = redis.Redis.from_url(stores.redis_url)
    pool = f"lanes-{uuid.uuid4().hex[:8]}"
    batch = request_stream("batch", pool)
    first = client.xadd(batch, {"message": b"{}"}, id="1000000-0")  # added at t = 1,000 s
    for _ in range(3):
        client.xadd(batch, {"message": b"{}"})
    client.xgroup_create(batch, PROCESSOR_GROUP, id="0")
    client.xreadgroup(PROCESSOR_GROUP, "p1", {batch: ">"}, count=2)  # two delivered, not acknowledged
    client.xadd(dead_letter_stream(batch), {"message": b"{}"})
    assert first == b"1000000-0"

    lanes = {lane.lane: lane for lane in read_lane_backlogs(client, pool, PROCESSOR_GROUP, now=lambda: 1060.5)}
    assert list(lanes) == ["interactive", "async", "batch"]
    assert (lanes["batch"].backlog, lanes["batch"].pending, lanes["batch"].dead) == (4, 2, 1)
    assert lanes["batch"].oldest_age_seconds == 60.5
    assert (lanes["interactive"].backlog, lanes["interactive"].oldest_age_seconds) == (0, 0.0)

    registry = CollectorRegistry()
    registry.register(LaneBacklogCollector(lambda: (client, pool, PROCESSOR_GROUP)))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    backlog = {s.labels["lane"]: s.value for s in families["backfill_gateway_lane_backlog_messages"].samples}
    assert backlog == {"interactive": 0, "async": 0, "batch": 4}
    assert [s.value for s in families["backfill_gateway_lane_oldest_age_seconds"].samples
            if s.labels["lane"] == "batch"][0] > 60  # against the real clock: added in 1970


def test_redis_down_means_no_lane_samples_not_a_failed_scrape():
    down = redis.Redis(unix_socket_path="/nonexistent/redis.sock", socket_connect_timeout=0.2)
    registry = CollectorRegistry()
    registry.register(LaneBacklogCollector(lambda: (down, "default", PROCESSOR_GROUP)))
    registry.register(LaneBacklogCollector(lambda: None))  # before the app started
    assert "backfill_gateway_lane" not in generate_latest(registry).decode()
