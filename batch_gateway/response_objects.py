"""OpenAI's shapes of a stored background response: the Response object (:func:`response_object`)
and the stream of events a client replays later (:func:`response_events`).

The Response object echoes the create request's own fields (``instructions``, ``temperature``,
``tools``, ``metadata``, …, OpenAI's defaults where absent) around the stored ``status``,
``output``, ``usage``, ``error`` and ``incomplete_details``; ``background`` and ``store`` are
true.

Replayed events (OpenAI's streaming events of the Responses API, ``sequence_number`` from 0)::

    response.created (status queued) · response.queued · response.in_progress (once started)
    per output item: response.output_item.added · for a message's text parts:
        response.content_part.added · response.output_text.delta (one per word) ·
        response.output_text.done · response.content_part.done
    response.output_item.done
    response.completed | response.incomplete | response.failed (the final object)

``response.queued`` is OpenAI's event of a background response waiting to run (the SDKs'
``ResponseQueuedEvent``). A cancelled response ends after its ``response.in_progress`` (or
``response.queued``): OpenAI names no stream event for a cancel.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from batch_gateway.store.models import BackgroundResponse
from batch_gateway.store.states import ResponseStatus

#: Request fields echoed in the Response object, with OpenAI's default when the request has none.
ECHOED_DEFAULTS: dict[str, Any] = {
    "instructions": None, "max_output_tokens": None, "max_tool_calls": None, "parallel_tool_calls": True,
    "reasoning": {"effort": None, "summary": None}, "service_tier": "auto", "temperature": 1.0,
    "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [], "top_logprobs": 0, "top_p": 1.0,
    "truncation": "disabled", "user": None, "prompt_cache_key": None, "safety_identifier": None,
}
FINAL_EVENT_TYPES = {ResponseStatus.COMPLETED: "response.completed", ResponseStatus.INCOMPLETE: "response.incomplete",
                     ResponseStatus.FAILED: "response.failed"}
_WORDS = re.compile(r"\s*\S+\s*|\s+")


def response_object(row: BackgroundResponse) -> dict[str, Any]:
    """The Response object of ``row`` as OpenAI renders it (see the module docstring)."""
    request = row.request or {}
    obj: dict[str, Any] = {
        "id": row.id, "object": "response", "created_at": row.created_at, "status": str(row.status),
        "background": True, "error": row.error, "incomplete_details": row.incomplete_details,
        "model": row.model, "output": row.output or [], "previous_response_id": row.previous_response_id,
        "store": True, "usage": row.usage, "metadata": request.get("metadata") or {},
    }
    for field, default in ECHOED_DEFAULTS.items():
        obj[field] = request.get(field, default)
    if row.status == ResponseStatus.COMPLETED:
        obj["completed_at"] = row.finished_at
    return obj


def _as_of(obj: dict[str, Any], status: str) -> dict[str, Any]:
    """``obj`` as it stood while ``status``: no output, usage, error or details yet."""
    early = copy.deepcopy(obj)
    early.update(status=status, output=[], usage=None, error=None, incomplete_details=None)
    early.pop("completed_at", None)
    return early


def _item_events(index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
    """The events that build output item ``index``."""
    item_id = item.get("id", f"item_{index}")
    events: list[dict[str, Any]] = []
    if item.get("type") != "message" or not isinstance(item.get("content"), list):
        return [{"type": "response.output_item.added", "output_index": index, "item": item},
                {"type": "response.output_item.done", "output_index": index, "item": item}]
    events.append({"type": "response.output_item.added", "output_index": index,
                   "item": {**item, "status": "in_progress", "content": []}})
    for c, part in enumerate(item["content"]):
        where = {"item_id": item_id, "output_index": index, "content_index": c}
        if not isinstance(part, dict) or part.get("type") != "output_text":
            events += [{"type": "response.content_part.added", **where, "part": part},
                       {"type": "response.content_part.done", **where, "part": part}]
            continue
        text = str(part.get("text", ""))
        events.append({"type": "response.content_part.added", **where,
                       "part": {**part, "text": "", "annotations": []}})
        events += [{"type": "response.output_text.delta", **where, "delta": word, "logprobs": []}
                   for word in _WORDS.findall(text)]
        events += [{"type": "response.output_text.done", **where, "text": text, "logprobs": []},
                   {"type": "response.content_part.done", **where, "part": part}]
    events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    return events


def response_events(row: BackgroundResponse) -> list[dict[str, Any]]:
    """Every event of ``row``'s stream so far, numbered (``sequence_number`` from 0); see the module
    docstring for the order. A response still open has only its first one or two."""
    obj = response_object(row)
    queued = _as_of(obj, ResponseStatus.QUEUED)
    events: list[dict[str, Any]] = [{"type": "response.created", "response": queued},
                                    {"type": "response.queued", "response": queued}]
    if row.in_progress_at is not None or row.status in FINAL_EVENT_TYPES:
        events.append({"type": "response.in_progress", "response": _as_of(obj, ResponseStatus.IN_PROGRESS)})
    if row.status in FINAL_EVENT_TYPES:
        for index, item in enumerate(obj["output"]):
            if isinstance(item, dict):
                events += _item_events(index, item)
        events.append({"type": FINAL_EVENT_TYPES[ResponseStatus(row.status)], "response": obj})
    return [{**event, "sequence_number": n} for n, event in enumerate(events)]
