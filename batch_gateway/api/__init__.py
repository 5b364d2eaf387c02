"""HTTP routes: ``files`` and ``batches`` under ``/v1``; ``operator`` (every tenant, admin key) under ``/admin/api/operator``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from batch_gateway.errors import InvalidRequestError
from batch_gateway.schemas import list_object


def list_page(page: tuple[list, bool] | None, after: str | None, kind: str,
              render: Callable[[Any], dict]) -> dict:
    """OpenAI's list envelope for a page from ``queries``; raises 400 (``param: after``) when the
    cursor named no object of the caller (a missing and a foreign id answer the same)."""
    if page is None:
        raise InvalidRequestError(f"No such {kind} object for 'after': {after}", param="after")
    rows, has_more = page
    return list_object([render(row) for row in rows], has_more)
