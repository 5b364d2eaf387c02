"""Each plugin alone, with scores computed by hand."""

import random

import pytest
from scheduling_helpers import FakeClock, InMemoryPrefixIndex, endpoints, prompt, request

from router.scheduling.hashing import request_block_keys
from router.scheduling.interfaces import PluginHandle
from router.scheduling.plugins.affinity_filter import AffinityOutcome, build_affinity_filter
from router.scheduling.plugins.load import build_kv_cache_scorer, build_queue_scorer, build_token_load_scorer
from router.scheduling.plugins.no_hit_lru import build_no_hit_lru
from router.scheduling.plugins.pickers import (
    build_max_score_picker,
    build_random_picker,
    build_round_robin_picker,
    build_weighted_random_picker,
)
from router.scheduling.plugins.prefix import build_approx_producer, build_precise_producer, build_prefix_scorer
from router.scheduling.plugins.session import build_session_affinity
from router.scheduling.plugins.spare_capacity import SpareCapacityOutcome, build_spare_capacity_filter
from router.scheduling.scheduler import SchedulingResult
from router.scheduling.types import CycleState, Endpoint, PrefixMatchInfo, prefix_match_key

APPROX = "approx-prefix-cache-producer"


def handle(seed: int = 0, **fields) -> PluginHandle:
    return PluginHandle(rng=random.Random(seed), **fields)


def committed(req, ep: Endpoint, state: CycleState | None = None) -> SchedulingResult:
    return SchedulingResult("default", ep, [ep], [0.0], {}, state or CycleState())


def match_state(total: int, matched: dict[str, float], producer: str = APPROX) -> CycleState:
    state = CycleState()
    state.write(prefix_match_key(producer), PrefixMatchInfo(total, 64, matched))
    return state


# --- prefix: approximate producer + scorer ------------------------------------------------------


def test_approx_producer_matches_consecutive_blocks_from_block_zero_and_scorer_divides_by_total():
    eps = endpoints(3)
    producer = build_approx_producer(APPROX, None, handle())
    scorer = build_prefix_scorer("prefix-cache-scorer", None, handle())
    a = prompt(1, 256)  # 4 blocks of 64
    first = request(a)
    producer.pre_request(first, committed(first, eps[0]))
    second = request(a[:128] + prompt(2, 128))  # shares blocks 0-1
    producer.pre_request(second, committed(second, eps[1]))

    state = CycleState()
    probe = request(a[:192] + prompt(3, 64))  # shares blocks 0-2 with a, 0-1 with second
    producer.produce(state, probe, eps)
    assert state.read(prefix_match_key(APPROX)).matched == {"http://e0": 3, "http://e1": 2}
    assert scorer.score(state, probe, eps) == [0.75, 0.5, 0.0]


def test_prefix_scorer_mixes_in_absolute_length():
    scorer = build_prefix_scorer("p", {"prefixLengthWeight": 0.5, "maxModelLen": 512}, handle())
    state = match_state(4, {"http://e0": 2})
    # 0.5 * min(1, 2*64/512)^2 + 0.5 * 2/4 = 0.5 * 0.0625 + 0.25
    assert scorer.score(state, request(prompt(1, 256)), endpoints(2)) == [pytest.approx(0.28125), 0.0]


def test_prefix_scorer_without_producer_data_or_blocks_scores_zero():
    scorer = build_prefix_scorer("p", None, handle())
    assert scorer.score(CycleState(), request(prompt(1, 256)), endpoints(2)) == [0.0, 0.0]
    assert scorer.score(match_state(0, {}), request(prompt(1, 10)), endpoints(2)) == [0.0, 0.0]


def test_approx_lru_is_sized_from_gpu_plus_cpu_blocks_and_evicts_oldest():
    # 32 GPU blocks x 16 tokens / 64 = 8 of our blocks
    small = Endpoint("http://small", block_size=16, num_gpu_blocks=32)
    producer = build_approx_producer(APPROX, None, handle())
    assert producer.capacity(small) == 8
    assert producer.capacity(Endpoint("http://cpu", block_size=16, num_gpu_blocks=32, num_cpu_blocks=16)) == 12
    assert producer.capacity(Endpoint("http://unknown")) == 31250
    a, b = request(prompt(1, 256)), request(prompt(2, 384))  # 4 + 6 blocks > 8
    producer.pre_request(a, committed(a, small))
    producer.pre_request(b, committed(b, small))
    assert producer.blocks_held("http://small") == 8
    state = CycleState()
    producer.produce(state, request(prompt(1, 256)), [small])
    assert state.read(prefix_match_key(APPROX)).matched == {}  # block 0 of a was evicted first
    producer.forget_endpoint("http://small")
    assert producer.blocks_held("http://small") == 0


def test_approx_block_size_is_raised_to_64():
    assert build_approx_producer(APPROX, {"blockSizeTokens": 16}, handle()).block_size_tokens == 64


# --- prefix: precise producer ---------------------------------------------------------------------


def test_precise_producer_weights_matched_blocks_by_tier():
    index = InMemoryPrefixIndex()
    req = request(prompt(1, 256))
    keys = request_block_keys(req, 64)
    index.put("m", "http://e0", keys)  # 4 blocks on GPU
    index.put("m", "http://e1", keys[:2])
    index.put("m", "http://e1", keys[2:], tier="cpu")  # run ends in CPU: 4 x 0.8
    index.put("m", "http://e2", keys[:2], tier="disk")  # 2 x 0.5
    producer = build_precise_producer("precise", None, handle(prefix_index=index))
    state = CycleState()
    producer.produce(state, req, endpoints(4))
    info = state.read(prefix_match_key("precise"))
    assert info.matched == {"http://e0": 4.0, "http://e1": pytest.approx(3.2), "http://e2": 1.0}
    assert info.held == {"http://e0": 4, "http://e1": 4, "http://e2": 2}  # every tier counted whole
    scorer = build_prefix_scorer("s", {"prefixMatchInfoProducerName": "precise"}, handle())
    assert scorer.score(state, req, endpoints(4)) == [1.0, pytest.approx(0.8), 0.25, 0.0]


def test_precise_producer_speculative_entries_on_decision():
    index = InMemoryPrefixIndex()
    producer = build_precise_producer(
        "precise", {"speculativeIndexing": True, "speculativeTTL": "500ms"}, handle(prefix_index=index)
    )
    req = request(prompt(1, 256))
    producer.pre_request(req, committed(req, endpoints(1)[0]))
    assert index.speculative == [("m", "http://e0", 4, 600.0)]  # held while the request runs
    producer.response_complete(req, endpoints(1)[0], None)
    assert index.speculative[-1] == ("m", "http://e0", 4, 0.5)  # then speculativeTTL


# --- load scorers -----------------------------------------------------------------------------------


def test_queue_scorer_is_min_max_normalised_waiting():
    eps = endpoints(3)
    for ep, waiting in zip(eps, [0, 5, 10]):
        ep.num_requests_waiting = waiting
    scorer = build_queue_scorer("q", None, handle())
    assert scorer.score(CycleState(), request(), eps) == [1.0, 0.5, 0.0]
    assert scorer.score(CycleState(), request(), endpoints(3, num_requests_waiting=4)) == [1.0, 1.0, 1.0]


def test_kv_cache_utilization_scorer_is_one_minus_usage():
    eps = [Endpoint("a", kv_cache_usage_perc=0.25), Endpoint("b", kv_cache_usage_perc=1.0)]
    assert build_kv_cache_scorer("k", None, handle()).score(CycleState(), request(), eps) == [0.75, 0.0]


def test_token_load_scorer_is_one_minus_capped_in_flight_uncached_tokens():
    eps = [Endpoint(f"e{i}", in_flight_uncached_tokens=t) for i, t in enumerate([0, 250, 2000])]
    scorer = build_token_load_scorer("t", {"queueThresholdTokens": 1000}, handle())
    assert scorer.score(CycleState(), request(), eps) == [1.0, 0.75, 0.0]


# --- session affinity ------------------------------------------------------------------------------


def test_session_affinity_prefers_the_last_endpoint_until_the_binding_expires():
    clock = FakeClock()
    scorer = build_session_affinity("s", {"evictionTtlSeconds": 60}, handle(clock=clock))
    eps = endpoints(3)
    first = request(session_id="chat-1")
    assert scorer.score(CycleState(), first, eps) == [0.0, 0.0, 0.0]
    scorer.pre_request(first, committed(first, eps[1]))
    clock.now += 59
    assert scorer.score(CycleState(), request(session_id="chat-1"), eps) == [0.0, 1.0, 0.0]
    assert scorer.score(CycleState(), request(session_id="chat-2"), eps) == [0.0, 0.0, 0.0]
    assert scorer.score(CycleState(), request(), eps) == [0.0, 0.0, 0.0]
    clock.now += 2
    assert scorer.score(CycleState(), request(session_id="chat-1"), eps) == [0.0, 0.0, 0.0]


def test_session_affinity_bindings_are_bounded():
    scorer = build_session_affinity("s", {"maxSessions": 2}, handle(clock=FakeClock()))
    ep = endpoints(1)[0]
    for sid in ["a", "b", "c"]:
        req = request(session_id=sid)
        scorer.pre_request(req, committed(req, ep))
    assert scorer.bound_endpoint("a") is None and scorer.bound_endpoint("c") == ep.name


# --- no-hit LRU ------------------------------------------------------------------------------------


def test_no_hit_lru_ranks_cold_requests_by_least_recent_cold_use():
    scorer = build_no_hit_lru("n", None, handle())
    eps = endpoints(3)
    cold = match_state(4, {})
    req = request(prompt(1, 256))
    assert scorer.score(cold, req, eps) == [1.0, 0.5, 0.0]  # never used: pool order
    scorer.pre_request(req, committed(req, eps[0], cold))
    cold2 = match_state(4, {})
    assert scorer.score(cold2, request(), eps) == [0.0, 1.0, 0.5]  # e0 most recent
    warm = match_state(4, {"http://e2": 1})
    assert scorer.score(warm, request(), eps) == [0.5, 0.5, 0.5]
    scorer.pre_request(req, committed(req, eps[1], warm))  # warm: no LRU change
    assert scorer.score(match_state(4, {}), request(), eps) == [0.0, 1.0, 0.5]


# --- prefix-cache affinity filter ------------------------------------------------------------------


def affinity(**params):
    base = {"peakPrefillThroughput": 1000, "maxTTFTPenaltyMs": 1000, "reuseLossWeight": 1}
    return build_affinity_filter("aff", base | params, handle())


def test_affinity_filter_keeps_the_longest_holders_when_they_hold_the_threshold():
    eps = endpoints(4)
    req = request(prompt(1, 256))
    state = match_state(4, {"http://e0": 4, "http://e1": 3.2, "http://e2": 3, "http://e3": 4})  # 1.0, 0.8, 0.75, 1.0
    assert affinity().filter(state, req, eps) == [eps[0], eps[3]]  # e1, e2 would recompute a block: a move
    assert state.read("affinity-outcome/aff") == AffinityOutcome.STICKY
    state = match_state(4, {"http://e0": 3, "http://e1": 2})  # the longest holds 0.75 < 0.8: no holder
    assert affinity().filter(state, req, eps) == eps
    assert state.read("affinity-outcome/aff") == AffinityOutcome.NO_STICKY


def test_affinity_filter_keeps_all_without_sticky_endpoints_or_data():
    eps = endpoints(3)
    req = request(prompt(1, 256))
    assert affinity().filter(match_state(4, {"http://e0": 1}), req, eps) == eps
    assert affinity().filter(CycleState(), req, eps) == eps


def test_affinity_filter_breaks_stickiness_when_the_sticky_backlog_is_too_long():
    eps = endpoints(2)
    req = request(prompt(1, 256))
    # wait(e0) = (in-flight + 0 uncached) / 1000 tok/s; wait(e1) = (0 + 256) / 1000 tok/s = 256 ms;
    # the move to the idle e1 costs the 256 recomputed tokens × (1 reuse lost + 0 in its engine) = 256 ms
    eps[0].in_flight_uncached_tokens = 1000  # 1000 - 256 = 744 ms <= 1000 ms floor: stick
    state = match_state(4, {"http://e0": 4})
    assert affinity().filter(state, req, eps) == [eps[0]]
    eps[0].in_flight_uncached_tokens = 1300  # 1300 - 256 = 1044 ms > max(1000, 256) ms: move
    state = match_state(4, {"http://e0": 4})
    assert affinity().filter(state, req, eps) == [eps[1]]  # the endpoints the move pays for
    assert state.read("affinity-outcome/aff") == AffinityOutcome.LOAD_OVERRIDE
    assert affinity(maxTTFTPenaltyMs=0).filter(match_state(4, {"http://e0": 4}), req, eps) == [eps[0]]


def test_move_cost_is_the_recompute_times_reuse_lost_plus_the_requests_in_the_target_engine():
    ep = endpoints(1, num_requests_waiting=2, num_requests_running=3, in_flight_requests=7)[0]  # 2 unseen
    # 512 tokens at 1000 tok/s = 512 ms, × (1 + 1 × (2 + 3 + 2)) = 8
    assert affinity().move_cost_ms(ep, 512) == pytest.approx(512 * 8)
    assert affinity(reuseLossWeight=0.5, queueImpactWeight=2).move_cost_ms(ep, 512) == pytest.approx(512 * 14.5)
    assert affinity(reuseLossWeight=0, queueImpactWeight=0).move_cost_ms(ep, 512) == 0.0
    assert affinity().move_cost_ms(ep, -5) == 0.0  # the target holds more than the holder: nothing recomputed


def test_a_busy_target_must_save_more_than_the_recompute_costs_its_queue():
    eps = endpoints(2)
    req = request(prompt(1, 256))
    eps[1].num_requests_running = 5  # every request there waits behind a 256-token recompute: 256 × 6 = 1536 ms
    aff = affinity(maxTTFTPenaltyMs=100)
    eps[0].in_flight_uncached_tokens = 1700  # saving 1700 - 256 = 1444 ms < 1536 ms: stay on the holder
    assert aff.filter(match_state(4, {"http://e0": 4}), req, eps) == [eps[0]]
    eps[0].in_flight_uncached_tokens = 1900  # saving 1644 ms > 1536 ms: the move pays
    assert aff.filter(match_state(4, {"http://e0": 4}), req, eps) == [eps[1]]
    old_rule = affinity(maxTTFTPenaltyMs=100, reuseLossWeight=0, queueImpactWeight=0)
    eps[0].in_flight_uncached_tokens = 1700  # without the cost terms the 1444 ms saving moved it
    assert old_rule.filter(match_state(4, {"http://e0": 4}), req, eps) == [eps[1]]


def test_only_the_tokens_a_holder_has_and_the_target_lacks_are_charged():
    eps = endpoints(3)
    req = request(prompt(1, 256))
    for ep in eps[1:]:
        ep.num_requests_running = 3
    eps[0].in_flight_uncached_tokens = 1000
    # e1 holds half the prompt: it recomputes 128 tokens (128 ms × 4 = 512 ms) and saves
    # 1000 - 128 = 872 ms; e2 holds nothing: 256 × 4 = 1024 ms against a saving of 744 ms
    state = match_state(4, {"http://e0": 4, "http://e1": 2})
    assert affinity(maxTTFTPenaltyMs=100, affinityThreshold=0.8).filter(state, req, eps) == [eps[1]]


def test_a_holder_offloaded_to_the_cpu_tier_is_still_the_longest_holder():
    eps = endpoints(3)
    req = request(prompt(1, 640))  # 10 blocks of 64
    state = CycleState()
    # e0 holds all 10 blocks in the CPU tier (weighted 8.0), e1 the first 9 on the GPU (9.0)
    state.write(prefix_match_key(APPROX), PrefixMatchInfo(10, 64, {"http://e0": 8.0, "http://e1": 9.0},
                                                          {"http://e0": 10, "http://e1": 9}))
    assert affinity().filter(state, req, eps) == [eps[0]]  # loads, recomputes nothing
    info = state.read(prefix_match_key(APPROX))
    assert info.prefill_tokens("http://e0", 640) == 0 and info.uncached_tokens("http://e0", 640) == 128


def test_affinity_filter_explores_with_its_probability():
    eps = endpoints(2)
    state = match_state(4, {"http://e0": 4})
    assert affinity(explorationProbability=1.0).filter(state, request(prompt(1, 256)), eps) == eps
    assert state.read("affinity-outcome/aff") == AffinityOutcome.EXPLORE


# --- pickers ---------------------------------------------------------------------------------------


def test_max_score_picker_breaks_ties_at_random_and_never_picks_lower():
    picker = build_max_score_picker("p", None, handle(seed=3))
    eps = endpoints(3)
    picks = {picker.pick(CycleState(), eps, [2.0, 1.0, 2.0]).name for _ in range(50)}
    assert picks == {"http://e0", "http://e2"}
    assert picker.pick(CycleState(), eps, [0.1, 0.3, 0.2]) is eps[1]


def test_weighted_random_picker_is_proportional_to_score_and_seeded():
    eps = endpoints(3)
    counts = {ep.name: 0 for ep in eps}
    picker = build_weighted_random_picker("w", None, handle(seed=7))
    for _ in range(4000):
        counts[picker.pick(CycleState(), eps, [0.0, 1.0, 3.0]).name] += 1
    assert counts["http://e0"] == 0
    assert 0.7 < counts["http://e2"] / 4000 < 0.8
    again = build_weighted_random_picker("w", None, handle(seed=7))
    first = build_weighted_random_picker("w", None, handle(seed=7))
    assert [again.pick(CycleState(), eps, [0, 1, 3]).name for _ in range(20)] == [
        first.pick(CycleState(), eps, [0, 1, 3]).name for _ in range(20)
    ]
    uniform = {picker.pick(CycleState(), eps, [0.0, 0.0, 0.0]).name for _ in range(60)}
    assert uniform == {ep.name for ep in eps}


def test_random_and_round_robin_pickers():
    eps = endpoints(3)
    rr = build_round_robin_picker("rr", None, handle())
    assert [rr.pick(CycleState(), eps, [0, 9, 0]).name for _ in range(4)] == [
        "http://e0", "http://e1", "http://e2", "http://e0"]
    rnd = build_random_picker("r", None, handle(seed=1))
    assert {rnd.pick(CycleState(), eps, [9, 0, 0]).name for _ in range(60)} == {ep.name for ep in eps}


def test_affinity_wait_adds_the_slot_wait_by_littles_law():
    eps = endpoints(1, num_requests_running=4, num_requests_waiting=3, peak_running=4, in_flight_requests=9)
    ep = eps[0]
    info = PrefixMatchInfo(4, 64, {ep.name: 4})
    aff = affinity()
    ep.mean_request_duration_s = 2.8
    # ahead for a slot: 3 waiting + (9 − 7 unseen − 0 free slots) = 5; slots free every 2.8 s / 9 in the engine
    assert aff.slot_wait_ms(ep) == pytest.approx(5 * 2800 / 9)
    assert aff.estimated_wait_ms(ep, info, 256) == pytest.approx(5 * 2800 / 9)  # fully cached: no prefill
    ep.mean_request_duration_s = None  # not measured yet: defaultRequestDurationMs
    assert aff.slot_wait_ms(ep) == pytest.approx(5 * 2000 / 9)
    assert affinity(defaultRequestDurationMs=0).slot_wait_ms(ep) == 0.0
    free = endpoints(1, num_requests_running=2, peak_running=4, in_flight_requests=3, mean_request_duration_s=2.0)[0]
    assert aff.slot_wait_ms(free) == 0.0  # 1 unseen request, 2 free slots: nobody waits for a slot


# --- spare-capacity filter ---------------------------------------------------------------------------


def spare_filter(levels: dict[str, float], **params):
    return build_spare_capacity_filter("spare", params, handle(saturation=lambda ep: levels[ep.name]))


def test_spare_capacity_filter_keeps_engines_with_room_for_sheddable_work_only():
    eps = endpoints(3)
    levels = {"http://e0": 2.0, "http://e1": 0.4, "http://e2": 1.0}
    state = CycleState()
    assert spare_filter(levels).filter(state, request(sheddable=True), eps) == [eps[1]]
    assert state.read("spare-capacity-outcome/spare") == SpareCapacityOutcome.KEPT_SPARE
    assert spare_filter(levels).filter(CycleState(), request(priority=-1), eps) == [eps[1]]
    assert spare_filter(levels).filter(CycleState(), request(priority=10), eps) == eps  # not sheddable
    assert spare_filter(levels, saturationThreshold=1.5).filter(CycleState(), request(sheddable=True), eps) == eps[1:]
    full = {name: 1.0 for name in levels}
    state = CycleState()
    assert spare_filter(full).filter(state, request(sheddable=True), eps) == eps  # never empties the set
    assert state.read("spare-capacity-outcome/spare") == SpareCapacityOutcome.NONE_SPARE


def test_spare_capacity_filter_defaults_to_the_detector_with_the_in_flight_credit():
    clock = FakeClock()
    eps = endpoints(2, metrics_updated_at=clock.now, peak_running=4, num_requests_running=4)
    eps[0].in_flight_requests = 4 + 5  # 5 the scrape does not show, no free slot: saturation 1.0
    eps[1].in_flight_requests = 4
    spare = build_spare_capacity_filter("spare", None, handle(clock=clock))
    assert spare.filter(CycleState(), request(sheddable=True), eps) == [eps[1]]
    clock.now += 1.0  # metrics 1 s old: both stale, saturated: keep both
    assert spare.filter(CycleState(), request(sheddable=True), eps) == eps


def test_spare_capacity_filter_leaves_the_reserved_slot_to_interactive_work():
    clock = FakeClock()
    # both 4 slots learned (reserve 1); a runs 3 sheddable requests, b 2 sheddable + 1 interactive
    eps = endpoints(2, metrics_updated_at=clock.now, peak_running=4, learned_max_num_seqs=4,
                    num_requests_running=3, in_flight_requests=3)
    eps[0].in_flight_sheddable, eps[1].in_flight_sheddable = 3, 2
    spare = build_spare_capacity_filter("spare", None, handle(clock=clock))
    assert spare.filter(CycleState(), request(sheddable=True), eps) == [eps[1]]
    assert spare.filter(CycleState(), request(priority=10), eps) == eps  # interactive may take the 4th slot
