"""``backfill router`` takes each engine's sequence slots from what the engine states (issue 24):
simulated engines export ``backfill:engine_config_info{max_num_seqs}`` as vLLM with backfill's
plugin does, and the router uses it from its first scrape, also after its own restart; an engine
that states nothing (``--no-plugin-metrics``: /metrics as vLLM alone) is learned from traffic."""

from __future__ import annotations

from pathlib import Path

import httpx

from engine_twin.launch import wait_ready
from router.cli import router_argv
from tests.integration.test_router_proxy import _hog
from tests.router_stack import RouterStack, stop_processes
from tests.waiting import wait_for

SLOTS = 8
#: ~48 s per request at the twin's ~12 ms a token: outlasts anything the test waits for.
ENDLESS_TOKENS = 4000


def _endpoint(s: RouterStack, url: str) -> dict:
    return next(e for e in s.state()["endpoints"] if e["name"] == url)


def _restart_router(s: RouterStack) -> None:
    stop_processes([s.router])
    argv = router_argv(s.router_port, s.engine_urls, kv_events_bind=s.kv_bind, **s.router_options)
    s.router = s._spawn(argv, "router-again", {"BACKFILL_ROUTER_TRUSTED_TOKEN": s.token or ""})
    wait_ready(s.url, timeout=30, process=s.router)
    s.wait_candidates(len(s.engine_urls))


def test_stated_slots_are_used_from_the_first_scrape_and_unstated_ones_learned(tmp_path: Path) -> None:
    stating = {"time_scale": 1.0, "max_num_seqs": SLOTS}
    plain = {**stating, "plugin_metrics": False}
    with RouterStack(tmp_path, engines=2, engine_options=[stating, plain]) as s:
        told, silent = s.engine_urls
        assert "backfill:engine_config_info{" in httpx.get(f"{told}/metrics", timeout=5).text
        assert "backfill:engine_config_info" not in httpx.get(f"{silent}/metrics", timeout=5).text
        first = _endpoint(s, told)
        assert (first["max_num_seqs"], first["slots_source"]) == (SLOTS, "stated")  # no traffic yet
        assert first["slot_reserve"] == 1
        assert (_endpoint(s, silent)["max_num_seqs"], _endpoint(s, silent)["slots_source"]) == (None, None)

        _hog(silent, SLOTS + 2, ENDLESS_TOKENS)  # full, two waiting: learned from scrapes
        learned = wait_for(lambda: (e := _endpoint(s, silent))["slots_source"] == "learned" and e,
                           "the router learning the silent engine's slots")
        assert learned["max_num_seqs"] == SLOTS

        _restart_router(s)  # the new router knows the stating engine's slots at once ...
        again = _endpoint(s, told)
        assert (again["max_num_seqs"], again["slots_source"]) == (SLOTS, "stated")
        # ... and learns the silent one's again from its scrapes (still full with the requests above)
        relearned = wait_for(lambda: (e := _endpoint(s, silent))["slots_source"] == "learned" and e,
                             "the restarted router learning the silent engine's slots")
        assert relearned["max_num_seqs"] == SLOTS
