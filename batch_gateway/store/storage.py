"""The file store: where file bytes live (never in Postgres rows).

One small interface, :class:`FileStore`, with two implementations: a local directory,
:class:`LocalFileStore` (the default), and any S3-compatible bucket,
:class:`~batch_gateway.store.storage_s3.S3FileStore`; :func:`build_file_store` picks one from the settings.
Keys are derived from object ids only (``files/ab/file-ab…``), never from
user file names. An object becomes visible only when its upload is committed, at once and whole (the
local store renames a temporary file; S3 completes an upload), so a crash or a rejected upload leaves
no partial object behind.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from batch_gateway.store.settings import SharedSettings

CHUNK_BYTES = 1024 * 1024


def storage_key(object_id: str) -> str:
    """The store key of object ``object_id`` (e.g. ``file-3fa9…`` → ``files/3f/file-3fa9…``).

    Raises ``ValueError`` for an id that is not ``[A-Za-z0-9_-]`` only.
    """
    if not object_id or not all(c.isascii() and (c.isalnum() or c in "-_") for c in object_id):
        raise ValueError(f"unsafe object id {object_id!r}")
    shard = object_id.split("-", 1)[-1][:2]
    return f"files/{shard}/{object_id}"


class Upload(Protocol):
    """An object being written: ``write`` chunks, then ``commit`` (visible) or ``abort`` (gone)."""

    def write(self, chunk: bytes) -> None:
        """Append ``chunk``; raises ``OSError`` (e.g. ``ENOSPC``) when the store cannot take it."""

    def commit(self) -> None:
        """Make the object visible under its key, atomically."""

    def abort(self) -> None:
        """Discard what was written; the key is untouched."""


class FileStore(Protocol):
    """Bytes by key. Implementations: :class:`LocalFileStore`,
    :class:`~batch_gateway.store.storage_s3.S3FileStore`. Every method raises ``ValueError`` for an
    unsafe key and ``OSError`` when the store fails."""

    def begin(self, key: str) -> Upload:
        """Start writing ``key``; nothing is visible until ``commit``."""

    def read(self, key: str, offset: int = 0, length: int | None = None,
             chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        """Yield the bytes of ``key`` from ``offset`` (``length`` bytes, or to the end) in chunks.
        Raises ``FileNotFoundError`` when the key is missing."""

    def delete(self, key: str) -> None:
        """Remove ``key``; missing keys are ignored."""

    def size(self, key: str) -> int:
        """Bytes in ``key``; raises ``FileNotFoundError`` when the key is missing."""

    def exists(self, key: str) -> bool:
        """Whether ``key`` holds a committed object."""


class _LocalUpload:
    def __init__(self, final: Path, tmp: Path):
        self.final = final
        self.tmp = tmp
        self.handle = open(tmp, "wb")

    def write(self, chunk: bytes) -> None:
        """See :meth:`Upload.write`."""
        self.handle.write(chunk)

    def commit(self) -> None:
        """fsync, then rename into place (see :meth:`Upload.commit`)."""
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        self.final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.tmp, self.final)

    def abort(self) -> None:
        """See :meth:`Upload.abort`."""
        if not self.handle.closed:
            self.handle.close()
        self.tmp.unlink(missing_ok=True)


class LocalFileStore:
    """A :class:`FileStore` in a local directory: ``ROOT/files/…`` for objects, ``ROOT/tmp`` for
    writes in progress (cleared of stale entries at start)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.tmp = self.root / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root.resolve() not in path.parents:
            raise ValueError(f"key escapes the store: {key!r}")
        return path

    def begin(self, key: str) -> _LocalUpload:
        """See :meth:`FileStore.begin`; raises ``ValueError`` for a key outside the root."""
        return _LocalUpload(self._path(key), self.tmp / uuid.uuid4().hex)

    def read(self, key: str, offset: int = 0, length: int | None = None,
             chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        """See :meth:`FileStore.read`."""
        handle = open(self._path(key), "rb")  # raises FileNotFoundError before the first chunk

        def chunks() -> Iterator[bytes]:
            with handle:
                handle.seek(offset)
                left = length
                while left is None or left > 0:
                    data = handle.read(chunk_bytes if left is None else min(chunk_bytes, left))
                    if not data:
                        return
                    if left is not None:
                        left -= len(data)
                    yield data

        return chunks()

    def delete(self, key: str) -> None:
        """See :meth:`FileStore.delete`."""
        self._path(key).unlink(missing_ok=True)

    def size(self, key: str) -> int:
        """See :meth:`FileStore.size`."""
        return self._path(key).stat().st_size

    def exists(self, key: str) -> bool:
        """See :meth:`FileStore.exists`."""
        return self._path(key).is_file()


def build_file_store(settings: SharedSettings) -> FileStore:
    """The store ``settings.file_store`` names: ``local`` (default) → :class:`LocalFileStore` under
    ``DATA_DIR/files``; ``s3`` → :class:`~batch_gateway.store.storage_s3.S3FileStore` on
    ``settings.s3_bucket`` (boto3 is imported only then)."""
    if settings.file_store == "s3":
        from batch_gateway.store.storage_s3 import S3FileStore

        return S3FileStore(settings.s3_bucket, prefix=settings.s3_prefix, part_bytes=settings.s3_part_bytes,
                           endpoint_url=settings.s3_endpoint_url, region_name=settings.s3_region,
                           addressing_style=settings.s3_addressing_style)
    return LocalFileStore(settings.files_dir)
