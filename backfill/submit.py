"""``backfill submit FILE`` and ``backfill demo``: run a batch file as a user would, with the
``openai`` client.

``submit`` uploads FILE to a running gateway, creates the batch, and with ``--wait`` shows a
progress bar from ``request_counts`` until the batch ends, then downloads its output and error
files. ``demo`` does the same against a stack it starts itself (``backfill up`` in-process) and
stops it afterwards.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click
import orjson

TERMINAL = ("completed", "failed", "expired", "cancelled")
ANY_STATUS = ("validating", "in_progress", "finalizing", "cancelling", *TERMINAL)


def endpoint_of(path: Path) -> str:
    """The ``url`` of the first request line of a batch file (``/v1/chat/completions`` if none)."""
    with path.open("rb") as handle:
        for raw in handle:
            line = raw.strip().removeprefix(b"\xef\xbb\xbf")
            if line:
                try:
                    url = orjson.loads(line).get("url")
                except (orjson.JSONDecodeError, AttributeError):
                    break
                if isinstance(url, str):
                    return url
                break
    return "/v1/chat/completions"


def run_batch(client, path: Path, *, endpoint: str | None, window: str, output_dir: Path,
              wait_until: tuple[str, ...] = TERMINAL, poll_seconds: float = 0.5):
    """Upload ``path``, create a batch, follow it until its status is in ``wait_until`` with a
    progress bar, and download its output/error files (if any) into ``output_dir``.

    Returns ``(batch, downloaded_paths)``. Raises ``openai.APIError`` subclasses on API errors.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint or endpoint_of(path),
                                  completion_window=window)
    click.echo(f"uploaded {path} as {uploaded.id}; created {batch.id}")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), transient=False) as progress:
        task = progress.add_task(batch.status, total=None)
        while batch.status not in wait_until:
            time.sleep(poll_seconds)
            batch = client.batches.retrieve(batch.id)
            counts = batch.request_counts
            done = (counts.completed + counts.failed) if counts else 0
            progress.update(task, description=batch.status, total=(counts.total or None) if counts else None,
                            completed=done)
    output_dir.mkdir(parents=True, exist_ok=True)
    downloaded = []
    for kind, file_id in (("output", batch.output_file_id), ("errors", batch.error_file_id)):
        if file_id:
            target = output_dir / f"{batch.id}_{kind}.jsonl"
            target.write_bytes(client.files.content(file_id).read())
            downloaded.append(target)
    return batch, downloaded


def _report(batch, downloaded: list[Path]) -> None:
    counts = batch.request_counts
    click.echo(f"batch {batch.id}: {batch.status}; requests total={counts.total} "
               f"completed={counts.completed} failed={counts.failed}")
    if batch.errors and batch.errors.data:
        for error in batch.errors.data[:10]:
            click.echo(f"  line {error.line}: {error.code}: {error.message}")
    for target in downloaded:
        click.echo(f"  wrote {target}")


@click.command("submit")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--endpoint", help="Batch endpoint (default: the url of the file's first line).")
@click.option("--window", default="24h", show_default=True, help="completion_window: 24h, 30m, 2h, …")
@click.option("--wait/--no-wait", default=False, help="Follow the batch to its end and download results.")
@click.option("--output-dir", type=click.Path(path_type=Path), default=Path("."), show_default=True)
@click.option("--base-url", envvar="OPENAI_BASE_URL", default="http://127.0.0.1:8000/v1", show_default=True)
@click.option("--api-key", envvar=["BACKFILL_API_KEY", "OPENAI_API_KEY"], required=True)
def submit_command(file: Path, endpoint: str | None, window: str, wait: bool, output_dir: Path,
                   base_url: str, api_key: str) -> None:
    """Upload FILE and create a batch on a running gateway."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=2)
    try:
        batch, downloaded = run_batch(client, file, endpoint=endpoint, window=window, output_dir=output_dir,
                                      wait_until=TERMINAL if wait else ANY_STATUS)
    except openai.APIError as exc:
        raise click.ClickException(str(exc)) from None
    _report(batch, downloaded)


@click.command("demo")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                default=Path("examples/chat-small.jsonl"))
@click.option("--data-dir", type=click.Path(path_type=Path), default=Path(".data"), show_default=True)
@click.option("--output-dir", type=click.Path(path_type=Path), default=Path("results"), show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
def demo_command(file: Path, data_dir: Path, output_dir: Path, port: int) -> None:
    """Start the stack, run FILE through it, print where the results are, and stop."""
    from backfill.up import Stop, stop_on_signals

    stop_on_signals()
    try:
        batch = _demo(file, data_dir, output_dir, port)
    except Stop:
        click.echo("backfill demo stopped", err=True)
        sys.exit(130)
    sys.exit(0 if batch.status != "failed" else 1)


def _demo(file: Path, data_dir: Path, output_dir: Path, port: int):
    import openai

    from backfill.up import run_stack

    with run_stack(data_dir, "127.0.0.1", port, None) as stack:
        click.echo(f"stack up: gateway={stack.gateway_url}")
        client = openai.OpenAI(base_url=stack.gateway_url, api_key=stack.api_key, max_retries=2)
        runs_requests = "processor" in stack.children
        batch, downloaded = run_batch(
            client, file, endpoint=None, window="24h", output_dir=output_dir,
            wait_until=TERMINAL if runs_requests else ("in_progress", *TERMINAL),
        )
        _report(batch, downloaded)
        if not runs_requests and batch.status == "in_progress":
            click.echo(
                "validated and queued. The async processor and router that run the requests are not "
                "built yet (issues 4 and 5), so the demo stops here; once they are, the output and "
                f"error files will be written to {output_dir.resolve()}/"
            )
    return batch
