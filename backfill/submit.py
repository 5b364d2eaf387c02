"""``backfill submit FILE`` and ``backfill demo``: run a batch file as a user would, with the
``openai`` client.

``submit`` uploads FILE to a running gateway (found as :mod:`backfill.client` says), creates the
batch and prints it as JSON; with ``--wait`` it shows a progress bar from ``request_counts`` until
the batch ends, downloads its output and error files, and exits with status 1 when the batch ended
failed, expired or cancelled. ``demo`` runs FILE against a stack it starts itself (``backfill up``
in-process, its engines serving the models FILE names) and stops it afterwards.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click
import orjson

from backfill.client import Gateway, api_errors, with_gateway

TERMINAL = ("completed", "failed", "expired", "cancelled")


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


def create_batch(client, path: Path, *, endpoint: str | None, window: str):
    """Upload ``path`` and create a batch of it; returns the batch. Raises ``openai.APIError``
    subclasses on API errors; when the batch is refused, the uploaded file is deleted first."""
    import openai

    with path.open("rb") as handle:
        uploaded = client.files.create(file=handle, purpose="batch")
    try:
        batch = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint or endpoint_of(path),
                                      completion_window=window)
    except openai.APIError:
        _drop_upload(client, path, uploaded.id)
        raise
    click.echo(f"uploaded {path} as {uploaded.id}; created {batch.id}", err=True)
    return batch


def _drop_upload(client, path: Path, file_id: str) -> None:
    """After a refused batch: delete the file uploaded for it, saying so on standard error with its
    id; when the delete fails too, say the file is kept and how to delete it."""
    import openai

    try:
        client.files.delete(file_id)
    except openai.APIError:
        click.echo(f"uploaded {path} as {file_id}; the batch was refused and the file is kept "
                   f"(backfill files delete {file_id})", err=True)
        return
    click.echo(f"uploaded {path} as {file_id}; the batch was refused, so {file_id} was deleted", err=True)


def follow(client, batch, *, wait_until: tuple[str, ...] = TERMINAL, poll_seconds: float = 0.5):
    """Poll ``batch`` until its status is in ``wait_until``, with a progress bar (on standard
    error) of ``request_counts``; returns the last batch read."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), transient=False, console=Console(stderr=True)) as progress:
        task = progress.add_task(batch.status, total=None)
        while batch.status not in wait_until:
            time.sleep(poll_seconds)
            batch = client.batches.retrieve(batch.id)
            counts = batch.request_counts
            done = (counts.completed + counts.failed) if counts else 0
            progress.update(task, description=batch.status, total=(counts.total or None) if counts else None,
                            completed=done)
    return batch


def run_batch(client, path: Path, *, endpoint: str | None, window: str, output_dir: Path,
              wait_until: tuple[str, ...] = TERMINAL, poll_seconds: float = 0.5):
    """Upload ``path``, create a batch, :func:`follow` it until its status is in ``wait_until``,
    and download its output/error files (if any) into ``output_dir``.

    Returns ``(batch, downloaded_paths)``. Raises ``openai.APIError`` subclasses on API errors.
    """
    from backfill.batches import download_results

    batch = create_batch(client, path, endpoint=endpoint, window=window)
    batch = follow(client, batch, wait_until=wait_until, poll_seconds=poll_seconds)
    return batch, download_results(client, batch, output_dir)


def _report(batch, downloaded: list[Path]) -> None:
    counts = batch.request_counts
    click.echo(f"batch {batch.id}: {batch.status}; requests total={counts.total} "
               f"completed={counts.completed} failed={counts.failed}")
    if batch.errors and batch.errors.data:
        for error in batch.errors.data[:10]:
            click.echo(f"  line {error.line}: {error.code}: {error.message}")
    for target in downloaded:
        click.echo(f"  wrote {target}")


UNSUCCESSFUL = ("failed", "expired", "cancelled")
"""Terminal statuses ``submit --wait`` and ``demo`` exit with status 1 on."""


@click.command("submit")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--endpoint", help="Batch endpoint (default: the url of the file's first line).")
@click.option("--window", default="24h", show_default=True, help="completion_window: 24h, 30m, 2h, …")
@click.option("--wait/--no-wait", default=False,
              help="Follow the batch to its end with a progress bar and download its files (exit status 1 "
                   "if it ends failed, expired or cancelled); --no-wait prints the new batch as JSON.")
@click.option("--output-dir", type=click.Path(path_type=Path), default=Path("."), show_default=True,
              help="Where --wait writes BATCH_ID_output.jsonl and BATCH_ID_errors.jsonl.")
@with_gateway
def submit_command(file: Path, endpoint: str | None, window: str, wait: bool, output_dir: Path,
                   gateway: Gateway) -> None:
    """Upload FILE and create a batch on a running gateway (the `backfill up` stack of --data-dir
    unless --base-url is given)."""
    from backfill.batches import download_results
    from backfill.output import echo_json

    client = gateway.client()
    with api_errors(gateway.base_url):
        batch = create_batch(client, file, endpoint=endpoint, window=window)
        if not wait:
            echo_json(batch)
            return
        batch = follow(client, batch)
        downloaded = download_results(client, batch, output_dir)
    _report(batch, downloaded)
    if batch.status in UNSUCCESSFUL:
        sys.exit(1)


def models_of(path: Path, limit: int = 16) -> list[str]:
    """The distinct ``body.model`` names of a batch file's request lines, in order of first
    appearance (at most ``limit``; unreadable lines are skipped: validation reports them)."""
    names: list[str] = []
    with path.open("rb") as handle:
        for raw in handle:
            try:
                model = orjson.loads(raw.strip().removeprefix(b"\xef\xbb\xbf") or b"{}").get("body", {}).get("model")
            except (orjson.JSONDecodeError, AttributeError):
                continue
            if isinstance(model, str) and model and model not in names:
                names.append(model)
                if len(names) >= limit:
                    break
    return names


@click.command("demo")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                default=Path("examples/chat-small.jsonl"))
@click.option("--data-dir", type=click.Path(path_type=Path), default=Path(".data"), show_default=True,
              help="Embedded stores, file bytes and logs of the demo's stack.")
@click.option("--output-dir", type=click.Path(path_type=Path), default=Path("results"), show_default=True,
              help="Where the batch's output and error files are written.")
@click.option("--port", default=8000, show_default=True, type=int, help="Port of the demo's gateway.")
@click.option("--served-model-name", "served_model_names", multiple=True,
              help="Model name the simulated engines serve (repeat, or separate with commas). "
                   "Default: the models FILE's lines name, so any batch file runs.")
def demo_command(file: Path, data_dir: Path, output_dir: Path, port: int, served_model_names: tuple[str, ...]) -> None:
    """Start the stack, run FILE through it, print where the results are, and stop (exit status 1
    if the batch ends failed, expired or cancelled). Answers are simulated: filler text, not a
    model's."""
    from backfill.up import Stop, stop_on_signals

    names = [name.strip() for value in served_model_names for name in value.split(",") if name.strip()]
    stop_on_signals()
    try:
        batch = _demo(file, data_dir, output_dir, port, names or models_of(file))
    except Stop:
        click.echo("backfill demo stopped", err=True)
        sys.exit(130)
    sys.exit(1 if batch.status in UNSUCCESSFUL else 0)


def _demo(file: Path, data_dir: Path, output_dir: Path, port: int, served_model_names: list[str]):
    from backfill.up import run_stack

    with run_stack(data_dir, "127.0.0.1", port, None, served_model_names=served_model_names) as stack:
        click.echo(f"stack up: gateway={stack.gateway_url} serving {', '.join(served_model_names) or 'sim-model'}")
        client = Gateway(base_url=stack.gateway_url, api_key=stack.api_key).client()
        with api_errors(stack.gateway_url):
            batch, downloaded = run_batch(client, file, endpoint=None, window="24h", output_dir=output_dir)
        _report(batch, downloaded)
    return batch
