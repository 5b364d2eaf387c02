"""OpenAI's flex processing (``service_tier: "flex"``) at the router.

OpenAI's flex tier (platform.openai.com/docs/guides/flex-processing) is the ordinary synchronous
call on Chat Completions or Responses, served "with slower response times and occasional resource
unavailability": clients raise their timeout to about 15 minutes and get a 429 "Resource
Unavailable" when no capacity frees up in time; the answer's ``service_tier`` says ``"flex"``.
The router serves it so (Completions too, the same way):

* the request runs in the flow-control band ``flex`` (``router/flow_control/config.py``: priority
  below ``async`` and above ``batch``, sheddable, gated by saturation: spare capacity only, no
  reserved interactive slot, evictable by make-room), whoever sends it: asking for flex only ever
  lowers a request's priority, so no trust is needed (:func:`flex_objective`); only a trusted
  caller's own objective header (the async processor's lanes) takes precedence (:func:`is_flex`);
* it waits for room up to the band's ``ttl_s`` (600 s by default), then gets OpenAI's 429 with
  code :data:`RESOURCE_UNAVAILABLE` (:func:`flex_refusal`); the ``Retry-After`` and
  ``x-llm-d-request-dropped-reason`` headers stay flow control's;
* evicted while it runs (make room for non-sheddable work), it gets the same 429 (type
  ``rate_limit_error``, code :data:`RESOURCE_UNAVAILABLE`, :func:`flex_eviction`), dropped reason
  ``evicted``: as an error response when nothing was sent yet, as the stream's closing ``error``
  event otherwise (the engine's request is aborted either way);
* ``service_tier`` is not sent to the engine (``router/parsing.py`` ``FLEX_TIER``) and the answer,
  JSON or SSE, says ``"service_tier": "flex"`` (:class:`FlexAnswer`).

``auto``, ``default``, any other value or none: nothing changes (the field passes to the engine as
before). A router whose flow-control config has no ``flex`` band answers a flex request with
OpenAI's 400 ``invalid_request_error`` rather than serve it in another band (as Azure OpenAI
answers a flex request for a model without flex: "HTTP 400 invalid_request_error ... no fallback
to standard processing"). With flow control off (``--no-flow-control``) nothing waits: a flex
request runs at once, as every other.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import orjson

from router.flow_control.config import FLEX_OBJECTIVE
from router.flow_control.errors import DropReason, RequestDropped
from router.parsing import FLEX_TIER, ParsedRequest, RequestError
from router.usage import sse_events

#: The error code of a flex request that found no room in time. OpenAI's guide names the error
#: "429 Resource Unavailable" and does not print its body; this is that name as an OpenAI code.
RESOURCE_UNAVAILABLE = "resource_unavailable"

#: Drops that mean "no capacity for flex now" (answered as OpenAI's flex 429); others (the router
#: stopping: 503) keep flow control's answer. An eviction mid-flight is :func:`flex_eviction`'s.
_NO_ROOM = frozenset({DropReason.TTL_EXPIRED, DropReason.SATURATED, DropReason.CAPACITY, DropReason.QUOTA})


def is_flex(parsed: ParsedRequest) -> bool:
    """The request is served as OpenAI's flex processing: it says ``service_tier: "flex"`` and no
    trusted caller set its objective (read after the trust decision, when an untrusted caller's
    objective is already gone). A trusted objective wins: the async processor's batch line that
    carries ``service_tier: "flex"`` stays in its lane and is never parked in the router's queue."""
    return parsed.service_tier == FLEX_TIER and parsed.objective is None


def flex_objective(objective_priority: Mapping[str, int]) -> str:
    """The band of a flex request: ``flex``.

    Raises:
        RequestError: 400 ``invalid_value`` on ``service_tier`` when the flow-control config has
            no ``flex`` band.
    """
    if FLEX_OBJECTIVE not in objective_priority:
        raise RequestError(400, "Invalid value for 'service_tier': 'flex' is not offered by this router (its "
                                "flow-control config has no 'flex' band); send 'auto' or 'default'.",
                           "service_tier", "invalid_value")
    return FLEX_OBJECTIVE


def flex_refusal(drop: RequestDropped, wait_s: float | None) -> tuple[str, str] | None:
    """OpenAI's flex 429 for flow control's ``drop`` of a flex request: ``(message, code)``, or
    None when ``drop`` is not a lack of room (answer it as flow control does).

    Args:
        drop: the flow-control refusal.
        wait_s: the ``flex`` band's TTL, seconds (None: no bound), for the message.
    """
    if drop.status != 429 or drop.reason not in _NO_ROOM:
        return None
    waited = f" within {wait_s:g} s" if wait_s else ""
    return (f"Resource unavailable: no spare capacity freed up for this flex request{waited}. Retry later, "
            "or send the request with service_tier 'auto'.", RESOURCE_UNAVAILABLE)


def flex_eviction() -> tuple[str, str]:
    """OpenAI's flex 429 for a flex request evicted while it ran: ``(message, code)``."""
    return ("Resource unavailable: this flex request was stopped to make room for higher-priority work. Retry "
            "later, or send the request with service_tier 'auto'.", RESOURCE_UNAVAILABLE)


def stamp(answer: Any) -> bool:
    """Set ``service_tier`` to ``"flex"`` on a decoded answer: a chat / completions object or
    chunk (top level), or a Responses event carrying the response object (``response``) or a
    response object itself. True when something was set."""
    if not isinstance(answer, dict):
        return False
    inner = answer.get("response")
    target: dict[str, Any] = inner if isinstance(inner, dict) else answer
    if "object" not in target and "choices" not in target:
        return False
    target["service_tier"] = FLEX_TIER
    return True


class FlexAnswer:
    """The engine's answer to a flex request as the client gets it: ``service_tier: "flex"``
    on every answer object and stream chunk (:func:`stamp`); anything not JSON passes unchanged."""

    def answer(self, data: bytes) -> bytes:
        """A non-streamed 200 answer for the client."""
        try:
            answer = orjson.loads(data)
        except orjson.JSONDecodeError:
            return data
        return orjson.dumps(answer) if stamp(answer) else data

    async def stream(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """A streamed answer for the client, cut at event boundaries, each ``data:`` object stamped."""
        async for events in sse_events(chunks):
            yield b"".join([self._event(event) for event in events])

    @staticmethod
    def _event(event: bytes) -> bytes:
        lines = event.split(b"\n")
        changed = False
        for i, line in enumerate(lines):
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            try:
                answer = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                continue
            if stamp(answer):
                lines[i] = b"data: " + orjson.dumps(answer) + (b"\r" if line.endswith(b"\r") else b"")
                changed = True
        return b"\n".join(lines) if changed else event
