"""The cached prompt tokens an engine reported, read from its answer (``usage.prompt_tokens_details.
cached_tokens``): always present in JSON answers; in streams only in the last ``data:`` event with a
``usage`` object, sent when the client asked for ``stream_options.include_usage``."""

from __future__ import annotations

import orjson

#: How many bytes of a stream's end are kept to find its usage event.
SSE_TAIL_BYTES = 8192


def cached_tokens_from_json(data: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a JSON answer, or None."""
    try:
        usage = orjson.loads(data).get("usage") or {}
        return (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    except (orjson.JSONDecodeError, AttributeError, TypeError):
        return None


def cached_tokens_from_sse_tail(tail: bytes) -> int | None:
    """The cached tokens of the last ``data:`` event carrying ``usage`` in a stream's tail, or None."""
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            return cached_tokens_from_json(line[6:])
    return None
