"""``backfill router`` takes each engine's sequence slots from what the engine states (issue 24):
simulated engines export ``backfill:engine_config_info{max_num_seqs}`` as vLLM with backfill's
plugin does, and the router uses it from its first scrape, also after its own restart; an engine
that states nothing (``--no-plugin-metrics``: /metrics as vLLM alone) is learned from traffic."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import httpx
from aiohttp import web

from engine_twin.launch import wait_ready
from router.cli import router_argv
from router.pool import EndpointPool, slots_source
from tests.integration.engine_twin.conftest import free_port
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


DATA = Path(__file__).resolve().parents[1] / "unit" / "router" / "data"


def test_a_vllm_in_dev_mode_answers_its_slots_at_server_info() -> None:
    """vLLM without the plugin states max_num_seqs only at GET /server_info (VLLM_SERVER_DEV_MODE=1):
    the router's probes read it once, beside the scrapes. The stand-in serves what a real vLLM 0.32
    answered (tests/unit/router/data)."""
    metrics_text = (DATA / "vllm-0.32-metrics.txt").read_bytes()
    server_info = json.loads((DATA / "vllm-0.32-server-info.json").read_text())
    asked: list[str | None] = []

    async def serve_metrics(_request: web.Request) -> web.Response:
        return web.Response(body=metrics_text, content_type="text/plain")

    async def serve_server_info(request: web.Request) -> web.Response:
        asked.append(request.query.get("config_format"))
        return web.json_response(server_info)

    async def serve_health(_request: web.Request) -> web.Response:
        return web.Response()

    async def main() -> tuple[int | None, str | None, int | None]:
        app = web.Application()
        app.router.add_get("/metrics", serve_metrics)
        app.router.add_get("/server_info", serve_server_info)
        app.router.add_get("/health", serve_health)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as session:
                pool = EndpointPool(session, scrape_interval_s=0.05)
                pool.set_endpoints([url])
                try:
                    ep = pool.states[url].endpoint
                    deadline = asyncio.get_running_loop().time() + 15
                    while ep.slots is None and asyncio.get_running_loop().time() < deadline:
                        await asyncio.sleep(0.05)
                    return ep.slots, slots_source(ep), ep.block_size
                finally:
                    await pool.close()
        finally:
            await runner.cleanup()

    slots, source, block_size = asyncio.run(main())
    assert (slots, source, block_size) == (8, "stated", 128)
    assert asked == ["json"]  # once, however many scrapes
