"""``backfill bench ingest``: upload + validation of a large generated batch file through the real
stack (``backfill up``'s gateway and Celery worker processes, embedded stores unless the URLs are
set), as PERFORMANCE.md defines it.

Measured in one run, side by side:

- upload MB/s through the gateway with the ``openai`` client (streamed multipart);
- validation MB/s: file bytes ÷ wall time from ``POST /v1/batches`` until the batch is
  ``in_progress`` (stream the file once, check every line, COPY the request rows, one transition);
- the floor of any validator on this machine: reading the same file and ``orjson``-parsing every
  line in one process, and the ratio validation ÷ floor;
- peak RSS growth (MB) of the gateway process and of the worker process tree over their idle
  baseline, sampled every 20 ms;
- finalisation MB/s: every request given a ~4 KB 200 response in the database, then the output
  file built from the rows, checked and published (``workers.lifecycle.finalize``, in-process).

Goals (PERFORMANCE.md): validation ≥ 100 MB/s; memory growth ≤ 150 MB for a 200 MB file;
finalisation ≥ 100 MB/s.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from pathlib import Path

import click
import orjson
import psutil

MB = 1_000_000


class PeakRss:
    """Samples the summed RSS (bytes) of a process and its descendants until stopped."""

    def __init__(self, pid: int, interval: float = 0.02):
        self.process = psutil.Process(pid)
        self.interval = interval
        self.baseline = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _rss(self) -> int:
        total = 0
        for proc in [self.process, *self.process.children(recursive=True)]:
            try:
                total += proc.memory_info().rss
            except psutil.Error:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._rss())

    def growth_mb(self) -> float:
        """Peak minus baseline, in MB, and stop sampling."""
        self._stop.set()
        self._thread.join()
        return (self.peak - self.baseline) / MB


def parse_floor(path: Path) -> float:
    """MB/s of reading ``path`` in 1 MiB chunks and ``orjson``-parsing every line (one process)."""
    start = time.perf_counter()
    tail = b""
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            lines = (tail + chunk).split(b"\n")
            tail = lines.pop()
            for line in lines:
                if line.strip():
                    orjson.loads(line)
    if tail.strip():
        orjson.loads(tail)
    return path.stat().st_size / MB / (time.perf_counter() - start)


RESPONSE_BYTES = 4000
"""Size of each simulated response body in the finalisation step (about one 4 KB request line)."""


def _finalize(stack, batch_id: str) -> tuple[float, int]:
    """Give every request of the batch a ~4 KB 200 response (as collect would), then time the
    finalisation in this process; returns ``(seconds, output file bytes)``."""
    from batch_gateway.store import queries
    from batch_gateway.store.models import Batch
    from workers import lifecycle
    from workers.app import create_celery
    from workers.settings import load_settings

    ctx = create_celery(load_settings(database_url=stack.env["DATABASE_URL"], redis_url=stack.env["REDIS_URL"],
                                      data_dir=stack.data_dir)).backfill
    body = orjson.dumps({"id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "sim-model",
                         "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None, "message": {
                             "role": "assistant", "content": "x" * RESPONSE_BYTES, "refusal": None}}],
                         "usage": {"prompt_tokens": 1000, "completion_tokens": 1000, "total_tokens": 2000}})
    with ctx.session() as session:
        queries.succeed_all_requests(session, batch_id, body)
        session.commit()
    start = time.perf_counter()
    status = lifecycle.finalize(ctx, batch_id)
    elapsed = time.perf_counter() - start
    with ctx.session() as session:
        batch = session.get(Batch, batch_id)
        output = (stack.data_dir / "files").rglob((batch.output_file_id if batch else None) or "-")
        size = sum(p.stat().st_size for p in output)
    if status != "completed":
        raise click.ClickException(f"finalisation ended {status}")
    return elapsed, size


@click.command("ingest")
@click.option("--lines", default=50_000, show_default=True, help="Requests in the generated file.")
@click.option("--megabytes", default=200, show_default=True, help="Size of the generated file (MB).")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Also write the figures here.")
@click.option("--data-dir", type=click.Path(path_type=Path), help="Stack data directory (default: temporary).")
def ingest_command(lines: int, megabytes: int, json_path: Path | None, data_dir: Path | None) -> None:
    """Upload + validate a generated batch file; print MB/s and memory growth."""
    import openai
    from rich.console import Console
    from rich.table import Table

    from lab.bench.batchfile import write_batch_file
    from lab.toolkit.launch import free_port
    from lab.toolkit.stack import backfill_up
    from lab.toolkit.tables import print_table

    console = Console()
    with tempfile.TemporaryDirectory(prefix="backfill-bench-") as tmp:
        tmp_dir = Path(tmp)
        path = tmp_dir / "batch.jsonl"
        size = write_batch_file(path, lines=lines, target_bytes=megabytes * MB)
        console.print(f"generated {path.name}: {size / MB:.1f} MB, {lines} lines")
        floor = parse_floor(path)
        port = free_port()
        with backfill_up(data_dir or tmp_dir / "data", "127.0.0.1", port) as stack:
            client = openai.OpenAI(base_url=stack.gateway_url, api_key=stack.api_key, max_retries=0,
                                   timeout=600)
            gateway_mem = PeakRss(stack.children["gateway"].pid)
            worker_mem = PeakRss(stack.children["worker"].pid)
            start = time.perf_counter()
            with path.open("rb") as handle:
                uploaded = client.files.create(file=handle, purpose="batch")
            upload_s = time.perf_counter() - start
            start = time.perf_counter()
            batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")
            while (batch := client.batches.retrieve(batch.id)).status == "validating":
                time.sleep(0.02)
            validate_s = time.perf_counter() - start
            gateway_growth, worker_growth = gateway_mem.growth_mb(), worker_mem.growth_mb()
            if batch.status != "in_progress" or batch.request_counts is None or batch.request_counts.total != lines:
                raise click.ClickException(f"validation ended {batch.status}: {batch.errors}")
            finalize_s, output_bytes = _finalize(stack, batch.id)

    figures = {
        "file_mb": size / MB,
        "lines": lines,
        "upload_mb_s": size / MB / upload_s,
        "validation_mb_s": size / MB / validate_s,
        "parse_floor_mb_s": floor,
        "validation_vs_floor": (size / MB / validate_s) / floor,
        "finalize_mb_s": output_bytes / MB / finalize_s,
        "output_file_mb": output_bytes / MB,
        "gateway_peak_growth_mb": gateway_growth,
        "worker_peak_growth_mb": worker_growth,
    }
    table = Table(title=f"ingest: {size / MB:.0f} MB, {lines} lines")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("goal", justify="right")
    goals = {"validation_mb_s": "≥ 100", "finalize_mb_s": "≥ 100", "gateway_peak_growth_mb": "≤ 150", "worker_peak_growth_mb": "≤ 150"}
    for name, value in figures.items():
        table.add_row(name, f"{value:,.2f}" if isinstance(value, float) else str(value), goals.get(name, ""))
    print_table(table, console)
    if json_path:
        json_path.write_text(json.dumps(figures, indent=2) + "\n")
