"""Request ids and processing time on every gateway answer, and one log line per request.

Every HTTP answer carries, as OpenAI's API does:

- ``x-request-id``: the client's own id when it sent a sane one (``X-Client-Request-Id`` or
  ``x-request-id``, see :func:`request_id_for`), else a new ``req_`` + 32 hex digits. The
  ``openai`` SDK puts it on every result as ``_request_id`` (and on errors as ``request_id``).
- ``openai-processing-ms``: milliseconds from the request reaching the app to its answer starting.

:class:`RequestIdMiddleware` wraps the whole application (``batch_gateway.app`` puts it outside
Starlette's error middleware), so 404, 422 and 500 answers carry both headers too; answers the
HTTP server makes itself (malformed framing, header deadline) carry a new id
(``batch_gateway.server``). The id is on ``request.state.request_id`` for handlers, and each request
is logged once (``action=http_request`` with ``request_id``, ``method``, ``path``, ``status``,
``duration_ms``; ``/health`` and ``/metrics`` at DEBUG, the rest at INFO).
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Iterable

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
PROCESSING_MS_HEADER = "openai-processing-ms"
CLIENT_ID_HEADERS = (b"x-client-request-id", b"x-request-id")
"""Headers whose value a client may give as the request's id, first found wins (OpenAI documents
``X-Client-Request-Id``; proxies set ``X-Request-Id``)."""

SANE_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")
"""A client id that is echoed: 1 to 128 characters of letters, digits and ``. _ : / + = @ -`` (UUIDs,
ULIDs, base64 and OpenAI's ``req_…`` all fit; anything else could forge log lines or headers)."""

QUIET_PATHS = ("/health", "/metrics")


def new_request_id() -> str:
    """A new id in OpenAI's form: ``req_`` + 32 hex digits (128 random bits)."""
    return "req_" + secrets.token_hex(16)


def request_id_for(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The id of a request with raw ASGI ``headers``: the first sane client id
    (:data:`CLIENT_ID_HEADERS`, :data:`SANE_ID`) or a new one."""
    given = {name: value for name, value in headers if name in CLIENT_ID_HEADERS}
    for name in CLIENT_ID_HEADERS:
        value = given.get(name, b"").decode("latin-1").strip()
        if SANE_ID.fullmatch(value):
            return value
    return new_request_id()


class RequestIdMiddleware:
    """ASGI middleware adding ``x-request-id`` and ``openai-processing-ms`` to every HTTP answer of
    ``app`` and logging the request once (see the module docstring)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_for(scope.get("headers", ()))
        scope.setdefault("state", {})["request_id"] = request_id
        started = time.perf_counter()
        status = 0

        async def send_with_ids(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = MutableHeaders(scope=message)
                headers[REQUEST_ID_HEADER] = request_id
                headers[PROCESSING_MS_HEADER] = str(round((time.perf_counter() - started) * 1000))
            await send(message)

        try:
            await self.app(scope, receive, send_with_ids)
        finally:
            path = scope.get("path", "")
            log.log(logging.DEBUG if path in QUIET_PATHS else logging.INFO, "request", extra={
                "action": "http_request", "request_id": request_id, "method": scope.get("method"),
                "path": path, "status": status or None,
                "duration_ms": round((time.perf_counter() - started) * 1000, 1)})
