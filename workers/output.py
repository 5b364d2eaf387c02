"""OpenAI's output and error lines, rendered from request rows (pure: rows in, bytes out).

One line per request, joined by ``custom_id`` (OpenAI promises no order; we keep input order)::

    {"id": "batch_req_…", "custom_id": "…", "response": {"status_code": 200, "request_id": "…",
     "body": {…}}, "error": null}

- a 2xx response goes to the **output** file;
- an HTTP error keeps ``error: null`` and the API error object inside ``response.body.error``
  (error file), in OpenAI's words whoever wrote it (the engine's ``BadRequestError`` / ``400``
  becomes ``invalid_request_error`` / ``context_length_exceeded`` …:
  :func:`common.contracts.errors.openai_error`);
- a request that got no HTTP response has ``response: null`` and a top-level ``error``
  ``{code, message}`` — ``batch_expired``, ``batch_cancelled`` (llm-d's extension),
  ``batch_failed``, ``request_timeout`` (error file).

A 2xx body is copied byte for byte (it was checked to be JSON when the result was recorded), so
building a file costs one pass over the rows; only error bodies are parsed and rewritten (the row
keeps the engine's own body, for operators). ``request_id`` is the engine's id of the answer (the
body's ``id``: ``chatcmpl-…``, ``resp_…``), ``""`` when the engine gave none — never a queue id. Line ids are derived from ``(batch_id, custom_id)``,
so finalising twice writes identical files (RELIABILITY.md promise 4).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import orjson

from common.contracts.errors import ErrorType, error_json, openai_error

NO_RESPONSE_MESSAGES = {
    "batch_expired": "This request could not be executed before the completion window expired.",
    "batch_cancelled": "This request was not executed because the batch was cancelled.",
    "batch_failed": "This request was not executed because the batch failed.",
    "request_timeout": "This request did not receive a response in time.",
}
"""Top-level ``error.message`` for each code with no HTTP response (wording ours; codes OpenAI's and
llm-d's)."""


def request_line_id(batch_id: str, custom_id: str) -> str:
    """``batch_req_`` + 24 hex characters of SHA-256 over the batch id and custom_id."""
    digest = hashlib.sha256(f"{batch_id}\x00{custom_id}".encode()).hexdigest()
    return "batch_req_" + digest[:24]


@dataclass(slots=True)
class RequestOutcome:
    """What a request row holds at the end: an HTTP response (``status_code`` > 0 with the raw JSON
    ``body`` bytes and ``request_id``) or a top-level ``error_code`` with an optional message."""

    custom_id: str
    status_code: int | None
    request_id: str | None
    body: bytes | None
    error_code: str | None
    error_message: str | None = None

    @property
    def succeeded(self) -> bool:
        """True for a 2xx response (its line goes to the output file)."""
        return self.status_code is not None and 200 <= self.status_code < 300


def error_body(status_code: int, body: bytes | None, *, endpoint: str, model: str | None) -> bytes:
    """``response.body`` of an HTTP error line: the recorded answer (JSON bytes, or None) in
    OpenAI's words (:func:`common.contracts.errors.openai_error` with the batch's ``endpoint`` and
    ``model``); the recorded bytes themselves when they already are."""
    parsed: Any
    try:
        parsed = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        parsed = body.decode("utf-8", errors="replace") if body else None
    envelope = openai_error(status_code, parsed, endpoint=endpoint, model=model)
    return body if body and envelope == parsed else orjson.dumps(envelope)


def render_line(batch_id: str, outcome: RequestOutcome, *, endpoint: str, model: str | None) -> bytes:
    """One output or error line (with its ``\\n``) of a batch of ``endpoint`` and ``model`` (they
    word the errors: :func:`error_body`). Raises ``ValueError`` for an outcome with neither a
    response nor an error code."""
    line_id = orjson.dumps(request_line_id(batch_id, outcome.custom_id))
    custom_id = orjson.dumps(outcome.custom_id)
    if outcome.status_code:
        if outcome.succeeded:
            body = outcome.body if outcome.body else b"null"
        else:
            body = error_body(outcome.status_code, outcome.body, endpoint=endpoint, model=model)
        return b"".join((
            b'{"id":', line_id, b',"custom_id":', custom_id, b',"response":{"status_code":',
            str(int(outcome.status_code)).encode(), b',"request_id":', orjson.dumps(outcome.request_id or ""),
            b',"body":', body, b'},"error":null}\n',
        ))
    if not outcome.error_code:
        raise ValueError(f"request {outcome.custom_id!r} has neither a response nor an error")
    error = {"code": outcome.error_code,
             "message": outcome.error_message or NO_RESPONSE_MESSAGES.get(outcome.error_code, outcome.error_code)}
    return b"".join((b'{"id":', line_id, b',"custom_id":', custom_id, b',"response":null,"error":',
                     orjson.dumps(error), b"}\n"))


def json_body(raw: bytes | str | None, status_code: int) -> bytes:
    """The upstream body as JSON bytes for ``response.body``: the body itself when it is a JSON
    value; otherwise (an HTML 502 page, empty, …) an OpenAI error object wrapping its text."""
    data = raw.encode() if isinstance(raw, str) else (raw or b"")
    try:
        orjson.loads(data)
        return data
    except orjson.JSONDecodeError:
        text = data.decode("utf-8", errors="replace")[:2000] or f"HTTP {status_code} with an empty body"
        return error_json(text, ErrorType.SERVER if status_code >= 500 else ErrorType.INVALID_REQUEST)
