"""``backfill bench engine-sim``: requests/s one simulator process sustains at time scale 0.

The simulator runs as its own process pinned to CPU 0 (when the machine has two cores or more);
the load generator runs in this process on CPU 1: a minimal HTTP/1.1 keep-alive client over asyncio
streams (pre-encoded requests, ``Content-Length`` responses), so the client costs far less than the
server. Every request is a distinct ``/v1/completions`` prompt of the given length (built-in
tokenizer: 4 bytes per token), ``max_tokens`` 16, KV events on (a ZMQ PUB socket nobody reads) and
prompt-token details on: each request hashes all its blocks, allocates them, evicts older ones and
publishes the events, the worst case for the simulator. Every request goes through the core's steps
(``engine_twin.core``): its prompt is scheduled in one or more steps under the token budget, then
15 decode steps batched with the other requests in flight, all driven by the engine's one driver task.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import click

from engine_twin.launch import sim_engine_argv, wait_ready
from lab.toolkit.launch import free_port


@dataclass
class BenchResult:
    """One measured case: prompt length (tokens), requests completed, seconds, requests/s, errors."""

    prompt_tokens: int
    requests: int
    seconds: float
    requests_per_s: float
    errors: int
    concurrency: int


def _request_bytes(port: int, prompt_tokens: int, index: int) -> bytes:
    unique = f"{index:08d} "  # 9 bytes, distinct per request; pad to whole 4-byte tokens
    body = {"model": "bench", "prompt": (unique + "word " * prompt_tokens)[: prompt_tokens * 4],
            "max_tokens": 16}
    data = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    return head + data


async def _worker(port: int, requests: list[bytes], start: int, stop_at: float, counts: list[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    i = start
    try:
        while time.perf_counter() < stop_at:
            writer.write(requests[i % len(requests)])
            i += 1
            status_line = await reader.readline()
            length = 0
            while True:
                line = await reader.readline()
                if line in (b"\r\n", b""):
                    break
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
            counts[0 if status_line.split(b" ", 2)[1] == b"200" else 1] += 1
    finally:
        writer.close()


async def _drive(port: int, requests: list[bytes], seconds: float, concurrency: int) -> tuple[int, int, float]:
    counts = [0, 0]
    t0 = time.perf_counter()
    stop_at = t0 + seconds
    step = len(requests) // concurrency
    await asyncio.gather(*(_worker(port, requests, k * step, stop_at, counts) for k in range(concurrency)))
    return counts[0], counts[1], time.perf_counter() - t0


def run_case(port: int, prompt_tokens: int, seconds: float, concurrency: int, pool: int) -> BenchResult:
    """Drive the simulator on ``port`` for ``seconds`` with ``concurrency`` connections."""
    requests = [_request_bytes(port, prompt_tokens, i) for i in range(pool)]
    asyncio.run(_drive(port, requests[: concurrency * 4], min(1.0, seconds), concurrency))  # warm-up
    ok, errors, elapsed = asyncio.run(_drive(port, requests, seconds, concurrency))
    return BenchResult(prompt_tokens, ok, round(elapsed, 3), round(ok / elapsed, 1), errors, concurrency)


def _pin(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {cpu})


@click.command("engine-sim")
@click.option("--seconds", type=float, default=5.0, show_default=True, help="measured time per case")
@click.option("--concurrency", type=int, default=32, show_default=True, help="open connections")
@click.option("--prompt-tokens", "prompt_tokens", type=int, multiple=True, default=(1000, 8000),
              show_default=True, help="prompt lengths to measure (repeat the flag)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="also write JSON here")
def bench_engine_sim_command(seconds: float, concurrency: int, prompt_tokens: tuple[int, ...],
                             json_path: str | None) -> None:
    """Requests/s of one simulator process at --time-scale 0 (goal: >= 1,000 at 1,000 tokens)."""
    from rich.table import Table

    from lab.toolkit.tables import print_table

    results: list[BenchResult] = []
    for tokens in prompt_tokens:
        port, events_port = free_port(), free_port()
        argv = sim_engine_argv(port, ["bench"], f"tcp://*:{events_port}", time_scale=0.0,
                               max_model_len=max(16384, tokens + 64))
        proc = subprocess.Popen(argv, preexec_fn=lambda: _pin(0), stdout=subprocess.DEVNULL)
        try:
            wait_ready(f"http://127.0.0.1:{port}", timeout=30, process=proc)
            _pin(1)
            pool = 4000 if tokens <= 2000 else 600
            results.append(run_case(port, tokens, seconds, concurrency, pool))
        finally:
            proc.terminate()
            proc.wait(timeout=10)

    table = Table(title="engine simulator, one process, --time-scale 0")
    for column in ("prompt tokens", "requests", "seconds", "requests/s", "errors", "connections"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(str(r.prompt_tokens), str(r.requests), f"{r.seconds:.2f}", f"{r.requests_per_s:.0f}",
                      str(r.errors), str(r.concurrency))
    print_table(table)
    if json_path:
        payload = {"benchmark": "engine-sim", "python": sys.version.split()[0], "cpus": os.cpu_count(),
                   "results": [asdict(r) for r in results]}
        with open(json_path, "w") as fh:
            json.dump(payload, fh, indent=2)
