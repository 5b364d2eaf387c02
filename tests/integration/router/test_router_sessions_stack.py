"""Sessions through a real ``backfill router`` (shipped config) in front of two simulated engines:
an agent client's own session header keeps its turns on one engine, even with prompts that share
nothing (which the prefix and load plugins would spread), and its idle working set shows in
``/admin/state``."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.router_stack import RouterStack


def test_a_claude_code_session_stays_on_one_engine_and_its_working_set_shows(tmp_path: Path) -> None:
    with RouterStack(tmp_path, engines=2) as s:
        before = s.served_counts()
        with httpx.Client(base_url=s.url, timeout=30) as client:
            for turn in range(6):  # distinct prompts: nothing to share, only the session ties them
                answer = client.post("/v1/chat/completions", headers={"X-Claude-Code-Session-Id": "cc-7f3e"}, json={
                    "model": "sim-model", "max_tokens": 2,
                    "messages": [{"role": "user", "content": f"turn {turn}: " + f"fresh words {turn} " * 120}]})
                assert answer.status_code == 200, answer.text
        served = [after - b for after, b in zip(s.served_counts(), before)]
        assert sorted(served) == [0, 6]
        home = s.engine_urls[served.index(6)]
        tokens = {e["name"]: e["idle_session_tokens"] for e in s.state()["endpoints"]}
        assert tokens[home] > 0 and sum(tokens.values()) == tokens[home]
        state = s.state()
        # the gate counts the working set, at most working_set_cap of the engine's GPU KV, and says why it is
        # open or closed (issue 27)
        reserved = {e["name"]: e["reserved_session_tokens"] for e in state["endpoints"]}
        assert 0 < reserved[home] <= tokens[home]
        assert state["gate_reason"] == "open" and {e["gate_reason"] for e in state["endpoints"]} == {"open"}
