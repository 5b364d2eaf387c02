"""The file store: where file bytes live (never in Postgres rows).

One small port, :class:`~.port.FileStore` (:mod:`.port`), with two implementations: a local
directory, :class:`~.local.LocalFileStore` (the default, :mod:`.local`), and any S3-compatible
bucket, :class:`~.s3.S3FileStore` (:mod:`.s3`); :func:`build_file_store` picks one from the
settings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batch_gateway.store.files.local import LocalFileStore
from batch_gateway.store.files.port import CHUNK_BYTES, FileStore, Upload, storage_key

if TYPE_CHECKING:
    from batch_gateway.store.settings import SharedSettings

__all__ = ["CHUNK_BYTES", "FileStore", "LocalFileStore", "Upload", "build_file_store", "storage_key"]


def build_file_store(settings: SharedSettings) -> FileStore:
    """The store ``settings.file_store`` names: ``local`` (default) → :class:`LocalFileStore` under
    ``DATA_DIR/files``; ``s3`` → :class:`~batch_gateway.store.files.s3.S3FileStore` on
    ``settings.s3_bucket`` (boto3 is imported only then)."""
    if settings.file_store == "s3":
        from batch_gateway.store.files.s3 import S3FileStore

        if not settings.s3_bucket:  # SharedSettings refuses this already
            raise ValueError("BACKFILL_FILE_STORE=s3 needs BACKFILL_S3_BUCKET")
        return S3FileStore(settings.s3_bucket, prefix=settings.s3_prefix, part_bytes=settings.s3_part_bytes,
                           endpoint_url=settings.s3_endpoint_url, region_name=settings.s3_region,
                           addressing_style=settings.s3_addressing_style)
    return LocalFileStore(settings.files_dir)
