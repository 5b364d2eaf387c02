"""``backfill bench sessions``: its flow-control files and trace (the run itself is the benchmark)."""

from pathlib import Path

from lab.bench.sessions import build_trace, flow_control_file
from router.flow_control import FlowControlConfig


def test_the_two_settings_differ_only_in_turn_priority(tmp_path: Path) -> None:
    off = FlowControlConfig.from_file(flow_control_file(False, 8, tmp_path, {"max_turn": 3}))
    on = FlowControlConfig.from_file(flow_control_file(True, 8, tmp_path, {"max_turn": 3}))
    assert (off.turn_priority.enabled, on.turn_priority.enabled) == (False, True)
    assert off.model_copy(update={"turn_priority": on.turn_priority}) == on
    interactive = on.band("interactive")
    assert (interactive.max_in_flight, interactive.tenant_max_in_flight, interactive.tenant_max_queued) == (8, None, None)
    assert on.turn_priority.max_turn == 3


def test_the_trace_is_sessions_only_with_later_turns() -> None:
    trace = build_trace(0, sessions=5, spread_s=1.0)
    assert {r.session_id for r in trace} and all(not r.session_id.startswith("one-off") for r in trace)
    assert any(r.turn >= 1 for r in trace)
