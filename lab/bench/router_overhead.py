"""``backfill bench router-overhead``: what the router costs, ours vs ``vllm-router``, in one run.

1. Decision time in process: :func:`lab.bench.scheduling.decision_latency` (prompt hashed,
   prefix index looked up, filters, scorers, picker) at 16 and 64 endpoints and 1k / 8k / 32k-token
   prompts, p50 and p99. Goal: p50 ≤ 0.2 ms at 16 endpoints and 8k tokens (llm-d's Go scheduler:
   0.10–0.20 ms).
2. Through a proxy: an engine that answers at once (:mod:`lab.bench.instant`, 4 ports = 4
   "engines", pinned to CPU 0 with the router under test) is called by a raw keep-alive client
   pinned to CPU 1 (this process): straight, through our router (``approximate``, the default
   profile), through ``vllm-router`` ``cache_aware`` and ``round_robin``. Added latency = p50 of
   sequential round trips through the router − p50 straight; max requests/s = closed loop on
   ``--connections`` connections. Goals: added latency p50 ≤ 1 ms; throughput ≥ 0.5 × ``vllm-router``
   (``cache_aware``, the comparable policy).

Requests: non-streaming chat bodies of ``--prompt-tokens`` tokens (built-in tokenizer, 4 bytes a
token), a shared prefix of 3/4 followed by a suffix unique to the request, ``max_tokens`` 1.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import click
import orjson

from lab.bench.instant import latencies, post_bytes, throughput
from lab.toolkit.launch import HOST, POLICIES, EngineOptions, LaunchError, Proc, ProcessGroup, free_port, process_group
from lab.toolkit.stats import percentile

TARGETS = ("direct", "ours", "vllm-router-cache_aware", "vllm-router-round_robin")
"""Rows of the proxy table: straight to the engine, then each router in front of it."""

_ROUTER_POLICY = {"ours": "approximate", "vllm-router-cache_aware": "vllm-router-cache_aware",
                  "vllm-router-round_robin": "round-robin"}


def request_pool(port: int, prompt_tokens: int, count: int = 256) -> list[bytes]:
    """``count`` pre-encoded chat requests to ``port``: a shared 3/4 prefix + a unique suffix."""
    shared = ("shared system prompt of the overhead benchmark " * (prompt_tokens // 10 + 1))[: 3 * prompt_tokens]
    out = []
    for i in range(count):
        suffix = (f"request {i:06d} " + f"asks about item {i} " * (prompt_tokens // 4))[: prompt_tokens]
        body = orjson.dumps({"model": "sim-model", "max_tokens": 1,
                             "messages": [{"role": "system", "content": shared}, {"role": "user", "content": suffix}]})
        out.append(post_bytes(HOST, port, "/v1/chat/completions", body))
    return out


def _pin(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {cpu})


def decision_cases(quick: bool) -> list[dict[str, Any]]:
    """In-process decision latency at 16/64 endpoints × 1k/8k/32k tokens (quick: 16 × 1k/8k, few
    iterations); one :func:`~lab.bench.scheduling.decision_latency` dict per case."""
    from lab.bench.scheduling import decision_latency

    cases = [(16, 1000), (16, 8000)] if quick else [(e, t) for e in (16, 64) for t in (1000, 8000, 32000)]
    out = []
    for endpoints, tokens in cases:
        iterations = 30 if quick else (600 if tokens > 8000 else 2000)
        out.append(decision_latency(endpoints, tokens, iterations=iterations, warmup=min(iterations, 300)))
    return out


def _measure(port: int, requests: list[bytes], samples: int, seconds: float, connections: int) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        await latencies(HOST, port, requests, min(samples, 50))  # warm-up: connections, caches
        lat = await latencies(HOST, port, requests, samples)
        p99 = percentile(lat, 99)
        assert p99 is not None, "no latency samples"
        await throughput(HOST, port, requests, min(seconds, 0.5), connections)
        ok, bad, elapsed = await throughput(HOST, port, requests, seconds, connections)
        return {"latency_p50_ms": percentile(lat, 50, default=math.nan) * 1000, "latency_p99_ms": p99 * 1000,
                "requests_per_s": ok / elapsed, "errors": bad}

    return asyncio.run(run())


def _server_cpus() -> set[int] | None:
    """CPU 0 for the engine and the router under test when there are two cores or more."""
    return {0} if (os.cpu_count() or 1) > 1 else None


def _start_router(group: ProcessGroup, target: str, engines: list[str]) -> tuple[Proc | None, int, str | None]:
    policy = POLICIES[_ROUTER_POLICY[target]]
    reason = policy.available()
    port = free_port()
    if reason is not None:
        return None, port, reason
    argv = policy.argv(port, engines, [""] * len(engines), EngineOptions(engines=len(engines)), None)
    proc = group.start(target, argv, cpus=_server_cpus())
    try:
        group.wait_ready(proc, f"http://{HOST}:{port}")
    except LaunchError as exc:
        return None, port, f"did not start: {str(exc)[:300]}"
    return proc, port, None


def proxy_targets(quick: bool, prompt_tokens: int, connections: int, log_dir: Path | None) -> dict[str, dict[str, Any]]:
    """Latency and max requests/s straight to the instant engine and through each router
    (``{"missing": reason}`` for a router not installed or not started)."""
    samples, seconds = (40, 0.5) if quick else (1000, 5.0)
    results: dict[str, dict[str, Any]] = {}
    with process_group(log_dir) as group:
        ports = [free_port() for _ in range(4)]
        argv = [sys.executable, "-m", "lab.bench.instant", "--host", HOST]
        for p in ports:
            argv += ["--port", str(p)]
        engine = group.start("instant-engine", argv, cpus=_server_cpus())
        engines = [f"http://{HOST}:{p}" for p in ports]
        for url in engines:
            group.wait_ready(engine, url)
        _pin(1)
        try:
            results["direct"] = _measure(ports[0], request_pool(ports[0], prompt_tokens), samples, seconds, connections)
            for target in TARGETS[1:]:
                proc, port, reason = _start_router(group, target, engines)
                if proc is None:
                    results[target] = {"latency_p50_ms": None, "latency_p99_ms": None, "requests_per_s": None,
                                       "missing": reason}
                    continue
                results[target] = _measure(port, request_pool(port, prompt_tokens), samples, seconds, connections)
                group.stop_one(proc)
        finally:
            if hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    return results


def summary(decisions: list[dict[str, Any]], targets: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The headline figures: decision p50/p99 at 16 endpoints and 8k tokens (ms), our added latency
    p50 (ms), ``vllm-router`` ``cache_aware``'s, and our max requests/s ÷ ``vllm-router``'s (None
    where a side is missing), with the goals."""
    headline = next((d for d in decisions if d["endpoints"] == 16 and d["prompt_tokens"] == 8000), None)
    direct = targets["direct"]["latency_p50_ms"]

    def added(target: str) -> float | None:
        value = targets.get(target, {}).get("latency_p50_ms")
        return value - direct if value is not None else None

    ours_rps = targets.get("ours", {}).get("requests_per_s")
    peer_rps = targets.get("vllm-router-cache_aware", {}).get("requests_per_s")
    out = {
        "decision_p50_ms": headline["decision_p50_ms"] if headline else None,
        "decision_p99_ms": headline["decision_p99_ms"] if headline else None,
        "added_latency_p50_ms": added("ours"),
        "vllm_router_added_latency_p50_ms": added("vllm-router-cache_aware"),
        "throughput_ratio_vs_vllm_router": ours_rps / peer_rps if ours_rps and peer_rps else None,
    }
    out["goals"] = {
        "decision_p50_ms": {"goal": 0.2, "met": None if out["decision_p50_ms"] is None
                            else out["decision_p50_ms"] <= 0.2},
        "added_latency_p50_ms": {"goal": 1.0, "met": None if out["added_latency_p50_ms"] is None
                                 else out["added_latency_p50_ms"] <= 1.0},
        "throughput_ratio_vs_vllm_router": {"goal": 0.5, "met": None if out["throughput_ratio_vs_vllm_router"] is None
                                            else out["throughput_ratio_vs_vllm_router"] >= 0.5},
    }
    return out


def _fmt(value: Any, digits: int = 3) -> str:
    return "—" if value is None else f"{value:,.{digits}f}" if isinstance(value, float) else str(value)


@click.command("router-overhead")
@click.option("--quick", is_flag=True, help="Few iterations and a short load (seconds, for tests).")
@click.option("--prompt-tokens", type=int, default=1000, show_default=True, help="Prompt size of proxied requests.")
@click.option("--connections", type=int, default=32, show_default=True, help="Connections of the throughput load.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Also write JSON here.")
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Keep router and engine logs here (default: a temporary directory).")
def router_overhead_command(quick: bool, prompt_tokens: int, connections: int, json_path: Path | None,
                            log_dir: Path | None) -> None:
    """Decision time in process; added latency and max requests/s through ours vs vllm-router."""
    from rich.console import Console
    from rich.table import Table

    from lab.toolkit.tables import print_table

    console = Console()
    if not console.is_terminal:
        console = Console(width=150)
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    decisions = decision_cases(quick)
    table = Table(title="scheduling decision in process (default profile: prefix 3, queue 1, kv-cache 1)")
    for column in ("endpoints", "prompt tokens", "decision p50 ms", "decision p99 ms", "learn p50 ms",
                   "chosen prefix score"):
        table.add_column(column, justify="right")
    for d in decisions:
        table.add_row(str(d["endpoints"]), str(d["prompt_tokens"]), _fmt(d["decision_p50_ms"]),
                      _fmt(d["decision_p99_ms"]), _fmt(d["learn_p50_ms"]), _fmt(d["chosen_prefix_score_mean"], 2))
    print_table(table, console)

    targets = proxy_targets(quick, prompt_tokens, connections, log_dir)
    direct = targets["direct"]
    table = Table(title=f"through a proxy to an instant engine ({prompt_tokens}-token chat prompts, "
                        f"{connections} connections)")
    for column in ("target", "latency p50 ms", "latency p99 ms", "added p50 ms", "max requests/s", "vs direct"):
        table.add_column(column, justify="left" if column == "target" else "right")
    for name, t in targets.items():
        if "missing" in t:
            table.add_row(name, "missing", "", "", "", t["missing"].splitlines()[0][:50])
            continue
        table.add_row(name, _fmt(t["latency_p50_ms"]), _fmt(t["latency_p99_ms"]),
                      _fmt(t["latency_p50_ms"] - direct["latency_p50_ms"]), _fmt(t["requests_per_s"], 0),
                      _fmt(t["requests_per_s"] / direct["requests_per_s"], 2))
    print_table(table, console)
    figures = summary(decisions, targets)
    goals = Table(title="goals (ours)")
    for column in ("figure", "value", "goal", "met"):
        goals.add_column(column)
    for key, g in figures["goals"].items():
        goals.add_row(key, _fmt(figures[key]), _fmt(g["goal"], 2), {True: "yes", False: "NO", None: "—"}[g["met"]])
    print_table(goals, console)
    if json_path:
        payload = {**figures, "benchmark": "router-overhead", "python": sys.version.split()[0],
                   "cpus": os.cpu_count(), "quick": quick, "prompt_tokens": prompt_tokens,
                   "connections": connections, "decision": decisions, "targets": targets}
        json_path.write_text(json.dumps(payload, indent=2) + "\n")
