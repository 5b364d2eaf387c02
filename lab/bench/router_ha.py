"""``backfill bench router-ha``: several precise routers on one fleet (router HA, active-active).

Engines are simulated (``backfill engine-sim``), each binding its KV-event publisher and vLLM's
replay socket; every router (``backfill router --config precise-config.yaml``) connects to every
engine (``--kv-events-connect``). Two measurements, side by side in one run:

1. **Index agreement.** A fleet with two routers; the trace (``backfill bench prefix``'s agentic
   shape) goes through router 1 only. Then: router 2's index against router 1's (``matched``: Σ
   over engines and tiers of min(blocks₁, blocks₂) ÷ Σ blocks₁; goal ≥ 0.90), the same for a third
   router started after the traffic (it learns from the replay sockets), and a probe per session
   (its last call plus one more user turn, ``max_tokens`` 1), alternately through router 2 and
   router 1: cached tokens ÷ the previous call's prompt tokens, per router. Router 2 routing the
   prompts to their holders shows as router 2's probe reuse equal to router 1's.
2. **Captured reuse with 1, 2 and 4 routers.** A fresh fleet (cold caches) per count; the trace's
   calls are spread over the routers in turn (call i → router i mod N, as a Service spreading new
   connections: a session's turns land on different routers). Captured reuse (Σ cached ÷ Σ
   oracle-reusable tokens) per count and its ratio to one router's (goal ≥ 0.95 at every count).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import click
import httpx

from engine_twin.launch import sim_engine_argv
from lab.bench.prefix import SHAPES, shape_trace
from lab.toolkit.launch import (
    HOST,
    PRECISE_CONFIG_PATH,
    EngineOptions,
    ProcessGroup,
    bench_flow_control,
    free_port,
    process_group,
)
from lab.toolkit.replay import ReplayResult, RequestResult, _call, closed_loop, summarize, wall_span
from lab.toolkit.workloads import TimedRequest, oracle_reusable_tokens
from router.cli import router_argv

REPLICA_COUNTS = (1, 2, 4)
INDEX_GOAL = 0.90
REUSE_GOAL = 0.95


@dataclass
class HAFleet:
    """Started engines (base URL → ``tcp://PUB,tcp://REPLAY``) and routers (base URLs)."""

    group: ProcessGroup
    connect: dict[str, str]
    routers: list[str]
    opts: EngineOptions

    def start_router(self, replicas: int) -> str:
        port = free_port()
        argv = router_argv(port, list(self.connect), config=str(PRECISE_CONFIG_PATH), profile="default",
                           tokenizer="estimate", flow_control=str(bench_flow_control()),
                           kv_events_connect=self.connect, replicas=replicas)
        proc = self.group.start(f"router-{len(self.routers)}", argv)
        url = f"http://{HOST}:{port}"
        self.group.wait_ready(proc, url)
        self.routers.append(url)
        return url


@contextlib.contextmanager
def ha_fleet(opts: EngineOptions, routers: int, log_dir: Path | None = None) -> Iterator[HAFleet]:
    """``opts.engines`` fresh engines binding their KV-event and replay sockets, ``routers``
    precise routers connected to all of them (``--replicas routers``); stops everything on exit."""
    with process_group(log_dir) as group:
        connect, procs = {}, []
        for i in range(opts.engines):
            port, pub, replay = free_port(), free_port(), free_port()
            argv = sim_engine_argv(port, [opts.model], f"tcp://*:{pub}", host=HOST, block_size=opts.block_size,
                                   num_gpu_blocks=opts.num_gpu_blocks, cpu_offload_blocks=opts.cpu_offload_blocks,
                                   max_num_seqs=opts.max_num_seqs, max_model_len=opts.max_model_len,
                                   time_scale=opts.time_scale, scheduling_policy="fcfs",
                                   kv_events_replay_endpoint=f"tcp://*:{replay}", extra=("--engine-index", str(i)))
            procs.append(group.start(f"engine-{i}", argv))
            url = f"http://{HOST}:{port}"
            connect[url] = f"tcp://{HOST}:{pub},tcp://{HOST}:{replay}"
        for proc, url in zip(procs, connect):
            group.wait_ready(proc, url)
        fleet = HAFleet(group, connect, [], opts)
        for _ in range(routers):
            fleet.start_router(routers)
        wait_subscribed(fleet.routers, list(connect))
        yield fleet


def admin_state(router: str) -> dict[str, Any]:
    return httpx.get(f"{router}/admin/state", timeout=10).json()


def wait_subscribed(routers: Sequence[str], engines: Sequence[str], timeout_s: float = 30.0) -> None:
    """Until every router sees every engine healthy and has a KV-event source for it."""
    deadline = time.monotonic() + timeout_s
    for router in routers:
        while True:
            state = admin_state(router)
            healthy = {e["name"] for e in state["endpoints"] if e["healthy"]}
            sources = set(state["index"].get("events", {}).get("sources", {}))
            if healthy >= set(engines) and sources >= set(engines):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{router}: engines not healthy/subscribed: {healthy}, {sources}")
            time.sleep(0.1)


def index_blocks(router: str) -> dict[tuple[str, str], int]:
    """(endpoint, tier) → blocks in ``router``'s KV-event index."""
    return {(e["name"], tier): n for e in admin_state(router)["endpoints"] for tier, n in e["cache_blocks"].items()}


def matched(reference: dict[tuple[str, str], int], other: dict[tuple[str, str], int]) -> float | None:
    """Σ min(reference, other) ÷ Σ reference over (endpoint, tier); None when the reference is empty."""
    total = sum(reference.values())
    return sum(min(n, other.get(k, 0)) for k, n in reference.items()) / total if total else None


def wait_settled(routers: Sequence[str], timeout_s: float = 15.0) -> None:
    """Until every router's index stops changing for 0.5 s (the last events applied)."""
    deadline = time.monotonic() + timeout_s
    last = [index_blocks(r) for r in routers]
    stable_since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = [index_blocks(r) for r in routers]
        if now != last:
            last, stable_since = now, time.monotonic()
        elif time.monotonic() - stable_since >= 0.5:
            return


async def replay_spread(trace: Sequence[TimedRequest], routers: Sequence[str], time_scale: float,
                        timeout_s: float = 300.0) -> ReplayResult:
    """:func:`lab.toolkit.replay.replay_async` with call ``i`` of the trace sent to router
    ``i mod len(routers)`` (sessions closed loop as there)."""
    urls = [f"{r.rstrip('/')}/v1/chat/completions" for r in routers]
    results = [RequestResult(i, r.session_id, r.workload, 0.0) for i, r in enumerate(trace)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024),
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        await closed_loop(trace, time_scale, lambda i: _call(session, urls[i % len(urls)], trace[i], results[i]))
    return ReplayResult(results, wall_span((r.sent_at, r.latency_s) for r in results))


def probe(router: str, request: TimedRequest, n: int) -> tuple[int, int]:
    """``request`` plus one more user turn through ``router`` (``max_tokens`` 1): (cached tokens,
    prompt tokens)."""
    body = {**request.body, "max_tokens": 1, "stream": False,
            "messages": [*request.body["messages"], {"role": "user", "content": f"probe {n}: one more question"}]}
    r = httpx.post(f"{router}/v1/chat/completions", json=body, timeout=60)
    r.raise_for_status()
    usage = r.json()["usage"]
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0, usage["prompt_tokens"]


def index_agreement(trace: list[TimedRequest], opts: EngineOptions, log_dir: Path | None) -> dict[str, Any]:
    """Measurement 1 (module docstring)."""
    with ha_fleet(opts, 2, log_dir) as fleet:
        first, second = fleet.routers
        result = asyncio.run(replay_spread(trace, [first], opts.time_scale))
        wait_settled([first, second])
        one, two = index_blocks(first), index_blocks(second)
        late = fleet.start_router(2)
        wait_subscribed([late], list(fleet.connect))
        wait_settled([first, late])
        three = index_blocks(late)
        late_events = admin_state(late)["index"]["events"]
        last: dict[str, tuple[TimedRequest, int]] = {}
        for i, request in enumerate(trace):
            if result.results[i].error is None and (request.session_id not in last or
                                                    request.turn >= last[request.session_id][0].turn):
                last[request.session_id] = (request, result.results[i].prompt_tokens)
        probes: dict[str, list[tuple[int, int]]] = {"router_1": [], "router_2": []}
        for n, (request, previous) in enumerate(last.values()):
            name = "router_2" if n % 2 == 0 else "router_1"
            cached, _prompt = probe(second if name == "router_2" else first, request, n)
            probes[name].append((cached, previous))
        events_two = admin_state(second)["index"]["events"]
    reuse = {name: (sum(min(c, p) for c, p in pairs) / total if (total := sum(p for _, p in pairs)) else None)
             for name, pairs in probes.items()}
    return {
        "router_1_blocks": sum(one.values()), "router_2_blocks": sum(two.values()),
        "late_router_blocks": sum(three.values()),
        "router_2_matched": matched(one, two), "late_router_matched": matched(one, three),
        "late_router_replays": late_events["replays"], "late_router_replayed_batches": late_events["replayed_batches"],
        "router_2_events": {k: events_two[k] for k in ("gaps", "replays", "drops", "restarts")},
        "probe_reuse": reuse, "probes": {name: len(pairs) for name, pairs in probes.items()},
        "trace_errors": result.errors,
    }


def reuse_by_replicas(trace: list[TimedRequest], reusable: list[int], opts: EngineOptions,
                      counts: Sequence[int], log_dir: Path | None) -> dict[str, Any]:
    """Measurement 2 (module docstring)."""
    out: dict[str, Any] = {}
    for count in counts:
        with ha_fleet(opts, count, log_dir) as fleet:
            result = asyncio.run(replay_spread(trace, fleet.routers, opts.time_scale))
        figures = summarize(result, reusable)
        out[str(count)] = {k: figures.get(k) for k in ("captured_reuse", "ttft_p50_s", "ttft_p99_s", "errors")}
    base = out[str(counts[0])]["captured_reuse"]
    for figures in out.values():
        value = figures["captured_reuse"]
        figures["vs_one_router"] = value / base if value is not None and base else None
    return out


@click.command("router-ha")
@click.option("--quick", is_flag=True, help="the prefix bench's quick fleet and trace (a smoke run)")
@click.option("--replicas", "counts", default=",".join(map(str, REPLICA_COUNTS)), show_default=True,
              help="router counts of the reuse measurement, comma-separated (the first is the baseline)")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path), default=None)
def router_ha_command(quick: bool, counts: str, seed: int, json_path: Path | None, log_dir: Path | None) -> None:
    """Several precise routers on one fleet: index agreement and captured reuse with 1, 2, 4 routers."""
    try:
        replicas = [int(c) for c in counts.split(",") if c.strip()]
    except ValueError:
        raise click.BadParameter(f"{counts!r}: expected comma-separated integers", param_hint="--replicas") from None
    if not replicas or min(replicas) < 1:
        raise click.BadParameter("at least one router count, each >= 1", param_hint="--replicas")
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    opts = SHAPES["agentic"].options(quick, None, None)
    trace = shape_trace("agentic", seed, quick, 1.0, opts.max_model_len)
    reusable = oracle_reusable_tokens(trace).reusable_tokens
    click.echo(f"trace: {len(trace)} calls; fleet: {opts.engines} engines x {opts.num_gpu_blocks} GPU blocks")
    agreement = index_agreement(trace, opts, log_dir)
    reuse = reuse_by_replicas(trace, reusable, opts, replicas, log_dir)
    goals = {
        "router_2_matched": {"value": agreement["router_2_matched"], "goal": INDEX_GOAL},
        **{f"reuse_{n}_routers_vs_one": {"value": f["vs_one_router"], "goal": REUSE_GOAL}
           for n, f in reuse.items() if n != str(replicas[0])},
    }
    for g in goals.values():
        g["met"] = None if g["value"] is None else g["value"] >= g["goal"]
    payload = {"benchmark": "router-ha", "python": sys.version.split()[0], "cpus": os.cpu_count(), "seed": seed,
               "quick": quick, "engines": opts.engines, "calls": len(trace), "index": agreement,
               "reuse_by_routers": reuse, "goals": goals}
    click.echo(json.dumps(payload, indent=2))
    if json_path:
        json_path.write_text(json.dumps(payload, indent=2) + "\n")
