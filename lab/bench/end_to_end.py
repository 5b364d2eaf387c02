"""``backfill bench end-to-end``: a 50,000-request batch through the whole stack on a simulated
fleet of known capacity C, as PERFORMANCE.md defines it (goal: achieved ≥ 0.95 × C; every
``custom_id`` exactly once).

The fleet is what ``backfill up`` sends to: the stack is started with one simulated engine behind
the router, so C is that engine's capacity. Its settings reach the engine through the simulator's environment variables
(``BACKFILL_ENGINE_SIM_TIME_SCALE``, ``…_MAX_NUM_SEQS``), which ``backfill up``'s children inherit.

The capacity is set by the simulator's serialised prefills: each request's prefill (30 ms model
overhead + uncached prompt tokens ÷ 16,000/s; the shared system prompts are cached after the first
few requests) ends ``time_scale`` × that after the previous one, so with ``max_num_seqs`` slots
enough for every request in flight the engine answers about 1 ÷ (``time_scale`` × 0.031 s)
requests/s: 256/s at the default 0.125. That chain of end times is computed in model time when a
request is admitted, so CPU contention from the stack on the same cores does not change it (a
decode-bound engine, few slots, would be slowed by the timer overshoot of every per-token sleep).
Every request asks for the same ``max_tokens`` (the simulator generates exactly that many).

Measured in one run, side by side, on the same engine process:

- C: the same request bodies (the first ``--capacity-requests`` lines of the batch file) sent
  straight to the engine with ``aiohttp`` at the processor's concurrency, once before and once
  after the stack run (requests/s; C is their pooled rate);
- the stack run: the file uploaded and the batch created with the ``openai`` client, the status
  polled every ``POLL_SECONDS``; validation (create → ``in_progress``), processing
  (``in_progress`` → every request counted) and finalisation (→ ``completed``) timed apart;
- achieved = requests ÷ (``in_progress`` → ``completed``), and the ratio achieved ÷ C; also the
  processing-only and create → ``completed`` rates;
- the mean requests at the engine (running + waiting, ``/sim/state`` sampled every 0.1 s) in both
  runs, and CPU seconds per stack component during the stack run (where the time goes);
- the output and error files, downloaded: every ``custom_id`` exactly once (the bench fails
  otherwise).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import click
import httpx
import orjson
import psutil

POLL_SECONDS = 0.1
"""How often the batch status is read during the stack run (s)."""
STATE_SAMPLE_SECONDS = 0.1
"""How often the engine's ``/sim/state`` is sampled (s)."""


class Occupancy:
    """Samples ``GET {engine}/sim/state`` in a thread: mean running sequences and waiting requests."""

    def __init__(self, engine_url: str, interval: float = STATE_SAMPLE_SECONDS):
        self.url = f"{engine_url}/sim/state"
        self.interval = interval
        self.running: list[int] = []
        self.waiting: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=2.0) as client:
            while not self._stop.wait(self.interval):
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    state = client.get(self.url).json()
                    self.running.append(state["running"])
                    self.waiting.append(state["waiting"])

    def stop(self) -> tuple[float, float]:
        """Stop sampling; ``(mean running sequences, mean waiting requests)``."""
        self._stop.set()
        self._thread.join()
        if not self.running:
            return 0.0, 0.0
        return sum(self.running) / len(self.running), sum(self.waiting) / len(self.waiting)


@dataclass
class DirectRun:
    """One capacity measurement: requests answered 200, wall seconds, engine occupancy."""

    requests: int
    seconds: float
    mean_running: float
    mean_waiting: float

    @property
    def rate(self) -> float:
        return self.requests / self.seconds


async def _drive(url: str, bodies: list[bytes], concurrency: int) -> float:
    import aiohttp

    pending = iter(bodies)
    failures: list[int] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def worker() -> None:
            for body in pending:
                async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
                    await resp.read()
                    if resp.status != 200:
                        failures.append(resp.status)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    if failures:
        raise click.ClickException(f"the engine answered {len(failures)} direct requests with "
                                   f"{collections.Counter(failures).most_common(3)}")
    return elapsed


def measure_capacity(engine_url: str, endpoint: str, bodies: list[bytes], concurrency: int) -> DirectRun:
    """Send ``bodies`` (JSON request bodies) to ``engine_url + endpoint`` with ``concurrency``
    requests in flight; raises ``ClickException`` unless every answer is 200."""
    occupancy = Occupancy(engine_url)
    seconds = asyncio.run(_drive(engine_url + endpoint, bodies, concurrency))
    running, waiting = occupancy.stop()
    return DirectRun(len(bodies), seconds, running, waiting)


def _components(stack) -> dict[psutil.Process, str]:
    """The stack's processes, each labelled with its component: a child's whole tree by the
    child's name (``engine``, ``processor``, ``worker``, …), the embedded stores by process name
    (found by the data directory or the Redis socket on their command lines), and this process as
    ``bench``."""
    labels: dict[psutil.Process, str] = {}

    def add(root: psutil.Process, label: str | None) -> None:
        with contextlib.suppress(psutil.Error):
            for proc in [root, *root.children(recursive=True)]:
                labels.setdefault(proc, label or proc.name().split()[0])

    for name, child in stack.children.items():
        with contextlib.suppress(psutil.Error):
            add(psutil.Process(child.pid), name.split("-")[0])
    with contextlib.suppress(psutil.Error):
        labels.setdefault(psutil.Process(stack.process.pid), "up")  # the supervisor itself
    marks = [str(stack.data_dir)]
    redis_url = stack.env.get("REDIS_URL", "")
    if redis_url.startswith("unix://"):
        marks.append(redis_url.removeprefix("unix://").split("?")[0])
    for proc in psutil.process_iter(["cmdline"]):
        if any(mark in part for part in proc.info["cmdline"] or () for mark in marks):
            add(proc, None)
    me = psutil.Process()
    labels[me] = "bench (this process)"
    add(me, None)
    return labels


def _cpu_by_component(labels: dict[psutil.Process, str]) -> dict[psutil.Process, tuple[str, float]]:
    out = {}
    for proc, label in labels.items():
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            out[proc] = (label, times.user + times.system)
    return out


def cpu_seconds_since(start: dict[psutil.Process, tuple[str, float]], stack) -> dict[str, float]:
    """CPU seconds (user + system) per component since ``start`` (a :func:`_cpu_by_component`
    snapshot); processes started since count whole, ones that exited since are missed."""
    totals: dict[str, float] = collections.defaultdict(float)
    for proc, (label, seconds) in _cpu_by_component(_components(stack)).items():
        totals[label] += seconds - start.get(proc, (label, 0.0))[1]
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def check_custom_ids(lines: list[bytes], expected: int) -> tuple[int, int, list[str]]:
    """Count output/error lines by ``custom_id``; ``(lines, distinct ids, problems)`` where
    ``problems`` names missing, doubled or unknown ids (empty when each of ``request-1`` …
    ``request-<expected>`` appears exactly once)."""
    counts = collections.Counter(orjson.loads(line)["custom_id"] for line in lines if line.strip())
    wanted = {f"request-{n}" for n in range(1, expected + 1)}
    problems = []
    missing = wanted - counts.keys()
    doubled = [cid for cid, k in counts.items() if k > 1]
    unknown = counts.keys() - wanted
    if missing:
        problems.append(f"{len(missing)} missing (e.g. {sorted(missing)[:3]})")
    if doubled:
        problems.append(f"{len(doubled)} more than once (e.g. {doubled[:3]})")
    if unknown:
        problems.append(f"{len(unknown)} unknown (e.g. {sorted(unknown)[:3]})")
    return sum(counts.values()), len(counts), problems


@click.command("end-to-end")
@click.option("--requests", "lines", default=50_000, show_default=True, help="Requests in the batch.")
@click.option("--time-scale", default=0.125, show_default=True, type=float,
              help="Engine simulator's wall seconds per model second.")
@click.option("--max-num-seqs", default=256, show_default=True, type=int, help="Engine's batch size (slots).")
@click.option("--max-tokens", default=16, show_default=True, type=int, help="Output tokens of every request.")
@click.option("--concurrency", default=64, show_default=True, type=int,
              help="Processor's requests in flight (BACKFILL_PROCESSOR_CONCURRENCY), and the direct load.")
@click.option("--capacity-requests", default=5_000, show_default=True, type=int,
              help="Requests of each direct capacity run (one before, one after the stack run).")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Also write the figures here.")
@click.option("--data-dir", type=click.Path(path_type=Path), help="Stack data directory (default: temporary).")
def end_to_end_command(lines: int, time_scale: float, max_num_seqs: int, max_tokens: int, concurrency: int,
                       capacity_requests: int, json_path: Path | None, data_dir: Path | None) -> None:
    """A batch through the whole stack vs the engine's capacity measured directly (same run)."""
    import openai
    from rich.console import Console
    from rich.table import Table

    from lab.bench.batchfile import write_batch_file
    from lab.toolkit.launch import environment, free_port
    from lab.toolkit.stack import backfill_up
    from lab.toolkit.tables import print_table

    console = Console()
    endpoint: Literal["/v1/chat/completions"] = "/v1/chat/completions"
    with tempfile.TemporaryDirectory(prefix="backfill-bench-") as tmp:
        tmp_dir = Path(tmp)
        path = tmp_dir / "batch.jsonl"
        size = write_batch_file(path, lines=lines, target_bytes=1, max_tokens=max_tokens)
        with path.open("rb") as handle:
            bodies = [orjson.dumps(orjson.loads(line)["body"])
                      for line, _ in zip(handle, range(min(capacity_requests, lines)))]
        console.print(f"generated {path.name}: {size / 1e6:.1f} MB, {lines} lines, max_tokens {max_tokens}")
        env = environment(BACKFILL_ENGINE_SIM_TIME_SCALE=str(time_scale),
                          BACKFILL_ENGINE_SIM_MAX_NUM_SEQS=str(max_num_seqs),
                          BACKFILL_PROCESSOR_CONCURRENCY=str(concurrency))
        with env, backfill_up(data_dir or tmp_dir / "data", "127.0.0.1", free_port(), engines=1) as stack:
            engine = stack.engine_urls[0]
            console.print(f"stack up; engine {engine}: time scale {time_scale}, max_num_seqs {max_num_seqs}")
            before = measure_capacity(engine, endpoint, bodies, concurrency)
            console.print(f"direct (before): {before.rate:,.1f} requests/s")

            client = openai.OpenAI(base_url=stack.gateway_url, api_key=stack.api_key, max_retries=2, timeout=600)
            with path.open("rb") as handle:
                uploaded = client.files.create(file=handle, purpose="batch")
            cpu_start = _cpu_by_component(_components(stack))
            occupancy: Occupancy | None = None
            running = waiting = 0.0
            seen: dict[str, float] = {}
            start = time.perf_counter()
            batch = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")
            seen["created"] = start
            while batch.status not in ("completed", "failed", "expired", "cancelled"):
                time.sleep(POLL_SECONDS)
                batch = client.batches.retrieve(batch.id)
                now = time.perf_counter()
                seen.setdefault(batch.status, now)
                if occupancy is None and batch.status != "validating":
                    occupancy = Occupancy(engine)
                counts = batch.request_counts
                if "counted" not in seen and counts and counts.completed + counts.failed >= lines:
                    seen["counted"] = now
                    if occupancy:
                        running, waiting = occupancy.stop()
            cpu = cpu_seconds_since(cpu_start, stack)
            if batch.status != "completed":
                raise click.ClickException(f"the batch ended {batch.status}: {batch.errors}")
            if "counted" not in seen:  # went from in_progress to completed between two polls
                seen["counted"] = seen["completed"]
                if occupancy:
                    running, waiting = occupancy.stop()

            after = measure_capacity(engine, endpoint, bodies, concurrency)
            console.print(f"direct (after): {after.rate:,.1f} requests/s")

            out_lines: list[bytes] = []
            error_lines = 0
            for file_id in (batch.output_file_id, batch.error_file_id):
                if file_id:
                    got = client.files.content(file_id).content.splitlines()
                    out_lines += got
                    error_lines += len(got) if file_id == batch.error_file_id else 0

    total_lines, distinct, problems = check_custom_ids(out_lines, lines)
    capacity = (before.requests + after.requests) / (before.seconds + after.seconds)
    in_progress = seen.get("in_progress", seen["created"])
    run_s = seen["completed"] - in_progress
    processing_s = seen["counted"] - in_progress
    figures: dict[str, Any] = {
        "requests": lines,
        "time_scale": time_scale,
        "max_num_seqs": max_num_seqs,
        "max_tokens": max_tokens,
        "concurrency": concurrency,
        "capacity_before_rps": before.rate,
        "capacity_after_rps": after.rate,
        "capacity_rps": capacity,
        "achieved_rps": lines / run_s,
        "achieved_vs_capacity": lines / run_s / capacity,
        "processing_rps": lines / processing_s,
        "processing_vs_capacity": lines / processing_s / capacity,
        "create_to_completed_rps": lines / (seen["completed"] - seen["created"]),
        "create_to_completed_vs_capacity": lines / (seen["completed"] - seen["created"]) / capacity,
        "validation_s": in_progress - seen["created"],
        "processing_s": processing_s,
        "finalisation_s": seen["completed"] - seen["counted"],
        "create_to_completed_s": seen["completed"] - seen["created"],
        "engine_in_flight_direct": (before.mean_running + before.mean_waiting
                                    + after.mean_running + after.mean_waiting) / 2,
        "engine_in_flight_stack": running + waiting,
        "engine_waiting_stack": waiting,
        "output_and_error_lines": total_lines,
        "error_lines": error_lines,
        "distinct_custom_ids": distinct,
        "cpu_seconds_stack_run": cpu,
    }
    goals = {"achieved_vs_capacity": "≥ 0.95", "distinct_custom_ids": f"= {lines}",
             "output_and_error_lines": f"= {lines}"}
    table = Table(title=f"end-to-end: {lines} requests, one simulated engine")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("goal", justify="right")
    for name, value in figures.items():
        if isinstance(value, dict):
            continue
        table.add_row(name, f"{value:,.3f}" if isinstance(value, float) else str(value), goals.get(name, ""))
    print_table(table, console)
    wall = figures["create_to_completed_s"]
    cpu_table = Table(title=f"CPU seconds per component during the stack run ({wall:.0f} s wall)")
    cpu_table.add_column("component")
    cpu_table.add_column("CPU s", justify="right")
    cpu_table.add_column("share of one core", justify="right")
    for name, value in figures["cpu_seconds_stack_run"].items():
        cpu_table.add_row(name, f"{value:,.1f}", f"{value / wall:.2f}")
    print_table(cpu_table, console)
    if json_path:
        json_path.write_text(json.dumps(figures, indent=2) + "\n")
    if problems:
        raise click.ClickException("custom_id check failed: " + "; ".join(problems))
