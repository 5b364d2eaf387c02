"""The scheduler end to end on pure data: repeated prefixes stick, new ones spread, load counts."""

import random
from collections import Counter

import pytest
from scheduling_helpers import FakeClock, InMemoryPrefixIndex, endpoints, prompt, request, scheduler_from

from router.scheduling import DEFAULT_CONFIG_PATH
from router.scheduling.config import build_scheduler, load_config, parse_config
from router.scheduling.errors import NoCandidatesError
from router.scheduling.hashing import request_block_keys
from router.scheduling.interfaces import PluginHandle
from router.scheduling.registry import builtin_factories
from router.scheduling.types import PrefixMatchInfo

SPREAD_CONFIG = """
plugins:
- type: prefix-cache-scorer
- type: no-hit-lru-scorer
- type: queue-scorer
- type: kv-cache-utilization-scorer
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: prefix-cache-scorer, weight: 3}
  - {pluginRef: no-hit-lru-scorer, weight: 2}
  - {pluginRef: queue-scorer, weight: 1}
  - {pluginRef: kv-cache-utilization-scorer, weight: 1}
"""


def route(scheduler, req, pool, profile=None):
    result = scheduler.schedule(req, pool, profile)
    scheduler.pre_request(req, result)
    return result


def conversation_turn(prefix_seed: int, turn: int) -> list[int]:
    """A 512-token shared prefix (system prompt) followed by a 128-token turn of its own."""
    return prompt(prefix_seed, 512) + prompt(10_000 + 100 * prefix_seed + turn, 128)


def test_new_prefixes_spread_and_repeated_prefixes_stick():
    scheduler, _ = scheduler_from(SPREAD_CONFIG, seed=1)
    pool = endpoints(4, block_size=16, num_gpu_blocks=4096)
    home = {p: route(scheduler, request(conversation_turn(p, 0)), pool).endpoint.name for p in range(4)}
    assert sorted(home.values()) == [ep.name for ep in pool]  # four new prefixes, four endpoints
    for turn in range(1, 6):
        for p in range(4):
            result = route(scheduler, request(conversation_turn(p, turn)), pool)
            assert result.endpoint.name == home[p]
            assert result.scores["prefix-cache-scorer"][pool.index(result.endpoint)] == pytest.approx(8 / 10)


def test_default_config_sticks_a_repeated_prefix_to_one_endpoint():
    scheduler = build_scheduler(load_config(DEFAULT_CONFIG_PATH), PluginHandle(rng=__import__("random").Random(5)))
    pool = endpoints(4, block_size=16, num_gpu_blocks=4096)
    chosen = Counter(route(scheduler, request(conversation_turn(7, t)), pool).endpoint.name for t in range(10))
    assert len(chosen) == 1


def test_a_busy_endpoint_loses_a_partial_prefix_match_to_an_idle_one():
    scheduler, _ = scheduler_from(SPREAD_CONFIG, seed=1)
    pool = endpoints(2, block_size=16, num_gpu_blocks=4096)
    first = route(scheduler, request(prompt(1, 256)), pool).endpoint  # 4 blocks learned
    other = pool[1 - pool.index(first)]
    first.num_requests_waiting, first.kv_cache_usage_perc = 10, 0.9
    # shares 1 of 8 blocks. busy: prefix 3 x 1/8 + queue 0 + kv 0.1 + no-hit 0.5 x 2 = 1.475;
    # idle: 0 + queue 1 + kv 1 + 1 = 3 (the request is warm, so no-hit-lru is neutral 0.5)
    partial = request(prompt(1, 256)[:64] + prompt(2, 448))
    result = route(scheduler, partial, pool)
    assert result.endpoint is other
    assert result.breakdown()["prefix-cache-scorer"][first.name] == pytest.approx(1 / 8)


def test_affinity_filter_sticks_until_the_sticky_endpoint_is_backlogged():
    scheduler, _ = scheduler_from("""
plugins:
- type: prefix-cache-affinity-filter
  parameters: {maxTTFTPenaltyMs: 1000, peakPrefillThroughput: 1000, reuseLossWeight: 1}
- type: token-load-scorer
  parameters: {queueThresholdTokens: 10000}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: prefix-cache-affinity-filter}, {pluginRef: token-load-scorer}]
""", seed=2)
    pool = endpoints(3, block_size=16, num_gpu_blocks=4096)
    home = route(scheduler, request(prompt(1, 512)), pool).endpoint
    home.in_flight_uncached_tokens = 1000  # least loaded it is not, but sticky: within the penalty
    for ep in pool:
        if ep is not home:
            ep.in_flight_uncached_tokens = 0
    assert route(scheduler, request(prompt(1, 512)), pool).endpoint is home
    home.in_flight_uncached_tokens = 2000  # 2000 ms vs 512 ms elsewhere: 1488 ms > max(1000, 512 × 1) ms
    result = route(scheduler, request(prompt(1, 512)), pool)
    assert result.endpoint is not home
    assert result.state.read("affinity-outcome/prefix-cache-affinity-filter") == "load_override"


def test_precise_mode_follows_the_index_and_prefers_gpu_over_cpu():
    index = InMemoryPrefixIndex()
    scheduler, _ = scheduler_from("""
plugins:
- {type: precise-prefix-cache-producer, name: kv}
- {type: prefix-cache-scorer, parameters: {prefixMatchInfoProducerName: kv}}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: prefix-cache-scorer}]
""", prefix_index=index)
    pool = endpoints(3)
    req = request(prompt(3, 512))
    keys = request_block_keys(req, 64)
    index.put("m", "http://e2", keys, tier="cpu")
    index.put("m", "http://e1", keys[:6])
    result = route(scheduler, req, pool)
    assert result.endpoint.name == "http://e2"  # 8 blocks x 0.8 = 6.4 > 6 on GPU
    assert result.scores["prefix-cache-scorer"] == [0.0, 0.75, pytest.approx(0.8)]
    index.put("m", "http://e1", keys[6:])
    assert route(scheduler, request(prompt(3, 512)), pool).endpoint.name == "http://e1"


def test_estimate_backend_learns_from_prompt_bytes():
    scheduler, _ = scheduler_from(SPREAD_CONFIG, seed=4)
    pool = endpoints(4)
    system = ("You are a careful assistant. " * 60).encode()
    first = route(scheduler, request(None, prompt_bytes=system + b"question one"), pool)
    again = route(scheduler, request(None, prompt_bytes=system + b"question two"), pool)
    assert again.endpoint is first.endpoint
    assert again.scores["prefix-cache-scorer"][pool.index(again.endpoint)] == 1.0


def test_round_robin_profile_cycles_and_learns_nothing():
    scheduler = build_scheduler(load_config(DEFAULT_CONFIG_PATH))
    pool = endpoints(3)
    names = [route(scheduler, request(prompt(1, 256)), pool, "round-robin").endpoint.name for _ in range(6)]
    assert names == [ep.name for ep in pool] * 2
    assert scheduler.profiles["default"].producers[0].blocks_held("http://e0") == 0


class DropAll:
    plugin_type = "drop-all"

    def __init__(self, name):
        self.name = name

    def filter(self, state, req, eps):
        return []


def test_a_filter_removing_every_endpoint_raises_no_candidates():
    factories = builtin_factories() | {"drop-all": lambda name, raw, handle: DropAll(name)}
    config = parse_config("plugins: [{type: drop-all}]\nschedulingProfiles: [{name: p, plugins: [{pluginRef: drop-all}]}]")
    with pytest.raises(NoCandidatesError, match="drop-all"):
        build_scheduler(config, PluginHandle(), factories).schedule(request(), endpoints(2))


# --- placement on a slot-bound fleet (issue 12) ------------------------------------------------------

SHARED = prompt(77, 1280)  # a shared system prompt: 20 blocks of 64 tokens


def batch_line(n: int) -> list[int]:
    """One line of a shared-prefix batch: the shared prompt and 64 tokens of its own."""
    return SHARED + prompt(5000 + n, 64)


class SlotBoundFleet:
    """Engines with ``max_num_seqs`` slots that never finish a request (the worst case for
    placement): each placement is forwarded and then scraped at once, as the pool would."""

    def __init__(self, n: int, max_num_seqs: int = 4, duration_s: float | None = 2.0) -> None:
        self.clock = FakeClock()
        self.pool = endpoints(n, block_size=16, num_gpu_blocks=4096)
        self.max_num_seqs = max_num_seqs
        for ep in self.pool:
            ep.mean_request_duration_s = duration_s
            self.scrape(ep)

    def scrape(self, ep) -> None:
        ep.num_requests_running = min(ep.in_flight_requests, self.max_num_seqs)
        ep.num_requests_waiting = ep.in_flight_requests - ep.num_requests_running
        ep.peak_running = max(ep.peak_running, ep.num_requests_running)
        ep.metrics_updated_at = self.clock.now

    def place(self, scheduler, tokens, **fields):
        req = request(tokens, **fields)
        result = route(scheduler, req, self.pool)
        ep = result.endpoint
        info = result.state.first(PrefixMatchInfo)
        ep.in_flight_requests += 1
        ep.in_flight_uncached_tokens += info.uncached_tokens(ep.name, req.prompt_tokens)
        self.scrape(ep)
        return result

    def default_scheduler(self, **affinity_params):
        config = load_config(DEFAULT_CONFIG_PATH)
        if affinity_params:
            for plugin in config.plugins:
                if plugin.type == "prefix-cache-affinity-filter":
                    plugin.parameters = {**(plugin.parameters or {}), **affinity_params}
        return build_scheduler(config, PluginHandle(rng=random.Random(3), clock=self.clock))


def test_a_full_sticky_engine_with_waiting_requests_sends_the_request_to_an_idle_one():
    fleet = SlotBoundFleet(2)
    scheduler = fleet.default_scheduler()
    home = fleet.place(scheduler, batch_line(0)).endpoint
    idle = fleet.pool[1 - fleet.pool.index(home)]
    # home runs 4 (all its slots) with 3 waiting; only a little prefill is queued there (1,332
    # tokens ≈ 84 ms); the slot wait, 3 × 2 s ÷ 7 = 857 ms, does not pay for recomputing the
    # 1,280-token shared prompt on the idle engine: 80 ms × (16 + 0 requests there) = 1,286 ms
    home.in_flight_requests, home.in_flight_uncached_tokens = 7, 1332
    fleet.scrape(home)
    result = fleet.place(scheduler, batch_line(1))
    assert result.endpoint is home
    assert result.state.read("affinity-outcome/prefix-cache-affinity-filter") == "sticky"
    # 8 waiting: 8 × 2 s ÷ 12 = 1,333 ms > 1,286 ms: the move pays
    home.in_flight_requests = 12
    fleet.scrape(home)
    result = fleet.place(scheduler, batch_line(2))
    assert result.endpoint is idle
    assert result.state.read("affinity-outcome/prefix-cache-affinity-filter") == "load_override"
    # the same state without the slot term sticks to the full engine (the defect of issue 12)
    blind = SlotBoundFleet(2, duration_s=None)
    scheduler = blind.default_scheduler(defaultRequestDurationMs=0)
    home = blind.place(scheduler, batch_line(0)).endpoint
    home.in_flight_requests, home.in_flight_uncached_tokens = 12, 1332
    blind.scrape(home)
    assert blind.place(scheduler, batch_line(1)).endpoint is home


def test_a_shared_prefix_batch_is_balanced_over_slot_bound_engines():
    fleet = SlotBoundFleet(2)
    scheduler = fleet.default_scheduler()
    chosen = Counter(fleet.place(scheduler, batch_line(n)).endpoint.name for n in range(40))
    assert sorted(chosen.values()) == [20, 20], chosen  # both sticky after the spill: load decides
    assert all(ep.num_requests_waiting == 16 for ep in fleet.pool)
    # without the slot term the batch piles onto one engine (prefill wait alone stays under 150 ms)
    blind = SlotBoundFleet(2, duration_s=None)
    scheduler = blind.default_scheduler(defaultRequestDurationMs=0)
    piled = Counter(blind.place(scheduler, batch_line(n)).endpoint.name for n in range(40))
    assert max(piled.values()) >= 35, piled


def test_sheddable_work_goes_only_to_an_engine_with_spare_capacity():
    fleet = SlotBoundFleet(2)
    scheduler = fleet.default_scheduler(maxTTFTPenaltyMs=0)  # affinity alone would always stick
    home = fleet.place(scheduler, batch_line(0)).endpoint
    spare = fleet.pool[1 - fleet.pool.index(home)]
    home.in_flight_requests = 4 + 5  # 5 waiting: saturation 1.0
    fleet.scrape(home)
    assert fleet.place(scheduler, batch_line(1)).endpoint is home  # interactive: sticky
    for fields in ({"sheddable": True}, {"priority": -10}):
        result = fleet.place(scheduler, batch_line(2), **fields)
        assert result.endpoint is spare
        assert result.state.read("spare-capacity-outcome/spare-capacity-filter") == "kept_spare"
