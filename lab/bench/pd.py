"""``backfill bench pd``: prefill/decode disaggregation against aggregated serving, equal engine count.

Real processes: ``--engines`` simulated vLLM engines (``backfill engine-sim``, the step model of
:mod:`engine_twin.step_model`: Llama-3.1-8B bf16 on one H100, vLLM V1's chunked prefill with an
8,192-token step budget) behind our router (``backfill router``). Layouts, each on a fresh fleet
(cold caches) replaying the same trace:

* ``aggregated``: every engine does both (``--engine URL`` each), the router's default scheduling
  config;
* ``P:D`` for every split of the engines (4 engines: ``1:3``, ``2:2``, ``3:1``; 2: ``1:1``; 3:
  ``1:2``, ``2:1``): P engines started as NIXL prefill engines (``kv_producer``) and D as decode
  engines (``kv_consumer``), ``engine_twin.launch.sim_engine_argv`` with their ``pd_role``, each
  with its own side channel (``pd_engine_env``); the router given
  ``--prefill-engine`` / ``--decode-engine`` and so its shipped P/D scheduling config: a request
  whose uncached prompt reaches the config's threshold is prefilled on a prefill engine
  (``max_tokens`` 1, ``kv_transfer_params.do_remote_decode``) and decoded on a decode engine, which
  receives the KV blocks over the modelled link; shorter prompts run whole on a decode engine.

The trace (:func:`pd_trace`, seeded; sizes in :class:`PdOptions`): long-prompt requests
(documents: prompts uniform in 8k–32k tokens, unique text, 32–128 tokens out; Mooncake-format
records through :func:`~lab.toolkit.workloads.mooncake_trace`, Poisson arrivals) beside
interactive chat (:func:`~lab.toolkit.workloads.agentic_sessions` with a short system prompt
and messages and 384 tokens out, sessions started uniformly, later turns closed loop), from three
tenants: ``docs`` sends the documents, ``chat-1`` and ``chat-2`` the chat sessions, each with its
fairness id (``x-llm-d-inference-fairness-id``, sent with the router's trusted token so the router
honours it).

Figures per layout, at the client (every call streamed, ``stream_options.include_usage``), in model
time (wall ÷ ``--time-scale``):

* correctness: every call answered 200 with ``usage.completion_tokens`` = its ``max_tokens`` and as
  many content chunks; from the engines' own ``/metrics`` (``vllm:generation_tokens_total``,
  ``vllm:request_success_total``), generated tokens per request of each prefill engine (goal ≤ 1) and
  the decode engines' generated tokens;
* ITL: the gaps between successive content chunks of each stream, pooled over all calls (as
  vLLM's ``benchmark_serving`` pools them), p50 / p99, and for the chat calls alone;
* TTFT (send → first chunk with a choice) p50 / p99, overall and per class;
* throughput: output tokens ÷ the replay's model seconds (first send to last answer).

Ratios, side by side in one run: ITL p99 aggregated ÷ P/D (goal ≥ 1.5, the point of splitting),
TTFT p50 and throughput P/D ÷ aggregated. The trace is open loop, so throughput is the offered
load unless a layout falls behind (a queue that grows); the best ratio is the P/D layout with the
lowest TTFT p50 among those meeting the ITL goal that keep up (throughput ≥ 0.95 × aggregated's),
else the one with the lowest ITL p99.

``--quick`` (the test's run): 2 engines, aggregated vs 1:1, a 6-second trace with 4k–8k prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import secrets
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import click
import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from common.executable import backfill_executable
from engine_twin.launch import pd_engine_env, sim_engine_argv
from lab.toolkit.launch import HOST, SIM_MAX_NUM_SEQS, ProcessGroup, bench_flow_control, free_port, process_group
from lab.toolkit.pd_mix import PdOptions, pd_trace, tenant_of
from lab.toolkit.replay import closed_loop, stream_chat, wall_span
from lab.toolkit.stats import percentile
from lab.toolkit.workloads import (
    TimedRequest,
)

ITL_GOAL = 1.5
"""ITL p99 aggregated ÷ P/D to reach (the goal table of docs/benchmarks.md)."""
BEST_MIN_THROUGHPUT = 0.95
"""A layout counts for the best ratio only if it serves the open-loop trace about as fast as the
aggregated fleet (its throughput is the offered load unless its queues grow)."""
PREFILL_TOKENS_GOAL = 1.0
"""Most tokens a prefill engine may generate per request (vLLM's NIXL flow sends it ``max_tokens`` 1)."""
TRUSTED_TOKEN_HEADER = "x-backfill-router-token"
"""``router.trust.TOKEN_HEADER`` (a benchmark must not import the router's internals it measures)."""
FAIRNESS_HEADER = "x-llm-d-inference-fairness-id"
"""llm-d's fairness-id header (``router.parsing.FAIRNESS_ID_HEADER``)."""


# ---- the client -------------------------------------------------------------------------------
@dataclass
class Call:
    """One streamed call. Times are wall seconds from its send; ``token_times`` the arrival of each
    content chunk. ``error`` is None when it answered 200 with its whole output."""

    index: int
    workload: str
    tenant: str
    max_tokens: int
    sent_at: float = 0.0
    ttft_s: float | None = None
    end_s: float | None = None
    token_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    def gaps(self) -> list[float]:
        """Seconds between successive content chunks."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


async def _stream(session: aiohttp.ClientSession, url: str, request: TimedRequest, call: Call,
                  headers: dict[str, str]) -> None:
    def on_chunk(chunk: dict[str, Any], now: float) -> str | None:
        if "error" in chunk:
            return f"stream error: {str(chunk['error'])[:200]}"
        for choice in chunk.get("choices") or []:
            if call.ttft_s is None:
                call.ttft_s = now
            if (choice.get("delta") or {}).get("content"):
                call.token_times.append(now)
            call.finish_reason = choice.get("finish_reason") or call.finish_reason
        usage = chunk.get("usage")
        if usage:
            call.completion_tokens = usage.get("completion_tokens") or 0
            call.prompt_tokens = usage.get("prompt_tokens") or 0
        return None

    streamed = await stream_chat(session, url, request.body, headers, on_chunk)
    call.sent_at, call.end_s, call.error = streamed.sent_at, streamed.end_s, streamed.error
    if call.error is None and (call.completion_tokens != call.max_tokens or len(call.token_times) != call.max_tokens):
        call.error = (f"incomplete: {call.completion_tokens} tokens in usage, {len(call.token_times)} "
                      f"content chunks, {call.max_tokens} asked")


async def run_trace(trace: Sequence[TimedRequest], base_url: str, tenants: int, token: str,
                    time_scale: float = 1.0, timeout_s: float = 600.0) -> tuple[list[Call], float]:
    """Replay ``trace`` against ``base_url`` as :func:`lab.toolkit.replay.replay_async` does
    (:func:`~lab.toolkit.replay.closed_loop`: a session's first call at its ``arrival_s`` ×
    ``time_scale``, later turns ``pause_s`` after the previous answer), every call from its tenant
    (:func:`tenant_of`) with the trusted ``token``. Returns the calls (trace order) and the wall
    seconds from the first send to the last answer. A failed call is recorded with its ``error``;
    never raises for one."""
    url = f"{base_url.rstrip('/')}/v1/chat/completions"
    calls = [Call(i, r.workload, tenant_of(r, tenants), r.max_tokens) for i, r in enumerate(trace)]
    connector = aiohttp.TCPConnector(limit=2048)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:

        async def send(i: int) -> None:
            headers = {"content-type": "application/json", TRUSTED_TOKEN_HEADER: token,
                       FAIRNESS_HEADER: calls[i].tenant}
            await _stream(session, url, trace[i], calls[i], headers)

        await closed_loop(trace, time_scale, send)
    return calls, wall_span((c.sent_at, c.end_s) for c in calls)


# ---- the fleet --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """How the fleet's engines are split: ``prefill`` + ``decode`` engines in their roles, or
    ``both`` engines that do everything (aggregated)."""

    prefill: int = 0
    decode: int = 0
    both: int = 0

    @property
    def name(self) -> str:
        return "aggregated" if not self.prefill else f"{self.prefill}:{self.decode}"

    @property
    def engines(self) -> int:
        return self.prefill + self.decode + self.both


def layouts(engines: int) -> list[Layout]:
    """Aggregated (``engines`` × both), then every ``P:D`` split of ``engines`` (P from 1 to
    ``engines`` − 1). Raises ``ValueError`` below 2 engines (no split)."""
    if engines < 2:
        raise ValueError("prefill/decode needs at least 2 engines")
    return [Layout(both=engines)] + [Layout(prefill=p, decode=engines - p) for p in range(1, engines)]


@dataclass
class Fleet:
    """A started fleet: engine base URLs by role (``prefill``, ``decode``, ``both``), the router."""

    engines: dict[str, list[str]]
    router: str
    token: str
    group: ProcessGroup


def engine_argv(port: int, role: str, opts: PdOptions, index: int) -> list[str]:
    """``backfill engine-sim`` of one engine of the fleet in ``role`` (``prefill``, ``decode``: vLLM's
    NixlConnector as ``kv_producer`` / ``kv_consumer``, the twin's default 50 GB/s link; ``both``:
    a plain engine, no KV transfer). Start a P/D engine with :func:`engine_twin.launch.pd_engine_env`."""
    return sim_engine_argv(port, ["sim-model"], None, host=HOST, block_size=opts.block_size,
                           num_gpu_blocks=opts.num_gpu_blocks, max_model_len=opts.max_model_len,
                           time_scale=opts.time_scale, pd_role=None if role == "both" else role,
                           extra=("--engine-index", f"{role}-{index}"))


def router_argv(port: int, engines: dict[str, list[str]]) -> list[str]:
    """``backfill router`` in front of ``engines`` (by role): ``--engine`` for ``both``,
    ``--prefill-engine`` / ``--decode-engine`` for the pools (the router then runs its shipped P/D
    config); the estimate tokenizer, the benchmarks' flow control without per-tenant caps
    (:func:`~lab.toolkit.launch.bench_flow_control`) and the simulators' 256 slots (as
    ``backfill up`` tells it). Its trusted token comes from the environment
    (``BACKFILL_ROUTER_TRUSTED_TOKEN``, :func:`pd_fleet`)."""
    argv = [*backfill_executable(), "router", "--host", HOST, "--port", str(port)]
    for flag, role in (("--engine", "both"), ("--prefill-engine", "prefill"), ("--decode-engine", "decode")):
        for url in engines.get(role, []):
            argv += [flag, url]
    return argv + ["--tokenizer", "estimate", "--flow-control", str(bench_flow_control()),
                   "--max-num-seqs", str(SIM_MAX_NUM_SEQS)]


@contextlib.contextmanager
def pd_fleet(layout: Layout, opts: PdOptions, log_dir: Path | None = None) -> Iterator[Fleet]:
    """Start ``layout``'s engines and our router in front; yield once every ``/health`` answers.
    Everything is stopped on exit. Raises :class:`~lab.toolkit.launch.LaunchError` when a
    process does not start."""
    with process_group(log_dir) as group:
        engines: dict[str, list[str]] = {}
        started = []
        index = 0
        for role, count in (("prefill", layout.prefill), ("decode", layout.decode), ("both", layout.both)):
            for _ in range(count):
                port = free_port()
                env = pd_engine_env(free_port(), HOST) if role != "both" else None  # its NIXL side channel
                proc = group.start(f"{layout.name.replace(':', 'x')}-{role}-{index}", engine_argv(port, role, opts, index),
                                   env=env)
                url = f"http://{HOST}:{port}"
                engines.setdefault(role, []).append(url)
                started.append((proc, url))
                index += 1
        for proc, url in started:
            group.wait_ready(proc, url)
        token = secrets.token_urlsafe(16)
        port = free_port()
        router = group.start(f"{layout.name.replace(':', 'x')}-router", router_argv(port, engines),
                             env=dict(os.environ, BACKFILL_ROUTER_TRUSTED_TOKEN=token))
        url = f"http://{HOST}:{port}"
        group.wait_ready(router, url)
        yield Fleet(engines, url, token, group)


def engine_counters(url: str) -> dict[str, float]:
    """An engine's ``vllm:generation_tokens_total``, ``vllm:prompt_tokens_total`` and
    ``vllm:request_success_total`` (summed over labels), from its ``/metrics``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    wanted = {"vllm:generation_tokens": "generation_tokens", "vllm:prompt_tokens": "prompt_tokens",
              "vllm:request_success": "requests"}
    out = dict.fromkeys(wanted.values(), 0.0)
    for family in text_string_to_metric_families(text):
        key = wanted.get(family.name)
        if key is None:
            continue
        out[key] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return out


# ---- figures ----------------------------------------------------------------------------------
def _ms(value: float | None, scale: float) -> float | None:
    return None if value is None else round(value / scale * 1000, 3)


def call_figures(calls: Sequence[Call], wall_s: float, time_scale: float) -> dict[str, Any]:
    """Client-side figures of one layout (module docstring), times in model milliseconds."""
    ok = [c for c in calls if c.error is None]
    out: dict[str, Any] = {"requests": len(calls), "errors": len(calls) - len(ok),
                           "first_error": next((c.error for c in calls if c.error), None),
                           "output_tokens": sum(c.completion_tokens for c in ok)}
    for label, picked in (("all", ok), ("chat", [c for c in ok if c.workload == "chat"]),
                          ("long", [c for c in ok if c.workload == "long-prompt"])):
        gaps = [g for c in picked for g in c.gaps()]
        ttfts = [c.ttft_s for c in picked if c.ttft_s is not None]
        out[f"itl_p50_ms_{label}"] = _ms(percentile(gaps, 50), time_scale)
        out[f"itl_p99_ms_{label}"] = _ms(percentile(gaps, 99), time_scale)
        out[f"ttft_p50_ms_{label}"] = _ms(percentile(ttfts, 50), time_scale)
        out[f"ttft_p99_ms_{label}"] = _ms(percentile(ttfts, 99), time_scale)
    model_s = wall_s / time_scale if time_scale else wall_s
    out["model_seconds"] = round(model_s, 3)
    out["output_tokens_per_s"] = round(out["output_tokens"] / model_s, 2) if model_s else None
    return out


def engine_figures(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]],
                   roles: dict[str, list[str]]) -> dict[str, Any]:
    """Per role: requests and generated / prompt tokens the engines counted during the replay
    (``after`` − ``before``, by engine URL), and for prefill engines the most tokens generated
    per request by any of them (goal ≤ 1)."""
    out: dict[str, Any] = {}
    for role, urls in roles.items():
        deltas = [{k: after[u][k] - before[u][k] for k in after[u]} for u in urls]
        out[role] = {"engines": len(urls), **{k: int(sum(d[k] for d in deltas)) for k in deltas[0]},
                     "requests_per_engine": [int(d["requests"]) for d in deltas]}
        if role == "prefill":
            per = [d["generation_tokens"] / d["requests"] for d in deltas if d["requests"]]
            out[role]["max_generated_per_request"] = round(max(per), 3) if per else None
    return out


def run_layout(layout: Layout, trace: Sequence[TimedRequest], opts: PdOptions,
               log_dir: Path | None = None) -> dict[str, Any]:
    """Replay ``trace`` on a fresh fleet of ``layout``: the client figures and the engines' counters."""
    with pd_fleet(layout, opts, log_dir) as fleet:
        urls = [u for role in fleet.engines.values() for u in role]
        before = {u: engine_counters(u) for u in urls}
        calls, wall = asyncio.run(run_trace(trace, fleet.router, opts.tenants, fleet.token, opts.time_scale))
        after = {u: engine_counters(u) for u in urls}
    figures = call_figures(calls, wall, opts.time_scale)
    figures["engines"] = engine_figures(before, after, fleet.engines)
    return figures


def _ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 3) if num is not None and den else None


def compare(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Ratios of every P/D layout against ``aggregated`` (ITL p99 aggregated ÷ P/D, TTFT p50 and
    throughput P/D ÷ aggregated), the goals, and the best P/D ratio: of the layouts meeting the
    ITL goal that keep up with the trace (throughput ≥ :data:`BEST_MIN_THROUGHPUT` × aggregated's),
    the lowest TTFT p50; when none does, the lowest ITL p99."""
    agg = results["aggregated"]
    ratios: dict[str, dict[str, Any]] = {}
    for name, fig in results.items():
        if name == "aggregated":
            continue
        prefill = fig["engines"].get("prefill", {})
        ratios[name] = {
            "itl_p99_aggregated_over_pd": _ratio(agg["itl_p99_ms_all"], fig["itl_p99_ms_all"]),
            "itl_p99_chat_aggregated_over_pd": _ratio(agg["itl_p99_ms_chat"], fig["itl_p99_ms_chat"]),
            "ttft_p50_pd_over_aggregated": _ratio(fig["ttft_p50_ms_all"], agg["ttft_p50_ms_all"]),
            "ttft_p50_long_pd_over_aggregated": _ratio(fig["ttft_p50_ms_long"], agg["ttft_p50_ms_long"]),
            "ttft_p50_chat_pd_over_aggregated": _ratio(fig["ttft_p50_ms_chat"], agg["ttft_p50_ms_chat"]),
            "throughput_pd_over_aggregated": _ratio(fig["output_tokens_per_s"], agg["output_tokens_per_s"]),
            "prefill_max_generated_per_request": prefill.get("max_generated_per_request"),
        }
    meeting = [n for n, r in ratios.items() if (r["itl_p99_aggregated_over_pd"] or 0) >= ITL_GOAL
               and (r["throughput_pd_over_aggregated"] or 0) >= BEST_MIN_THROUGHPUT]
    best: str | None
    if meeting:
        best = min(meeting, key=lambda n: results[n]["ttft_p50_ms_all"] or math.inf)
    else:
        best = min(ratios, key=lambda n: results[n]["itl_p99_ms_all"] or math.inf) if ratios else None
    correct = all(r["errors"] == 0 for r in results.values()) and all(
        (r["prefill_max_generated_per_request"] or 0) <= PREFILL_TOKENS_GOAL for r in ratios.values())
    return {"ratios": ratios, "best_ratio": best, "goals": {
        "correctness": {"met": correct, "goal": "every call 200 with its full output; prefill engines "
                                                f"generate <= {PREFILL_TOKENS_GOAL:g} token per request"},
        "itl_p99_aggregated_over_pd": {
            "value": ratios[best]["itl_p99_aggregated_over_pd"] if best else None, "at": best, "goal": ITL_GOAL,
            "met": bool(best and (ratios[best]["itl_p99_aggregated_over_pd"] or 0) >= ITL_GOAL)}}}


def trace_figures(trace: Sequence[TimedRequest]) -> dict[str, Any]:
    """Counts and token totals of the trace, by workload."""
    out: dict[str, Any] = {}
    for workload in ("long-prompt", "chat"):
        picked = [r for r in trace if r.workload == workload]
        prompts = [len(orjson.dumps(r.body["messages"])) // 4 for r in picked]
        out[workload] = {"requests": len(picked), "max_tokens": sum(r.max_tokens for r in picked),
                         "approx_prompt_tokens_max": max(prompts, default=0)}
    return out


def _table(results: dict[str, dict[str, Any]], summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from lab.toolkit.tables import print_table

    table = Table(title="bench pd: aggregated vs prefill:decode (model time)")
    for column in ("layout", "errors", "ITL p50 ms", "ITL p99 ms", "chat ITL p99", "TTFT p50 ms",
                   "long TTFT p50", "tok/s", "agg/PD ITL p99", "PD/agg TTFT p50", "PD/agg tok/s",
                   "prefill tok/req"):
        table.add_column(column)
    for name, fig in results.items():
        r = summary["ratios"].get(name, {})
        table.add_row(name, str(fig["errors"]), str(fig["itl_p50_ms_all"]), str(fig["itl_p99_ms_all"]),
                      str(fig["itl_p99_ms_chat"]), str(fig["ttft_p50_ms_all"]), str(fig["ttft_p50_ms_long"]),
                      str(fig["output_tokens_per_s"]), str(r.get("itl_p99_aggregated_over_pd", "-")),
                      str(r.get("ttft_p50_pd_over_aggregated", "-")), str(r.get("throughput_pd_over_aggregated", "-")),
                      str(r.get("prefill_max_generated_per_request", "-")))
    print_table(table, Console(stderr=True))


@click.command("pd")
@click.option("--engines", type=click.IntRange(min=2), default=None,
              help="engines of every layout (aggregated and each P:D split)  [default: 4; --quick: 2]")
@click.option("--quick", is_flag=True, help="2 engines, a 6-second trace with 4k-8k prompts (a smoke run)")
@click.option("--duration", type=click.FloatRange(min=1.0), default=None,
              help="trace length, model seconds  [default: 60; --quick: 6]")
@click.option("--time-scale", type=click.FloatRange(min=0.05), default=1.0, show_default=True,
              help="wall seconds per model second of the engines (figures are in model time)")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="also write the JSON here")
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="keep the engines' and routers' logs here (default: a temporary directory)")
def pd_command(engines: int | None, quick: bool, duration: float | None, time_scale: float, seed: int,
               json_path: Path | None, log_dir: Path | None) -> None:
    """Prefill/decode disaggregation vs aggregated, equal engine count: ITL, TTFT, throughput."""
    opts = PdOptions.quick(seed, time_scale) if quick else PdOptions(seed=seed, time_scale=time_scale)
    changes: dict[str, Any] = {}
    if engines is not None:
        changes["engines"] = engines
    if duration is not None:
        changes["duration_s"] = duration
    if changes:
        from dataclasses import replace

        opts = replace(opts, **changes)
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None  # before our own processes
    trace = pd_trace(opts)
    click.echo(f"trace: {len(trace)} calls; layouts of {opts.engines} engines", err=True)
    results: dict[str, dict[str, Any]] = {}
    for layout in layouts(opts.engines):
        click.echo(f"layout {layout.name} ...", err=True)
        results[layout.name] = run_layout(layout, trace, opts, log_dir)
    summary = compare(results)
    _table(results, summary)
    payload = {"benchmark": "pd", "python": sys.version.split()[0], "cpus": os.cpu_count(),
               "load_average_before": load, "quick": quick,
               "options": asdict(opts), "trace": trace_figures(trace), "layouts": results, **summary}
    click.echo(json.dumps(payload, indent=2))
    if json_path:
        json_path.write_text(json.dumps(payload, indent=2) + "\n")
