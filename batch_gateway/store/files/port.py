"""The file store's port: :class:`FileStore` and :class:`Upload`, and the keys objects live under.

Keys are derived from object ids only (``files/ab/file-ab…``), never from user file names. An object
becomes visible only when its upload is committed, at once and whole, so a crash or a rejected
upload leaves no partial object behind.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

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
        """Discard what was written; the key is untouched. Never raises; calling it again, or
        after ``commit``, does nothing more."""


class FileStore(Protocol):
    """Bytes by key. Implementations: :class:`~batch_gateway.store.files.local.LocalFileStore`,
    :class:`~batch_gateway.store.files.s3.S3FileStore`. Every method raises ``ValueError`` for an
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

    def sweep_temp(self, older_than_s: float | None = None) -> int:
        """Remove what writes whose process died left behind (untouched for ``older_than_s``
        seconds, default the store's own age); returns how many were removed."""
