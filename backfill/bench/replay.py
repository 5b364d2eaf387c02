"""Replay a trace against a router (or an engine) with streaming; TTFT, cached tokens, captured reuse.

Sessions run closed loop: a session's first call is sent at its ``arrival_s``, each later call
``pause_s`` after the previous answer ended. One-turn sessions are therefore open loop (sent at
their arrival whatever the fleet's state). Times of the trace are model seconds, multiplied by
``time_scale`` (the engines' ``--time-scale``) to get wall seconds.

Every call is ``POST {base_url}/v1/chat/completions`` with ``stream: true`` and
``stream_options.include_usage``; the last chunk's ``usage.prompt_tokens_details.cached_tokens``
(reported by engines started with ``--enable-prompt-tokens-details``) is the prompt tokens served
from cache. TTFT is the time from sending to the first chunk carrying a choice.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
import orjson

from backfill.bench.workloads import TimedRequest


@dataclass
class RequestResult:
    """One replayed call. Times in wall seconds; ``ttft_s``/``latency_s`` are None when it failed.
    ``error`` is None on success, else the HTTP status or exception text."""

    index: int
    session_id: str
    workload: str
    sent_at: float
    ttft_s: float | None = None
    latency_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@dataclass
class ReplayResult:
    """Every call of a replay (trace order) and the replay's wall time (first send to last end)."""

    results: list[RequestResult] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def errors(self) -> int:
        return sum(1 for r in self.results if r.error is not None)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile ``q`` in [0, 1] of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summarize(replay: ReplayResult, reusable_tokens: Sequence[int], indexes: Sequence[int] | None = None
              ) -> dict[str, float | int | None]:
    """Figures of a replay, over all calls or the calls at ``indexes`` (trace positions).

    ``reusable_tokens``: the oracle-reusable tokens per trace position
    (:func:`~backfill.bench.workloads.oracle_reusable_tokens`). Returns ``captured_reuse`` (Σ cached
    prompt tokens ÷ Σ oracle-reusable tokens, over successful calls; None when the oracle is 0),
    ``ttft_p50_s``, ``ttft_p99_s`` (None without a successful call), ``output_tokens_per_s`` (Σ
    completion tokens ÷ the replay's wall seconds), ``cached_tokens``, ``reusable_tokens``,
    ``prompt_tokens``, ``requests``, ``errors``, and ``cached_above_oracle_tokens`` (Σ of cached −
    oracle where a call got more than the oracle: possible only when calls ran in another order
    than the trace's, e.g. a closed-loop turn that started late; it inflates captured reuse).
    """
    picked = [replay.results[i] for i in indexes] if indexes is not None else replay.results
    ok = [r for r in picked if r.error is None]
    cached = sum(r.cached_tokens for r in ok)
    reusable = sum(reusable_tokens[r.index] for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    return {
        "captured_reuse": cached / reusable if reusable else None,
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p99_s": percentile(ttfts, 0.99),
        "output_tokens_per_s": sum(r.completion_tokens for r in ok) / replay.wall_s if replay.wall_s else 0.0,
        "cached_tokens": cached,
        "reusable_tokens": reusable,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "requests": len(picked),
        "errors": len(picked) - len(ok),
        "cached_above_oracle_tokens": sum(max(0, r.cached_tokens - reusable_tokens[r.index]) for r in ok),
    }


async def _call(session: aiohttp.ClientSession, url: str, request: TimedRequest, out: RequestResult,
                session_header: str | None = None) -> None:
    body = {**request.body, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"content-type": "application/json"}
    if session_header:
        headers[session_header] = request.session_id
    start = time.perf_counter()
    out.sent_at = start
    try:
        async with session.post(url, data=orjson.dumps(body), headers=headers) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = orjson.loads(data)
                if out.ttft_s is None and chunk.get("choices"):
                    out.ttft_s = time.perf_counter() - start
                usage = chunk.get("usage")
                if usage:
                    out.prompt_tokens = usage.get("prompt_tokens") or 0
                    out.completion_tokens = usage.get("completion_tokens") or 0
                    details = usage.get("prompt_tokens_details") or {}
                    out.cached_tokens = details.get("cached_tokens") or 0
        out.latency_s = time.perf_counter() - start
        if out.ttft_s is None:
            out.error = "stream ended without a choice"
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:200]


async def replay_async(trace: Sequence[TimedRequest], base_url: str, time_scale: float = 1.0,
                       timeout_s: float = 300.0, connections: int = 1024,
                       session_header: str | None = None) -> ReplayResult:
    """Replay ``trace`` against ``base_url`` (``http://host:port``, no path); see the module docstring.

    ``timeout_s``: per call, wall seconds. ``session_header``: send each call's session id in this
    header (e.g. ``x-session-id``); None: no session header. A failed call (non-200, broken stream, timeout) is
    recorded with its ``error`` and its session goes on with the next turn. Never raises for a
    call's failure.
    """
    url = f"{base_url.rstrip('/')}/v1/chat/completions"
    results = [RequestResult(i, r.session_id, r.workload, 0.0) for i, r in enumerate(trace)]
    sessions: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(trace):
        sessions[r.session_id].append(i)
    connector = aiohttp.TCPConnector(limit=connections, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()

        async def run(indexes: list[int]) -> None:
            turns = sorted(indexes, key=lambda i: trace[i].turn)
            first = trace[turns[0]]
            await asyncio.sleep(max(0.0, t0 + first.arrival_s * time_scale - time.perf_counter()))
            for k, i in enumerate(turns):
                if k and trace[i].pause_s > 0:
                    await asyncio.sleep(trace[i].pause_s * time_scale)
                await _call(session, url, trace[i], results[i], session_header)

        await asyncio.gather(*(run(ix) for ix in sessions.values()))
        ends = [r.sent_at + r.latency_s for r in results if r.latency_s is not None]
        starts = [r.sent_at for r in results if r.sent_at]
        wall = (max(ends) - min(starts)) if ends and starts else 0.0
    return ReplayResult(results, wall)


def replay(trace: Sequence[TimedRequest], base_url: str, time_scale: float = 1.0,
           timeout_s: float = 300.0) -> ReplayResult:
    """Synchronous :func:`replay_async` (runs its own event loop)."""
    return asyncio.run(replay_async(trace, base_url, time_scale, timeout_s))
