"""The enqueued-token quota's wording, shared by the API (a create over the quota, 429) and the
validation task (a batch whose real estimate is over it, ``failed``)."""

from __future__ import annotations


def token_limit_message(tenant_name: str, limit: int, model: str | None = None) -> str:
    """OpenAI's wording for an enqueued-token quota reached (``token_limit_exceeded``)."""
    return (
        f"Enqueued token limit reached for {model or 'this model'} in organization {tenant_name}. "
        f"Limit: {limit:,} enqueued tokens. Please try again once some in_progress batches have "
        "been completed."
    )
