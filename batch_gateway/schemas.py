"""Wire shapes of the API: request bodies (pydantic, strict) and OpenAI's object layouts.

``file_object`` and ``batch_object`` render rows exactly as OpenAI's File (9 fields) and Batch
(22 fields) objects; ``list_object`` is the list envelope with ``first_id``/``last_id``/``has_more``.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

from batch_gateway.store.models import Batch, File

BATCH_ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/moderations",
)
UPLOAD_PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
STORED_PURPOSES = UPLOAD_PURPOSES + ("batch_output", "assistants_output", "fine-tune-results")

EXPIRES_AFTER_MIN, EXPIRES_AFTER_MAX = 3600, 2_592_000
"""Bounds of ``expires_after[seconds]`` (1 hour .. 30 days), from OpenAI's API reference."""

WINDOW_MIN, WINDOW_MAX = 60, 30 * 24 * 3600
"""Bounds of our ``completion_window`` extension: 1 minute .. 30 days (files live 30 days)."""

_WINDOW = re.compile(r"([1-9][0-9]{0,6})([smhd])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def window_seconds(window: str) -> int:
    """Seconds in a completion window: OpenAI's ``24h``, or our extension ``<n>s|m|h|d`` between
    1 minute and 30 days (``30m``, ``2h``, ``7d``). Raises ``ValueError`` otherwise."""
    match = _WINDOW.fullmatch(window)  # the whole string: "24h\n" is refused ($ matches before a final \n)
    if not match:
        raise ValueError("completion_window must be '24h' or a duration such as '30m', '2h' or '7d'")
    seconds = int(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    if not WINDOW_MIN <= seconds <= WINDOW_MAX:
        raise ValueError("completion_window must be between 1 minute and 30 days")
    return seconds


class ExpiresAfter(BaseModel):
    """``{"anchor": "created_at", "seconds": 3600..2592000}``."""

    model_config = ConfigDict(extra="forbid")
    anchor: Literal["created_at"]
    seconds: StrictInt = Field(ge=EXPIRES_AFTER_MIN, le=EXPIRES_AFTER_MAX)


class CreateBatch(BaseModel):
    """Body of ``POST /v1/batches``."""

    model_config = ConfigDict(extra="forbid")
    input_file_id: StrictStr = Field(min_length=1, max_length=64)
    endpoint: StrictStr
    completion_window: StrictStr
    metadata: dict[StrictStr, StrictStr] | None = None
    output_expires_after: ExpiresAfter | None = None

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, value: str) -> str:
        if value not in BATCH_ENDPOINTS:
            raise ValueError(
                f"Invalid value: '{value[:100]}'. Supported values are: "
                + ", ".join(f"'{e}'" for e in BATCH_ENDPOINTS) + "."
            )
        return value

    @field_validator("completion_window")
    @classmethod
    def _window(cls, value: str) -> str:
        window_seconds(value)
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return value
        if len(value) > 16:
            raise ValueError("metadata may hold at most 16 key-value pairs")
        for key, item in value.items():
            if len(key) > 64:
                raise ValueError("metadata keys may be at most 64 characters long")
            if len(item) > 512:
                raise ValueError("metadata values may be at most 512 characters long")
            if "\x00" in key or "\x00" in item:
                raise ValueError("metadata keys and values may not contain NUL characters")
        return value


def file_object(row: File) -> dict:
    """OpenAI's File object."""
    return {
        "id": row.id,
        "object": "file",
        "bytes": row.bytes,
        "created_at": row.created_at,
        "expires_at": row.expires_at,
        "filename": row.filename,
        "purpose": row.purpose,
        "status": row.status,
        "status_details": row.status_details,
    }


def batch_object(row: Batch) -> dict:
    """OpenAI's Batch object (22 fields); ``output_expires_after`` is stored, not echoed."""
    return {
        "id": row.id,
        "object": "batch",
        "endpoint": row.endpoint,
        "model": row.model,
        "errors": {"object": "list", "data": row.errors} if row.errors else None,
        "input_file_id": row.input_file_id,
        "completion_window": row.completion_window,
        "status": row.status,
        "output_file_id": row.output_file_id,
        "error_file_id": row.error_file_id,
        "created_at": row.created_at,
        "in_progress_at": row.in_progress_at,
        "expires_at": row.expires_at,
        "finalizing_at": row.finalizing_at,
        "completed_at": row.completed_at,
        "failed_at": row.failed_at,
        "expired_at": row.expired_at,
        "cancelling_at": row.cancelling_at,
        "cancelled_at": row.cancelled_at,
        "request_counts": {
            "total": row.request_total,
            "completed": row.request_completed,
            "failed": row.request_failed,
        },
        "usage": {
            "input_tokens": row.usage_input_tokens,
            "input_tokens_details": {"cached_tokens": row.usage_cached_tokens},
            "output_tokens": row.usage_output_tokens,
            "output_tokens_details": {"reasoning_tokens": row.usage_reasoning_tokens},
            "total_tokens": row.usage_input_tokens + row.usage_output_tokens,
        },
        "metadata": row.metadata_,
    }


def list_object(data: list[dict], has_more: bool) -> dict:
    """OpenAI's list envelope."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }
