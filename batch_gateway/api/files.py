"""``/v1/files``: upload (streamed, byte-capped), retrieve, list, download, delete — as OpenAI."""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Literal
from urllib.parse import quote

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from batch_gateway.api import list_page
from batch_gateway.deps import SessionDep, SettingsDep, StoreDep, TenantDep
from batch_gateway.errors import (
    GatewayError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    RequestTimeoutError,
    ServiceUnavailableError,
)
from batch_gateway.schemas import (
    EXPIRES_AFTER_MAX,
    EXPIRES_AFTER_MIN,
    STORED_PURPOSES,
    UPLOAD_PURPOSES,
    file_object,
)
from batch_gateway.settings import GatewaySettings
from batch_gateway.store import queries
from batch_gateway.store.files import FileStore, storage_key
from batch_gateway.store.models import Tenant
from batch_gateway.uploads import UploadParser, multipart_boundary
from common.logging import tenant_fields

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/files", tags=["files"])


UPLOAD_RETRY_AFTER_SECONDS = 2
"""``Retry-After`` of an upload refused past ``max_concurrent_uploads``: a one-line upload takes
milliseconds, so a slot is usually free again within a second or two."""


class UploadSlots:
    """At most ``limit`` uploads in progress at once (counted on the event loop: the upload handler
    is async, so no lock is needed). :meth:`take` raises :class:`ServiceUnavailableError` (503 with
    ``Retry-After``) when all are taken; :meth:`release` gives one back."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_use = 0

    def take(self) -> None:
        """Hold one slot; raises :class:`ServiceUnavailableError` when none is free."""
        if self.in_use >= self.limit:
            raise ServiceUnavailableError(
                f"The server is handling {self.limit} uploads at the moment. Please retry after a few seconds.",
                retry_after_seconds=UPLOAD_RETRY_AFTER_SECONDS)
        self.in_use += 1

    def release(self) -> None:
        """Give back a slot :meth:`take` held."""
        self.in_use -= 1


class StorageUnavailableError(GatewayError):
    """503: the file store could not take the bytes (e.g. disk full); nothing was registered."""

    status = 503
    type = "server_error"


def _not_found(file_id: str) -> NotFoundError:
    return NotFoundError(f"No such File object: {file_id[:100]}", param="id")


def _expires_after(fields: dict[str, str], purpose: str, default_ttl: int) -> int | None:
    anchor = fields.get("expires_after[anchor]")
    seconds = fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return default_ttl if purpose == "batch" else None
    if anchor != "created_at":
        raise InvalidRequestError("expires_after[anchor] must be 'created_at'.", param="expires_after[anchor]")
    if seconds is None or not seconds.isdigit() or not EXPIRES_AFTER_MIN <= int(seconds) <= EXPIRES_AFTER_MAX:
        raise InvalidRequestError(
            f"expires_after[seconds] must be an integer between {EXPIRES_AFTER_MIN} and {EXPIRES_AFTER_MAX}.",
            param="expires_after[seconds]",
        )
    return int(seconds)


async def _body_chunks(request: Request, idle_timeout: float):
    stream = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), idle_timeout)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise RequestTimeoutError("The request body was not received in time.") from None
        except ClientDisconnect:  # nobody reads the answer; a clean 4xx keeps it out of the 500 path
            raise InvalidRequestError("The client closed the connection before the body was complete.") from None
        if chunk:
            yield chunk


@router.post("")
async def create_file(request: Request, tenant: TenantDep, session: SessionDep,
                      settings: SettingsDep, store: StoreDep) -> dict:
    """Upload a file (multipart ``file`` + ``purpose`` [+ ``expires_after``]); returns the File.

    The cap is ``max_batch_file_bytes`` (200 MB) for ``purpose=batch`` and ``max_file_bytes``
    (512 MB) otherwise; 413 past it. A refused upload leaves no row and no bytes behind. Past
    ``max_concurrent_uploads`` uploads in progress the answer is 503 with ``Retry-After``
    (:class:`UploadSlots`); no database connection is held while the bytes stream.
    """
    slots: UploadSlots = request.app.state.upload_slots
    slots.take()
    try:
        return await _create_file(request, tenant, session, settings, store)
    finally:
        slots.release()


async def _create_file(request: Request, tenant: Tenant, session: Session, settings: GatewaySettings,
                       store: FileStore) -> dict:
    boundary = multipart_boundary(request.headers.get("content-type"))
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise InvalidRequestError("Content-Length must be a non-negative integer.")
        if int(declared) > settings.max_file_bytes + 64 * 1024:
            raise PayloadTooLargeError(
                f"File is too large: the limit is {settings.max_file_bytes} bytes.", param="file"
            )
    file_id = queries.new_id("file-")
    key = storage_key(file_id)
    upload = store.begin(key)
    parser = UploadParser(boundary, upload, settings.max_file_bytes)
    committed = False
    try:
        try:
            async for chunk in _body_chunks(request, settings.body_idle_timeout_seconds):
                parser.feed(chunk)
                if "purpose" in parser.result.fields:
                    if parser.result.fields["purpose"] == "batch":
                        parser.max_file_bytes = settings.max_batch_file_bytes
            parsed = parser.finish()
        except OSError as exc:
            log.error("file store write failed", extra={"action": "upload_failed", "error": str(exc)})
            raise StorageUnavailableError("The file could not be stored; try again later.") from None
        purpose = parsed.fields.get("purpose")
        if purpose is None:
            raise InvalidRequestError("Missing required parameter: 'purpose'.", param="purpose")
        if purpose not in UPLOAD_PURPOSES:
            raise InvalidRequestError(
                f"Invalid value for 'purpose': '{purpose[:64]}'. Supported values are: "
                + ", ".join(f"'{p}'" for p in UPLOAD_PURPOSES) + ".",
                param="purpose",
            )
        if not parsed.has_file:
            raise InvalidRequestError("Missing required parameter: 'file'.", param="file")
        if purpose == "batch" and parsed.size > settings.max_batch_file_bytes:
            raise PayloadTooLargeError(
                f"File is too large: the limit for purpose 'batch' is {settings.max_batch_file_bytes} bytes.",
                param="file",
            )
        ttl = _expires_after(parsed.fields, purpose, settings.batch_file_ttl_seconds)
        try:
            await run_in_threadpool(upload.commit)
        except OSError:
            raise StorageUnavailableError("The file could not be stored; try again later.") from None
        committed = True

        def register():
            row = queries.insert_file(
                session, file_id=file_id, tenant_id=tenant.id, size=parsed.size,
                filename=parsed.filename or "file", purpose=purpose, storage_key=key,
                sha256=parsed.sha256, expires_after_seconds=ttl,
            )
            session.commit()
            return row

        row = await run_in_threadpool(register)
    except BaseException:
        upload.abort()
        if committed:
            store.delete(key)
        raise
    log.info("file uploaded", extra={"action": "file_created", "file_id": file_id,
                                     **tenant_fields(tenant.id, tenant.name), "bytes": row.bytes})
    request.app.state.metrics.file_uploaded(purpose, row.bytes)
    return file_object(row)


@router.get("")
def list_files(tenant: TenantDep, session: SessionDep,
               purpose: Annotated[str | None, Query(max_length=32)] = None,
               limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
               order: Literal["asc", "desc"] = "desc",
               after: Annotated[str | None, Query(max_length=128)] = None) -> dict:
    """List the caller's files (``purpose`` filter, ``limit`` 1..10,000, ``order``, ``after``)."""
    if purpose is not None and purpose not in STORED_PURPOSES:
        raise InvalidRequestError(f"Invalid value for 'purpose': '{purpose}'.", param="purpose")
    page = queries.list_files(session, tenant.id, purpose=purpose, limit=limit, order=order, after=after)
    return list_page(page, after, "File", file_object)


@router.get("/{file_id}")
def retrieve_file(file_id: str, tenant: TenantDep, session: SessionDep) -> dict:
    """The File object; 404 when missing or another tenant's."""
    row = queries.get_file(session, tenant.id, file_id)
    if row is None:
        raise _not_found(file_id)
    return file_object(row)


@router.delete("/{file_id}")
def delete_file(file_id: str, tenant: TenantDep, session: SessionDep, store: StoreDep) -> dict:
    """Delete a file: ``{id, object: "file", deleted: true}``. Bytes still read by a running batch
    are kept until it ends; the file is gone from the API at once."""
    row = queries.delete_file(session, tenant.id, file_id)
    if row is None:
        raise _not_found(file_id)
    in_use = queries.file_in_use(session, file_id)
    session.commit()
    if not in_use:
        store.delete(row.storage_key)
        queries.mark_purged(session, [row.id])
        session.commit()
    return {"id": row.id, "object": "file", "deleted": True}


def content_disposition(filename: str) -> str:
    """``attachment`` with an ASCII fallback and the RFC 5987 UTF-8 form of ``filename``."""
    ascii_name = filename.encode("ascii", "replace").decode().replace('"', "_").replace("\\", "_")
    return f"attachment; filename=\"{ascii_name}\"; filename*=UTF-8''{quote(filename, safe='')}"


@router.get("/{file_id}/content")
def file_content(file_id: str, tenant: TenantDep, session: SessionDep, store: StoreDep) -> StreamingResponse:
    """The file's bytes, streamed."""
    row = queries.get_file(session, tenant.id, file_id)
    if row is None:
        raise _not_found(file_id)
    try:
        chunks = store.read(row.storage_key)
    except FileNotFoundError:
        raise _not_found(file_id) from None
    return StreamingResponse(
        chunks,
        media_type="application/octet-stream",
        headers={"content-length": str(row.bytes),
                 "content-disposition": content_disposition(row.filename)},
    )
