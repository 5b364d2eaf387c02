"""The open-loop interactive client of the isolation and mixed benchmarks, and the sampler of the
router's state and the batch lane's results beside it.

:func:`run_interactive` sends streamed chat completions at given arrival times to the router
(objective ``interactive``) and records send, first-token and end times per request
(:class:`Sample`); :func:`summarize` turns one phase's samples into TTFT percentiles
(:mod:`lab.toolkit.stats`), rates and the client's send lag. :class:`LaneSampler` reads the batch
result stream's length and the router's ``/admin/state`` every :data:`SAMPLE_SECONDS`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from lab.toolkit.prompts import ENDPOINT
from lab.toolkit.stats import percentile

SAMPLE_SECONDS = 0.25
"""How often the router's admin state and the batch result count are read (s)."""
RESULT_STREAM = "bench:isolation:results"
"""The Redis stream the benchmarks' batch requests name as their result queue."""


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


def summarize(samples: list[Sample], duration: float, output_tokens: int | None = None) -> dict[str, Any]:
    """TTFT percentiles (ms), completed/s and client send lag of one phase's samples; with
    ``output_tokens`` (every request's, > 1) also the inter-token latency per request, (last token −
    first token) ÷ (``output_tokens`` − 1), p50 and p99 (ms)."""
    ok = [s for s in samples if s.status == 200 and not math.isnan(s.first_token)]
    ttft = [s.ttft * 1000 for s in ok]
    lag = [(s.sent - s.scheduled) * 1000 for s in samples if not math.isnan(s.sent)]
    itl: dict[str, Any] = {}
    if output_tokens and output_tokens > 1:
        per = [(s.done - s.first_token) * 1000 / (output_tokens - 1) for s in ok if not math.isnan(s.done)]
        itl = {"itl_ms_p50": percentile(per, 50, default=math.nan), "itl_ms_p99": percentile(per, 99, default=math.nan)}
    return {**itl,
        "requests": len(samples), "completed": len(ok), "errors": len(samples) - len(ok),
        "offered_rps": len(samples) / duration, "completed_rps": len(ok) / duration,
        "ttft_ms_p50": percentile(ttft, 50, default=math.nan), "ttft_ms_p90": percentile(ttft, 90, default=math.nan),
        "ttft_ms_p99": percentile(ttft, 99, default=math.nan), "ttft_ms_mean": statistics.fmean(ttft) if ttft else math.nan,
        "ttft_ms_max": max(ttft, default=math.nan),
        "send_lag_ms_p99": percentile(lag, 99, default=math.nan),
        "prompt_tokens_mean": statistics.fmean(s.prompt_tokens for s in ok) if ok else math.nan,
    }


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
