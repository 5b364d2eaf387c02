"""Simulated engines and a ``backfill router`` as subprocesses, as an operator runs them.

``RouterStack(engines=3, …)`` starts ``backfill engine-sim`` processes on free ports and one
``backfill router`` in front of them, waits until the router's ``/health`` answers 200 (≥ 1
engine healthy) and, with ``wait_all``, until every engine is a candidate. ``kill_engine(i)``
SIGKILLs one engine; ``restart_engine(i)`` starts it again on the same port. The router runs with
the trusted token ``token`` (``router/trust.py``); ``trusted(headers)`` adds it to a request's
headers, as the async processor does, so their fairness id and objective are honoured.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from engine_twin.launch import sim_engine_argv, wait_ready
from router.cli import router_argv
from router.trust import TOKEN_HEADER
from tests.integration.engine_twin.conftest import free_port

#: A scheduling config that spreads unrelated prompts (prefix, no-hit LRU and queue scorers), for
#: tests that need requests on several engines.
SPREAD_CONFIG = """
plugins:
- type: approx-prefix-cache-producer
- type: prefix-cache-scorer
- type: no-hit-lru-scorer
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: prefix-cache-scorer, weight: 3}
  - {pluginRef: no-hit-lru-scorer, weight: 2}
  - {pluginRef: queue-scorer, weight: 1}
  - {pluginRef: max-score-picker}
"""

#: The trusted token a :class:`RouterStack`'s router runs with unless told otherwise.
ROUTER_STACK_TOKEN = "router-stack-token"


def wait_candidates(router_url: str, n: int, timeout: float = 15.0) -> dict:
    """Wait until exactly ``n`` endpoints of the router at ``router_url`` are healthy with fresh
    metrics (its ``/admin/state``); returns the state. Raises ``TimeoutError`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        state = httpx.get(f"{router_url}/admin/state", timeout=5).json()
        healthy = [e for e in state["endpoints"] if e["healthy"] and e["metrics_age_s"] is not None]
        if len(healthy) == n:
            return state
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(healthy)} healthy endpoints, wanted {n}: {state['endpoints']}")
        time.sleep(0.05)


def stop_processes(procs: Sequence[subprocess.Popen | None]) -> None:
    """Stop every process group of ``procs`` (started with ``start_new_session``): SIGTERM to all
    still running, then wait up to 10 s for each and SIGKILL one that is still there. None: skipped."""
    for proc in procs:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        if proc is None:
            continue
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


class RouterStack:
    """Engines + router on 127.0.0.1; use as a context manager (stops everything on exit)."""

    def __init__(self, log_dir: Path, *, engines: int = 3, model: str = "sim-model",
                 engine_options: list[dict[str, Any]] | None = None, router_options: dict[str, Any] | None = None,
                 kv_events: bool = False, token: str | None = ROUTER_STACK_TOKEN) -> None:
        self.log_dir = log_dir
        self.token = token
        self.model = model
        self.engine_ports = [free_port() for _ in range(engines)]
        self.engine_urls = [f"http://127.0.0.1:{p}" for p in self.engine_ports]
        self.engine_options = engine_options or [{} for _ in range(engines)]
        self.kv_bind = f"tcp://127.0.0.1:{free_port()}" if kv_events else None
        self.router_port = free_port()
        self.url = f"http://127.0.0.1:{self.router_port}"
        self.router_options = router_options or {}
        self.engines: list[subprocess.Popen | None] = [None] * engines
        self.router: subprocess.Popen | None = None

    def trusted(self, headers: dict[str, str] | None = None) -> dict[str, str]:
        """``headers`` plus the router's trusted token (a caller like the async processor)."""
        assert self.token, "this stack's router trusts nobody"
        return {**(headers or {}), TOKEN_HEADER: self.token}

    def _spawn(self, argv: list[str], name: str, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(extra_env or {}))
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def start_engine(self, i: int) -> None:
        """Start engine ``i`` (again) on its port and wait until it answers."""
        options = {"time_scale": 0.0, **self.engine_options[i]}
        models = options.pop("models", [self.model])
        argv = sim_engine_argv(self.engine_ports[i], models, self.kv_bind, **options)
        self.engines[i] = self._spawn(argv, f"engine{i}")
        wait_ready(self.engine_urls[i], timeout=30, process=self.engines[i])

    def __enter__(self) -> RouterStack:
        try:
            for i in range(len(self.engine_ports)):
                self.start_engine(i)
            argv = router_argv(self.router_port, self.engine_urls, kv_events_bind=self.kv_bind,
                               **self.router_options)
            self.router = self._spawn(argv, "router", {"BACKFILL_ROUTER_TRUSTED_TOKEN": self.token or ""})
            wait_ready(self.url, timeout=30, process=self.router)
            self.wait_candidates(len(self.engine_urls))
            if self.kv_bind:
                self.wait_kv_events()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def state(self) -> dict:
        """The router's ``/admin/state``."""
        return httpx.get(f"{self.url}/admin/state", timeout=5).json()

    def wait_candidates(self, n: int, timeout: float = 15.0) -> dict:
        """:func:`wait_candidates` of this stack's router."""
        return wait_candidates(self.url, n, timeout)

    def wait_kv_events(self, timeout: float = 15.0) -> None:
        """Wait until every engine's KV events reach the router's index, then clear the engines.

        ZMQ drops what a PUB socket sends before its connection to the router's SUB is up (the
        engines start first and reconnect every 100 ms), so each engine gets a probe prompt —
        again until the router's index shows blocks for it — and then ``/reset_prefix_cache``.
        """
        deadline = time.monotonic() + timeout
        pending = set(self.engine_urls)
        attempt = 0
        while pending:
            for url in pending:
                httpx.post(f"{url}/v1/completions", timeout=10, json={
                    "model": self.model, "max_tokens": 1, "prompt": f"probe {attempt} {url} " + "x" * 600})
            time.sleep(0.1)
            blocks = {e["name"]: sum(e["cache_blocks"].values()) for e in self.state()["endpoints"]}
            pending = {url for url in pending if not blocks.get(url)}
            attempt += 1
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"no KV events reached the router from {sorted(pending)}")
        for url in self.engine_urls:
            httpx.post(f"{url}/reset_prefix_cache", timeout=10).raise_for_status()

    def kill_engine(self, i: int) -> None:
        """SIGKILL engine ``i`` (no goodbye: connections drop mid-stream)."""
        proc = self.engines[i]
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def served_counts(self) -> list[int]:
        """Requests each engine has finished (``vllm:request_success_total`` summed)."""
        counts = []
        for url in self.engine_urls:
            try:
                text = httpx.get(f"{url}/metrics", timeout=5).text
            except httpx.HTTPError:
                counts.append(-1)
                continue
            counts.append(int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                                  if line.startswith("vllm:request_success_total"))))
        return counts

    def stop(self) -> None:
        """Stop the router and every engine (SIGTERM, then SIGKILL)."""
        stop_processes([self.router, *self.engines])
