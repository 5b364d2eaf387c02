"""``backfill bench prefix``: captured prefix reuse and TTFT per routing policy, side by side.

One trace (agentic sessions merged with llm-d-style shared-prefix groups, :mod:`.workloads`) is
replayed against every policy of :data:`~backfill.bench.launch.POLICIES`, each in front of a FRESH
fleet of simulated engines (cold caches), whose GPU tier holds less than the trace's working set
(evictions happen) and which offload evicted blocks to a CPU tier. Per policy: captured reuse
(Σ cached prompt tokens ÷ Σ oracle-reusable tokens), TTFT p50/p99, output tokens/s, and the same
per workload. Goals (shared/PERFORMANCE.md): captured reuse ≥ 0.98 precise, ≥ 0.90 approximate;
TTFT p50 ≤ 0.15 × round-robin; TTFT p50 and p99 no worse than the best peer.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import click
import httpx

from backfill.bench.launch import POLICIES, EngineOptions, LaunchError, Policy, fleet_with_router, our_policy
from backfill.bench.replay import replay, summarize
from backfill.bench.workloads import TimedRequest, agentic_sessions, merge, oracle_reusable_tokens, shared_prefix_groups

PEERS = ("vllm-router-cache_aware", "vllm-router-kv_aware", "sglang-router-cache_aware")
OURS = ("approximate", "precise")
FIGURES = ("captured_reuse", "ttft_p50_s", "ttft_p99_s", "output_tokens_per_s")


def build_trace(seed: int = 0, quick: bool = False, load: float = 1.0) -> list[TimedRequest]:
    """The benchmark's trace: agentic sessions and shared-prefix groups with their default
    parameters, merged (full: about 260 calls, most sent in the first 10 model seconds; quick:
    about 14 calls over a few model seconds). ``load`` multiplies the arrival rates (session starts
    and shared-prefix requests); raises ``ValueError`` when it is not positive."""
    if load <= 0:
        raise ValueError("load must be positive")
    if quick:
        agentic = agentic_sessions(seed, sessions=3, system_tokens=300, task_tokens=(40, 80), call_tokens=(10, 20),
                                   result_tokens=(40, 80), turns=(2, 3), pause_s=0.5, one_off_share=0.1,
                                   one_off_tokens=(100, 200), duration_s=2.0, max_tokens=4)
        shared = shared_prefix_groups(seed, groups=2, users=2, questions_per_user=1, prefix_tokens=300,
                                      question_tokens=50, max_tokens=4, rate_per_s=4.0)
        return merge(agentic, shared)
    return merge(agentic_sessions(seed, duration_s=9.0 / load), shared_prefix_groups(seed, rate_per_s=14.0 * load))


def engine_options(quick: bool, engines: int | None, time_scale: float | None) -> EngineOptions:
    """Full: 4 engines × 1,536 GPU blocks (24,576 tokens) + 3,072 CPU blocks, time scale 1. Quick: 2
    engines × 160 GPU blocks + 160 CPU blocks, max_model_len 2,048, time scale 0.1."""
    base = (EngineOptions(engines=2, num_gpu_blocks=160, cpu_offload_blocks=160, max_model_len=2048, time_scale=0.1)
            if quick else EngineOptions())
    return EngineOptions(**{**base.__dict__, **({"engines": engines} if engines else {}),
                            **({"time_scale": time_scale} if time_scale is not None else {})})


def _engine_state(urls: list[str]) -> dict[str, Any]:
    gpu = cpu = 0
    served = []
    with httpx.Client(timeout=5.0) as client:
        for url in urls:
            state = client.get(f"{url}/sim/state").json()
            gpu += state["tiers"].get("GPU", 0)
            cpu += state["tiers"].get("CPU", 0)
            metrics = client.get(f"{url}/metrics").text
            served.append(int(sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                                  if line.startswith("vllm:request_success_total"))))
    return {"gpu_blocks_used": gpu, "cpu_blocks_used": cpu, "requests_per_engine": served}


def run_policy(name: str, trace: list[TimedRequest], reusable: list[int], opts: EngineOptions,
               log_dir: Path | None = None, policy: Policy | None = None) -> dict[str, Any]:
    """Run one policy on a fresh fleet; its figures (see :func:`~backfill.bench.replay.summarize`), a
    ``by_workload`` breakdown and the engines' end state, or ``{"missing": reason}`` with every
    figure None when the router is not installed or did not start. ``policy`` replaces
    ``POLICIES[name]`` (``--config``)."""
    policy = policy or POLICIES[name]
    reason = policy.available()
    if reason is None:
        try:
            with fleet_with_router(policy, opts, log_dir) as fleet:
                result = replay(trace, fleet.router, opts.time_scale)
                state = _engine_state(fleet.engines)
        except LaunchError as exc:
            reason = f"did not start: {str(exc)[:300]}"
    if reason is not None:
        return {**dict.fromkeys(FIGURES), "missing": reason}
    figures: dict[str, Any] = summarize(result, reusable)
    workloads = sorted({r.workload for r in trace})
    figures["by_workload"] = {w: summarize(result, reusable, [i for i, r in enumerate(trace) if r.workload == w])
                              for w in workloads}
    figures["engines"] = state
    first_error = next((r.error for r in result.results if r.error), None)
    if first_error:
        figures["first_error"] = first_error
    return figures


def evaluate(policies: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Goals of shared/PERFORMANCE.md for ``approximate`` and ``precise``: each entry gives the
    figure, the bound and ``met`` (None when a side is missing)."""
    def fig(name: str, key: str) -> float | None:
        return policies.get(name, {}).get(key)

    peers = [p for p in PEERS if fig(p, "ttft_p50_s") is not None]
    goals: dict[str, Any] = {}
    for ours, reuse_goal in (("approximate", 0.90), ("precise", 0.98)):
        reuse = fig(ours, "captured_reuse")
        goals[f"{ours}_captured_reuse"] = {"value": reuse, "goal": reuse_goal,
                                           "met": None if reuse is None else reuse >= reuse_goal}
        p50, rr = fig(ours, "ttft_p50_s"), fig("round-robin", "ttft_p50_s")
        ratio = p50 / rr if p50 is not None and rr else None
        goals[f"{ours}_ttft_p50_vs_round_robin"] = {"value": ratio, "goal": 0.15,
                                                    "met": None if ratio is None else ratio <= 0.15}
        for key in ("ttft_p50_s", "ttft_p99_s"):
            best = min((v for p in peers if (v := fig(p, key)) is not None), default=None)
            value = fig(ours, key)
            goals[f"{ours}_{key}_vs_best_peer"] = {
                "value": value / best if value is not None and best else None, "goal": 1.0,
                "met": None if value is None or best is None else value <= best}
    return goals


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


@click.command("prefix")
@click.option("--quick", is_flag=True, help="A tiny trace on 2 engines at time scale 0.1 (seconds, for tests).")
@click.option("--policy", "policies", multiple=True, type=click.Choice(list(POLICIES)),
              help="Policies to run (repeat; default: all).")
@click.option("--engines", type=int, default=None, help="Simulated engines (default 4; quick 2).")
@click.option("--time-scale", type=float, default=None, help="Engines' wall seconds per model second (default 1).")
@click.option("--seed", type=int, default=0, show_default=True, help="Workload seed.")
@click.option("--load", type=click.FloatRange(min=0.05), default=1.0, show_default=True,
              help="Multiplies the trace's arrival rates (full trace only).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Also write JSON here.")
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Keep engine and router logs here (default: a temporary directory).")
@click.option("--config", "configs", multiple=True, metavar="POLICY=YAML",
              help="Run our POLICY (approximate or precise) with this scheduling YAML instead of the shipped one.")
def prefix_command(quick: bool, policies: tuple[str, ...], engines: int | None, time_scale: float | None, seed: int,
                   load: float, json_path: Path | None, log_dir: Path | None, configs: tuple[str, ...]) -> None:
    """Captured prefix reuse and TTFT: round-robin, ours, vllm-router, sglang-router on one trace."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=150)
    overrides = {}
    for spec in configs:
        name, _, path = spec.partition("=")
        if name not in ("approximate", "precise") or not Path(path).is_file():
            raise click.BadParameter(f"{spec!r}: expected approximate=PATH or precise=PATH of an existing file",
                                     param_hint="--config")
        overrides[name] = our_policy(name, Path(path))
    opts = engine_options(quick, engines, time_scale)
    trace = build_trace(seed, quick, load)
    oracle = oracle_reusable_tokens(trace, block_size=opts.block_size)
    fleet_gpu = opts.engines * opts.num_gpu_blocks
    console.print(f"trace: {len(trace)} calls, {sum(oracle.prompt_tokens):,} prompt tokens, "
                  f"{oracle.total_reusable:,} oracle-reusable; working set {oracle.distinct_blocks:,} blocks vs "
                  f"{fleet_gpu:,} GPU blocks in the fleet ({opts.engines} engines)")
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    for name in policies or POLICIES:
        if log_dir:
            (log_dir / name).mkdir(exist_ok=True)
        results[name] = run_policy(name, trace, oracle.reusable_tokens, opts, log_dir / name if log_dir else None,
                                   overrides.get(name))
        r = results[name]
        console.print(f"{name}: " + (f"missing ({r['missing'].splitlines()[0]})" if "missing" in r else
                                     f"reuse {_fmt(r['captured_reuse'])}, TTFT p50 {_fmt(r['ttft_p50_s'])} s"))
    goals = evaluate(results)

    rr = results.get("round-robin", {}).get("ttft_p50_s")
    table = Table(title=f"bench prefix: {len(trace)} calls, {opts.engines} simulated engines, "
                        f"time scale {opts.time_scale}")
    for column in ("policy", "captured reuse", "TTFT p50 s", "TTFT p99 s", "p50 ÷ RR", "output tok/s",
                   "CPU-tier blocks", "errors"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for name, r in results.items():
        if "missing" in r:
            table.add_row(name, "missing", "", "", "", "", "", r["missing"].splitlines()[0][:50])
            continue
        ratio = r["ttft_p50_s"] / rr if rr and r["ttft_p50_s"] is not None else None
        table.add_row(name, _fmt(r["captured_reuse"]), _fmt(r["ttft_p50_s"]), _fmt(r["ttft_p99_s"]), _fmt(ratio, 2),
                      _fmt(r["output_tokens_per_s"], 1), str(r["engines"]["cpu_blocks_used"]), str(r["errors"]))
    console.print(table)
    goal_table = Table(title="goals (ours)")
    for column in ("goal", "value", "bound", "met"):
        goal_table.add_column(column)
    for key, g in goals.items():
        goal_table.add_row(key, _fmt(g["value"]), _fmt(g["goal"], 2), {True: "yes", False: "NO", None: "—"}[g["met"]])
    console.print(goal_table)
    if json_path:
        payload = {
            "benchmark": "prefix", "python": sys.version.split()[0], "cpus": os.cpu_count(), "seed": seed,
            "quick": quick, "load": load, "fleet": {**opts.__dict__, "fleet_gpu_blocks": fleet_gpu},
            "trace": {"requests": len(trace), "prompt_tokens": sum(oracle.prompt_tokens),
                      "oracle_reusable_tokens": oracle.total_reusable, "working_set_blocks": oracle.distinct_blocks,
                      "sharing_share": oracle.sharing_share},
            "round_robin": "vllm-router --policy round_robin",
            "policies": results, "goals": goals,
        }
        json_path.write_text(json.dumps(payload, indent=2) + "\n")
