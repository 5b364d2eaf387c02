"""Wall-clock measurements of one engine through its OpenAI API: the same client for the twin and a real vLLM.

A request is ``POST /v1/completions`` with the prompt as token ids (vLLM and the twin both take a list
of ints), ``stream: true`` with usage in the last chunk, ``ignore_eos`` so every request produces
exactly ``max_tokens`` tokens, and vLLM's ``priority`` field (acts under ``--scheduling-policy
priority``). :func:`stream` records when each chunk carrying tokens arrives (``time.perf_counter``
seconds) and how many prompt tokens the engine found cached (``usage.prompt_tokens_details``).
One chunk is one engine step for that request (vLLM V1 and the twin send a request's tokens of a step
together), so the gaps between chunks are step times as the client sees them.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

import aiohttp

FOREGROUND_PRIORITY = -100
"""vLLM ``priority`` of interactive requests (what the router sends for the interactive band)."""
BACKGROUND_PRIORITY = 10
"""vLLM ``priority`` of batch requests (``router/parsing.py``: −(band priority) = 10 for the batch band)."""


def token_ids(seed: int | str, n: int, vocab: int = 65_536) -> list[int]:
    """``n`` pseudo-random token ids below ``vocab`` from ``seed`` (distinct seeds share no block)."""
    data = array("I", random.Random(seed).randbytes(4 * n)).tolist()
    return [t % vocab for t in data]


@dataclass
class StreamTimes:
    """One streamed request: ``sent`` and each token chunk's arrival (perf_counter seconds), tokens
    per chunk, the prompt's cached tokens, and the error text when it failed."""

    sent: float
    chunks: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        """Seconds from sending to the first token (NaN without one)."""
        return self.chunks[0] - self.sent if self.chunks else float("nan")

    @property
    def gaps(self) -> list[float]:
        """Seconds between consecutive token chunks."""
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]


def session(timeout_s: float = 600.0) -> aiohttp.ClientSession:
    """A client session without a connection limit."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=timeout_s))


async def stream(http: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int,
                 priority: int = 0, on_chunk: Any = None, extra: dict[str, Any] | None = None,
                 out: StreamTimes | None = None) -> StreamTimes:
    """Stream one completion (module docstring); ``on_chunk(times)`` is called after each token chunk.
    ``out``: the record to fill (so a caller that cancels the task keeps what arrived; cancelling
    closes the connection, which aborts the request on the engine). An HTTP error or a broken stream
    is returned in ``error``, not raised."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0.0, "priority": priority, "stream_options": {"include_usage": True}, **(extra or {})}
    if out is None:
        out = StreamTimes(time.perf_counter())
    out.sent = time.perf_counter()
    try:
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return out
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                now = time.perf_counter()
                usage = chunk.get("usage")
                if usage:
                    out.prompt_tokens = usage.get("prompt_tokens", 0)
                    out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                if chunk.get("choices"):
                    out.chunks.append(now)
                    out.tokens.append(1)
                    if on_chunk is not None:
                        on_chunk(out)
    except (TimeoutError, aiohttp.ClientError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def metric(http: aiohttp.ClientSession, url: str, name: str) -> float:
    """Sum of every sample of Prometheus metric ``name`` on ``{url}/metrics`` (0 when absent)."""
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (len(line) == len(name) or line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def wait_idle(http: aiohttp.ClientSession, url: str, timeout: float = 120.0) -> None:
    """Until ``vllm:num_requests_running`` + ``waiting`` is 0 (both engines export them). Raises
    ``TimeoutError`` after ``timeout`` seconds."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        busy = await metric(http, url, "vllm:num_requests_running") + await metric(http, url, "vllm:num_requests_waiting")
        if busy == 0:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{url} still busy after {timeout} s")


async def plugin_counters(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Every ``backfill:*`` sample on ``{url}/metrics`` (the vLLM plugin's counters), summed per metric
    name and label set as written (``name{labels}`` → value); empty without the plugin (and on the twin)."""
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("backfill:") and not line.startswith("backfill:engine_config_info"):
            key, value = line.rsplit(" ", 1)
            if not key.split("{", 1)[0].endswith("_created"):
                out[key] = out.get(key, 0.0) + float(value)
    return out
