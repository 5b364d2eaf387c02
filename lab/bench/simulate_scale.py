"""``backfill bench simulate-scale``: the virtual-time fleet (``backfill simulate``) from 4 to 256 engines.

For each engine count N of ``--engines`` the same workload shape, scaled so the load per engine is
constant: the simulator's synthetic mix (:func:`lab.simulate.workload.synthetic_requests`:
several tenants, 48 shared system prompts, multi-turn chat sessions, and async / batch document
jobs through the processor's lanes and gates) with ``requests_per_engine × N`` requests at
6 first turns per second per engine (the CLI's default rate), and the processor's in-flight bound
scaled with the fleet (``processor_per_engine × N``; 16 per engine gives the processor's default 64
at 4 engines, ``async_processor/settings.py``), so batch and async work offer the same load per
engine at every size. Every policy of ``--policy`` (default: round-robin, approximate, precise)
runs the same arrivals on a fresh fleet (:class:`lab.simulate.sim.Simulation`, the production
scheduler, KV index, pool, flow control and processor code).

Figures per (engines, policy), from the simulation's own figures (docs/simulate.md):
``decision_p50_ms`` / ``decision_p99_ms`` (real ``perf_counter`` time of one scheduling decision),
``index_bytes`` (precise: the KV index's estimate; approximate: its producer's LRU entries; round
robin: 0), ``captured_reuse``, ``ttft_p50_s`` / ``ttft_p99_s`` and ``ttft_p50_vs_round_robin``
(÷ round-robin's at the same size, measured in the same sweep), ``wall_s`` and
``wall_us_per_request``, and per lane (``interactive``, ``async``, ``batch``: every tenant pooled)
TTFT p50 / p99 (:func:`lane_figures`) with the worst tenant's interactive p99. Isolation at scale:
``interactive_p99_growth`` per policy, the interactive TTFT p99 at the largest size ÷ at the
smallest (near 1: the interactive lane does not slow down as batch load grows with the fleet).

Plots (``--plots DIR``, matplotlib's Agg backend): one PNG of six panels against the engine count
(log₂ axis): decision p50, index MiB, captured reuse, TTFT p50 ÷ round-robin, and the lanes' TTFT
p99 for the two routing policies.

``--quick`` (the test's run): 2 and 4 engines, 30 requests per engine.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click

from lab.simulate.sim import POLICIES, SimConfig, Simulation
from lab.simulate.workload import synthetic_requests
from lab.toolkit.charts import scale_plot
from lab.toolkit.cli_common import fmt_cell as _fmt
from lab.toolkit.stats import percentile

DEFAULT_ENGINES = (4, 8, 16, 32, 64, 128, 256)
DEFAULT_POLICIES = ("round-robin", "approximate", "precise")
LANES = ("interactive", "async", "batch")
RATE_PER_ENGINE = 6.0
"""First turns per second per engine: ``backfill simulate``'s default synthetic rate."""


@dataclass
class ScaleOptions:
    """One sweep. ``engines``: the fleet sizes; ``requests_per_engine``: requests (turns included)
    per engine at every size; ``processor_per_engine``: the processor's in-flight bound per engine
    (16: its default 64 at 4 engines); ``tenants``, ``system_pieces``: the synthetic mix's (the
    CLI's defaults); the engines are the twin's defaults (8,192 GPU blocks of 16 tokens)."""

    engines: tuple[int, ...] = DEFAULT_ENGINES
    requests_per_engine: int = 200
    policies: tuple[str, ...] = DEFAULT_POLICIES
    processor_per_engine: int = 16
    tenants: int = 4
    system_pieces: tuple[int, int] = (2, 8)
    seed: int = 0
    gpu_blocks: int = 8192

    def __post_init__(self) -> None:
        if not self.engines or min(self.engines) < 1:
            raise ValueError("engines must be positive counts")
        if self.requests_per_engine < 1 or self.processor_per_engine < 1 or self.tenants < 1:
            raise ValueError("requests_per_engine, processor_per_engine and tenants must be positive")
        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown or not self.policies:
            raise ValueError(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")

    @classmethod
    def quick(cls, seed: int = 0) -> ScaleOptions:
        """2 and 4 engines, 30 requests per engine (the test's run)."""
        return cls(engines=(2, 4), requests_per_engine=30, seed=seed)


def lane_figures(ttft: Sequence[float], group_of: Sequence[int],
                 groups: Sequence[tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """TTFT per lane with every tenant pooled. ``ttft[i]`` (seconds) is answer ``i``'s, of group
    ``group_of[i]``, an index into ``groups`` of ``(lane, tenant)``. Returns lane → ``requests``,
    ``ttft_p50_s``, ``ttft_p99_s`` (nearest rank), ``tenants`` and ``worst_tenant_p99_s`` (the
    highest of its tenants' p99); lanes without an answer are absent."""
    by_lane: dict[str, list[float]] = {}
    by_tenant: dict[tuple[str, str], list[float]] = {}
    for value, g in zip(ttft, group_of):
        lane, tenant = groups[g]
        by_lane.setdefault(lane, []).append(value)
        by_tenant.setdefault((lane, tenant), []).append(value)
    out: dict[str, dict[str, Any]] = {}
    for lane, values in sorted(by_lane.items()):
        tenant_p99 = [percentile(v, 99) or 0.0 for (ln, _), v in by_tenant.items() if ln == lane]
        out[lane] = {"requests": len(values), "ttft_p50_s": percentile(values, 50),
                     "ttft_p99_s": percentile(values, 99), "tenants": len(tenant_p99),
                     "worst_tenant_p99_s": max(tenant_p99)}
    return out


def run_one(opts: ScaleOptions, engines: int, policy: str) -> dict[str, Any]:
    """One policy on a fresh fleet of ``engines``: the simulation's figures plus ``lanes``
    (:func:`lane_figures`), ``processor_concurrency`` and ``rate_per_s``."""
    n = opts.requests_per_engine * engines
    rate = RATE_PER_ENGINE * engines
    concurrency = max(opts.processor_per_engine * engines, 13)  # > the 8 + 4 reserved slots
    config = SimConfig(engines=engines, gpu_blocks=opts.gpu_blocks, seed=opts.seed,
                       processor_concurrency=concurrency)
    arrivals = synthetic_requests(n, opts.seed, rate_per_s=rate, tenants=opts.tenants,
                                  system_pieces=opts.system_pieces)
    sim = Simulation(config, policy, arrivals)
    figures = sim.run()
    figures["lanes"] = lane_figures(sim.ttft, sim.group_of, sim.groups)
    figures["processor_concurrency"] = concurrency
    figures["rate_per_s"] = rate
    return figures


def sweep(opts: ScaleOptions, on_run: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every size × policy (:func:`run_one`), ratios to round-robin at each size, and the summary
    (:func:`summarise`). ``on_run(figures)`` after each run (progress)."""
    started = time.perf_counter()
    runs: list[dict[str, Any]] = []
    for engines in opts.engines:
        size_runs = []
        for policy in opts.policies:
            fig = run_one(opts, engines, policy)
            size_runs.append(fig)
            if on_run is not None:
                on_run(fig)
        base = next((r for r in size_runs if r["policy"] == "round-robin"), None)
        for r in size_runs:
            r["ttft_p50_vs_round_robin"] = _ratio(r["ttft_p50_s"], base["ttft_p50_s"]) if base else None
            r["ttft_p99_vs_round_robin"] = _ratio(r["ttft_p99_s"], base["ttft_p99_s"]) if base else None
        runs.extend(size_runs)
    return {"options": asdict(opts), "runs": runs, "summary": summarise(runs),
            "sweep_wall_s": time.perf_counter() - started}


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def _lane(run: dict[str, Any], lane: str, key: str) -> float | None:
    got = run["lanes"].get(lane)
    return None if got is None else got[key]


def summarise(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per policy, from the smallest to the largest size: decision p50 at each end, index bytes
    per engine at each end, and ``interactive_p99_growth`` (interactive TTFT p99 at the largest
    size ÷ at the smallest; None without both)."""
    out: dict[str, Any] = {}
    for policy in dict.fromkeys(r["policy"] for r in runs):
        mine = sorted((r for r in runs if r["policy"] == policy), key=lambda r: r["engines"])
        lo, hi = mine[0], mine[-1]
        out[policy] = {
            "engines": [lo["engines"], hi["engines"]],
            "decision_p50_ms": [lo["decision_p50_ms"], hi["decision_p50_ms"]],
            "index_bytes_per_engine": [lo["index_bytes"] / lo["engines"], hi["index_bytes"] / hi["engines"]],
            "captured_reuse": [lo["captured_reuse"], hi["captured_reuse"]],
            "interactive_p99_s": [_lane(lo, "interactive", "ttft_p99_s"), _lane(hi, "interactive", "ttft_p99_s")],
            "interactive_p99_growth": _ratio(_lane(hi, "interactive", "ttft_p99_s"),
                                             _lane(lo, "interactive", "ttft_p99_s")),
            "wall_us_per_request": [lo["wall_us_per_request"], hi["wall_us_per_request"]],
        }
    return out


def print_tables(payload: dict[str, Any]) -> None:
    """The sweep as two rich tables (figures; lanes) on stdout."""
    from rich.console import Console
    from rich.table import Table

    from lab.toolkit.tables import print_table

    out = Console() if Console().is_terminal else Console(width=200)
    runs = payload["runs"]
    opts = payload["options"]
    table = Table(title=f"simulate-scale: {opts['requests_per_engine']} requests per engine, "
                        f"{opts['tenants']} tenants, system prompts of {opts['system_pieces'][0]}-"
                        f"{opts['system_pieces'][1]} x 512 tokens, seed {opts['seed']}")
    for col in ("engines", "policy", "requests", "decision p50 / p99 ms", "index MiB", "captured reuse",
                "TTFT p50 / p99 s", "p50 ÷ RR", "wall s", "µs / req"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in runs:
        table.add_row(_fmt(r["engines"]), r["policy"], _fmt(r["requests"]),
                      f"{_fmt(r['decision_p50_ms'], 4)} / {_fmt(r['decision_p99_ms'], 2)}",
                      _fmt(r["index_bytes"] / 2**20, 1), _fmt(r["captured_reuse"]),
                      f"{_fmt(r['ttft_p50_s'])} / {_fmt(r['ttft_p99_s'])}", _fmt(r["ttft_p50_vs_round_robin"]),
                      _fmt(r["wall_s"], 1), _fmt(r["wall_us_per_request"], 0))
    print_table(table, out)
    lanes = Table(title="TTFT by lane, every tenant pooled: p50 / p99 s (worst tenant's p99)")
    for col in ("engines", "policy", *LANES):
        lanes.add_column(col, justify="left" if col == "policy" else "right")
    for r in runs:
        cells = []
        for lane in LANES:
            g = r["lanes"].get(lane)
            cells.append("-" if g is None else
                         f"{_fmt(g['ttft_p50_s'])} / {_fmt(g['ttft_p99_s'])} ({_fmt(g['worst_tenant_p99_s'])})")
        lanes.add_row(_fmt(r["engines"]), r["policy"], *cells)
    print_table(lanes, out)


def _engine_list(value: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError as exc:
        raise click.BadParameter(f"{value!r}: a comma-separated list of engine counts") from exc
    if not sizes or min(sizes) < 1:
        raise click.BadParameter(f"{value!r}: engine counts must be positive")
    return tuple(sorted(set(sizes)))


@click.command("simulate-scale")
@click.option("--engines", "engines_csv", default=",".join(map(str, DEFAULT_ENGINES)), show_default=True,
              help="Fleet sizes, comma-separated.")
@click.option("--requests-per-engine", type=click.IntRange(min=1), default=200, show_default=True,
              help="Requests (session turns included) per engine at every size.")
@click.option("--policy", "policies", multiple=True, type=click.Choice(list(POLICIES)),
              help="Routing policy (repeatable). Default: round-robin, approximate, precise.")
@click.option("--processor-per-engine", type=click.IntRange(min=1), default=16, show_default=True,
              help="The processor's in-flight bound per engine (16: its default 64 at 4 engines).")
@click.option("--tenants", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--system-pieces", type=(int, int), default=(2, 8), show_default=True,
              help="Shared system prompts: MIN MAX pieces of 512 tokens (15 15: 8k-token prompts).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--quick", is_flag=True, help="2 and 4 engines, 30 requests per engine (a smoke run).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the figures here.")
@click.option("--plots", "plots_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Write simulate-scale.png (six panels) into this folder (e.g. docs/plots).")
def simulate_scale_command(engines_csv: str, requests_per_engine: int, policies: tuple[str, ...],
                           processor_per_engine: int, tenants: int, system_pieces: tuple[int, int], seed: int,
                           quick: bool,
                           json_path: Path | None, plots_dir: Path | None) -> None:
    """The virtual-time fleet from 4 to 256 engines: decision cost, index memory, reuse, TTFT, isolation."""
    if system_pieces[0] < 1 or system_pieces[1] < system_pieces[0]:
        raise click.BadParameter("MIN must be >= 1 and MAX >= MIN", param_hint="--system-pieces")
    if quick:
        opts = ScaleOptions.quick(seed)
    else:
        opts = ScaleOptions(engines=_engine_list(engines_csv), requests_per_engine=requests_per_engine,
                            processor_per_engine=processor_per_engine, tenants=tenants,
                            system_pieces=system_pieces, seed=seed)
    if policies:
        opts.policies = tuple(dict.fromkeys(policies))
    total = sum(opts.engines) * opts.requests_per_engine * len(opts.policies)

    def progress(fig: dict[str, Any]) -> None:
        click.echo(f"{fig['engines']:>4} engines {fig['policy']:<12} {fig['requests']:>7,} requests "
                   f"{fig['wall_s']:7.1f} s wall ({fig['wall_us_per_request']:.0f} µs/request)", err=True)

    click.echo(f"simulate-scale: engines {','.join(map(str, opts.engines))}, {opts.requests_per_engine} "
               f"requests per engine, {len(opts.policies)} policies ({total:,} simulated requests)", err=True)
    payload = sweep(opts, progress)
    print_tables(payload)
    for policy, s in payload["summary"].items():
        growth = s["interactive_p99_growth"]
        click.echo(f"{policy}: decision p50 {_fmt(s['decision_p50_ms'][0], 4)} -> {_fmt(s['decision_p50_ms'][1], 4)} ms, "
                   f"interactive TTFT p99 {_fmt(s['interactive_p99_s'][0])} -> {_fmt(s['interactive_p99_s'][1])} s "
                   f"(x{_fmt(growth, 2)}) from {s['engines'][0]} to {s['engines'][1]} engines")
    click.echo(f"sweep: {payload['sweep_wall_s']:.0f} s wall", err=True)
    if json_path is not None:
        json_path.write_text(json.dumps(payload, indent=2, default=_json_default) + "\n")
        click.echo(f"wrote {json_path}", err=True)
    if plots_dir is not None:
        click.echo(f"wrote {scale_plot(payload, plots_dir / 'simulate-scale.png', LANES)}", err=True)


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    return str(value)
