"""The cached prompt tokens an engine reported, read from its answer (``usage.prompt_tokens_details.
cached_tokens``): always present in JSON answers; in streams only in the last ``data:`` event with a
``usage`` object, sent when the client asked for ``stream_options.include_usage``."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

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


#: End of one SSE event (a blank line; either line ending).
EVENT_END = re.compile(rb"\r?\n\r?\n")


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[list[bytes]]:
    """The events of an SSE byte stream, each whole with its blank-line end, in the groups that
    complete with each chunk; what is left after the last chunk (a partial event) comes last, alone."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        out: list[bytes] = []
        while (end := EVENT_END.search(buffer)) is not None:
            out.append(buffer[:end.end()])
            buffer = buffer[end.end():]
        if out:
            yield out
    if buffer:
        yield [buffer]


def with_cached_tokens(answer: dict, cached_tokens: int) -> bool:
    """Set ``usage.prompt_tokens_details.cached_tokens`` of a decoded answer (or stream chunk) to
    ``cached_tokens`` where the engine reported it; True when it did."""
    usage = answer.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    if not isinstance(details, dict) or "cached_tokens" not in details:
        return False
    details["cached_tokens"] = cached_tokens
    return True
