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
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from lab.toolkit.stats import percentile
from lab.toolkit.workloads import TimedRequest


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


def summarize(replay: ReplayResult, reusable_tokens: Sequence[int], indexes: Sequence[int] | None = None
              ) -> dict[str, float | int | None]:
    """Figures of a replay, over all calls or the calls at ``indexes`` (trace positions).

    ``reusable_tokens``: the oracle-reusable tokens per trace position
    (:func:`~lab.toolkit.workloads.oracle_reusable_tokens`). Returns ``captured_reuse`` (Σ cached
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
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "output_tokens_per_s": sum(r.completion_tokens for r in ok) / replay.wall_s if replay.wall_s else 0.0,
        "cached_tokens": cached,
        "reusable_tokens": reusable,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "requests": len(picked),
        "errors": len(picked) - len(ok),
        "cached_above_oracle_tokens": sum(max(0, r.cached_tokens - reusable_tokens[r.index]) for r in ok),
    }


ChunkHandler = Callable[[dict[str, Any], float], str | None]
"""Called with each parsed ``data:`` chunk of a stream and the wall seconds since the send;
returns None to go on, or an error text that ends the call as failed."""


@dataclass
class Streamed:
    """How one streamed call ended: ``sent_at`` (``perf_counter`` at the send), ``end_s`` (wall
    seconds from the send to the stream's end; None when it failed) and ``error`` (None on success,
    else the HTTP status and body, the exception text, or the chunk handler's error)."""

    sent_at: float
    end_s: float | None = None
    error: str | None = None


async def stream_chat(session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str],
                      on_chunk: ChunkHandler) -> Streamed:
    """POST ``body`` to ``url`` with ``stream: true`` and ``stream_options.include_usage`` and read
    its server-sent events: every ``data:`` line up to ``[DONE]`` is parsed and given to
    ``on_chunk`` (see :data:`ChunkHandler`). A non-200 answer, a timeout, a client error or a
    chunk that is not JSON ends it with ``error`` set (texts cut to 200 characters); never raises
    for those."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    out = Streamed(start)
    try:
        async with session.post(url, data=orjson.dumps(body), headers=headers) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return out
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                error = on_chunk(orjson.loads(data), time.perf_counter() - start)
                if error is not None:
                    out.error = error
                    return out
        out.end_s = time.perf_counter() - start
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:200]
    return out


def wall_span(calls: Iterable[tuple[float, float | None]]) -> float:
    """Wall seconds from the first send to the last end over ``(sent_at, end_s)`` pairs (``sent_at``
    0: never sent; ``end_s`` None: failed, counted for its send only); 0.0 without an ended call."""
    pairs = list(calls)
    ends = [sent + end for sent, end in pairs if end is not None]
    starts = [sent for sent, _ in pairs if sent]
    return (max(ends) - min(starts)) if ends and starts else 0.0


async def closed_loop(trace: Sequence[TimedRequest], time_scale: float,
                      send: Callable[[int], Awaitable[None]]) -> None:
    """Run ``trace``'s sessions closed loop (module docstring): ``send(i)`` makes the call at trace
    position ``i`` and returns when its answer ended; a session's first call at its ``arrival_s`` ×
    ``time_scale`` wall seconds from now, each later turn (by ``turn``) ``pause_s`` × ``time_scale``
    after the previous one returned."""
    sessions: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(trace):
        sessions[r.session_id].append(i)
    t0 = time.perf_counter()

    async def run(indexes: list[int]) -> None:
        turns = sorted(indexes, key=lambda i: trace[i].turn)
        await asyncio.sleep(max(0.0, t0 + trace[turns[0]].arrival_s * time_scale - time.perf_counter()))
        for k, i in enumerate(turns):
            if k and trace[i].pause_s > 0:
                await asyncio.sleep(trace[i].pause_s * time_scale)
            await send(i)

    await asyncio.gather(*(run(ix) for ix in sessions.values()))


async def _call(session: aiohttp.ClientSession, url: str, request: TimedRequest, out: RequestResult,
                session_header: str | None = None) -> None:
    headers = {"content-type": "application/json"}
    if session_header:
        headers[session_header] = request.session_id

    def on_chunk(chunk: dict[str, Any], now: float) -> None:
        if out.ttft_s is None and chunk.get("choices"):
            out.ttft_s = now
        usage = chunk.get("usage")
        if usage:
            out.prompt_tokens = usage.get("prompt_tokens") or 0
            out.completion_tokens = usage.get("completion_tokens") or 0
            details = usage.get("prompt_tokens_details") or {}
            out.cached_tokens = details.get("cached_tokens") or 0

    streamed = await stream_chat(session, url, request.body, headers, on_chunk)
    out.sent_at, out.latency_s, out.error = streamed.sent_at, streamed.end_s, streamed.error
    if out.error is None and out.ttft_s is None:
        out.error = "stream ended without a choice"


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
    connector = aiohttp.TCPConnector(limit=connections, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await closed_loop(trace, time_scale, lambda i: _call(session, url, trace[i], results[i], session_header))
    return ReplayResult(results, wall_span((r.sent_at, r.latency_s) for r in results))


def replay(trace: Sequence[TimedRequest], base_url: str, time_scale: float = 1.0,
           timeout_s: float = 300.0) -> ReplayResult:
    """Synchronous :func:`replay_async` (runs its own event loop)."""
    return asyncio.run(replay_async(trace, base_url, time_scale, timeout_s))
