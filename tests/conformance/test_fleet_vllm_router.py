"""vLLM's own Rust router (`vllm-router --policy kv_aware`) reads our KV events and routes repeated
prefixes to the simulated engine that holds them.

Each engine is warmed directly (the router never sees those requests), so only the KV events can
tell the router where each prefix lives. `vllm-router` 0.1.x subscribes static sources with the
empty topic (vLLM's default), tokenizes through the engine's `/v1/completions/render`, and hashes
`token_ids` of `BlockStored` itself.
"""

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine_twin.launch import sim_engine_argv, wait_ready


def _router_binary() -> str:
    found = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    if not Path(found).exists():
        pytest.skip("vllm-router is not installed (pip install vllm-router); it could not be found on PATH")
    return found


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PREFIX_A = "Tenant A system prompt: you answer questions about invoices and purchase orders. " * 6
PREFIX_B = "Tenant B system prompt: you write haiku about mountains, rivers and the sea. " * 6


def test_vllm_router_kv_aware_routes_prefixes_to_the_engine_holding_them(tmp_path):
    router_bin = _router_binary()
    procs = []
    try:
        engines = []
        for _ in range(2):
            port, events = _port(), _port()
            argv = sim_engine_argv(port, ["m1"], time_scale=0.0, extra=(
                "--kv-events-config",
                f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:{events}"}}'))
            procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            engines.append((f"http://127.0.0.1:{port}", events))
        for (url, _), proc in zip(engines, procs):
            wait_ready(url, timeout=20, process=proc)
        router_port = _port()
        cmd = [router_bin, "--host", "127.0.0.1", "--port", str(router_port), "--policy", "kv_aware",
               "--worker-urls", *[u for u, _ in engines], "--kv-event-model", "m1", "--kv-event-block-size", "16",
               "--health-check-interval-secs", "3600",
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_port())]  # not the shared default 29000
        for url, events in engines:
            cmd += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{events}"]
        log = open(tmp_path / "router.log", "w")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        router = f"http://127.0.0.1:{router_port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{router}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or procs[-1].poll() is not None:
                pytest.fail(f"vllm-router did not start: {(tmp_path / 'router.log').read_text()[-2000:]}")
            time.sleep(0.2)
        time.sleep(1.0)  # let the router's SUB sockets connect before the engines publish

        # warm engine 0 with prefix A and engine 1 with prefix B, bypassing the router
        for (url, _), prefix in zip(engines, (PREFIX_A, PREFIX_B)):
            r = httpx.post(f"{url}/v1/completions", json={"model": "m1", "prompt": prefix + "warm", "max_tokens": 1})
            assert r.status_code == 200
        time.sleep(1.0)  # events reach the router's index

        def route(prefix: str, i: int) -> int:
            r = httpx.post(f"{router}/v1/completions", headers={"content-type": "application/json"},
                           json={"model": "m1", "prompt": f"{prefix}question {i}", "max_tokens": 2}, timeout=30)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        def served(url: str) -> float:
            metrics = httpx.get(f"{url}/metrics").text
            line = [x for x in metrics.splitlines() if x.startswith("vllm:request_success_total")]
            return sum(float(x.split()[-1]) for x in line)

        before = [served(u) for u, _ in engines]
        cached_a = [route(PREFIX_A, i) for i in range(4)]
        after_a = [served(u) for u, _ in engines]
        cached_b = [route(PREFIX_B, i) for i in range(4)]
        after_b = [served(u) for u, _ in engines]
        assert after_a[0] - before[0] == 4 and after_a[1] == before[1], "prefix A must go to engine 0"
        assert after_b[1] - after_a[1] == 4 and after_b[0] == after_a[0], "prefix B must go to engine 1"
        assert all(c > 0 for c in cached_a + cached_b)
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
