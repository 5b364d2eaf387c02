"""``backfill bench slots``: a batch's throughput through the stack on engines with few sequence
slots, against the fleet's, before and after a router restart mid-batch (issue 24, "slots from
the engine").

The operator's reproduction of issue 24: two engines started with ``--max-num-seqs 8`` behind
``backfill up --engine-url A --engine-url B``; the router learned 4 slots per engine from what it
saw in flight, held batch work at that and ran the batch at 57 % of the fleet, also after a
router restart mid-batch. Goal: batch ≥ 0.9 × the fleet's, after the restart too.

Per variant (``--variant``, several side by side in one run; each on its own fresh engines and
stack):

* ``stated``: simulated engines exporting ``backfill:engine_config_info`` as vLLM with backfill's
  plugin does (the router takes ``max_num_seqs`` from it);
* ``plain``: simulated engines with ``--no-plugin-metrics`` (``/metrics`` as vLLM alone: the
  router learns the slots from traffic, ``router/pool/slots.py``);
* ``configured``: plain engines, the router told ``BACKFILL_ROUTER_MAX_NUM_SEQS`` (the operator's
  word; the reference for what the router's own slot reserve leaves to batch);
* ``unreserved`` (not in the default set): ``stated`` with the router's slot reserve for
  interactive work off (``BACKFILL_ROUTER_SLOT_RESERVE_FRACTION=0``,
  ``BACKFILL_ROUTER_MIN_SLOT_RESERVE=0``): what the reserve's slot (1 of 8 per engine) costs batch.

With ``--engine-url`` (given twice, e.g. real vLLM engines) the bench runs on those instead, as
variant ``given``, whatever the engines state.

Steps of one variant:

1. the fleet's throughput C: the batch's request shape (the cookbook movie lines, ``--max-tokens``
   output tokens each) straight to the engines, ``--max-num-seqs`` in flight on each (every
   slot), for ``--capacity-seconds``: requests/s, by Little's law from the mean latency of the
   requests started after :data:`WARMUP_S` (:func:`capacity`);
2. ``backfill up --engine-url A --engine-url B``; a ``--lines`` batch created through the gateway
   with the ``openai`` client;
3. once the batch is in progress and ``--settle`` seconds passed, ``--window`` seconds of it:
   batch requests/s finished by the engines (``vllm:request_success_total`` with
   ``finished_reason`` stop or length: aborted ones are not work done);
4. the router restarted (SIGTERM; ``backfill up`` starts it again on its port, as a Deployment
   would), its ``/health`` back, ``--settle`` seconds, then the same window again;
5. the batch cancelled, the stack and engines stopped.

Printed and in ``--json``: C (before and after the batch, pooled), both windows' rates and their
ratio to C, the mean requests running per engine in each window ÷ ``--max-num-seqs`` (the share
of the slots the batch held: on CPU engines the stack's own work slows the engines, which the
rate ratio counts and this does not), and the router's view of each engine after each window
(``max_num_seqs`` and its source, ``slot_reserve``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import click
import orjson

WARMUP_S = 5.0
"""Completions of the capacity run's first seconds are not counted (every slot fills first)."""
GOAL = 0.9
"""Batch through the stack ÷ the fleet's throughput, after the restart (issue 24)."""
VARIANTS = ("stated", "plain", "configured", "unreserved")
DEFAULT_VARIANTS = VARIANTS[:3]
VARIANT_ENV = {
    "configured": lambda opts: {"BACKFILL_ROUTER_MAX_NUM_SEQS": str(opts["max_num_seqs"])},
    "unreserved": lambda opts: {"BACKFILL_ROUTER_SLOT_RESERVE_FRACTION": "0", "BACKFILL_ROUTER_MIN_SLOT_RESERVE": "0"},
}
"""Router settings of a variant, set in the environment ``backfill up``'s children inherit."""
DONE_REASONS = ('finished_reason="stop"', 'finished_reason="length"')


async def finished(session: Any, engine_urls: list[str]) -> float:
    """Requests the engines finished with a stop or length reason so far (their
    ``vllm:request_success_total`` series summed)."""
    total = 0.0
    for url in engine_urls:
        async with session.get(f"{url}/metrics") as resp:
            text = await resp.text()
        total += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("vllm:request_success_total{") and any(r in line for r in DONE_REASONS))
    return total


async def busy(session: Any, engine_urls: list[str]) -> int:
    """Requests running or waiting on the engines (``vllm:num_requests_running`` / ``_waiting``)."""
    total = 0
    for url in engine_urls:
        async with session.get(f"{url}/metrics") as resp:
            text = await resp.text()
        total += sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
                     if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")))
    return total


async def wait_idle(session: Any, engine_urls: list[str], timeout: float = 180.0) -> None:
    """Until the engines run and hold nothing; raises ``click.ClickException`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while await busy(session, engine_urls):
        if time.monotonic() > deadline:
            raise click.ClickException(f"the engines did not drain within {timeout:.0f} s")
        await asyncio.sleep(0.25)


async def capacity(session: Any, engine_urls: list[str], bodies: list[bytes], per_engine: int,
                   seconds: float) -> float:
    """The fleet's throughput, requests/s: a closed loop straight to the engines, ``per_engine``
    requests in flight on each for ``seconds``, and by Little's law (J. D. C. Little, Operations
    Research 9(3), 1961) ``per_engine × engines ÷`` the mean latency of the requests started after
    :data:`WARMUP_S` (a count of completions in a window would jump with the loop's waves: every
    slot starts at once). Raises ``click.ClickException`` on a non-200 answer or when no request
    started after the warm-up."""
    start = time.perf_counter()
    end = start + seconds
    latencies: list[float] = []
    bad: list[int] = []
    counter = iter(range(1 << 62))

    async def worker(url: str) -> None:
        while (sent := time.perf_counter()) < end:
            body = bodies[next(counter) % len(bodies)]
            async with session.post(url + "/v1/chat/completions", data=body,
                                    headers={"content-type": "application/json"}) as resp:
                await resp.read()
                if resp.status != 200:
                    bad.append(resp.status)
            if sent >= start + WARMUP_S:
                latencies.append(time.perf_counter() - sent)

    await asyncio.gather(*(worker(url) for url in engine_urls for _ in range(per_engine)))
    if bad:
        raise click.ClickException(f"engines answered {len(bad)} capacity requests with {sorted(set(bad))}")
    if not latencies:
        raise click.ClickException(f"no request started after the {WARMUP_S:g}-s warm-up: raise --capacity-seconds")
    return per_engine * len(engine_urls) / (sum(latencies) / len(latencies))


async def router_view(session: Any, router_url: str) -> list[dict[str, Any]]:
    """Each engine as the router sees it: slots, their source, the slot reserve."""
    async with session.get(f"{router_url}/admin/state") as resp:
        state = orjson.loads(await resp.read())
    return [{k: e.get(k) for k in ("name", "max_num_seqs", "slots_source", "slot_reserve", "num_requests_running",
                                   "num_requests_waiting")} for e in state["endpoints"]]


async def running(session: Any, engine_urls: list[str]) -> list[int]:
    """``vllm:num_requests_running`` of each engine."""
    out = []
    for url in engine_urls:
        async with session.get(f"{url}/metrics") as resp:
            text = await resp.text()
        out.append(sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
                       if line.startswith("vllm:num_requests_running{")))
    return out


async def window(session: Any, engine_urls: list[str], seconds: float) -> tuple[float, float]:
    """Over the next ``seconds``: requests/s the engines finished, and the mean requests running
    per engine (sampled every 0.25 s)."""
    before, t0 = await finished(session, engine_urls), time.perf_counter()
    samples: list[float] = []
    while time.perf_counter() - t0 < seconds:
        counts = await running(session, engine_urls)
        samples.append(sum(counts) / len(counts))
        await asyncio.sleep(0.25)
    rate = (await finished(session, engine_urls) - before) / (time.perf_counter() - t0)
    return rate, sum(samples) / len(samples)


async def wait_health(session: Any, url: str, timeout: float = 120.0) -> None:
    """Poll ``GET {url}/health`` every 0.1 s until it answers 200 (connection errors while the
    router restarts are waited out); raises ``click.ClickException`` after ``timeout`` seconds."""
    import aiohttp

    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(TimeoutError, OSError, aiohttp.ClientConnectionError):
            async with session.get(f"{url}/health") as resp:
                if resp.status == 200:
                    return
        if time.monotonic() > deadline:
            raise click.ClickException(f"{url} did not come back within {timeout:.0f} s")
        await asyncio.sleep(0.1)


def batch_lines(opts: dict[str, Any], seed: str) -> list[dict[str, Any]]:
    """``opts["lines"]`` cookbook-shaped lines for model ``opts["model"]`` with ``max_tokens``, without
    the file's ``response_format`` (a JSON grammar on a random-weight model's output only slows a
    real engine down; the twin ignores it)."""
    from lab.bench.mixed import shared_prefix_batch

    lines = shared_prefix_batch(opts["source"], opts["lines"], seed, use_file_lines=False)
    for line in lines:
        line["body"]["model"] = opts["model"]
        line["body"]["max_tokens"] = opts["max_tokens"]
        line["body"].pop("response_format", None)
        if opts["ignore_eos"]:
            line["body"]["ignore_eos"] = True  # vLLM's extension: every request decodes max_tokens
    return lines


async def run_variant(opts: dict[str, Any], engine_urls: list[str], stack: Any, console: Any) -> dict[str, Any]:
    """Steps 1 and 3–5 of the module docstring on a running stack in front of ``engine_urls``
    (C is measured on the same engines with the stack up and idle, before the batch and again
    after it, and pooled: a drift of the machine's load shows as their difference)."""
    import aiohttp

    from lab.bench.mixed import TERMINAL, Gateway

    out: dict[str, Any] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        shape = [orjson.dumps(line["body"]) for line in batch_lines(opts, "capacity")]
        out["fleet_rps"] = await capacity(session, engine_urls, shape, opts["max_num_seqs"], opts["capacity_seconds"])
        console.print(f"  fleet before the batch: {out['fleet_rps']:.2f} requests/s ({opts['max_num_seqs']} in "
                      "flight per engine)")
        await wait_idle(session, engine_urls)
        gateway = Gateway(stack.gateway_url, {"default": stack.api_key}, SimpleNamespace(rows=[]))  # type: ignore[arg-type]
        try:
            batch = await gateway.submit("default", batch_lines(opts, "batch"))
            while batch.status == "validating" and time.perf_counter() - batch.created < 120:
                await gateway.poll()
                await asyncio.sleep(0.2)
            await asyncio.sleep(opts["settle"])
            out["before_rps"], out["before_running"] = await window(session, engine_urls, opts["window"])
            out["before_router"] = await router_view(session, stack.router_url)
            console.print(f"  batch before the restart: {out['before_rps']:.2f} requests/s "
                          f"({out['before_rps'] / out['fleet_rps']:.2f} × fleet), {out['before_running']:.1f} running per engine; router: "
                          + ", ".join(f"{e['max_num_seqs']} ({e['slots_source']})" for e in out["before_router"]))
            router = stack.children["router"]
            t0 = time.perf_counter()
            router.terminate()
            await asyncio.to_thread(router.wait, 60)
            await wait_health(session, stack.router_url)
            out["restart_s"] = time.perf_counter() - t0
            await asyncio.sleep(opts["settle"])
            out["after_rps"], out["after_running"] = await window(session, engine_urls, opts["window"])
            out["after_router"] = await router_view(session, stack.router_url)
            await gateway.poll()
            console.print(f"  batch after the restart ({out['restart_s']:.1f} s down): {out['after_rps']:.2f} "
                          f"requests/s ({out['after_rps'] / out['fleet_rps']:.2f} × fleet), {out['after_running']:.1f} running per engine; "
                          "router: "
                          + ", ".join(f"{e['max_num_seqs']} ({e['slots_source']})" for e in out["after_router"]))
            out["batch_status"] = batch.status
            out["batch_done"] = batch.done
            if batch.status in TERMINAL:
                console.print(f"  [yellow]the batch ended ({batch.status}) before the window did: raise --lines")
        finally:
            await gateway.cancel_unfinished()
            await gateway.close()
        await wait_idle(session, engine_urls)
        out["fleet_before_rps"] = out["fleet_rps"]
        out["fleet_after_rps"] = await capacity(session, engine_urls, shape, opts["max_num_seqs"],
                                                opts["capacity_seconds"])
        out["fleet_rps"] = (out["fleet_before_rps"] + out["fleet_after_rps"]) / 2
        console.print(f"  fleet after the batch: {out['fleet_after_rps']:.2f} requests/s; pooled "
                      f"{out['fleet_rps']:.2f}")
    out["before_ratio"] = out["before_rps"] / out["fleet_rps"]
    out["after_ratio"] = out["after_rps"] / out["fleet_rps"]
    out["before_occupancy"] = out["before_running"] / opts["max_num_seqs"]
    out["after_occupancy"] = out["after_running"] / opts["max_num_seqs"]
    return out


def _engines(group: Any, opts: dict[str, Any], variant: str) -> list[str]:
    from common.executable import backfill_executable
    from engine_twin.step_model import overhead_ms_for_idle_step
    from lab.toolkit.launch import HOST, free_port

    urls = []
    for i in range(2):
        port = free_port()
        argv = [*backfill_executable(), "engine-sim", "--host", HOST, "--port", str(port),
                "--max-num-seqs", str(opts["max_num_seqs"]), "--step-overhead-ms",
                str(overhead_ms_for_idle_step(opts["itl_ms"])), "--time-scale", str(opts["time_scale"]),
                "--served-model-name", opts["model"], "--engine-index", str(i)]
        if variant in ("plain", "configured"):
            argv.append("--no-plugin-metrics")
        proc = group.start(f"{variant}-engine-{i}", argv)
        urls.append(f"http://{HOST}:{port}")
        group.wait_ready(proc, urls[-1])
    return urls


def _print(figures: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(title="batch through the stack ÷ the fleet's throughput (goal after the restart ≥ 0.9)")
    for col in ("variant", "fleet req/s", "batch before", "× fleet", "slots held", "batch after restart",
                "× fleet", "slots held", "router's slots after"):
        table.add_column(col)
    for name, v in figures["variants"].items():
        table.add_row(name, f"{v['fleet_rps']:.2f}", f"{v['before_rps']:.2f}", f"{v['before_ratio']:.2f}",
                      f"{v['before_occupancy']:.2f}", f"{v['after_rps']:.2f}", f"{v['after_ratio']:.2f}",
                      f"{v['after_occupancy']:.2f}",
                      ", ".join(f"{e['max_num_seqs']} ({(e['slots_source'] or '-')[:5]})" for e in v["after_router"]))
    console.print(table)


@click.command("slots")
@click.option("--variant", "variants", multiple=True, type=click.Choice(VARIANTS),
              help="simulated fleets to run, side by side (default: stated, plain, configured); ignored with "
                   "--engine-url")
@click.option("--engine-url", "engine_urls", multiple=True,
              help="run on these engines instead (give two; e.g. real vLLM started with --max-num-seqs 8)")
@click.option("--model", default="sim-model", show_default=True, help="model name the engines serve")
@click.option("--max-num-seqs", default=8, show_default=True, type=click.IntRange(1), help="engines' slots")
@click.option("--max-tokens", default=128, show_default=True, type=click.IntRange(1), help="output tokens a line")
@click.option("--itl-ms", default=40.0, show_default=True, type=click.FloatRange(0.0),
              help="simulated engines' idle decode step (their --step-overhead-ms is derived from it)")
@click.option("--time-scale", default=1.0, show_default=True, type=click.FloatRange(0.05),
              help="simulated engines' --time-scale")
@click.option("--lines", default=600, show_default=True, type=click.IntRange(10), help="batch lines")
@click.option("--capacity-seconds", default=30.0, show_default=True, type=click.FloatRange(WARMUP_S + 1))
@click.option("--window", default=30.0, show_default=True, type=click.FloatRange(1.0), help="seconds measured")
@click.option("--settle", default=10.0, show_default=True, type=click.FloatRange(0.0),
              help="seconds after the batch starts and after the restart before a window")
@click.option("--ignore-eos/--no-ignore-eos", default=None,
              help="send vLLM's ignore_eos (default: with --engine-url, so a random-weight model decodes every token)")
@click.option("--source", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="batch file whose shape the lines take (default: the cookbook movies file)")
@click.option("--quick", is_flag=True, help="a smoke run (about a minute a variant): 32 output tokens, 150 lines, "
              "short windows; what the tests run")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="also write the figures here")
@click.option("--data-dir", type=click.Path(path_type=Path), help="stack data and logs (default: temporary)")
def slots_command(variants: tuple[str, ...], engine_urls: tuple[str, ...], quick: bool, json_path: Path | None,
                  data_dir: Path | None, **opts: Any) -> None:
    """Batch throughput on --max-num-seqs 8 engines vs the fleet's, before and after a router restart."""
    from rich.console import Console

    from lab.bench.mixed import DEFAULT_SOURCE
    from lab.toolkit.launch import HOST, free_port, process_group
    from lab.toolkit.stack import backfill_up

    if quick:
        opts.update(max_tokens=32, lines=150, capacity_seconds=WARMUP_S + 4, window=4.0, settle=2.0)
    console = Console()
    opts["source"] = opts["source"] or DEFAULT_SOURCE
    if opts["ignore_eos"] is None:
        opts["ignore_eos"] = bool(engine_urls)
    if engine_urls and len(engine_urls) != 2:
        raise click.UsageError("give --engine-url twice (the reproduction's two engines)")
    runs = ["given"] if engine_urls else list(variants or DEFAULT_VARIANTS)
    figures: dict[str, Any] = {"options": {k: (str(v) if isinstance(v, Path) else v) for k, v in opts.items()},
                               "variants": {}}
    import uvloop

    with tempfile.TemporaryDirectory(prefix="backfill-slots-") as tmp:
        root = (data_dir or Path(tmp)).resolve()
        for variant in runs:
            console.print(f"[bold]{variant}[/bold]")
            (root / variant).mkdir(parents=True, exist_ok=True)
            env = VARIANT_ENV[variant](opts) if variant in VARIANT_ENV else {}
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)  # up's children inherit it
            try:
                with process_group(root / variant) as group:
                    urls = list(engine_urls) if engine_urls else _engines(group, opts, variant)
                    with backfill_up(root / variant / "stack", HOST, free_port(), engine_urls=urls) as stack:
                        figures["variants"][variant] = uvloop.run(run_variant(opts, urls, stack, console))
            finally:
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
    figures["goal_after_ratio"] = GOAL
    _print(figures, console)
    if json_path:
        json_path.write_text(json.dumps(figures, indent=2, default=str) + "\n")
    missed = [v for v, f in figures["variants"].items() if not math.isnan(f["after_ratio"]) and f["after_ratio"] < GOAL]
    if missed:
        console.print(f"[yellow]below {GOAL} × the fleet after the restart: {', '.join(missed)}")
