"""``backfill simulate``: the whole fleet in virtual time (docs/simulate.md).

Workloads (one or more, merged by arrival): ``--trace PATH`` (Mooncake JSONL), ``--synthetic-requests
N`` (a mix of tenants, shared prefixes, multi-turn sessions and the processor's async / batch
lanes), ``--workload NAME`` (the benchmark generators of :mod:`lab.toolkit.workloads`, and
``pd-mix``: ``backfill bench pd``'s long-prompt + chat mix), ``--batch FILE`` (an OpenAI batch input
file as a backlog on the batch lane). Every policy runs the same workload on a fresh fleet; the
table and ``--json`` hold the figures of each.

``--sweep`` runs every policy on ``bench prefix``'s shapes (and ``conversation``) at several loads
and seeds, each on its shape's fleet, and reports mean ± sd (:mod:`lab.simulate.sweep`).

Fleets: ``--engines N`` engines of role ``both``; ``--prefill-engines P --decode-engines D`` a
prefill/decode fleet (policy ``pd``: the shipped ``pd-config.yaml``, or ``--config``); ``--layout``
(repeatable: ``N`` or ``P:D``) runs several fleets on the same workload, with a table of the P/D
ratios against the aggregated run (ITL p99 aggregated ÷ P/D, TTFT p50 and throughput P/D ÷
aggregated, as ``backfill bench pd`` reports them).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
import pydantic

from lab.simulate.sim import PD_POLICY, POLICIES, SimConfig, Simulation
from lab.simulate.workload import (
    SimRequest,
    batch_file_requests,
    merge_arrivals,
    mooncake_requests,
    pd_mix_requests,
    synthetic_requests,
    text_requests,
)
from lab.toolkit import workloads as wl
from lab.toolkit.cli_common import fmt_cell as _fmt
from lab.toolkit.cli_common import mooncake_trace_options
from router.flow_control import FlowControlConfig
from router.scheduling.errors import ConfigError

WORKLOADS = ("agentic", "shared-prefix", "tool-agent", "long-context", "conversation", "pd-mix")
"""``--workload`` names: the generators of ``backfill bench prefix``'s shapes, ``conversation``
(:func:`lab.toolkit.workloads.conversation_records`: a window of a conversation service with the
public Mooncake conversation trace's statistics), and ``bench pd``'s mix."""

TRACE_SHAPES = ("long-context", "conversation")
"""``--trace-shape`` names: the Mooncake-form generators ``--write-trace`` can write."""


def parse_layout(spec: str) -> tuple[int, int, int]:
    """``N`` (N engines of role both) or ``P:D`` (prefill and decode engines) → (both, prefill,
    decode). Raises ``click.BadParameter`` for anything else, a P/D split with an empty side, or no
    engine."""
    try:
        if ":" in spec:
            p, d = (int(x) for x in spec.split(":"))
            if p < 1 or d < 1:
                raise ValueError
            return 0, p, d
        n = int(spec)
        if n < 1:
            raise ValueError
        return n, 0, 0
    except ValueError:
        raise click.BadParameter(f"{spec!r}: a layout is N (engines of role both) or P:D (prefill and decode "
                                 "engines, both at least 1)", param_hint="--layout") from None


def layout_name(both: int, prefill: int, decode: int) -> str:
    """``aggregated`` for a fleet without prefill engines, else ``P:D`` (``+N both`` when mixed)."""
    if not prefill:
        return "aggregated"
    return f"{prefill}:{decode}" + (f"+{both}" if both else "")


def _generator(name: str, seed: int, conversations: int, duration_s: float | None,
               max_model_len: int, engines: int = 4) -> tuple[Callable[[], Iterator[SimRequest]], int]:
    """A maker of the workload's arrivals and its request count (turns included); ``pd-mix`` is
    sized for ``engines`` (its rates and sessions are per engine) over ``duration_s``."""
    if name == "pd-mix":
        from lab.toolkit.pd_mix import PdOptions, pd_trace

        opts = PdOptions(engines=engines, duration_s=duration_s or 24.0, seed=seed, max_model_len=max_model_len)
        return (lambda: pd_mix_requests(opts)), len(pd_trace(opts))
    if name in TRACE_SHAPES:
        records = _shape_records(name, seed, conversations, duration_s)
        return (lambda: mooncake_requests(records, max_model_len=max_model_len, space=name)), len(records)
    if name == "agentic":
        trace = wl.merge(wl.agentic_sessions(seed), wl.shared_prefix_groups(seed))
    elif name == "shared-prefix":
        trace = wl.shared_prefix_batch(seed)
    else:
        trace = wl.tool_agents(seed)
    return (lambda: text_requests(trace)), len(trace)


@click.command("simulate")
@mooncake_trace_options("Replay this trace file (Mooncake JSONL).")
@click.option("--max-output-tokens", type=click.IntRange(min=1), default=None,
              help="--trace: cap every output_length (bench prefix caps long-context answers at 64).")
@click.option("--synthetic-requests", type=click.IntRange(min=1), default=None,
              help="Add N requests of the synthetic mix (tenants, shared prefixes, sessions, lanes).")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Synthetic first turns per second (default: 6 per engine).")
@click.option("--tenants", type=click.IntRange(min=1), default=4, show_default=True,
              help="Synthetic tenants.")
@click.option("--system-pieces", type=(int, int), default=(2, 8), show_default=True,
              help="Synthetic shared system prompts: MIN MAX pieces of 512 tokens.")
@click.option("--workload", "workload_names", multiple=True, type=click.Choice(WORKLOADS),
              help="Add a benchmark generator's trace (repeatable).")
@click.option("--conversations", type=click.IntRange(min=1), default=64, show_default=True,
              help="--workload long-context: conversations.")
@click.option("--duration-s", type=click.FloatRange(min=0, min_open=True), default=None,
              help="--workload long-context: seconds the conversations start over (default 24); conversation: "
                   "the window's seconds (default 120); pd-mix: the trace's seconds (default 24).")
@click.option("--write-trace", type=click.Path(dir_okay=False, path_type=Path),
              help="Only write the --trace-shape workload's records (--conversations, --duration-s, --seed) here as "
                   "Mooncake JSONL, for --trace here and in bench prefix, and exit.")
@click.option("--trace-shape", type=click.Choice(TRACE_SHAPES), default="long-context", show_default=True,
              help="--write-trace: the generator (conversation: the public Mooncake conversation trace's statistics).")
@click.option("--batch", "batch_files", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Add an OpenAI batch input file as a backlog on the batch lane, via the processor (repeatable).")
@click.option("--engines", type=click.IntRange(min=0), default=None,
              help="Simulated engines of role both (default 4; 0 when --prefill-engines is given).")
@click.option("--prefill-engines", type=click.IntRange(min=0), default=0, show_default=True,
              help="Engines of role prefill (P/D disaggregation, policy pd; needs --decode-engines).")
@click.option("--decode-engines", type=click.IntRange(min=0), default=0, show_default=True,
              help="Engines of role decode.")
@click.option("--layout", "layout_specs", multiple=True,
              help="Run this fleet too: N (engines of role both) or P:D (repeatable; replaces --engines / "
                   "--prefill-engines / --decode-engines). P/D ratios against the aggregated run are printed.")
@click.option("--kv-transfer-bandwidth", type=click.FloatRange(min=0, min_open=True), default=None,
              help="P/D: the KV link's GB/s (default: the engine twin's, 50).")
@click.option("--gpu-blocks", type=click.IntRange(min=1), default=8192, show_default=True,
              help="GPU KV blocks per engine (the twin's default).")
@click.option("--cpu-blocks", type=click.IntRange(min=0), default=0, show_default=True,
              help="CPU offload blocks per engine.")
@click.option("--block-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=8192, show_default=True)
@click.option("--max-model-len", type=click.IntRange(min=16), default=None,
              help="Default: what the GPU cache holds, at most 131,072.")
@click.option("--scheduling-policy", type=click.Choice(["priority", "fcfs"]), default="priority", show_default=True,
              help="The engines' vLLM --scheduling-policy (priority: the router sends vLLM priorities).")
@click.option("--policy", "policies", multiple=True, type=click.Choice([*POLICIES, PD_POLICY, "all"]),
              help="Routing policy of aggregated fleets (repeatable; 'all': every one; default: all). A fleet "
                   "with prefill engines runs 'pd' (the shipped pd-config.yaml).")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Also run a custom scheduling config YAML (its first profile).")
@click.option("--flow-control", "flow_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Flow-control YAML (default: the shipped bands without interactive per-tenant limits).")
@click.option("--processor-concurrency", type=click.IntRange(min=2), default=64, show_default=True,
              help="The processor's requests in flight at most (its --concurrency; 8 / 4 kept for interactive / async).")
@click.option("--tenant-limit", type=click.IntRange(min=0), default=0, show_default=True,
              help="The processor's in flight per tenant (0: no tenant gate).")
@click.option("--kv-event-delay-ms", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="From a step's end to its KV events reaching the index.")
@click.option("--make-room/--no-make-room", default=True, show_default=True,
              help="The router's make-room: a non-sheddable request bound for an engine with no free slot "
                   "evicts a sheddable one there (the router's default: on).")
@click.option("--router-seeds", type=click.IntRange(min=1), default=1, show_default=True,
              help="Run every policy N times, the router's (and engines') seed --seed … --seed+N−1 on the same "
                   "workload, and print mean ± sd: one run is one draw of the router's tie-breaks.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--sweep", is_flag=True,
              help="Sweep: every policy (round-robin, approximate, precise, cache-aware-model, plus --config) on "
                   "every --shape at every --load over --seeds seeds, each shape on its bench fleet; mean ± sd "
                   "(docs/simulate.md, 'Sweep'). Ignores the workload and fleet options.")
@click.option("--seeds", type=click.IntRange(min=1), default=5, show_default=True, help="--sweep: seeds 0 … N−1.")
@click.option("--shape", "sweep_shapes", default="all", show_default=True,
              help="--sweep: comma-separated shapes (agentic, shared-prefix, long-context, tool-agent, "
                   "conversation) or 'all'.")
@click.option("--load", "sweep_loads", default="1,2", show_default=True,
              help="--sweep: comma-separated load factors (× the shape's arrival rates).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the figures here.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bar on long runs.")
def simulate_command(trace_path: Path | None, trace_format: str, start_min: float, minutes: float | None,
                     speed: float, max_output_tokens: int | None, synthetic_requests: int | None, rate: float | None,
                     tenants: int, system_pieces: tuple[int, int], workload_names: tuple[str, ...],
                     conversations: int, duration_s: float | None, write_trace: Path | None, trace_shape: str,
                     batch_files: tuple[Path, ...],
                     engines: int | None, prefill_engines: int, decode_engines: int, layout_specs: tuple[str, ...],
                     kv_transfer_bandwidth: float | None, gpu_blocks: int, cpu_blocks: int, block_size: int,
                     max_num_seqs: int, router_seeds: int,
                     max_num_batched_tokens: int, max_model_len: int | None, scheduling_policy: str,
                     policies: tuple[str, ...], config_path: Path | None, flow_path: Path | None,
                     processor_concurrency: int, tenant_limit: int, kv_event_delay_ms: float, make_room: bool, seed: int,
                     sweep: bool, seeds: int, sweep_shapes: str, sweep_loads: str,
                     json_path: Path | None, progress: bool) -> None:
    """Run the fleet in virtual time with the production router, flow control and processor code."""
    from rich.console import Console

    console = Console(stderr=True)
    if sweep:
        from lab.simulate.sweep import run_sweep

        run_sweep(seeds, sweep_shapes, sweep_loads, policies, config_path, json_path, console)
        return
    if write_trace is not None:
        _write_trace(write_trace, trace_shape, seed, conversations, duration_s, console)
        return
    if not (trace_path or synthetic_requests or workload_names or batch_files):
        raise click.UsageError("give a workload: --trace, --synthetic-requests, --workload or --batch")
    layouts = _layouts(layout_specs, engines, prefill_engines, decode_engines, policies)
    if system_pieces[0] < 1 or system_pieces[1] < system_pieces[0]:
        raise click.BadParameter("MIN must be >= 1 and MAX >= MIN", param_hint="--system-pieces")
    config = SimConfig(engines=layouts[0][0], prefill_engines=layouts[0][1], decode_engines=layouts[0][2],
                       kv_transfer_bandwidth_gb_s=kv_transfer_bandwidth, gpu_blocks=gpu_blocks, cpu_blocks=cpu_blocks,
                       block_size=block_size,
                       max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                       max_model_len=max_model_len, scheduling_policy=scheduling_policy, seed=seed,
                       kv_event_delay_s=kv_event_delay_ms / 1000, processor_concurrency=processor_concurrency,
                       processor_tenant_limit=tenant_limit, make_room=make_room)
    _finish_config(config, flow_path)
    fleet_engines = sum(layouts[0])
    model_len = config.model_len()
    sources: list[Callable[[], Iterator[SimRequest]]] = []
    total = 0
    if trace_path is not None:
        total += _add_trace(sources, trace_path, start_min, minutes, speed, model_len, max_output_tokens, console)
    if synthetic_requests:
        syn_rate = rate or 6.0 * fleet_engines
        n = synthetic_requests
        sources.append(lambda: synthetic_requests_iter(n, seed, syn_rate, tenants, system_pieces))
        total += n
    for name in workload_names:
        gen, count = _generator(name, seed, conversations, duration_s, model_len, fleet_engines)
        total += count
        sources.append(gen)
    for batch_path in batch_files:
        total += _add_batch(sources, batch_path, block_size)
    results = []
    for k in range(router_seeds):
        draw = _run_layouts(replace(config, seed=seed + k), layouts, policies, config_path, sources, total, progress,
                            console)
        for r in draw:
            r["router_seed"] = seed + k
            if router_seeds > 1:
                r["run"] = f"{r['run']} #{seed + k}"
        results += draw
    comparison = pd_comparison(results)
    _print_tables(results, comparison, layouts, gpu_blocks, cpu_blocks, total)
    spread = seed_spread(results) if router_seeds > 1 else {}
    if spread:
        _print_spread(spread, router_seeds)
    if json_path is not None:
        payload = {"engines": fleet_engines, "layouts": [layout_name(*lay) for lay in layouts],
                   "gpu_blocks": gpu_blocks, "cpu_blocks": cpu_blocks, "seed": seed,
                   "requests": total, "runs": results, "pd_comparison": comparison, "router_seed_spread": spread}
        json_path.write_text(json.dumps(payload, indent=2))
        console.print(f"wrote {json_path}")


def _shape_records(shape: str, seed: int, conversations: int, duration_s: float | None) -> list[wl.MooncakeRecord]:
    """The records of a Mooncake-form generator (:data:`TRACE_SHAPES`): ``long-context``
    (``conversations`` started over ``duration_s``, default 24 s) or ``conversation`` (a window of
    ``duration_s``, default 120 s, of :func:`lab.toolkit.workloads.conversation_records`)."""
    if shape == "conversation":
        return wl.conversation_records(seed, duration_s=duration_s or 120.0)
    return wl.long_context_records(seed, conversations=conversations, duration_s=duration_s or 24.0)


def _write_trace(path: Path, shape: str, seed: int, conversations: int, duration_s: float | None,
                 console: Any) -> None:
    """``--write-trace``: the ``shape`` generator's records as a Mooncake trace file."""
    records = _shape_records(shape, seed, conversations, duration_s)
    wl.write_mooncake(records, path)
    lengths = [r.input_length for r in records]
    console.print(f"wrote {path}: {len(records):,} records over {records[-1].timestamp_ms / 1000 if records else 0:.0f} s, "
                  f"mean prompt {sum(lengths) / max(1, len(lengths)):,.0f} tokens (max {max(lengths, default=0):,}), "
                  f"{wl.reusable_share(records):.3f} of prompt tokens reusable within 5 min")


def _layouts(layout_specs: tuple[str, ...], engines: int | None, prefill_engines: int, decode_engines: int,
             policies: tuple[str, ...]) -> list[tuple[int, int, int]]:
    """The fleets to run, ``(both, prefill, decode)`` each: the ``--layout`` specs, else the one of
    ``--engines`` / ``--prefill-engines`` / ``--decode-engines``. Raises ``click.UsageError``."""
    if layout_specs:
        layouts = [parse_layout(spec) for spec in layout_specs]
    else:
        if prefill_engines and not decode_engines:
            raise click.UsageError("--prefill-engines needs --decode-engines (the engines that decode)")
        both = engines if engines is not None else (0 if prefill_engines or decode_engines else 4)
        if both + prefill_engines + decode_engines < 1:
            raise click.UsageError("the fleet needs at least one engine: --engines N (engines doing both), or --prefill-engines P with --decode-engines D")
        layouts = [(both, prefill_engines, decode_engines)]
    if "pd" in policies and not any(p for _, p, _ in layouts):
        raise click.UsageError("--policy pd needs prefill engines (--prefill-engines or a --layout P:D)")
    return layouts


def _finish_config(config: SimConfig, flow_path: Path | None) -> None:
    """The processor's reserve (none at 12 slots or fewer), ``--flow-control``, and a check of the
    engine settings. Raises ``click.BadParameter``."""
    try:
        flow = FlowControlConfig.from_file(flow_path) if flow_path else None
    except (ValueError, OSError, pydantic.ValidationError) as exc:
        raise click.BadParameter(str(exc), param_hint="--flow-control") from exc
    if config.processor_concurrency <= 12:
        config.processor_reserved = {}
    if flow is not None:
        config.flow_control = flow
    try:
        config.engine_settings()
    except pydantic.ValidationError as exc:
        raise click.BadParameter(str(exc.errors()[0].get("msg", exc)), param_hint="--gpu-blocks / --max-model-len") from exc


def _add_trace(sources: list[Callable[[], Iterator[SimRequest]]], trace_path: Path, start_min: float,
               minutes: float | None, speed: float, model_len: int, max_output_tokens: int | None,
               console: Any) -> int:
    """Add the ``--trace`` window to ``sources``; returns its request count. Raises ``click.BadParameter``."""
    try:
        records = wl.read_mooncake(trace_path)
    except (ValueError, OSError, UnicodeDecodeError) as exc:
        raise click.BadParameter(str(exc), param_hint="--trace") from exc
    window = list(mooncake_requests(records, start_min, minutes, speed, model_len, max_output_tokens))
    if not window:
        raise click.BadParameter(f"{trace_path}: no record in the window (--start-min {start_min}, "
                                 f"--minutes {minutes})", param_hint="--trace")
    console.print(f"{trace_path}: {len(records):,} records, {len(window):,} in the window, "
                  f"{wl.reusable_share(records):.3f} of prompt tokens reusable within 5 min")
    sources.append(lambda: mooncake_requests(records, start_min, minutes, speed, model_len, max_output_tokens))
    return len(window)


def _add_batch(sources: list[Callable[[], Iterator[SimRequest]]], batch_path: Path, block_size: int) -> int:
    """Add one ``--batch`` file's backlog to ``sources``; returns its request count. Raises ``click.BadParameter``."""
    try:
        backlog = list(batch_file_requests(batch_path, block_size=block_size))
    except (ValueError, OSError, UnicodeDecodeError) as exc:
        raise click.BadParameter(str(exc), param_hint="--batch") from exc
    sources.append(_replayer(backlog))
    return len(backlog)


def _run_layouts(config: SimConfig, layouts: list[tuple[int, int, int]], policies: tuple[str, ...],
                 config_path: Path | None, sources: list[Callable[[], Iterator[SimRequest]]], total: int,
                 progress: bool, console: Any) -> list[dict[str, Any]]:
    """Every policy (``pd`` on a fleet with prefill engines, plus ``--config``) on every layout, each
    on a fresh fleet and fresh arrivals; the figures of each run, with ``ttft_p50_vs_round_robin``.
    Raises ``click.BadParameter`` for a config the scheduler refuses."""
    names = list(POLICIES) if not policies or "all" in policies else \
        [p for p in dict.fromkeys(policies) if p != PD_POLICY] or ["approximate"]
    results: list[dict[str, Any]] = []
    for both, prefill, decode in layouts:
        fleet = replace(config, engines=both, prefill_engines=prefill, decode_engines=decode)
        runs: list[tuple[str, Path | None]] = [(PD_POLICY, None)] if prefill else [(name, None) for name in names]
        if config_path is not None:
            runs.append((f"config:{config_path.stem}", config_path))
        lname = layout_name(both, prefill, decode)
        for name, path in runs:
            arrivals = merge_arrivals(*(make() for make in sources))
            label = name if len(layouts) == 1 else f"{lname} {name}"
            try:
                sim = Simulation(fleet, name, arrivals, config_path=path)
            except (ConfigError, KeyError, OSError, ValueError) as exc:
                raise click.BadParameter(str(exc), param_hint="--config") from exc
            figures = _run(sim, label, total, progress and total >= 5000, console)
            figures["layout_name"] = lname
            figures["run"] = label
            results.append(figures)
            console.print(f"{label}: {figures['completed']:,} answered in {figures['wall_s']:.1f} s wall "
                          f"({figures['virtual_s']:.1f} s virtual)")
    baseline = next((r for r in results if r["policy"] == "round-robin"), None)
    for r in results:
        if baseline is not None and baseline["ttft_p50_s"] and r["ttft_p50_s"] is not None:
            r["ttft_p50_vs_round_robin"] = r["ttft_p50_s"] / baseline["ttft_p50_s"]
    return results


def _print_tables(results: list[dict[str, Any]], comparison: dict[str, dict[str, Any]],
                  layouts: list[tuple[int, int, int]], gpu_blocks: int, cpu_blocks: int, total: int) -> None:
    """The runs, TTFT by lane and tenant, and (with P/D runs) the disaggregation table on stdout."""
    from rich.console import Console
    from rich.table import Table

    from lab.toolkit.tables import print_table

    out = Console()
    table = Table(title=f"simulate: {' / '.join(layout_name(*lay) + f' ({sum(lay)})' for lay in layouts)} engines x "
                        f"{gpu_blocks} GPU + {cpu_blocks} CPU blocks, {total:,} requests")
    for col in ("policy", "answered", "captured reuse", "TTFT p50 s", "TTFT p99 s", "ITL p99 s", "req/s",
                "vs RR p50", "decision p50 ms", "index MiB", "wall s", "virtual s"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in results:
        table.add_row(r["run"], _fmt(r["completed"]), _fmt(r["captured_reuse"]), _fmt(r["ttft_p50_s"]),
                      _fmt(r["ttft_p99_s"]), _fmt(r["itl_p99_s"]), _fmt(r["throughput_rps"], 1),
                      _fmt(r.get("ttft_p50_vs_round_robin")), _fmt(r["decision_p50_ms"], 4),
                      _fmt(r["index_bytes"] / 2**20, 1), _fmt(r["wall_s"], 1), _fmt(r["virtual_s"], 1))
    print_table(table, out)
    lanes = Table(title="TTFT by lane / tenant (p50 / p99 s)")
    lanes.add_column("lane/tenant")
    for r in results:
        lanes.add_column(r["run"], justify="right")
    keys = sorted({k for r in results for k in r["by_lane_tenant"]})
    for key in keys:
        cells = []
        for r in results:
            g = r["by_lane_tenant"].get(key)
            cells.append("-" if g is None else f"{_fmt(g['ttft_p50_s'])} / {_fmt(g['ttft_p99_s'])} ({g['requests']:,})")
        lanes.add_row(key, *cells)
    print_table(lanes, out)
    if any(r["pd"] for r in results):
        print_table(_pd_table(results, comparison), out)


SPREAD_FIGURES = ("captured_reuse", "ttft_p50_s", "ttft_p99_s")
"""The figures ``--router-seeds`` summarises."""


def seed_spread(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per run name without its ``#seed`` suffix (a policy on a layout): for each of
    :data:`SPREAD_FIGURES`, ``{"mean", "sd", "min", "max", "n"}`` over its runs (``sd`` the sample
    standard deviation, 0.0 for one run; figures that are None are left out, a figure with none
    is absent)."""
    import statistics

    groups: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault(str(r["run"]).rsplit(" #", 1)[0], []).append(r)
    out: dict[str, dict[str, Any]] = {}
    for name, runs in groups.items():
        row: dict[str, Any] = {}
        for key in SPREAD_FIGURES:
            values = [float(r[key]) for r in runs if r.get(key) is not None]
            if values:
                row[key] = {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
                            "min": min(values), "max": max(values), "n": len(values)}
        out[name] = row
    return out


def _print_spread(spread: dict[str, dict[str, Any]], n: int) -> None:
    from rich.console import Console
    from rich.table import Table

    from lab.toolkit.tables import print_table

    table = Table(title=f"mean ± sd over {n} router seeds (min – max)")
    table.add_column("policy")
    for key in SPREAD_FIGURES:
        table.add_column(key, justify="right")
    for name, row in spread.items():
        cells = [f"{_fmt(g['mean'])} ± {_fmt(g['sd'])} ({_fmt(g['min'])} – {_fmt(g['max'])})" if (g := row.get(key))
                 else "-" for key in SPREAD_FIGURES]
        table.add_row(name, *cells)
    print_table(table, Console())


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def pd_comparison(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each P/D run against the aggregated run (the first run without prefill engines under
    ``approximate``, the router's default config, else the first without prefill engines):
    ``itl_p99_agg_over_pd``, ``ttft_p50_pd_over_agg``, ``throughput_pd_over_agg`` (output tokens
    per virtual second), chat and long-prompt TTFT p50 of both; empty without either."""
    aggregated = [r for r in results if not r["pd"]]
    base = next((r for r in aggregated if r["policy"] == "approximate"), aggregated[0] if aggregated else None)
    if base is None:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for r in results:
        if not r["pd"]:
            continue
        row: dict[str, Any] = {
            "against": base["run"],
            "itl_p99_agg_over_pd": _ratio(base["itl_p99_s"], r["itl_p99_s"]),
            "ttft_p50_pd_over_agg": _ratio(r["ttft_p50_s"], base["ttft_p50_s"]),
            "throughput_pd_over_agg": _ratio(r["output_tokens_per_s"], base["output_tokens_per_s"]),
        }
        for workload in sorted(set(r["by_workload"]) | set(base["by_workload"])):
            mine, theirs = r["by_workload"].get(workload, {}), base["by_workload"].get(workload, {})
            row[f"{workload}_ttft_p50_s"] = mine.get("ttft_p50_s")
            row[f"{workload}_ttft_p50_agg_s"] = theirs.get("ttft_p50_s")
            row[f"{workload}_itl_p99_agg_over_pd"] = _ratio(theirs.get("itl_p99_s"), mine.get("itl_p99_s"))
        out[r["run"]] = row
    return out


def _pd_table(results: list[dict[str, Any]], comparison: dict[str, dict[str, Any]]) -> Any:
    from rich.table import Table


    table = Table(title="prefill/decode disaggregation")
    for col in ("run", "disagg share", "fallbacks", "transfers", "GiB moved", "transfer p50 ms",
                "prefill tok/req", "util P / D / both", "ITL p99 agg/PD", "TTFT p50 PD/agg", "tput PD/agg"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for r in results:
        pd = r["pd"]
        if not pd:
            continue
        util = r["utilisation_by_role"]
        ratios = comparison.get(r["run"], {})
        table.add_row(r["run"], _fmt(pd["disaggregated_share"]), _fmt(pd["fallbacks"]), _fmt(pd["kv_transfers"]),
                      _fmt(pd["kv_transfer_bytes"] / 2**30, 1), _fmt((pd["kv_transfer_s_p50"] or 0) * 1000, 2),
                      _fmt(pd["prefill_tokens_per_request"], 2),
                      " / ".join(_fmt(util[k], 2) for k in ("prefill", "decode", "both")),
                      _fmt(ratios.get("itl_p99_agg_over_pd"), 2), _fmt(ratios.get("ttft_p50_pd_over_agg"), 2),
                      _fmt(ratios.get("throughput_pd_over_agg"), 2))
    return table


def synthetic_requests_iter(n: int, seed: int, rate: float, tenants: int,
                            system_pieces: tuple[int, int]) -> Iterator[SimRequest]:
    """The synthetic mix of the CLI's options."""
    return synthetic_requests(n, seed, rate_per_s=rate, tenants=tenants, system_pieces=system_pieces)


def _replayer(backlog: list[SimRequest]) -> Callable[[], Iterator[SimRequest]]:
    """A maker of fresh copies of a batch backlog, one per run."""
    return lambda: iter([replace(r) for r in backlog])


def _run(sim: Simulation, name: str, total: int, show: bool, console: Any) -> dict[str, Any]:
    if not show:
        return sim.run()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn(f"{name}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task(name, total=total)
        return sim.run(lambda n: bar.update(task, completed=n))
