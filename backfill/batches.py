"""``backfill batches list|show|cancel|download`` and ``backfill files list|show|download|delete``:
existing batches and files on a gateway, through the ``openai`` client; with the admin key
(``--admin-key`` / ``BACKFILL_ADMIN_KEY``) every tenant's (``list --all-tenants``, ``batches show``
of any batch) through the gateway's operator JSON (:class:`backfill.client.Operator`). A list ends
with how many were shown and the ``--after`` of the next page.

Every command finds the gateway as ``backfill submit`` does (:mod:`backfill.client`), prints a
table or the object's fields, and with ``--json`` the API's JSON objects instead (a list for
``list``). Errors exit with status 1 and one line naming the gateway URL.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
from openai.types import Batch as SdkBatch
from openai.types import FileObject

from backfill.client import ADMIN_KEY_OPTION, Gateway, Operator, api_errors, own_tenant_only, with_gateway
from backfill.output import echo_json, echo_table, format_time, page_hint
from common.private import private_dir, write_private

JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Print the API's JSON instead of a table.")


def download_results(client, batch, output_dir: Path) -> list[Path]:
    """Write the batch's output and error files (those it has) to
    ``output_dir/{batch_id}_output.jsonl`` and ``…_errors.jsonl``, each ``0600`` whatever the umask
    (tenants' data: :func:`common.private.write_private`; ``output_dir`` is made ``0700`` when it
    does not exist); returns the paths written."""
    if not output_dir.exists():
        private_dir(output_dir)  # made here: 0700, like the files in it (an existing folder is left as it is)
    written = []
    for kind, file_id in (("output", batch.output_file_id), ("errors", batch.error_file_id)):
        if file_id:
            target = output_dir / f"{batch.id}_{kind}.jsonl"
            write_private(target, client.files.content(file_id).read())
            written.append(target)
    return written


def _counts(batch) -> str:
    """``completed/total ok, N failed``; for a cancelled batch the API's ``failed`` also counts the
    requests the cancel stopped before they ran, so it says ``failed or cancelled``."""
    counts = batch.request_counts
    if not counts:
        return "-"
    ended = "failed or cancelled" if batch.status in ("cancelling", "cancelled") else "failed"
    return f"{counts.completed}/{counts.total} ok, {counts.failed} {ended}"


def echo_batch(batch, tenant: str | None = None) -> None:
    """The fields of a batch a person asks about, one per line (its ``tenant`` when given)."""
    rows = [("id", batch.id), *([("tenant", tenant)] if tenant else []), ("status", batch.status), ("endpoint", batch.endpoint),
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
@click.option("--after", help="Show batches after this one (the next page; the cursor the last line gives).")
@click.option("--all-tenants", is_flag=True, help="Every tenant's batches (needs the admin key).")
@click.option("--status", help="With --all-tenants: only batches of this status.")
@click.option("--tenant", help="With --all-tenants: only this tenant's batches.")
@ADMIN_KEY_OPTION
@JSON_OPTION
@with_gateway
def batches_list(gateway: Gateway, limit: int, after: str | None, all_tenants: bool, status: str | None,
                 tenant: str | None, admin_key: str | None, as_json: bool) -> None:
    """List batches, newest first: the API key's tenant's; with --all-tenants and the admin key every
    tenant's, with a TENANT column (--admin-key without --all-tenants is refused)."""
    own_tenant_only("batches", all_tenants, admin_key)
    if all_tenants:
        page = Operator.of(gateway, admin_key, "--all-tenants").get(
            "/batches", limit=limit, after=after, status=status, tenant=tenant)
        batches = [SdkBatch.model_validate(row) for row in page["data"]]
        tenants, more, cursor, total = [row["tenant_name"] for row in page["data"]], page["has_more"], page["next"], \
            page["total"]
    else:
        if status or tenant:
            raise click.UsageError("--status and --tenant need --all-tenants")
        with api_errors(gateway.base_url):
            found = gateway.client().batches.list(limit=limit, **({"after": after} if after else {}))
        batches, more, total = found.data, bool(found.has_more), None
        cursor, tenants = (batches[-1].id if batches else None), []
    if as_json:
        echo_json([{**b.model_dump(mode="json"), "tenant_name": t} for b, t in zip(batches, tenants)] if all_tenants
                  else batches)
        return
    rows = [(b.id, b.status, b.endpoint, _counts(b), format_time(b.created_at)) for b in batches]
    if all_tenants:
        echo_table(("ID", "TENANT", "STATUS", "ENDPOINT", "REQUESTS", "CREATED"),
                   [(row[0], name, *row[1:]) for row, name in zip(rows, tenants)])
    else:
        echo_table(("ID", "STATUS", "ENDPOINT", "REQUESTS", "CREATED"), rows)
    click.echo(page_hint(len(batches), more, cursor, total))


@batches_group.command("show")
@click.argument("batch_id")
@ADMIN_KEY_OPTION
@JSON_OPTION
@with_gateway
def batches_show(gateway: Gateway, batch_id: str, admin_key: str | None, as_json: bool) -> None:
    """Show BATCH_ID; with the admin key any tenant's (and its tenant)."""
    if admin_key:
        found = Operator.of(gateway, admin_key, "--admin-key").get(f"/batches/{batch_id}")
        batch, tenant = SdkBatch.model_validate(found), found["tenant_name"]
    else:
        with api_errors(gateway.base_url):
            batch, tenant = gateway.client().batches.retrieve(batch_id), None
    if as_json:
        echo_json({**batch.model_dump(mode="json"), **({"tenant_name": tenant} if tenant else {})})
    else:
        echo_batch(batch, tenant)


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
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True, help="Files to show.")
@click.option("--after", help="Show files after this file id (the next page; the last line gives it).")
@click.option("--all-tenants", is_flag=True, help="Every tenant's files (needs the admin key).")
@ADMIN_KEY_OPTION
@JSON_OPTION
@with_gateway
def files_list(gateway: Gateway, purpose: str | None, limit: int, after: str | None, all_tenants: bool,
               admin_key: str | None, as_json: bool) -> None:
    """List files, newest first: the API key's tenant's; with --all-tenants and the admin key every
    tenant's, with a TENANT column (--admin-key without --all-tenants is refused)."""
    own_tenant_only("files", all_tenants, admin_key)
    if all_tenants:
        page = Operator.of(gateway, admin_key, "--all-tenants").get("/files", limit=limit, after=after, purpose=purpose)
        files = [FileObject.model_validate(row) for row in page["data"]]
        tenants, more, total = [row["tenant_name"] for row in page["data"]], page["has_more"], page["total"]
    else:
        with api_errors(gateway.base_url):
            found = gateway.client().files.list(limit=limit, **({"purpose": purpose} if purpose else {}),
                                                **({"after": after} if after else {}))
        files, tenants, more, total = found.data, [], bool(found.has_more), None
    if as_json:
        echo_json([{**f.model_dump(mode="json"), "tenant_name": t} for f, t in zip(files, tenants)] if all_tenants
                  else files)
        return
    rows = [(f.id, f.purpose, f.bytes, f.filename, format_time(f.created_at)) for f in files]
    if all_tenants:
        echo_table(("ID", "TENANT", "PURPOSE", "BYTES", "FILENAME", "CREATED"),
                   [(row[0], name, *row[1:]) for row, name in zip(rows, tenants)])
    else:
        echo_table(("ID", "PURPOSE", "BYTES", "FILENAME", "CREATED"), rows)
    click.echo(page_hint(len(files), more, files[-1].id if files else None, total))


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
    """Download the bytes of FILE_ID (the file written is readable by you only: 0600)."""
    with api_errors(gateway.base_url):
        content = gateway.client().files.content(file_id).read()
    if str(output) == "-":
        sys.stdout.buffer.write(content)
        return
    target = output or Path(f"{file_id}.jsonl")
    write_private(target, content)
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
