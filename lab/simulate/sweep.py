"""``backfill simulate --sweep``: every policy on every workload shape, several seeds and loads,
in virtual time; mean and spread of each figure (docs/simulate.md, "Sweep").

A run is one (shape, load, seed, policy): the shape's trace (:mod:`lab.toolkit.shapes`, the
requests ``backfill bench prefix`` replays in real time, generated with that seed and load) on the
shape's fleet (the bench's engines, blocks, CPU tier, ``max_num_seqs`` and scheduling policy),
a fresh fleet per run. Shapes: those of ``bench prefix`` plus ``conversation`` (long multi-turn
conversations in Mooncake form with the public conversation trace's statistics,
:func:`lab.toolkit.workloads.conversation_records`, on the fleet of issue 27's held-back trace:
4 engines × 16,384 GPU + 65,536 CPU blocks, answers capped at 64 tokens).

``load`` multiplies the shape's arrival rates as ``bench prefix --load`` does (session starts and
request rates; a Mooncake trace is replayed ``load`` × faster).

Per (shape, load, policy) the summary gives, for captured reuse and TTFT p50 / p99, the mean, the
sample standard deviation (``sd``, n − 1), min and max over the seeds; per (shape, load) the paired
difference precise − approximate in captured reuse (same seed, same trace), mean and sd.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.simulate.sim import POLICIES, SimConfig, Simulation
from lab.simulate.workload import SimRequest, mooncake_requests, text_requests
from lab.toolkit import shapes as shp
from lab.toolkit import workloads as wl
from lab.toolkit.launch import EngineOptions

CACHE_AWARE_MODEL = Path(__file__).with_name("cache-aware-model.yaml")
"""A model of the peers' ``cache_aware`` policy (the file says what it leaves out)."""

SWEEP_POLICIES = ("round-robin", "approximate", "precise", "cache-aware-model")
"""The default policies: the baseline, ours (both), the peer model."""

CONVERSATION = "conversation"
CONVERSATION_FLEET = EngineOptions(engines=4, num_gpu_blocks=16384, cpu_offload_blocks=65536,
                                   max_model_len=131072)
"""Issue 27's held-back trace runs: 4 engines × 16,384 GPU + 65,536 CPU blocks (block 16)."""

SHAPES = (*shp.SHAPES, CONVERSATION)
FIGURES = ("captured_reuse", "ttft_p50_s", "ttft_p99_s")


@dataclass(frozen=True)
class Run:
    """One cell of the sweep."""

    shape: str
    load: float
    seed: int
    policy: str


def fleet_of(shape: str) -> EngineOptions:
    """The shape's fleet (the bench's full one; ``conversation``: :data:`CONVERSATION_FLEET`).
    Raises ``KeyError`` for an unknown shape."""
    return CONVERSATION_FLEET if shape == CONVERSATION else shp.SHAPES[shape].full


def sim_config(opts: EngineOptions, seed: int) -> SimConfig:
    """The simulator's fleet for the bench's engine options (same blocks, slots and policy)."""
    return SimConfig(engines=opts.engines, gpu_blocks=opts.num_gpu_blocks, cpu_blocks=opts.cpu_offload_blocks,
                     block_size=opts.block_size, max_num_seqs=opts.max_num_seqs, max_model_len=opts.max_model_len,
                     scheduling_policy=opts.scheduling_policy, seed=seed)


def shape_requests(shape: str, seed: int, load: float, opts: EngineOptions) -> Callable[[], Iterator[SimRequest]]:
    """A maker of the shape's arrivals (fresh per run). Mooncake shapes run as block pieces, the text
    shapes as token ids of their chat bodies. Raises ``KeyError`` (unknown shape), ``ValueError``
    (non-positive load), ``RuntimeError`` (``conversation`` without its generator)."""
    cap = shp.LONG_CONTEXT_OUTPUT_CAP
    if shape in ("long-context", CONVERSATION):
        if shape == "long-context":
            records = wl.long_context_records(seed)
        else:
            generator = getattr(wl, "conversation_records", None)
            if generator is None:
                raise RuntimeError("the conversation shape needs lab.toolkit.workloads.conversation_records")
            records = generator(seed)
        return lambda: mooncake_requests(records, speed=load, max_model_len=opts.max_model_len,
                                         max_output_tokens=cap, space=shape)
    trace = shp.shape_trace(shape, seed, load=load, max_model_len=opts.max_model_len)
    return lambda: text_requests(trace, block_size=opts.block_size)


def run_one(run: Run, make: Callable[[], Iterator[SimRequest]], opts: EngineOptions,
            configs: dict[str, Path]) -> dict[str, Any]:
    """One simulation; its figures with the cell's coordinates."""
    path = configs.get(run.policy)
    if path is None and run.policy not in POLICIES:
        raise KeyError(run.policy)
    sim = Simulation(sim_config(opts, run.seed), run.policy, make(), config_path=path)
    figures = sim.run()
    keep = ("completed", "requests", "captured_reuse", "ttft_p50_s", "ttft_p99_s", "throughput_rps", "preemptions",
            "wall_s", "virtual_s")
    return {"shape": run.shape, "load": run.load, "seed": run.seed, "policy": run.policy,
            **{k: figures.get(k) for k in keep}}


def spread(values: Sequence[float | None]) -> dict[str, float | int | None]:
    """Mean, sample standard deviation (n − 1; 0 for one value), min and max of the non-None
    values, and their count."""
    xs = [v for v in values if v is not None]
    if not xs:
        return {"n": 0, "mean": None, "sd": None, "min": None, "max": None}
    return {"n": len(xs), "mean": statistics.fmean(xs), "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "min": min(xs), "max": max(xs)}


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``cells``: per (shape, load, policy) the spread of each figure; ``paired``: per (shape,
    load) precise − approximate captured reuse by seed (when both ran)."""
    cells: list[dict[str, Any]] = []
    keys = list(dict.fromkeys((r["shape"], r["load"], r["policy"]) for r in runs))
    for shape, load, policy in keys:
        mine = [r for r in runs if (r["shape"], r["load"], r["policy"]) == (shape, load, policy)]
        cells.append({"shape": shape, "load": load, "policy": policy,
                      **{f: spread([r[f] for r in mine]) for f in FIGURES}})
    paired: list[dict[str, Any]] = []
    for shape, load in dict.fromkeys((r["shape"], r["load"]) for r in runs):
        by = {(r["policy"], r["seed"]): r["captured_reuse"] for r in runs if (r["shape"], r["load"]) == (shape, load)}
        diffs = [p - a for (pol, seed), p in by.items() if pol == "precise" and p is not None
                 and (a := by.get(("approximate", seed))) is not None]
        if diffs:
            paired.append({"shape": shape, "load": load, "precise_minus_approximate_reuse": spread(diffs)})
    return {"cells": cells, "paired": paired}


def sweep(shapes: Sequence[str], seeds: int, loads: Sequence[float], policies: Sequence[str],
          configs: dict[str, Path] | None = None, say: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Every (shape, load, seed, policy) on a fresh fleet; the runs and their :func:`summarize`.
    ``configs``: policy name → scheduling config YAML for names outside :data:`POLICIES` (the
    default maps ``cache-aware-model``). Seeds are 0 … ``seeds`` − 1. Raises ``KeyError`` for an
    unknown shape or policy."""
    configs = {"cache-aware-model": CACHE_AWARE_MODEL, **(configs or {})}
    runs: list[dict[str, Any]] = []
    for shape in shapes:
        opts = fleet_of(shape)
        for load in loads:
            for seed in range(seeds):
                make = shape_requests(shape, seed, load, opts)
                for policy in policies:
                    r = run_one(Run(shape, load, seed, policy), make, opts, configs)
                    runs.append(r)
                    say(f"{shape} ×{load:g} seed {seed} {policy}: reuse {_f(r['captured_reuse'])}, "
                        f"TTFT p50 {_f(r['ttft_p50_s'])} p99 {_f(r['ttft_p99_s'])} s ({r['wall_s']:.1f} s wall)")
    return {"shapes": list(shapes), "seeds": list(range(seeds)), "loads": list(loads), "policies": list(policies),
            "configs": {k: str(v) for k, v in configs.items()}, "runs": runs, "summary": summarize(runs)}


def _f(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def cell_text(s: dict[str, Any], digits: int = 3) -> str:
    """``mean ± sd`` of one spread (``—`` when empty)."""
    if s["mean"] is None:
        return "—"
    return f"{s['mean']:.{digits}f} ± {s['sd']:.{digits}f}"


def _parse_list(spec: str, allowed: Sequence[str], what: str) -> list[str]:
    import click

    names = list(allowed) if spec.strip() == "all" else [x.strip() for x in spec.split(",") if x.strip()]
    unknown = [n for n in names if n not in allowed]
    if not names or unknown:
        raise click.BadParameter(f"{', '.join(unknown) or spec!r}: choose from {', '.join(allowed)} or 'all'",
                                 param_hint=what)
    return names


def parse_loads(spec: str) -> list[float]:
    """``1,2`` → ``[1.0, 2.0]``; raises ``click.BadParameter`` for anything but positive numbers."""
    import click

    try:
        loads = [float(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        loads = []
    if not loads or any(x <= 0 for x in loads):
        raise click.BadParameter(f"{spec!r}: comma-separated positive numbers", param_hint="--load")
    return loads


def run_sweep(seeds: int, shapes_spec: str, loads_spec: str, policies: Sequence[str], config_path: Path | None,
              json_path: Path | None, console: Any) -> dict[str, Any]:
    """The CLI's ``--sweep``: parse, run (progress on ``console``), print the table, write JSON."""
    import json

    shapes = _parse_list(shapes_spec, SHAPES, "--shape")
    loads = parse_loads(loads_spec)
    names = [p for p in dict.fromkeys(policies) if p not in ("all", "pd")] if policies and "all" not in policies \
        else list(SWEEP_POLICIES)
    configs: dict[str, Path] = {}
    if config_path is not None:
        name = f"config:{config_path.stem}"
        configs[name] = config_path
        names.append(name)
    result = sweep(shapes, seeds, loads, names, configs, say=console.print)
    print_summary(result)
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2))
        console.print(f"wrote {json_path}")
    return result


def print_summary(result: dict[str, Any]) -> None:
    """The sweep's table (mean ± sd over seeds) and the paired precise − approximate reuse on stdout."""
    from rich.console import Console
    from rich.table import Table

    from lab.toolkit.tables import print_table

    out = Console()
    seeds = len(result["seeds"])
    table = Table(title=f"simulate --sweep: mean ± sd over {seeds} seeds")
    for col in ("shape", "load", "policy", "captured reuse", "TTFT p50 s", "TTFT p99 s"):
        table.add_column(col, justify="left" if col in ("shape", "policy") else "right")
    for c in result["summary"]["cells"]:
        table.add_row(c["shape"], f"{c['load']:g}", c["policy"], cell_text(c["captured_reuse"]),
                      cell_text(c["ttft_p50_s"]), cell_text(c["ttft_p99_s"]))
    print_table(table, out)
    paired = Table(title="precise − approximate captured reuse, paired by seed")
    for col in ("shape", "load", "mean ± sd", "min", "max"):
        paired.add_column(col, justify="left" if col == "shape" else "right")
    for p in result["summary"]["paired"]:
        d = p["precise_minus_approximate_reuse"]
        paired.add_row(p["shape"], f"{p['load']:g}", cell_text(d), _f(d["min"]), _f(d["max"]))
    print_table(paired, out)
