"""Settings the gateway and the workers share: the stores, the data directory, batch limits.

Environment variables: ``DATABASE_URL`` (or ``BACKFILL_DATABASE_URL``), ``REDIS_URL`` (or
``BACKFILL_REDIS_URL``), ``BACKFILL_DATA_DIR`` and the ``BACKFILL_…`` names below. Each service
extends :class:`SharedSettings` with its own prefix (``batch_gateway.settings``,
``workers.settings``); nothing is built at import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MB = 1024 * 1024


def sqlalchemy_url(url: str) -> str:
    """Return ``url`` with the psycopg 3 driver named (``postgresql+psycopg://``).

    Accepts ``postgres://``, ``postgresql://`` and ``postgresql+psycopg://`` URLs; raises
    ``ValueError`` for any other scheme.
    """
    for prefix in ("postgresql+psycopg://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    raise ValueError(f"not a PostgreSQL URL: {url.split(':', 1)[0]}://…")


class SharedSettings(BaseSettings):
    """What the gateway and the workers both read: the stores, the data directory, batch limits.

    Defaults follow OpenAI's published limits (contracts/openai-batch.md): 50,000 requests per batch.
    """

    model_config = SettingsConfigDict(extra="ignore", populate_by_name=True)

    database_url: str = Field(validation_alias=AliasChoices("BACKFILL_DATABASE_URL", "DATABASE_URL"))
    redis_url: str = Field(validation_alias=AliasChoices("BACKFILL_REDIS_URL", "REDIS_URL"))
    data_dir: Path = Field(default=Path(".data"), validation_alias="BACKFILL_DATA_DIR")
    max_requests_per_batch: int = Field(default=50_000, validation_alias="BACKFILL_MAX_REQUESTS_PER_BATCH")
    default_enqueued_token_limit: int = Field(
        default=5_000_000_000, validation_alias="BACKFILL_DEFAULT_ENQUEUED_TOKEN_LIMIT"
    )
    """Per-tenant enqueued batch tokens when the tenant row sets none (OpenAI's tier-5 limit for
    its largest models is of this order)."""

    task_queue: str = Field(default="backfill", validation_alias="BACKFILL_TASK_QUEUE")
    """Celery queue of the lifecycle tasks (one per deployment; tests use one per test)."""

    file_store: Literal["local", "s3"] = Field(default="local", validation_alias="BACKFILL_FILE_STORE")
    """Where file bytes go: ``local`` (``DATA_DIR/files``) or ``s3`` (any S3-compatible bucket)."""
    s3_bucket: str | None = Field(default=None, validation_alias="BACKFILL_S3_BUCKET")
    s3_prefix: str = Field(default="", validation_alias="BACKFILL_S3_PREFIX")
    """Key prefix inside the bucket (e.g. ``backfill/prod``); objects go to ``PREFIX/files/…``."""
    s3_endpoint_url: str | None = Field(default=None, validation_alias="BACKFILL_S3_ENDPOINT_URL")
    """An S3-compatible service (MinIO, R2, moto); None is AWS S3."""
    s3_region: str | None = Field(default=None, validation_alias="BACKFILL_S3_REGION")
    """None leaves the region to boto3's chain (``AWS_REGION``, ``AWS_DEFAULT_REGION``, profile)."""
    s3_addressing_style: Literal["auto", "path", "virtual"] = Field(
        default="auto", validation_alias="BACKFILL_S3_ADDRESSING_STYLE")
    """botocore's bucket addressing; MinIO usually wants ``path``."""
    s3_part_bytes: int = Field(default=8 * MB, ge=5 * MB, validation_alias="BACKFILL_S3_PART_BYTES")
    """Multipart part size, bytes: the most one upload buffers in memory. Default 8 MiB (boto3's
    ``multipart_chunksize``); at least 5 MiB, S3's smallest part."""

    @model_validator(mode="after")
    def _s3_bucket_given(self):
        if self.file_store == "s3" and not self.s3_bucket:
            raise ValueError("BACKFILL_FILE_STORE=s3 needs BACKFILL_S3_BUCKET")
        return self

    @field_validator("database_url")
    @classmethod
    def _driver(cls, value: str) -> str:
        return sqlalchemy_url(value)

    @property
    def files_dir(self) -> Path:
        """Root of the local file store (``DATA_DIR/files``)."""
        return self.data_dir / "files"
