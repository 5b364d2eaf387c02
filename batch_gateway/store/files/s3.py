"""The S3-compatible file store: :class:`S3FileStore` (AWS S3, MinIO, Cloudflare R2, Ceph RGW, moto).

The same port as :class:`~batch_gateway.store.files.LocalFileStore`, with the same promises:

- **Streamed writes.** An upload keeps at most one part in memory (``part_bytes``, default 8 MiB).
  An object that ends within its first part is sent with one ``PutObject``; a larger one becomes a
  multipart upload, one ``UploadPart`` each time the buffer reaches ``part_bytes``.
- **Atomic publish.** S3 shows an object only once ``PutObject`` or ``CompleteMultipartUpload``
  succeeded, so readers never see a partial object. Any error while writing or committing aborts
  the multipart upload (``AbortMultipartUpload``) before the error is raised, and ``abort()`` does
  the same, so no parts are left behind. Parts of a process killed mid-upload stay invisible; they
  are aborted by :meth:`S3FileStore.sweep_temp` once older than ``temp_max_age_s`` (or by a bucket
  lifecycle rule, ``AbortIncompleteMultipartUpload``).
- **Streamed reads.** ``GetObject`` (with a ``Range`` for an offset or a length) read in chunks.
- **Errors** are the local store's: ``FileNotFoundError`` for a missing key, ``PermissionError`` for
  access denied, ``OSError`` (``EIO``) for any other S3 or network failure.

Credentials come from boto3's standard chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
``AWS_PROFILE``, web identity, instance metadata, …); nothing here reads them.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from batch_gateway.store.files.port import CHUNK_BYTES

log = logging.getLogger(__name__)

MIB = 1024 * 1024
MIN_PART_BYTES = 5 * MIB
"""S3's smallest part of a multipart upload, the last part excepted (AWS S3 user guide, "Amazon S3
multipart upload limits"). Stores such as MinIO and R2 enforce the same."""
DEFAULT_PART_BYTES = 8 * MIB
"""boto3's own ``multipart_chunksize`` default (``boto3.s3.transfer.TransferConfig``)."""
MAX_PARTS = 10_000
"""S3's largest number of parts per upload: with 8 MiB parts an object may reach 78 GiB."""

_MISSING = {"NoSuchKey", "404", "NotFound"}
_DENIED = {"AccessDenied", "403", "Forbidden"}
_AWS_ERRORS = (BotoCoreError, ClientError)


def _code(exc: Exception) -> str:
    return exc.response.get("Error", {}).get("Code", "") if isinstance(exc, ClientError) else ""


def _os_error(exc: Exception, key: str) -> OSError:
    """The local store's exception for an S3 error ``exc`` on ``key``."""
    code = _code(exc)
    if code in _MISSING:
        return FileNotFoundError(errno.ENOENT, "no such object", key)
    if code in _DENIED:
        return PermissionError(errno.EACCES, f"S3 denied access ({code})", key)
    return OSError(errno.EIO, f"S3 request failed: {code or type(exc).__name__}: {exc}", key)


class _S3Upload:
    """One object being written (see :class:`~batch_gateway.store.files.Upload`).

    A full part is handed to the store's sender threads (the first one also starts the multipart
    upload) and ``write`` returns at once, so the gateway's event loop is not held for S3 calls; it
    waits only when the previous part of this upload is still being sent (at most two parts in
    memory: one in flight, one filling).
    A failed part is reported by the next ``write`` that fills a part, or by ``commit``.
    """

    def __init__(self, store: S3FileStore, key: str):
        self._store = store
        self._key = key
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[dict] = []
        self._in_flight: Future | None = None
        self._state = "open"  # open | committed | aborted

    def _check_open(self) -> None:
        if self._state != "open":
            raise ValueError(f"upload of {self._key!r} is {self._state}")

    def _send_part(self, body: bytes, number: int) -> dict:
        if self._upload_id is None:  # the first part starts the multipart upload
            self._upload_id = self._store.client.create_multipart_upload(
                Bucket=self._store.bucket, Key=self._key)["UploadId"]
        reply = self._store.client.upload_part(Bucket=self._store.bucket, Key=self._key,
                                               UploadId=self._upload_id, PartNumber=number, Body=body)
        return {"ETag": reply["ETag"], "PartNumber": number}

    def _wait_part(self) -> None:
        """Wait for the part in flight; raises its error."""
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            self._parts.append(in_flight.result())

    def _next_part(self) -> bytes:
        self._wait_part()
        if len(self._parts) >= MAX_PARTS:
            raise OSError(errno.EFBIG, f"object exceeds {MAX_PARTS} parts of {self._store.part_bytes} bytes",
                          self._key)
        body, self._buffer = bytes(self._buffer), bytearray()
        return body

    def _start_part(self) -> None:
        body = self._next_part()
        self._in_flight = self._store.sender.submit(self._send_part, body, len(self._parts) + 1)

    def _publish(self) -> None:
        client, bucket = self._store.client, self._store.bucket
        self._wait_part()
        if self._upload_id is None:
            client.put_object(Bucket=bucket, Key=self._key, Body=bytes(self._buffer))
            return
        if self._buffer:
            self._parts.append(self._send_part(self._next_part(), len(self._parts) + 1))
        client.complete_multipart_upload(Bucket=bucket, Key=self._key, UploadId=self._upload_id,
                                          MultipartUpload={"Parts": self._parts})

    def _abort_on_error(self, action) -> None:
        """Run ``action``; on any exception abort the upload, then raise (S3 errors as ``OSError``)."""
        try:
            action()
        except BaseException as exc:
            self.abort()
            if isinstance(exc, _AWS_ERRORS):
                raise _os_error(exc, self._key) from exc
            raise

    def write(self, chunk: bytes) -> None:
        """Append ``chunk``; a full part (``part_bytes``) goes to the sender threads. On failure
        (this part's start or the previous part's PUT) the upload is aborted and ``OSError``
        raised; ``ValueError`` after ``commit``/``abort``."""
        self._check_open()
        self._buffer += chunk
        if len(self._buffer) >= self._store.part_bytes:
            self._abort_on_error(self._start_part)

    def commit(self) -> None:
        """Publish the object: one ``PutObject``, or the last part and ``CompleteMultipartUpload``.
        On failure the upload is aborted and ``OSError`` raised (the key keeps what it had)."""
        self._check_open()
        self._abort_on_error(self._publish)
        self._state = "committed"
        self._buffer = bytearray()

    def abort(self) -> None:
        """Discard what was written: wait for the part in flight, then ``AbortMultipartUpload``.
        No-op after ``commit``; never raises (a failed abort is logged, the parts stay invisible)."""
        if self._state != "open":
            return
        self._state = "aborted"
        self._buffer = bytearray()
        if self._in_flight is not None:
            wait([self._in_flight])
            self._in_flight = None
        if self._upload_id is None:
            return
        upload_id, self._upload_id = self._upload_id, None
        try:
            self._store.client.abort_multipart_upload(Bucket=self._store.bucket, Key=self._key,
                                                      UploadId=upload_id)
        except _AWS_ERRORS as exc:
            log.warning("multipart upload not aborted", extra={"action": "s3_abort_failed", "key": self._key,
                                                              "upload_id": upload_id, "error": str(exc)})


class S3FileStore:
    """A :class:`~batch_gateway.store.files.FileStore` in bucket ``bucket`` under ``prefix``.

    ``part_bytes``: bytes per multipart part and the most an upload buffers (default 8 MiB, at
    least 1; S3 itself refuses parts under 5 MiB but the last). ``endpoint_url`` selects an
    S3-compatible service (MinIO, R2, moto); ``region_name`` and ``addressing_style`` (``auto``,
    ``path``, ``virtual``) are passed to botocore. ``sender_threads``: threads sending parts for
    all uploads of this store (each upload has at most one part in flight). The boto3 client and
    the threads are made on first use in each process (a forked worker never reuses its parent's).
    """

    def __init__(self, bucket: str, *, prefix: str = "", part_bytes: int = DEFAULT_PART_BYTES,
                 endpoint_url: str | None = None, region_name: str | None = None,
                 addressing_style: str = "auto", sender_threads: int = 8, max_pool_connections: int = 32,
                 temp_max_age_s: float = 3600.0):
        if not bucket:
            raise ValueError("an S3 file store needs a bucket")
        if part_bytes < 1:
            raise ValueError("part_bytes must be positive")
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.part_bytes = part_bytes
        self.temp_max_age_s = temp_max_age_s
        self._client_args = {
            "endpoint_url": endpoint_url or None,
            "region_name": region_name or None,
            "config": Config(s3={"addressing_style": addressing_style}, retries={"mode": "standard"},
                             max_pool_connections=max_pool_connections),
        }
        self._sender_threads = sender_threads
        self._lock = threading.Lock()
        self._client = None
        self._sender: ThreadPoolExecutor | None = None
        self._pid = 0

    def _per_process(self) -> None:
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    self._client = boto3.session.Session().client("s3", **self._client_args)
                    self._sender = ThreadPoolExecutor(self._sender_threads, thread_name_prefix="s3-parts")
                    self._pid = os.getpid()

    @property
    def client(self):
        """This process's boto3 S3 client (thread-safe once built)."""
        self._per_process()
        return self._client

    @property
    def sender(self) -> ThreadPoolExecutor:
        """This process's threads that send multipart parts."""
        self._per_process()
        assert self._sender is not None  # set by _per_process
        return self._sender

    def object_key(self, key: str) -> str:
        """The S3 object key of store key ``key`` (``prefix/key``). Raises ``ValueError`` for an
        empty key, a leading ``/`` or a ``.``/``..``/empty segment (what the local store refuses
        as escaping its root)."""
        if not key or any(part in ("", ".", "..") for part in key.split("/")):
            raise ValueError(f"unsafe store key {key!r}")
        return self.prefix + key

    def begin(self, key: str) -> _S3Upload:
        """See :meth:`FileStore.begin` (nothing is sent before the first full part)."""
        return _S3Upload(self, self.object_key(key))

    def read(self, key: str, offset: int = 0, length: int | None = None,
             chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        """See :meth:`FileStore.read`; ``FileNotFoundError`` is raised before the first chunk, and a
        failure mid-stream as ``OSError``."""
        name = self.object_key(key)
        if length is not None and length <= 0:
            self.size(key)  # FileNotFoundError when missing
            return iter(())
        args = {"Bucket": self.bucket, "Key": name}
        if offset or length is not None:  # a Range on an empty object is refused (416)
            args["Range"] = f"bytes={offset}-" + ("" if length is None else str(offset + length - 1))
        try:
            body = self.client.get_object(**args)["Body"]
        except _AWS_ERRORS as exc:
            if _code(exc) == "InvalidRange":  # offset at or past the end: nothing to read
                return iter(())
            raise _os_error(exc, key) from exc

        def chunks() -> Iterator[bytes]:
            try:
                yield from body.iter_chunks(chunk_bytes)
            except _AWS_ERRORS as exc:
                raise _os_error(exc, key) from exc
            finally:
                body.close()

        return chunks()

    def delete(self, key: str) -> None:
        """See :meth:`FileStore.delete` (S3 answers a missing key with success too). Raises
        ``OSError`` when S3 fails."""
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.object_key(key))
        except _AWS_ERRORS as exc:
            raise _os_error(exc, key) from exc

    def size(self, key: str) -> int:
        """See :meth:`FileStore.size` (``HeadObject``)."""
        try:
            return self.client.head_object(Bucket=self.bucket, Key=self.object_key(key))["ContentLength"]
        except _AWS_ERRORS as exc:
            raise _os_error(exc, key) from exc

    def sweep_temp(self, older_than_s: float | None = None) -> int:
        """Abort the multipart uploads under the prefix started more than ``older_than_s`` seconds
        ago (default ``temp_max_age_s``, one hour): a writer killed mid-upload. Returns how many;
        ``OSError`` when listing fails (an abort that fails is left for the next sweep)."""
        age = self.temp_max_age_s if older_than_s is None else older_than_s
        cutoff = time.time() - age
        removed = 0
        try:
            pages = self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket,
                                                                                Prefix=self.prefix)
            stale = [(u["Key"], u["UploadId"]) for page in pages for u in page.get("Uploads", ())
                     if u["Initiated"].timestamp() < cutoff]
        except _AWS_ERRORS as exc:
            raise _os_error(exc, self.prefix) from exc
        for key, upload_id in stale:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
                removed += 1
            except _AWS_ERRORS as exc:
                log.warning("stale multipart upload not aborted", extra={
                    "action": "s3_abort_failed", "key": key, "upload_id": upload_id, "error": str(exc)})
        return removed

    def exists(self, key: str) -> bool:
        """See :meth:`FileStore.exists` (``HeadObject``); ``OSError`` when S3 fails otherwise."""
        try:
            self.size(key)
        except FileNotFoundError:
            return False
        return True
