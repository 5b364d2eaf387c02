"""Sessions: the session id from headers, the session-affinity filter (stay, released to the move
rule when saturated, move once), the idle
sessions' working set and its term in the saturation batch is gated on."""

from __future__ import annotations

import random

import orjson
import pytest
from scheduling_helpers import FakeClock, endpoints, request

from router.parsing import CHAT_PATH, MAX_SESSION_ID_CHARS, parse_request
from router.scheduling import DEFAULT_CONFIG_PATH
from router.scheduling.config import build_scheduler, load_config
from router.scheduling.interfaces import PluginHandle
from router.scheduling.plugins.session import (
    SessionAffinityFilter,
    SessionOutcome,
    build_session_affinity,
    build_session_filter,
    working_set_of,
)
from router.scheduling.saturation import SaturationThresholds, endpoint_saturation, fleet_saturation
from router.scheduling.scheduler import SchedulingResult
from router.scheduling.types import CycleState, Endpoint

BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


# --- headers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("headers", "expected"), [
    ({"x-session-id": "ours"}, "ours"),
    ({"X-Claude-Code-Session-Id": "3f0c-claude"}, "3f0c-claude"),  # Claude Code
    ({"x-session-affinity": "ses_abc", "X-Session-Id": "ses_abc"}, "ses_abc"),  # OpenCode
    ({"x-session-affinity": "ses_only_affinity"}, "ses_only_affinity"),
    ({"x-opencode-session": "ses_zen"}, "ses_zen"),  # OpenCode towards its own providers
    ({"session-id": "019a-codex"}, "019a-codex"),  # Codex ≥ 0.131
    ({"session_id": "019a-codex-old"}, "019a-codex-old"),  # Codex before
    ({"x-session-id": "  ", "session-id": "next"}, "next"),  # blank ones are skipped
    ({"x-session-id": "first", "x-claude-code-session-id": "second"}, "first"),  # ours wins
    ({"thread-id": "t", "conversation_id": "c"}, None),  # not session ids
    ({}, None),
])
def test_session_id_from_ours_and_the_agent_clients_headers(headers, expected):
    assert parse_request(CHAT_PATH, BODY, headers).session_id == expected


def test_a_long_session_id_is_cut():
    parsed = parse_request(CHAT_PATH, BODY, {"x-session-id": "s" * 10_000})
    assert parsed.session_id == "s" * MAX_SESSION_ID_CHARS


# --- the filter -------------------------------------------------------------------------------------

NOW = 1000.0


def fleet(n: int = 3) -> list[Endpoint]:
    """Fresh, idle endpoints with 16-token blocks and 1,000 GPU blocks (16,000 tokens) each."""
    return endpoints(n, metrics_updated_at=NOW, block_size=16, num_gpu_blocks=1000)


def result(ep: Endpoint) -> SchedulingResult:
    return SchedulingResult("default", ep, [ep], [0.0], {}, CycleState())


def serve(plugin, req, ep: Endpoint) -> None:
    """The request was sent to ``ep`` and its answer ended."""
    plugin.pre_request(req, result(ep))
    plugin.response_complete(req, ep, None)


def session_filter(clock: FakeClock, **params) -> SessionAffinityFilter:
    return build_session_filter("session", params or None, PluginHandle(clock=clock))


def test_a_bound_session_stays_on_its_endpoint():
    clock, eps = FakeClock(NOW), fleet()
    plugin = session_filter(clock)
    first = request(session_id="agent-1")
    state = CycleState()
    assert plugin.filter(state, first, eps) == eps  # unbound: the profile decides
    assert state.read("session-affinity-outcome/session") == SessionOutcome.UNBOUND
    serve(plugin, first, eps[2])
    state = CycleState()
    assert plugin.filter(state, request(session_id="agent-1"), eps) == [eps[2]]
    assert state.read("session-affinity-outcome/session") == SessionOutcome.KEPT
    assert plugin.filter(CycleState(), request(session_id="other"), eps) == eps
    assert plugin.filter(CycleState(), request(), eps) == eps


def test_a_saturated_endpoint_releases_the_session_and_a_move_is_followed_by_later_turns():
    clock, eps = FakeClock(NOW), fleet()
    plugin = session_filter(clock)
    serve(plugin, request(session_id="agent"), eps[0])
    eps[0].num_requests_waiting = 5  # queue threshold: saturation 1.0
    state = CycleState()
    turn = request(session_id="agent")
    kept = plugin.filter(state, turn, eps)
    assert kept == eps and state.read("session-affinity-outcome/session") == SessionOutcome.RELEASED
    serve(plugin, turn, eps[1])  # the rest of the profile (the move rule) picked e1: the binding moves
    assert plugin.bound_endpoint("agent") == eps[1].name and plugin.moves_total == 1
    eps[0].num_requests_waiting = 0  # the old engine has room again: the session does not go back
    assert plugin.filter(CycleState(), request(session_id="agent"), eps) == [eps[1]]
    assert plugin.moves_total == 1


def test_below_the_threshold_the_session_stays_and_a_lone_saturated_endpoint_is_kept():
    clock, eps = FakeClock(NOW), fleet(2)
    plugin = session_filter(clock)
    serve(plugin, request(session_id="agent"), eps[0])
    eps[0].num_requests_waiting = 4  # 0.8
    assert plugin.filter(CycleState(), request(session_id="agent"), eps) == [eps[0]]
    eps[0].num_requests_waiting = 9
    assert plugin.filter(CycleState(), request(session_id="agent"), eps[:1]) == [eps[0]]  # never empty


def test_an_interactive_session_is_not_moved_by_the_slot_reserve_but_a_sheddable_one_is():
    clock, eps = FakeClock(NOW), fleet(2)
    for ep in eps:
        ep.max_num_seqs, ep.in_flight_sheddable, ep.in_flight_requests, ep.num_requests_running = 4, 3, 3, 3
    plugin = session_filter(clock)
    serve(plugin, request(session_id="agent"), eps[0])
    assert plugin.filter(CycleState(), request(session_id="agent"), eps) == [eps[0]]
    assert plugin.filter(CycleState(), request(session_id="agent", sheddable=True), eps) == eps  # released


def test_bindings_expire_and_go_with_their_endpoint():
    clock, eps = FakeClock(NOW), fleet()
    plugin = session_filter(clock, evictionTtlSeconds=60)
    serve(plugin, request(session_id="a"), eps[0])
    serve(plugin, request(session_id="b"), eps[1])
    plugin.forget_endpoint(eps[0].name)
    assert plugin.bound_endpoint("a") is None and plugin.bound_endpoint("b") == eps[1].name
    clock.now += 61
    assert plugin.filter(CycleState(), request(session_id="b"), eps) == eps


def test_the_scorer_type_shares_the_store_semantics():
    clock, eps = FakeClock(NOW), fleet()
    scorer = build_session_affinity("s", None, PluginHandle(clock=clock))
    serve(scorer, request(session_id="a"), eps[1])
    assert scorer.score(CycleState(), request(session_id="a"), eps) == [0.0, 1.0, 0.0]
    assert not hasattr(scorer, "filter") and not hasattr(session_filter(clock), "score")


# --- the working set ---------------------------------------------------------------------------------


def test_idle_sessions_count_in_their_endpoints_working_set_within_the_window():
    clock, eps = FakeClock(NOW), fleet()
    plugin = session_filter(clock, workingSetWindowSeconds=120)
    a, b = request(list(range(3000)), session_id="a"), request(list(range(1000)), session_id="b")
    plugin.pre_request(a, result(eps[0]))
    assert plugin.working_set_tokens() == {}  # running: its blocks are in the engine's own books
    plugin.response_complete(a, eps[0], None)
    serve(plugin, b, eps[0])
    serve(plugin, request(list(range(500)), session_id="c"), eps[1])
    assert plugin.working_set_tokens() == {eps[0].name: 4000, eps[1].name: 500}
    nxt = request(list(range(3500)), session_id="a")
    plugin.pre_request(nxt, result(eps[0]))  # a's next turn runs: a leaves the idle set
    assert plugin.working_set_tokens() == {eps[0].name: 1000, eps[1].name: 500}
    plugin.response_complete(nxt, eps[0], None)
    assert plugin.working_set_tokens() == {eps[0].name: 4500, eps[1].name: 500}
    clock.now += 121
    assert plugin.working_set_tokens() == {}


def test_a_moved_session_takes_its_working_set_along():
    clock, eps = FakeClock(NOW), fleet(2)
    plugin = session_filter(clock)
    serve(plugin, request(list(range(800)), session_id="a"), eps[0])
    serve(plugin, request(list(range(900)), session_id="a"), eps[1])
    assert plugin.working_set_tokens() == {eps[1].name: 900}


def test_window_zero_turns_the_working_set_off():
    clock, eps = FakeClock(NOW), fleet()
    plugin = session_filter(clock, workingSetWindowSeconds=0)
    serve(plugin, request(list(range(800)), session_id="a"), eps[0])
    assert plugin.working_set_tokens() == {} and working_set_of([plugin]) is None
    assert working_set_of([session_filter(clock)]) is not None


def test_the_working_set_raises_the_sheddable_saturation_only():
    ep = fleet(1)[0]
    ep.kv_cache_usage_perc = 0.4
    t = SaturationThresholds()
    assert endpoint_saturation(ep, NOW, t) == pytest.approx(0.5)
    # 8,000 idle tokens of 16,000: +0.5 of the cache, (0.4 + 0.5) / 0.8
    assert endpoint_saturation(ep, NOW, t, working_set_tokens=8000) == pytest.approx(1.125)
    assert endpoint_saturation(ep, NOW, t, working_set_tokens=8000, reserve=False) == pytest.approx(0.5)
    assert endpoint_saturation(ep, NOW, t, working_set_tokens=10**9) == pytest.approx(1.4 / 0.8)  # capped at 1
    unknown = Endpoint("http://x", metrics_updated_at=NOW, kv_cache_usage_perc=0.4)
    assert endpoint_saturation(unknown, NOW, t, working_set_tokens=8000) == pytest.approx(0.5)  # no sizes yet
    busy, idle = fleet(2)
    assert fleet_saturation([busy, idle], NOW, t, working_set={busy.name: 16000}) == [pytest.approx(1.25), 0.0]


# --- through the shipped config -------------------------------------------------------------------------


def test_the_shipped_profile_keeps_a_session_then_moves_it_once():
    clock = FakeClock(NOW)
    scheduler = build_scheduler(load_config(DEFAULT_CONFIG_PATH), PluginHandle(rng=random.Random(0), clock=clock))
    eps = fleet(3)
    history = list(range(2000))
    placed = []
    for turn in range(6):
        history = history + list(range(10_000 + 100 * turn, 10_000 + 100 * turn + 100))
        req = request(history, session_id="agent")
        if turn == 3:  # its engine saturates: 6 requests wait for a slot, each ~10 s: a move pays
            bound = next(ep for ep in eps if ep.name == placed[-1])
            bound.num_requests_waiting, bound.mean_request_duration_s = 6, 10.0
        res = scheduler.schedule(req, eps)
        scheduler.pre_request(req, res)
        scheduler.response_complete(req, res, None)
        placed.append(res.endpoint.name)
    assert len(set(placed[:3])) == 1  # stays
    assert placed[3] != placed[2] and len(set(placed[3:])) == 1  # moved once, later turns follow


def test_the_shipped_profile_keeps_a_session_on_its_saturated_engine_when_every_engine_is_as_busy():
    """The session filter releases a saturated engine's session to the move rule, and moving
    would only add a 2,000-token recompute to another full queue: it stays."""
    clock = FakeClock(NOW)
    scheduler = build_scheduler(load_config(DEFAULT_CONFIG_PATH), PluginHandle(rng=random.Random(0), clock=clock))
    eps = fleet(3)
    history = list(range(2000))
    placed = []
    for turn in range(5):
        history = history + list(range(10_000 + 100 * turn, 10_000 + 100 * turn + 100))
        req = request(history, session_id="agent")
        if turn == 2:
            for ep in eps:  # every engine saturates alike
                ep.num_requests_waiting, ep.num_requests_running = 6, 4
                ep.in_flight_requests = 10
        res = scheduler.schedule(req, eps)
        state = res.state
        scheduler.pre_request(req, res)
        scheduler.response_complete(req, res, None)
        placed.append(res.endpoint.name)
        if turn >= 2:
            assert state.read("session-affinity-outcome/session-affinity-filter") == SessionOutcome.RELEASED
    assert len(set(placed)) == 1


def test_one_endpoints_working_set_read_equals_its_entry_in_the_whole_map():
    """working_set_tokens_at / SessionWorkingSet.tokens (the router's per-endpoint read) against
    working_set_tokens() on randomized turns, moves, expiries and a lost endpoint."""
    rng = random.Random(5)
    clock, eps = FakeClock(NOW), fleet(5)
    plugin = session_filter(clock, workingSetWindowSeconds=30)
    source = working_set_of([plugin])
    assert source is not None
    running: dict[str, tuple[object, Endpoint]] = {}
    for _ in range(400):
        roll, sid = rng.random(), f"s{rng.randrange(12)}"
        if roll < 0.45 and sid not in running:
            req, ep = request(list(range(rng.randint(1, 4000))), session_id=sid), rng.choice(eps)
            plugin.pre_request(req, result(ep))
            running[sid] = (req, ep)
        elif roll < 0.85 and running:
            req, ep = running.pop(rng.choice(sorted(running)))
            plugin.response_complete(req, ep, None)  # type: ignore[arg-type]
        elif roll < 0.97:
            clock.now += rng.choice((1.0, 10.0, 25.0))
        else:
            plugin.forget_endpoint(rng.choice(eps).name)
        whole = source()
        assert whole == plugin.working_set_tokens()
        for ep in eps:
            assert source.tokens(ep.name) == plugin.working_set_tokens_at(ep.name) == whole.get(ep.name, 0)
