"""The local-directory file store: :class:`LocalFileStore` (the default).

A write goes to ``ROOT/tmp`` and is fsynced, then renamed into place, so an object appears whole or
not at all.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

from batch_gateway.store.files.port import CHUNK_BYTES


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
    """A :class:`~batch_gateway.store.files.port.FileStore` in a local directory: ``ROOT/files/…`` for objects, ``ROOT/tmp`` for
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
