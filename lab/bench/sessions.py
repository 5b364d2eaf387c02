"""``backfill bench sessions``: agent sessions beside a batch backlog, turn priority off vs on.

One run per setting (``off`` first, then ``on``; ``--repeat`` alternates more pairs), each on a FRESH
fleet of ``--engines`` simulated engines (``max_num_seqs`` 4; ``--engine-policy``: vLLM's
``priority`` by default, the router sending vLLM's ``priority`` per band, as ``backfill up`` runs
them; or ``fcfs``) behind our router with
the shipped scheduling config and a flow-control file that differs only in
``turn_priority.enabled``. Both runs replay the same seeded trace:

* **agent sessions** (:func:`~lab.toolkit.workloads.agentic_sessions`, 3–8 calls each, tool pauses
  of 1 s mean, every call with its ``x-session-id``), closed loop per session, started over
  ``--spread`` seconds, so the fleet is over its slots while many sessions run at once;
* **a batch backlog**: ``--batch-workers`` closed-loop clients sending ``batch``-objective requests
  as the async processor does (trusted token, a 429 waits its ``Retry-After``) for the whole run.

The interactive band keeps its bypass of saturation up to ``--interactive-bound`` requests in flight
(default: the fleet's slots); past it, its requests wait in the router's queue, the one place flow
control orders them, which is where turn priority acts. Per run: TTFT p50 and p99 of later turns
(turn ≥ 2 of a session: what turn priority favours) and of first turns (what it costs), and the batch
requests done per second. Goal (docs/benchmarks.md): later turns' TTFT p99 lower with turn priority on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import click
import orjson
import yaml

from common.executable import backfill_executable
from lab.toolkit.launch import EngineOptions, LaunchError, Policy, fleet_with_router
from lab.toolkit.replay import replay_async
from lab.toolkit.stats import percentile
from lab.toolkit.workloads import TimedRequest, agentic_sessions
from router.scheduling import DEFAULT_CONFIG_PATH
from router.trust import TOKEN_HEADER

SESSION_HEADER = "x-session-id"
BATCH_PROMPT_TOKENS = 300
BATCH_MAX_TOKENS = 64


def build_trace(seed: int, sessions: int, spread_s: float) -> list[TimedRequest]:
    """The agent sessions (no one-off calls: every call belongs to a session)."""
    return agentic_sessions(seed, sessions=sessions, system_tokens=2000, task_tokens=(200, 400),
                            result_tokens=(200, 600), turns=(3, 8), pause_s=1.0, one_off_share=0.0,
                            duration_s=spread_s, max_tokens=16, workload="agentic")


def flow_control_file(turn_priority: bool, interactive_bound: int, directory: Path,
                      overrides: dict[str, Any] | None = None) -> Path:
    """The shipped flow-control defaults with the interactive band's tenant limits off (one replayer is
    one tenant), its bypass bound at ``interactive_bound``, and turn priority on or off."""
    from router.flow_control.config import FlowControlConfig

    data = FlowControlConfig().model_dump(mode="json")
    for band in data["bands"]:
        if band["objective"] == "interactive":
            band["tenant_max_in_flight"] = band["tenant_max_queued"] = None
            band["max_in_flight"] = interactive_bound
    data["turn_priority"].update(overrides or {})
    data["turn_priority"]["enabled"] = turn_priority
    path = directory / f"flow-{'on' if turn_priority else 'off'}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def router_policy(name: str, flow_control: Path) -> Policy:
    """Our router (shipped scheduling config, ``estimate`` tokenizer) with ``flow_control``."""
    def argv(port: int, engines: list[str], event_endpoints: list[str], opts: EngineOptions,
             router_events_port: int | None) -> list[str]:
        cmd = [*backfill_executable(), "router", "--host", "127.0.0.1", "--port", str(port)]
        for url in engines:
            cmd += ["--engine", url]
        cmd += ["--config", str(DEFAULT_CONFIG_PATH), "--profile", "default", "--tokenizer", "estimate",
                "--flow-control", str(flow_control)]
        return cmd + (["--engine-priority"] if opts.scheduling_policy == "priority" else [])
    return Policy(name, "own", argv, lambda: None)


async def batch_backlog(base_url: str, token: str, workers: int, stop: asyncio.Event) -> dict[str, int]:
    """``workers`` closed-loop batch clients until ``stop``: counts of done and 429-answered requests."""
    counts = {"done": 0, "refused": 0, "errors": 0}
    headers = {"content-type": "application/json", TOKEN_HEADER: token,
               "x-llm-d-inference-objective": "batch", "x-llm-d-inference-fairness-id": "batch-tenant"}
    url = f"{base_url}/v1/chat/completions"

    async def worker(w: int, session: aiohttp.ClientSession) -> None:
        n = 0
        while not stop.is_set():
            text = f"batch line {w}.{n}: " + "summarise this record please " * (BATCH_PROMPT_TOKENS // 6)
            body = {"model": "sim-model", "max_tokens": BATCH_MAX_TOKENS,
                    "messages": [{"role": "user", "content": text}]}
            n += 1
            try:
                async with session.post(url, data=orjson.dumps(body), headers=headers) as resp:
                    await resp.read()
                    if resp.status == 200:
                        counts["done"] += 1
                        continue
                    counts["refused" if resp.status == 429 else "errors"] += 1
                    wait = float(resp.headers.get("Retry-After", "1"))
            except (aiohttp.ClientError, TimeoutError):
                counts["errors"] += 1
                wait = 1.0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=wait)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(worker(w, session) for w in range(workers)))
    return counts


async def _run(router: str, trace: list[TimedRequest], token: str, workers: int, warmup_s: float) -> dict[str, Any]:
    stop = asyncio.Event()
    backlog = asyncio.create_task(batch_backlog(router, token, workers, stop))
    await asyncio.sleep(warmup_s)  # the backlog fills the batch slots first
    started = time.perf_counter()
    replayed = await replay_async(trace, router, 1.0, timeout_s=120.0, session_header=SESSION_HEADER)
    wall = time.perf_counter() - started
    stop.set()
    counts = await backlog
    later = [r.ttft_s for r, t in zip(replayed.results, trace) if t.turn >= 1 and r.ttft_s is not None]
    first = [r.ttft_s for r, t in zip(replayed.results, trace) if t.turn == 0 and r.ttft_s is not None]
    return {
        "later_turns": len(later), "later_ttft_p50_s": percentile(later, 50), "later_ttft_p99_s": percentile(later, 99),
        "first_turns": len(first), "first_ttft_p50_s": percentile(first, 50), "first_ttft_p99_s": percentile(first, 99),
        "errors": replayed.errors, "wall_s": wall, "batch_done": counts["done"], "batch_refused": counts["refused"],
        "batch_per_s": counts["done"] / (wall + warmup_s) if wall + warmup_s else 0.0,
        "first_error": next((r.error for r in replayed.results if r.error), None),
    }


def run_setting(turn_priority: bool, trace: list[TimedRequest], opts: EngineOptions, bound: int, workers: int,
                work_dir: Path, log_dir: Path | None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """One setting on a fresh fleet; its figures (``{"missing": reason}`` when the fleet did not start)."""
    name = "on" if turn_priority else "off"
    token = secrets.token_hex(16)
    os.environ["BACKFILL_ROUTER_TRUSTED_TOKEN"] = token  # the router subprocess inherits it
    policy = router_policy(name, flow_control_file(turn_priority, bound, work_dir, overrides))
    sub = None
    if log_dir is not None:
        sub = log_dir / name
        sub.mkdir(parents=True, exist_ok=True)
    try:
        with fleet_with_router(policy, opts, sub) as fleet:
            return asyncio.run(_run(fleet.router, trace, token, workers, warmup_s=2.0))
    except LaunchError as exc:
        return {"missing": str(exc)[:300]}
    finally:
        os.environ.pop("BACKFILL_ROUTER_TRUSTED_TOKEN", None)


def _fmt(value: Any) -> str:
    return "—" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


@click.command("sessions")
@click.option("--engines", type=click.IntRange(min=1), default=2, show_default=True, help="Simulated engines.")
@click.option("--sessions", "n_sessions", type=click.IntRange(min=1), default=32, show_default=True,
              help="Agent sessions in the trace.")
@click.option("--spread", type=click.FloatRange(min=0.1), default=4.0, show_default=True,
              help="Seconds over which the sessions start.")
@click.option("--batch-workers", type=click.IntRange(min=0), default=8, show_default=True,
              help="Closed-loop batch clients (the backlog).")
@click.option("--interactive-bound", type=click.IntRange(min=1), default=None,
              help="The interactive band's bypass bound (default: the fleet's slots, 4 per engine).")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True,
              help="Pairs of runs (off, on), alternating; figures are per run and their mean.")
@click.option("--max-turn", type=click.IntRange(min=1), default=None,
              help="turn_priority.max_turn of the `on` runs (default: the shipped one).")
@click.option("--time-weight", type=click.FloatRange(min=0), default=None,
              help="turn_priority.time_weight_per_s of the `on` runs (default: the shipped one).")
@click.option("--engine-policy", type=click.Choice(["priority", "fcfs"]), default="priority", show_default=True,
              help="the engines' --scheduling-policy; with priority the router sends vLLM's priority per band, "
                   "as `backfill up` runs them")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Also write JSON here.")
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path), help="Keep engine and router logs here.")
def sessions_command(engines: int, n_sessions: int, spread: float, batch_workers: int, interactive_bound: int | None,
                     repeat: int, max_turn: int | None, time_weight: float | None, engine_policy: str, seed: int,
                     json_path: Path | None, log_dir: Path | None) -> None:
    """Later turns' TTFT with and without turn priority, agent sessions beside a batch backlog."""
    from rich.console import Console
    from rich.table import Table

    from lab.toolkit.tables import print_table

    console = Console(width=160)
    opts = EngineOptions(engines=engines, num_gpu_blocks=2048, cpu_offload_blocks=0, max_num_seqs=4,
                         max_model_len=16384, time_scale=1.0, scheduling_policy=engine_policy)
    bound = interactive_bound or 4 * engines
    trace = build_trace(seed, n_sessions, spread)
    overrides: dict[str, Any] = {}
    if max_turn is not None:
        overrides["max_turn"] = max_turn
    if time_weight is not None:
        overrides["time_weight_per_s"] = time_weight
    console.print(f"trace: {len(trace)} calls in {n_sessions} sessions; {engines} engines × 4 slots; "
                  f"interactive bypass bound {bound}; {batch_workers} batch workers")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="backfill-bench-sessions-") as tmp:
        for k in range(repeat):
            for on in (False, True):
                figures = run_setting(on, trace, opts, bound, batch_workers, Path(tmp), log_dir, overrides)
                runs.append({"turn_priority": on, "pair": k, **figures})
                console.print(f"pair {k} turn priority {'on' if on else 'off'}: " + (
                    f"missing ({figures['missing']})" if "missing" in figures else
                    f"later p99 {_fmt(figures['later_ttft_p99_s'])} s, first p99 {_fmt(figures['first_ttft_p99_s'])} s"))
    keys = ("later_ttft_p50_s", "later_ttft_p99_s", "first_ttft_p50_s", "first_ttft_p99_s", "batch_per_s", "errors")
    mean: dict[str, dict[str, float | None]] = {}
    for on in (False, True):
        picked = [r for r in runs if r["turn_priority"] is on and "missing" not in r]
        mean["on" if on else "off"] = {key: (sum(r[key] for r in picked) / len(picked)
                                             if picked and all(r[key] is not None for r in picked) else None)
                                       for key in keys}
    off, on_ = mean["off"]["later_ttft_p99_s"], mean["on"]["later_ttft_p99_s"]
    ratio = on_ / off if on_ is not None and off else None
    table = Table(title=f"bench sessions: turn priority off vs on ({repeat} pair(s), means)")
    for column in ("turn priority", "later p50 s", "later p99 s", "first p50 s", "first p99 s", "batch req/s",
                   "errors"):
        table.add_column(column, justify="left" if column == "turn priority" else "right")
    for name, m in mean.items():
        table.add_row(name, *(_fmt(m[key]) for key in keys))
    print_table(table, console)
    console.print(f"later turns' TTFT p99, on ÷ off: {_fmt(ratio)} (goal < 1)")
    if json_path:
        json_path.write_text(json.dumps({
            "benchmark": "sessions", "python": sys.version.split()[0], "cpus": os.cpu_count(), "seed": seed,
            "engines": engines, "sessions": n_sessions, "spread_s": spread, "batch_workers": batch_workers,
            "interactive_bound": bound, "turn_priority_overrides": overrides, "calls": len(trace), "runs": runs, "mean": mean,
            "later_p99_on_over_off": ratio, "goal_met": None if ratio is None else ratio < 1.0,
        }, indent=2) + "\n")
