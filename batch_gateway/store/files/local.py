"""The local-directory file store: :class:`LocalFileStore` (the default).

A write goes to ``ROOT/tmp`` and is fsynced, then renamed into place, so an object appears whole or
not at all. A write that fails is removed from ``ROOT/tmp`` whatever failed (``abort`` always
unlinks, even when closing the file raises, e.g. ``ENOSPC`` flushing its buffer, and may be called
any number of times); what a killed process left there is removed by :meth:`LocalFileStore.sweep_temp`
once untouched for ``temp_max_age_s`` (default one hour), when the store is opened and, in the
workers, every purge interval.

Tenants' bytes are private to the service user: folders ``0700``, files ``0600``, whatever the
process umask (:mod:`common.private`).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from batch_gateway.store.files.port import CHUNK_BYTES
from common.private import open_private, private_dir

log = logging.getLogger(__name__)

DEFAULT_TEMP_MAX_AGE_S = 3600.0
"""Age (since the last write) after which a file in ``ROOT/tmp`` is an orphan: an upload or an
output file being written touches its file every few milliseconds, so one idle for an hour has no
writer left (a process killed mid-write)."""


class _LocalUpload:
    def __init__(self, final: Path, tmp: Path):
        self.final = final
        self.tmp = tmp
        self.handle = os.fdopen(open_private(tmp, os.O_WRONLY | os.O_EXCL), "wb")

    def write(self, chunk: bytes) -> None:
        """See :meth:`Upload.write`."""
        self.handle.write(chunk)

    def commit(self) -> None:
        """fsync, then rename into place (see :meth:`Upload.commit`); on failure the temporary
        file is removed and the error raised."""
        try:
            self.handle.flush()
            os.fsync(self.handle.fileno())
            self.handle.close()
            private_dir(self.final.parent)
            os.replace(self.tmp, self.final)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """See :meth:`Upload.abort`: close the file (an error closing it, e.g. ``ENOSPC`` flushing
        its last bytes, is logged, not raised: they are being discarded) and always unlink it.
        Idempotent; a no-op after ``commit``."""
        try:
            if not self.handle.closed:
                self.handle.close()
        except OSError as exc:
            log.debug("temporary file not closed cleanly", extra={"action": "upload_abort", "path": str(self.tmp),
                                                                   "error": str(exc)})
        finally:
            self.tmp.unlink(missing_ok=True)


class LocalFileStore:
    """A :class:`~batch_gateway.store.files.port.FileStore` in a local directory: ``ROOT/files/…``
    for objects, ``ROOT/tmp`` for writes in progress. Opening the store sweeps ``ROOT/tmp`` of
    entries untouched for ``temp_max_age_s`` (:meth:`sweep_temp`)."""

    def __init__(self, root: Path, *, temp_max_age_s: float = DEFAULT_TEMP_MAX_AGE_S):
        self.root = Path(root)
        self.tmp = self.root / "tmp"
        private_dir(self.root)
        private_dir(self.tmp)
        self.temp_max_age_s = temp_max_age_s
        self.sweep_temp()

    def sweep_temp(self, older_than_s: float | None = None) -> int:
        """Remove files in ``ROOT/tmp`` last modified more than ``older_than_s`` seconds ago
        (default ``temp_max_age_s``): writes whose process died. Returns how many; never raises for
        a file that vanished or could not be removed (it is tried again next time)."""
        age = self.temp_max_age_s if older_than_s is None else older_than_s
        cutoff = time.time() - age
        removed = 0
        try:
            entries = list(os.scandir(self.tmp))
        except FileNotFoundError:
            return 0
        for entry in entries:
            try:
                if entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_mtime < cutoff:
                    os.unlink(entry.path)
                    removed += 1
            except OSError:
                continue  # gone already, or not ours to remove: the next sweep tries again
        if removed:
            log.info("stale temporary files removed", extra={"action": "temp_swept", "files": removed,
                                                              "older_than_s": age})
        return removed

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
