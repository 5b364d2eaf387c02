"""``backfill batches list|show|cancel|download`` and ``backfill files list|show|download|delete``:
existing batches and files on a gateway, through the ``openai`` client.

Every command finds the gateway as ``backfill submit`` does (:mod:`backfill.client`), prints a
table or the object's fields, and with ``--json`` the API's JSON objects instead (a list for
``list``). Errors exit with status 1 and one line naming the gateway URL.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from backfill.client import Gateway, api_errors, with_gateway
from backfill.output import echo_json, echo_table, format_time

JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Print the API's JSON instead of a table.")


def download_results(client, batch, output_dir: Path) -> list[Path]:
    """Write the batch's output and error files (those it has) to
    ``output_dir/{batch_id}_output.jsonl`` and ``…_errors.jsonl``; returns the paths written."""
    output_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for kind, file_id in (("output", batch.output_file_id), ("errors", batch.error_file_id)):
        if file_id:
            target = output_dir / f"{batch.id}_{kind}.jsonl"
            target.write_bytes(client.files.content(file_id).read())
            written.append(target)
    return written


def _counts(batch) -> str:
    counts = batch.request_counts
    return f"{counts.completed}/{counts.total} ok, {counts.failed} failed" if counts else "-"


def echo_batch(batch) -> None:
    """The fields of a batch a person asks about, one per line."""
    rows = [("id", batch.id), ("status", batch.status), ("endpoint", batch.endpoint),
            ("input_file_id", batch.input_file_id), ("output_file_id", batch.output_file_id or "-"),
            ("error_file_id", batch.error_file_id or "-"), ("requests", _counts(batch)),
            ("completion_window", batch.completion_window), ("created_at", format_time(batch.created_at))]
    for field in ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
                  "cancelling_at", "cancelled_at", "expires_at"):
        if getattr(batch, field, None):
            rows.append((field, format_time(getattr(batch, field))))
    if batch.metadata:
        rows.append(("metadata", ", ".join(f"{k}={v}" for k, v in batch.metadata.items())))
    for key, value in rows:
        click.echo(f"{key + ':':<19} {value}")
    if batch.errors and batch.errors.data:
        click.echo("errors:")
        for error in batch.errors.data[:10]:
            click.echo(f"  line {error.line}: {error.code}: {error.message}")


@click.group("batches")
def batches_group() -> None:
    """List, show, cancel and download batches. Each command takes --data-dir (the `backfill up` stack to use), or --base-url and
    --api-key."""


@batches_group.command("list")
@click.option("--limit", type=click.IntRange(1, 100), default=20, show_default=True, help="Batches to show.")
@click.option("--after", help="Show batches after this batch id (the next page).")
@JSON_OPTION
@with_gateway
def batches_list(gateway: Gateway, limit: int, after: str | None, as_json: bool) -> None:
    """List batches, newest first."""
    with api_errors(gateway.base_url):
        page = gateway.client().batches.list(limit=limit, **({"after": after} if after else {}))
    if as_json:
        echo_json(page.data)
        return
    echo_table(("ID", "STATUS", "ENDPOINT", "REQUESTS", "CREATED"),
               [(b.id, b.status, b.endpoint, _counts(b), format_time(b.created_at)) for b in page.data])


@batches_group.command("show")
@click.argument("batch_id")
@JSON_OPTION
@with_gateway
def batches_show(gateway: Gateway, batch_id: str, as_json: bool) -> None:
    """Show BATCH_ID."""
    with api_errors(gateway.base_url):
        batch = gateway.client().batches.retrieve(batch_id)
    echo_json(batch) if as_json else echo_batch(batch)


@batches_group.command("cancel")
@click.argument("batch_id")
@JSON_OPTION
@with_gateway
def batches_cancel(gateway: Gateway, batch_id: str, as_json: bool) -> None:
    """Cancel BATCH_ID (its status becomes cancelling, then cancelled)."""
    with api_errors(gateway.base_url):
        batch = gateway.client().batches.cancel(batch_id)
    echo_json(batch) if as_json else click.echo(f"{batch.id}: {batch.status}")


@batches_group.command("download")
@click.argument("batch_id")
@click.option("--output-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("."),
              show_default=True, help="Where BATCH_ID_output.jsonl and BATCH_ID_errors.jsonl are written.")
@with_gateway
def batches_download(gateway: Gateway, batch_id: str, output_dir: Path) -> None:
    """Download the output and error files of BATCH_ID (exit status 1 when it has none yet)."""
    client = gateway.client()
    with api_errors(gateway.base_url):
        batch = client.batches.retrieve(batch_id)
        written = download_results(client, batch, output_dir)
    if not written:
        raise click.ClickException(f"{batch.id} is {batch.status} and has no output or error file yet")
    for path in written:
        click.echo(f"wrote {path}")


@click.group("files")
def files_group() -> None:
    """List, show, download and delete files. Each command takes --data-dir (the `backfill up` stack to use), or --base-url and
    --api-key."""


@files_group.command("list")
@click.option("--purpose", help="Only files of this purpose (batch, batch_output).")
@click.option("--limit", type=click.IntRange(1, 10000), default=20, show_default=True, help="Files to show.")
@JSON_OPTION
@with_gateway
def files_list(gateway: Gateway, purpose: str | None, limit: int, as_json: bool) -> None:
    """List files, newest first."""
    with api_errors(gateway.base_url):
        page = gateway.client().files.list(limit=limit, **({"purpose": purpose} if purpose else {}))
    if as_json:
        echo_json(page.data)
        return
    echo_table(("ID", "PURPOSE", "BYTES", "FILENAME", "CREATED"),
               [(f.id, f.purpose, f.bytes, f.filename, format_time(f.created_at)) for f in page.data])


@files_group.command("show")
@click.argument("file_id")
@JSON_OPTION
@with_gateway
def files_show(gateway: Gateway, file_id: str, as_json: bool) -> None:
    """Show FILE_ID."""
    with api_errors(gateway.base_url):
        found = gateway.client().files.retrieve(file_id)
    if as_json:
        echo_json(found)
        return
    for key, value in (("id", found.id), ("purpose", found.purpose), ("filename", found.filename),
                       ("bytes", found.bytes), ("created_at", format_time(found.created_at)),
                       ("expires_at", format_time(getattr(found, "expires_at", None)))):
        click.echo(f"{key + ':':<11} {value}")


@files_group.command("download")
@click.argument("file_id")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="File to write (default: FILE_ID.jsonl; '-' for standard output).")
@with_gateway
def files_download(gateway: Gateway, file_id: str, output: Path | None) -> None:
    """Download the bytes of FILE_ID."""
    with api_errors(gateway.base_url):
        content = gateway.client().files.content(file_id).read()
    if str(output) == "-":
        sys.stdout.buffer.write(content)
        return
    target = output or Path(f"{file_id}.jsonl")
    target.write_bytes(content)
    click.echo(f"wrote {target}")


@files_group.command("delete")
@click.argument("file_id")
@JSON_OPTION
@with_gateway
def files_delete(gateway: Gateway, file_id: str, as_json: bool) -> None:
    """Delete FILE_ID."""
    with api_errors(gateway.base_url):
        deleted = gateway.client().files.delete(file_id)
    echo_json(deleted) if as_json else click.echo(f"{deleted.id}: {'deleted' if deleted.deleted else 'not deleted'}")
