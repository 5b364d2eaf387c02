"""What the processor and the router read of an OpenAI request body to bound it: the output tokens
it asks for (``../shared/contracts/openai-batch.md``; OpenAI's API reference for Chat Completions,
Completions and Responses)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeGuard

ROUTED_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
"""The OpenAI paths the platform serves: those the router forwards to the engines
(``router/app.py`` ``INFERENCE_PATHS``, kept equal by a test). A batch for any other endpoint (e.g.
``/v1/moderations``, which OpenAI's Batch API takes but no vLLM engine serves) fails validation."""

OUTPUT_TOKEN_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
"""Output budget fields per choice, in the order they are looked for: Chat Completions'
``max_completion_tokens`` (which replaces its ``max_tokens``), Completions' ``max_tokens``,
Responses' ``max_output_tokens``."""


def requested_output_tokens(body: Mapping[str, Any], budget: int | None = None) -> int:
    """Output tokens ``body`` asks for in all: its budget (``budget`` when the caller parsed it
    already, else the first positive integer of :data:`OUTPUT_TOKEN_FIELDS`) times ``n`` (1 unless a
    positive integer); 0 when no budget is named."""
    tokens: int = budget if budget is not None else next(
        (body[f] for f in OUTPUT_TOKEN_FIELDS if _positive_int(body.get(f))), 0)
    n = body.get("n")
    choices = n if _positive_int(n) else 1
    return tokens * choices


def _positive_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
