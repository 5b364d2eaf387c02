"""``backfill bench prefix``: captured prefix reuse and TTFT per routing policy, side by side.

One trace per workload shape (:data:`SHAPES`, ``--shape``; default ``agentic``: agentic sessions
merged with llm-d-style shared-prefix groups, :mod:`.workloads`; or a Mooncake-format file,
``--trace``) is replayed against every policy of :data:`~lab.toolkit.launch.POLICIES`, each in front of a FRESH
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
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
import httpx

from lab.toolkit.cli_common import mooncake_trace_options
from lab.toolkit.launch import POLICIES, EngineOptions, LaunchError, Policy, fleet_with_router, our_policy
from lab.toolkit.replay import replay, summarize
from lab.toolkit.shapes import (  # noqa: F401  (re-exported: the bench's shapes, where they always were)
    LONG_CONTEXT_OUTPUT_CAP,
    SHAPES,
    Shape,
    build_trace,
    engine_options,
    long_context_trace,
    shape_trace,
)
from lab.toolkit.workloads import (
    TimedRequest,
    mooncake_trace,
    oracle_reusable_tokens,
    read_mooncake,
    reusable_share,
    write_mooncake,
)

PEERS = ("vllm-router-cache_aware", "vllm-router-kv_aware", "sglang-router-cache_aware")
OURS = ("approximate", "precise")
FIGURES = ("captured_reuse", "ttft_p50_s", "ttft_p99_s", "output_tokens_per_s")


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
    """Run one policy on a fresh fleet; its figures (see :func:`~lab.toolkit.replay.summarize`), a
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




def versus_best_peer(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Ours against the best peer of one shape: the best peer's captured reuse (highest) and TTFT
    p50 (lowest) with who holds them, and per ours (``approximate``, ``precise``) its figures and
    whether each is at least as good (None when a side is missing)."""
    def best(key: str, pick: Any) -> tuple[str | None, float | None]:
        found = [(r[key], p) for p in PEERS if (r := results.get(p)) and r.get(key) is not None]
        if not found:
            return None, None
        value, name = pick(found)
        return name, value

    reuse_peer, reuse = best("captured_reuse", max)
    p50_peer, p50 = best("ttft_p50_s", min)
    out: dict[str, Any] = {"best_peer_reuse": reuse, "best_peer_reuse_by": reuse_peer,
                           "best_peer_ttft_p50_s": p50, "best_peer_ttft_p50_by": p50_peer}
    for ours in OURS:
        r = results.get(ours, {})
        our_reuse, our_p50 = r.get("captured_reuse"), r.get("ttft_p50_s")
        out[ours] = {"captured_reuse": our_reuse, "ttft_p50_s": our_p50,
                     "reuse_beats": None if our_reuse is None or reuse is None else our_reuse >= reuse,
                     "p50_beats": None if our_p50 is None or p50 is None else our_p50 <= p50}
    a, p = (results.get(name, {}).get("captured_reuse") for name in OURS)
    out["precise_reuse_at_least_approximate"] = None if a is None or p is None else p >= a
    return out


def run_shape(shape: str, trace: list[TimedRequest], opts: EngineOptions, policies: tuple[str, ...],
              overrides: dict[str, Policy], log_dir: Path | None, say: Any) -> dict[str, Any]:
    """Every policy on ``trace``; the JSON payload of one shape (``say`` prints progress)."""
    oracle = oracle_reusable_tokens(trace, block_size=opts.block_size)
    fleet_gpu = opts.engines * opts.num_gpu_blocks
    say(f"{shape}: trace: {len(trace)} calls, {sum(oracle.prompt_tokens):,} prompt tokens, "
        f"{oracle.total_reusable:,} oracle-reusable; working set {oracle.distinct_blocks:,} blocks vs "
        f"{fleet_gpu:,} GPU blocks in the fleet ({opts.engines} engines)")
    results: dict[str, dict[str, Any]] = {}
    for name in policies or POLICIES:
        sub = log_dir / shape / name if log_dir else None
        if sub:
            sub.mkdir(parents=True, exist_ok=True)
        results[name] = run_policy(name, trace, oracle.reusable_tokens, opts, sub, overrides.get(name))
        r = results[name]
        say(f"{shape} · {name}: " + (f"missing ({r['missing'].splitlines()[0]})" if "missing" in r else
                                     f"reuse {_fmt(r['captured_reuse'])}, TTFT p50 {_fmt(r['ttft_p50_s'])} s"))
    prompts = oracle.prompt_tokens
    return {
        "shape": shape, "fleet": {**opts.__dict__, "fleet_gpu_blocks": fleet_gpu},
        "trace": {"requests": len(trace), "prompt_tokens": sum(prompts),
                  "mean_prompt_tokens": sum(prompts) / len(prompts) if prompts else 0,
                  "max_prompt_tokens": max(prompts, default=0),
                  "oracle_reusable_tokens": oracle.total_reusable, "working_set_blocks": oracle.distinct_blocks,
                  "sharing_share": oracle.sharing_share},
        "policies": results, "goals": evaluate(results), "versus_best_peer": versus_best_peer(results),
    }


def _print_shape(console: Any, payload: dict[str, Any]) -> None:
    from rich.table import Table

    from lab.toolkit.tables import print_table

    results, opts = payload["policies"], payload["fleet"]
    rr = results.get("round-robin", {}).get("ttft_p50_s")
    table = Table(title=f"bench prefix, {payload['shape']}: {payload['trace']['requests']} calls, "
                        f"{opts['engines']} simulated engines, time scale {opts['time_scale']}")
    for column in ("policy", "captured reuse", "TTFT p50 s", "TTFT p99 s", "p50 ÷ RR", "output tok/s",
                   "CPU-tier blocks", "requests per engine", "errors"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for name, r in results.items():
        if "missing" in r:
            table.add_row(name, "missing", "", "", "", "", "", "", r["missing"].splitlines()[0][:50])
            continue
        ratio = r["ttft_p50_s"] / rr if rr and r["ttft_p50_s"] is not None else None
        table.add_row(name, _fmt(r["captured_reuse"]), _fmt(r["ttft_p50_s"]), _fmt(r["ttft_p99_s"]), _fmt(ratio, 2),
                      _fmt(r["output_tokens_per_s"], 1), str(r["engines"]["cpu_blocks_used"]),
                      " / ".join(map(str, r["engines"]["requests_per_engine"])), str(r["errors"]))
    print_table(table, console)


def _print_summary(console: Any, shapes: dict[str, dict[str, Any]]) -> None:
    from rich.table import Table

    from lab.toolkit.tables import print_table

    table = Table(title="ours vs best peer, per shape (reuse higher is better, p50 lower)")
    for column in ("shape", "best peer reuse", "approx reuse", "precise reuse", "best peer p50 s", "approx p50 s",
                   "precise p50 s", "precise ≥ approx"):
        table.add_column(column, justify="left" if column == "shape" else "right")
    yes = {True: "", False: " ✗", None: ""}
    for shape, payload in shapes.items():
        v = payload["versus_best_peer"]
        a, p = v["approximate"], v["precise"]
        table.add_row(shape, f"{_fmt(v['best_peer_reuse'])} ({v['best_peer_reuse_by'] or '—'})",
                      _fmt(a["captured_reuse"]) + yes[a["reuse_beats"]], _fmt(p["captured_reuse"]) + yes[p["reuse_beats"]],
                      f"{_fmt(v['best_peer_ttft_p50_s'])} ({v['best_peer_ttft_p50_by'] or '—'})",
                      _fmt(a["ttft_p50_s"]) + yes[a["p50_beats"]], _fmt(p["ttft_p50_s"]) + yes[p["p50_beats"]],
                      {True: "yes", False: "NO", None: "—"}[v["precise_reuse_at_least_approximate"]])
    print_table(table, console)


@click.command("prefix")
@click.option("--quick", is_flag=True, help="Tiny traces on 2 engines at time scale 0.1 (seconds, for tests).")
@click.option("--shape", type=click.Choice([*SHAPES, "all"]), default="agentic", show_default=True,
              help="Workload shape; `all` runs every shape against every policy.")
@mooncake_trace_options("Replay this trace file instead of a generated shape (fleet of the long-context shape).")
@click.option("--write-trace", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the long-context shape's generated trace here as Mooncake JSONL.")
@click.option("--policy", "policies", multiple=True, type=click.Choice(list(POLICIES)),
              help="Policies to run (repeat; default: all).")
@click.option("--engines", type=int, default=None, help="Simulated engines (default: the shape's).")
@click.option("--time-scale", type=float, default=None, help="Engines' wall seconds per model second (default 1).")
@click.option("--gpu-blocks", type=click.IntRange(min=1), default=None,
              help="GPU KV blocks per engine (default: the shape's; backfill simulate's --gpu-blocks).")
@click.option("--cpu-blocks", type=click.IntRange(min=0), default=None,
              help="CPU offload blocks per engine (default: the shape's; backfill simulate's --cpu-blocks).")
@click.option("--seed", type=int, default=0, show_default=True, help="Workload seed.")
@click.option("--load", type=click.FloatRange(min=0.05), default=1.0, show_default=True,
              help="Multiplies the generated traces' arrival rates (not --quick's).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Also write JSON here.")
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Keep engine and router logs here (default: a temporary directory).")
@click.option("--config", "configs", multiple=True, metavar="POLICY=YAML",
              help="Run our POLICY (approximate or precise) with this scheduling YAML instead of the shipped one.")
def prefix_command(quick: bool, shape: str, trace_path: Path | None, trace_format: str, start_min: float,
                   minutes: float | None, speed: float, write_trace: Path | None, policies: tuple[str, ...],
                   engines: int | None, time_scale: float | None, gpu_blocks: int | None, cpu_blocks: int | None,
                   seed: int, load: float, json_path: Path | None, log_dir: Path | None,
                   configs: tuple[str, ...]) -> None:
    """Captured prefix reuse and TTFT: round-robin, ours, vllm-router, sglang-router, per workload shape."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    overrides = {}
    for spec in configs:
        name, _, path = spec.partition("=")
        if name not in ("approximate", "precise") or not Path(path).is_file():
            raise click.BadParameter(f"{spec!r}: expected approximate=PATH or precise=PATH of an existing file",
                                     param_hint="--config")
        overrides[name] = our_policy(name, Path(path))
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    load = 1.0 if quick else load
    runs: list[tuple[str, list[TimedRequest], EngineOptions]] = []

    def fleet(shape_name: str) -> EngineOptions:
        opts = SHAPES[shape_name].options(quick, engines, time_scale)
        return replace(opts, num_gpu_blocks=gpu_blocks or opts.num_gpu_blocks,
                       cpu_offload_blocks=opts.cpu_offload_blocks if cpu_blocks is None else cpu_blocks)

    if trace_path is not None:
        opts = fleet("long-context")
        records = read_mooncake(trace_path)
        console.print(f"{trace_path}: {len(records)} records, {reusable_share(records):.3f} of prompt tokens "
                      "reusable within 5 minutes")
        trace = mooncake_trace(records, start_min, minutes, speed, opts.max_model_len, LONG_CONTEXT_OUTPUT_CAP,
                               workload="mooncake")
        runs.append(("mooncake", trace, opts))
    else:
        for name in (list(SHAPES) if shape == "all" else [shape]):
            opts = fleet(name)
            if name == "long-context":
                trace, records = long_context_trace(seed, quick, load, opts.max_model_len)
                console.print(f"long-context: {len(records)} records, {reusable_share(records):.3f} of prompt "
                              "tokens reusable within 5 minutes")
                if write_trace:
                    write_mooncake(records, write_trace)
            else:
                trace = shape_trace(name, seed, quick, load, opts.max_model_len)
            runs.append((name, trace, opts))
    shapes: dict[str, dict[str, Any]] = {}
    for name, trace, opts in runs:
        shapes[name] = run_shape(name, trace, opts, policies, overrides, log_dir, console.print)
        _print_shape(console, shapes[name])
    if len(shapes) > 1 or shape == "all":
        _print_summary(console, shapes)
    else:
        from rich.table import Table

        from lab.toolkit.tables import print_table

        goal_table = Table(title="goals (ours)")
        for column in ("goal", "value", "bound", "met"):
            goal_table.add_column(column)
        for key, g in next(iter(shapes.values()))["goals"].items():
            goal_table.add_row(key, _fmt(g["value"]), _fmt(g["goal"], 2),
                               {True: "yes", False: "NO", None: "—"}[g["met"]])
        print_table(goal_table, console)
    if json_path:
        common = {"benchmark": "prefix", "python": sys.version.split()[0], "cpus": os.cpu_count(), "seed": seed,
                  "quick": quick, "load": load, "round_robin": "vllm-router --policy round_robin"}
        if len(shapes) == 1 and shape != "all":
            payload = {**common, **next(iter(shapes.values()))}
        else:
            payload = {**common, "shapes": shapes}
        json_path.write_text(json.dumps(payload, indent=2) + "\n")
