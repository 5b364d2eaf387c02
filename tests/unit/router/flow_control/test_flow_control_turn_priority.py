"""Turn priority inside a flow (llm-d's ``turn-priority``): later turns first, aging, cold restarts."""

from __future__ import annotations

import pytest
from flow_control_helpers import Slots, ids

from router.flow_control import ConfigError, FlowControlConfig, FlowControlCore, FlowItem, Ticket


def core_with(enabled: bool = True, weight: float = 0.5, inactivity: float = 120.0,
              max_sessions: int = 100, max_turn: int = 100) -> FlowControlCore:
    """One queueing interactive band, no bypass, so the slots decide when things dispatch."""
    return FlowControlCore(FlowControlConfig.from_mapping({
        "bands": [{"objective": "interactive", "priority": 100, "ttl_s": 600}],
        "turn_priority": {"enabled": enabled, "time_weight_per_s": weight, "inactivity_s": inactivity,
                          "max_sessions": max_sessions, "max_turn": max_turn},
    }))


def ask(core: FlowControlCore, rid: str, now: float, session: str | None = None, tenant: str = "t") -> Ticket:
    return core.enqueue(FlowItem(rid, tenant, "interactive", 10, session_id=session), now)


def run_turns(core: FlowControlCore, session: str, turns: int, now: float) -> None:
    """``turns`` requests of ``session`` dispatched and finished at ``now``."""
    for k in range(turns):
        ticket = ask(core, f"{session}-warm{k}", now, session)
        assert core.step(now, lambda: 0.0).dispatched == [ticket]
        core.release(ticket, now)


def one_by_one(core: FlowControlCore, now: float) -> list[str]:
    """Dispatch the queue through one slot, releasing each before the next; the order."""
    order = []
    while core.queued_requests:
        [ticket] = core.step(now, Slots(core, capacity=1)).dispatched
        order.append(ticket.item.request_id)
        core.release(ticket, now)
    return order


def test_a_sessions_next_turn_goes_ahead_of_new_sessions():
    core = core_with()
    run_turns(core, "agent", 3, now=0.0)
    full = Slots(core, capacity=1)
    blocker = ask(core, "blocker", 1.0)
    core.step(1.0, full)  # the one slot is taken
    for n in range(3):
        ask(core, f"new{n}", 1.0 + n * 0.01, session=f"fresh-{n}")
    later = ask(core, "agent-turn4", 1.05, "agent")
    assert later.turn == 4
    assert core.step(1.1, full).dispatched == []
    core.release(blocker, 1.2)
    assert ids(core.step(1.2, full).dispatched) == ["agent-turn4"]


def test_without_turn_priority_the_order_is_fifo():
    core = core_with(enabled=False)
    run_turns(core, "agent", 3, now=0.0)
    full = Slots(core, capacity=1)
    blocker = ask(core, "blocker", 1.0)
    core.step(1.0, full)
    ask(core, "new", 1.0, session="fresh")
    assert ask(core, "agent-turn4", 1.05, "agent").turn == 1  # not counted with the feature off
    core.release(blocker, 1.2)
    assert ids(core.step(1.2, full).dispatched) == ["new"]


def test_deeper_sessions_first_and_fifo_on_equal_scores():
    core = core_with(weight=0.0)
    run_turns(core, "deep", 5, now=0.0)
    run_turns(core, "shallow", 1, now=0.0)
    run_turns(core, "shallow-too", 1, now=0.0)
    for rid, session in [("s1", "shallow"), ("d", "deep"), ("s2", "shallow-too"), ("none", None)]:
        ask(core, rid, 1.0, session)
    assert one_by_one(core, 2.0) == ["d", "s1", "s2", "none"]


def test_aging_lets_a_waiting_first_turn_overtake_deeper_arrivals():
    # score = turn + 0.5 × wait: a first turn queued at t=0 has 1 + 0.5 × 20 = 11 at t=20, ahead of a
    # 10th turn that just arrived (10 + 0) and behind a 12th (12 + 0)
    core = core_with(weight=0.5)
    run_turns(core, "ten", 9, now=0.0)
    run_turns(core, "twelve", 11, now=0.0)
    full = Slots(core, capacity=1)
    blocker = ask(core, "blocker", 0.0)
    core.step(0.0, full)
    ask(core, "first", 0.0, session="newcomer")
    ask(core, "turn10", 20.0, "ten")
    ask(core, "turn12", 20.0, "twelve")
    core.release(blocker, 20.0)
    dispatched = []
    for now in (20.0, 20.1, 20.2):
        dispatched += ids(core.step(now, full).dispatched)
        if core._bands[0].in_flight:
            core.release(next(iter(core._bands[0].in_flight.values())), now)
    assert dispatched == ["turn12", "first", "turn10"]


@pytest.mark.parametrize(("weight", "max_turn"), [(0.5, 16), (1.0, 8)])
def test_no_starvation_under_a_steady_stream_of_ever_deeper_turns(weight, max_turn):
    # a new session waits while one agent's turns keep arriving, one per slot freed each second, its
    # turn number growing by one each time (faster than aging alone could catch): with turns counted
    # up to max_turn the newcomer goes once 1 + weight × wait ≥ max_turn (FIFO on the tie)
    core = core_with(weight=weight, max_turn=max_turn)
    run_turns(core, "deep", 5, now=0.0)
    full = Slots(core, capacity=1)
    running = ask(core, "blocker", 0.0)
    core.step(0.0, full)
    ask(core, "newcomer", 0.0, session="newcomer")
    dispatched_at = None
    for second in range(1, 100):
        now = float(second)
        ask(core, f"deep-{second}", now, "deep")
        core.release(running, now)
        [running] = core.step(now, full).dispatched
        if running.item.request_id == "newcomer":
            dispatched_at = now
            break
    assert dispatched_at == (max_turn - 1) / weight


def test_without_a_turn_cap_a_fast_session_can_hold_a_newcomer_back():
    # the reason for max_turn: unbounded, the agent's count outgrows the newcomer's aging
    core = core_with(weight=0.5, max_turn=10**6)
    run_turns(core, "deep", 5, now=0.0)
    full = Slots(core, capacity=1)
    running = ask(core, "blocker", 0.0)
    core.step(0.0, full)
    ask(core, "newcomer", 0.0, session="newcomer")
    for second in range(1, 60):
        ask(core, f"deep-{second}", float(second), "deep")
        core.release(running, float(second))
        [running] = core.step(float(second), full).dispatched
        assert running.item.request_id != "newcomer"


def test_a_session_idle_past_inactivity_is_back_at_turn_one():
    core = core_with(inactivity=60.0)
    run_turns(core, "agent", 4, now=0.0)
    assert core.turn_number("agent", 59.0) == 5
    assert core.turn_number("agent", 61.0) == 1
    assert ask(core, "back", 61.0, "agent").turn == 1
    core.step(61.0, lambda: 0.0)
    assert core.turn_number("agent", 61.5) == 2  # the count restarted


def test_in_flight_keeps_a_session_warm_and_zero_inactivity_never_resets():
    core = core_with(inactivity=60.0)
    run_turns(core, "agent", 2, now=0.0)
    ticket = ask(core, "long", 1.0, "agent")
    core.step(1.0, lambda: 0.0)
    assert core.turn_number("agent", 500.0) == 4  # a request is still running
    core.release(ticket, 500.0)
    assert core.turn_number("agent", 559.0) == 4
    never = core_with(inactivity=0.0)
    run_turns(never, "agent", 2, now=0.0)
    assert never.turn_number("agent", 10**6) == 3


def test_remembered_sessions_are_bounded():
    core = core_with(max_sessions=2)
    for session in ("a", "b", "c"):
        run_turns(core, session, 1, now=0.0)
    assert core.turn_number("a", 1.0) == 1 and core.turn_number("c", 1.0) == 2


def test_tenants_keep_their_fair_share_with_turn_priority():
    # tenant x's deep session does not overtake tenant y's first turns: DRR between tenants stays
    core = core_with(weight=0.0)
    run_turns(core, "deep", 5, now=0.0)
    full = Slots(core, capacity=1)
    blocker = ask(core, "blocker", 0.0)
    core.step(0.0, full)
    for n in range(2):
        ask(core, f"x-deep{n}", 1.0, "deep", tenant="x")
        ask(core, f"y-new{n}", 1.0, f"y{n}", tenant="y")
    core.release(blocker, 2.0)
    dispatched = []
    for k in range(4):
        dispatched += ids(core.step(2.0 + k, full).dispatched)
        core.release(next(iter(core._bands[0].in_flight.values())), 2.0 + k)
    assert sorted(dispatched[:2]) == ["x-deep0", "y-new0"] and sorted(dispatched[2:]) == ["x-deep1", "y-new1"]


def test_a_deadline_at_risk_still_goes_first_with_turn_priority():
    core = core_with(weight=0.0)
    run_turns(core, "deep", 5, now=0.0)
    full = Slots(core, capacity=1)
    blocker = ask(core, "blocker", 0.0)
    core.step(0.0, full)
    ask(core, "deep", 1.0, "deep")
    urgent = core.enqueue(FlowItem("urgent", "t", "interactive", 10, deadline=2.5), 1.0)
    core.release(blocker, 2.0)
    assert core.step(2.0, full).dispatched == [urgent]
    core.release(urgent, 2.1)
    assert ids(core.step(2.1, full).dispatched) == ["deep"]


def test_turn_priority_config_is_validated():
    with pytest.raises(ConfigError):
        FlowControlConfig.from_mapping({"turn_priority": {"time_weight_per_s": -1}})
    with pytest.raises(ConfigError):
        FlowControlConfig.from_mapping({"turn_priority": {"surprise": 1}})
    assert FlowControlConfig().turn_priority.enabled is False
