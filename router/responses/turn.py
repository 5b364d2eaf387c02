"""One ``POST /v1/responses`` through the router: :class:`ResponsesTurn`, the proxy's exchange hook.

Before scheduling (:meth:`ResponsesTurn.prepare`):

* the Responses-only fields are checked: ``store`` (a boolean, OpenAI's default true),
  ``previous_response_id`` (a non-empty string), ``background`` and ``conversation`` (not
  supported: 400);
* with ``previous_response_id`` the tenant's stored record is read and the input REBUILT as OpenAI
  defines it: the previous response's input items + its output items + this request's input (a
  string input becomes one ``user`` message item). ``instructions`` are not carried over (OpenAI:
  "the instructions from a previous response will not be carried over"); the request's own apply;
* the engine gets a stateless request: the rebuilt ``input``, ``store: false``, no
  ``previous_response_id`` (vLLM keeps its own, per-engine state only when asked; the router owns
  it). The request is re-parsed from that body, so the scheduling plugins see the WHOLE prompt and
  the prefix scorers send it to the engine holding the conversation so far.

After the engine answers (:meth:`ResponsesTurn.answer` for JSON, :meth:`ResponsesTurn.stream` for
SSE): the response object gets the router's ``id`` (``resp_…``), ``previous_response_id`` and
``store``; a ``completed`` or ``incomplete`` response with ``store`` is written to the store BEFORE
the client sees it (the JSON body, or the ``response.completed`` event), so the client's next turn
always finds it. Stream events pass through unchanged except the ones carrying the response object
(``response.created``, ``response.in_progress``, ``response.completed``, …), which are re-serialised
with those three fields.

A store failure while writing does not lose the answer: the client gets it with ``store: false``
(and the router logs ``router.responses.store_failed``). Reading the previous response when the
store fails is a 503 (``state_store_unavailable``), retryable.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import orjson

from common.contracts.errors import ErrorType
from common.contracts.responses import (
    PREVIOUS_NOT_FOUND_CODE,
    PREVIOUS_NOT_FOUND_STATUS,
    StoredResponse,
    conversation_input,
    input_items,
    new_response_id,
    previous_not_found_message,
    stamp_response,
)
from common.json_types import json_type_name
from router.parsing import ParsedRequest, RequestError, parse_request
from router.responses.store import ResponseStore, StoreUnavailable
from router.trust import ANONYMOUS_TENANT
from router.usage import sse_events

log = logging.getLogger(__name__)

#: Statuses of a response that is kept (and may be chained from).
STORED_STATUSES = frozenset({"completed", "incomplete"})
#: Stream events whose ``response`` is the final object.
FINAL_EVENTS = frozenset({"response.completed", "response.incomplete"})
#: Message appended when no store is configured.
NO_STORE_HINT = " This router keeps no response state (no --state-redis-url)."


def _unavailable(exc: StoreUnavailable) -> RequestError:
    return RequestError(503, f"the router's response store is unavailable: {exc}", None,
                        "state_store_unavailable", type=ErrorType.SERVER)


class ResponsesTurn:
    """The exchange hook of one ``POST /v1/responses`` (:class:`router.proxy.ExchangeHook`).

    Args:
        store: the response store, or None when the router keeps no state: then nothing is
            stored (every answer says ``store: false``) and any ``previous_response_id`` is unknown
            (the 400 ``previous_response_not_found``, with a hint in the message).

    Attributes:
        response_id: the id the client gets (``resp_`` + 48 hex digits).
        previous_response_id: the request's, or None.
        tenant: whose response this is (the request's fairness id after the trust decision).
        keep: the response is to be stored (``store`` true and a store configured).
        input: the input items the model sees (the rebuilt conversation).
        cached_tokens: ``usage.input_tokens_details.cached_tokens`` of the answer, once read.
    """

    def __init__(self, store: ResponseStore | None) -> None:
        self.store = store
        self.response_id = new_response_id()
        self.previous_response_id: str | None = None
        self.tenant = ANONYMOUS_TENANT
        self.keep = False
        self.input: list[dict[str, Any]] = []
        self.cached_tokens: int | None = None

    # ---- before scheduling ---------------------------------------------------------------------------
    async def prepare(self, parsed: ParsedRequest, headers: Mapping[str, str]) -> ParsedRequest:
        """The request to schedule and send: stateless, with the rebuilt input (module docstring).

        Args:
            parsed: the client's request, after the trust decision (its ``fairness_id`` is the tenant).
            headers: the request headers (re-read for the rebuilt request's llm-d headers).

        Raises:
            RequestError: 400 for an ill-typed ``store`` / ``previous_response_id``, ``background``
                true, ``conversation`` set, or an unknown ``previous_response_id`` (code
                ``previous_response_not_found``); 503 when the store cannot be read.
        """
        body = parsed.body
        store_flag = body.get("store", True)
        if store_flag is None:
            store_flag = True
        if not isinstance(store_flag, bool):
            raise RequestError(400, f"Invalid type for 'store': expected a boolean, but got "
                                    f"{json_type_name(store_flag)} instead.", "store", "invalid_type")
        previous_id = body.get("previous_response_id")
        if previous_id is not None and (not isinstance(previous_id, str) or not previous_id):
            raise RequestError(400, f"Invalid type for 'previous_response_id': expected a non-empty string, but got "
                                    f"{json_type_name(previous_id)} instead.", "previous_response_id", "invalid_type")
        if body.get("background") not in (None, False):
            raise RequestError(400, "Invalid value for 'background': background responses are not supported by "
                                    "this router; send the request without it.", "background", "unsupported_value")
        if body.get("conversation") is not None:
            raise RequestError(400, "Invalid value for 'conversation': the Conversations API is not supported by "
                                    "this router; use previous_response_id.", "conversation", "unsupported_value")
        self.tenant = parsed.fairness_id or ANONYMOUS_TENANT
        self.previous_response_id = previous_id
        self.keep = store_flag and self.store is not None
        engine_input: Any = body["input"]
        if previous_id is not None:
            previous = await self._previous(previous_id)
            engine_input = conversation_input(previous.input, previous.output, body["input"])
        self.input = input_items(engine_input)
        engine_body = {k: v for k, v in body.items() if k != "previous_response_id"}
        engine_body["input"] = engine_input
        engine_body["store"] = False
        rebuilt = parse_request(parsed.path, orjson.dumps(engine_body), headers)
        rebuilt.objective, rebuilt.fairness_id, rebuilt.request_id = \
            parsed.objective, parsed.fairness_id, parsed.request_id
        return rebuilt

    async def _previous(self, previous_id: str) -> StoredResponse:
        hint = ""
        record = None
        if self.store is None:
            hint = NO_STORE_HINT
        else:
            try:
                record = await self.store.get(self.tenant, previous_id)
            except StoreUnavailable as exc:
                raise _unavailable(exc) from exc
        if record is None:
            raise RequestError(PREVIOUS_NOT_FOUND_STATUS, previous_not_found_message(previous_id) + hint,
                               "previous_response_id", PREVIOUS_NOT_FOUND_CODE)
        return record

    # ---- after the engine answered -----------------------------------------------------------------
    async def answer(self, status: int, data: bytes) -> bytes:
        """The JSON answer for the client: a 200 response object stamped (and stored); anything
        else (an engine error) unchanged."""
        if status != 200:
            return data
        try:
            response = orjson.loads(data)
        except orjson.JSONDecodeError:
            return data
        if not isinstance(response, dict) or response.get("object") != "response":
            return data
        await self._finish(response)
        return orjson.dumps(response)

    async def stream(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The SSE answer for the client, cut at event boundaries (an event is passed on once it
        is whole); events carrying the response object are stamped, and the final one is stored
        before it is passed on."""
        async for events in sse_events(chunks):
            yield b"".join([await self._event(event) for event in events])

    async def _event(self, event: bytes) -> bytes:
        if b'"response":' not in event:
            return event
        lines = event.split(b"\n")
        for i, line in enumerate(lines):
            if not line.startswith(b"data:"):
                continue
            try:
                data = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                return event
            response = data.get("response") if isinstance(data, dict) else None
            if not isinstance(response, dict):
                return event
            if data.get("type") in FINAL_EVENTS:
                await self._finish(response)
            else:
                stamp_response(response, self.response_id, self.previous_response_id, self.keep)
            lines[i] = b"data: " + orjson.dumps(data) + (b"\r" if line.endswith(b"\r") else b"")
            return b"\n".join(lines)
        return event

    async def _finish(self, response: dict[str, Any]) -> None:
        """Stamp the final response object and store it when it is to be kept."""
        usage = response.get("usage")
        if isinstance(usage, dict) and isinstance(details := usage.get("input_tokens_details"), dict):
            cached = details.get("cached_tokens")
            self.cached_tokens = cached if isinstance(cached, int) else None
        stored = False
        if self.keep and self.store is not None and response.get("status") in STORED_STATUSES:
            stamp_response(response, self.response_id, self.previous_response_id, True)
            try:
                await self.store.put(self.tenant, self.response_id, StoredResponse(response=response,
                                                                                   input=self.input))
                stored = True
            except StoreUnavailable as exc:
                log.warning("response not stored", extra={"action": "router.responses.store_failed",
                                                          "response_id": self.response_id, "error": str(exc)})
        stamp_response(response, self.response_id, self.previous_response_id, stored)
