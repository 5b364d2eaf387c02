"""The Responses API state the router keeps: OpenAI's object shapes and the Redis record layout.

Every router replica reads and writes the same Redis (``--state-redis-url``), so the record below is
a contract between replicas (of possibly different versions during a rollout); the client-facing
shapes are OpenAI's (API reference, "Responses": create, retrieve, delete, list input items).

Client-facing shapes::

    response         {"id": "resp_…", "object": "response", "created_at": Unix s, "status":
                      "completed" | "incomplete" | …, "model", "output": [{"type": "message",
                      "id": "msg_…", "role": "assistant", "status", "content": [{"type":
                      "output_text", "text", "annotations": []}]}, …], "usage": {"input_tokens",
                      "input_tokens_details": {"cached_tokens"}, "output_tokens",
                      "output_tokens_details": {"reasoning_tokens"}, "total_tokens"},
                      "previous_response_id": str | null, "store": bool, …}
                     (the engine writes it; the router sets ``id``, ``previous_response_id`` and
                     ``store``: :func:`stamp_response`)
    deleted          {"id": "resp_…", "object": "response.deleted", "deleted": true}
    input items      {"object": "list", "data": [item with "id", …], "first_id", "last_id",
                      "has_more": bool}

Errors (OpenAI's envelope, :mod:`common.contracts.errors`), as OpenAI's API answers them:

* an unknown, expired, deleted or other tenant's ``previous_response_id``: **400**
  ``{"message": "Previous response with id 'resp_…' not found.", "type": "invalid_request_error",
  "param": "previous_response_id", "code": "previous_response_not_found"}`` (OpenAI answers 400
  here, not 404; clients such as Codex recover on that status and code by resending the whole
  history);
* ``GET`` / ``DELETE`` of an unknown id: **404** ``{"message": "Response with id 'resp_…' not
  found.", "type": "invalid_request_error", "param": null, "code": null}``.

Redis record (one string key per stored response, with the store's TTL)::

    key    backfill:router:response:{tenant_hash}:{response_id}
           tenant_hash = the first 32 hex digits of SHA-256(the tenant's fairness id, UTF-8)
    value  JSON {"v": 1, "response": <response object as the client got it>,
                 "input": [<every input item the model saw, oldest first: the previous
                            response's input + its output + this request's input>]}

A record holds its whole conversation so far, so each one stands alone: one ``GET`` rebuilds a
turn, and deleting or expiring one response never breaks another's chain (the cost: a
conversation of T turns stores about T²/2 turns' worth of text; the TTL bounds it).
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field

from common.contracts.errors import ErrorType, error_json
from common.json_types import json_type_name

RESPONSE_ID_PREFIX = "resp_"
"""OpenAI's prefix of response ids."""
KEY_PREFIX = "backfill:router:response:"
"""Redis key prefix of stored responses."""
RECORD_VERSION = 1
"""``v`` of the record this code writes; readers refuse (treat as absent) a higher one."""

PREVIOUS_NOT_FOUND_STATUS = 400
"""HTTP status of an unknown ``previous_response_id`` (OpenAI's; see the module docstring)."""
PREVIOUS_NOT_FOUND_CODE = "previous_response_not_found"
NOT_FOUND_STATUS = 404
"""HTTP status of ``GET`` / ``DELETE`` of an unknown response id."""
MAX_RESPONSE_ID_CHARS = 256
"""Longest response id looked up; a longer one is not found without asking Redis."""


def new_response_id() -> str:
    """A fresh id: ``resp_`` + 48 hex digits (192 random bits; OpenAI's ids are about as long)."""
    return RESPONSE_ID_PREFIX + secrets.token_hex(24)


def tenant_hash(tenant: str) -> str:
    """The key part of ``tenant``: 32 hex digits of SHA-256 (fixed length, so no tenant name can
    make its keys collide with another tenant's)."""
    return hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def record_key(tenant: str, response_id: str) -> str:
    """The Redis key of ``response_id`` stored by ``tenant``."""
    return f"{KEY_PREFIX}{tenant_hash(tenant)}:{response_id}"


class StoredResponse(BaseModel):
    """One stored response (the Redis value): the response object the client got and the input
    items the model saw (the whole conversation before this response's output)."""

    model_config = ConfigDict(extra="ignore")

    v: int = RECORD_VERSION
    response: dict[str, Any]
    input: list[dict[str, Any]] = Field(default_factory=list)

    def to_json(self) -> bytes:
        """The Redis value (orjson: records hold whole conversations, so this is on the hot path)."""
        return orjson.dumps({"v": self.v, "response": self.response, "input": self.input})

    @classmethod
    def from_json(cls, data: bytes | str) -> StoredResponse:
        """Read a Redis value; only the top-level shape is checked (the router wrote it).

        Raises:
            ValueError: not JSON, or not ``{"v": int, "response": object, "input": array}``.
        """
        value = orjson.loads(data)
        if not (isinstance(value, dict) and isinstance(value.get("v"), int) and isinstance(value.get("response"), dict)
                and isinstance(value.get("input", []), list)):
            raise ValueError("not a stored response record")
        return cls.model_construct(v=value["v"], response=value["response"], input=value.get("input", []))

    @property
    def output(self) -> list[dict[str, Any]]:
        """The response's output items (``[]`` when it has none)."""
        output = self.response.get("output")
        return [item for item in output if isinstance(item, dict)] if isinstance(output, list) else []


def stamp_response(response: dict[str, Any], response_id: str, previous_response_id: str | None,
                   stored: bool) -> dict[str, Any]:
    """``response`` (an engine's response object) with the router's ``id``,
    ``previous_response_id`` and ``store`` (True only when the router keeps it). Modifies and
    returns ``response``."""
    response["id"] = response_id
    response["previous_response_id"] = previous_response_id
    response["store"] = stored
    return response


def deleted_object(response_id: str) -> dict[str, Any]:
    """``DELETE /v1/responses/{id}``'s answer."""
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def input_items_page(items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """``GET /v1/responses/{id}/input_items``' answer: a list page of ``items`` (each with an
    ``id``)."""
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}


def previous_not_found_message(response_id: str) -> str:
    """The message of the 400 for an unknown ``previous_response_id`` (param ``previous_response_id``,
    code :data:`PREVIOUS_NOT_FOUND_CODE`, type ``invalid_request_error``)."""
    return f"Previous response with id '{response_id}' not found."


def not_found_json(response_id: str, hint: str = "") -> bytes:
    """The 404 envelope of ``GET`` / ``DELETE`` of an unknown response id (``hint``: appended to
    the message)."""
    return error_json(f"Response with id '{response_id}' not found.{hint}", ErrorType.INVALID_REQUEST)


MESSAGE_ROLES = ("assistant", "system", "developer", "user")
"""Roles of a message input item (OpenAI's ``EasyInputMessage`` / ``InputMessage``)."""
TEXT_PART_TYPES = ("input_text", "output_text")
"""Content parts that carry a ``text`` string."""


def _wrong(param: str, expected: str, value: Any) -> tuple[str, str, str]:
    return f"Invalid type for '{param}': expected {expected}, but got {json_type_name(value)} instead.", param, "invalid_type"


def _message_problem(item: dict[str, Any], at: str) -> tuple[str, str, str] | None:
    """What is wrong with message item ``item`` (at param ``at``), or None."""
    role = item.get("role")
    if role is None:
        return f"Missing required parameter: '{at}.role'.", f"{at}.role", "missing_required_parameter"
    if role not in MESSAGE_ROLES:
        if not isinstance(role, str):
            return _wrong(f"{at}.role", "a string", role)
        return (f"Invalid value: '{role[:100]}'. Supported values are: 'assistant', 'system', 'developer', and "
                "'user'.", f"{at}.role", "invalid_value")
    content = item.get("content")
    if content is None:
        return f"Missing required parameter: '{at}.content'.", f"{at}.content", "missing_required_parameter"
    if isinstance(content, str):
        return None
    if not isinstance(content, list):
        return _wrong(f"{at}.content", "one of a string or an array of input content", content)
    for j, part in enumerate(content):
        where = f"{at}.content[{j}]"
        if not isinstance(part, dict):
            return _wrong(where, "an object", part)
        if part.get("type") is None:
            return f"Missing required parameter: '{where}.type'.", f"{where}.type", "missing_required_parameter"
        if part["type"] in TEXT_PART_TYPES and not isinstance(part.get("text"), str):
            if part.get("text") is None:
                return f"Missing required parameter: '{where}.text'.", f"{where}.text", "missing_required_parameter"
            return _wrong(f"{where}.text", "a string", part["text"])
    return None


def input_problem(value: Any) -> tuple[str, str, str] | None:
    """What is wrong with a create request's ``input``, as OpenAI's 400 names it: ``(message,
    param, code)``, or None when it is a string or a non-empty array of input items whose message
    items (``type`` ``message`` or none) have a known ``role`` and a string or an array of content
    parts (each an object with a ``type``; text parts with a string ``text``). Items of other types
    (``function_call_output``, ``reasoning``, …) pass to the engine as they are. Params are
    OpenAI's paths (``input[0].content[1].text``)."""
    if isinstance(value, str):
        return None
    if not isinstance(value, list):
        return _wrong("input", "one of a string or an array of input items", value)
    if not value:
        return ("Invalid 'input': empty array. Expected an array with minimum length 1, but got an empty array "
                "instead.", "input", "empty_array")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            return _wrong(f"input[{i}]", "an object", item)
        kind = item.get("type", "message")
        if not isinstance(kind, str):
            return _wrong(f"input[{i}].type", "a string", kind)
        if kind == "message" and (problem := _message_problem(item, f"input[{i}]")) is not None:
            return problem
    return None


def input_items(value: Any) -> list[dict[str, Any]]:
    """A create request's ``input`` as input items: a string becomes ``[{"type": "message", "role":
    "user", "content": value}]`` (OpenAI's rule); a list is returned as a new list."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value)


def conversation_input(previous_input: list[dict[str, Any]], previous_output: list[dict[str, Any]],
                       new_input: Any) -> list[dict[str, Any]]:
    """The input the model sees for a response chained by ``previous_response_id``: the previous
    response's input items, its output items, then this request's input (:func:`input_items`),
    oldest first (OpenAI, "Conversation state"). The router's Responses API and the gateway's
    background responses both chain this way."""
    return [*previous_input, *previous_output, *input_items(new_input)]
