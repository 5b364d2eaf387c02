"""How the gateway is served: uvicorn with :class:`GatewayHttpProtocol`, built by :func:`uvicorn_config`.

uvicorn's HTTP/1.1 protocol (``httptools``) has a keep-alive timeout but no deadline for a request's
headers or for the whole request, and no bound on open connections, so sockets that send a partial
request line, or trickle headers a byte at a time, stay open until the process runs out of file
descriptors and stops answering everyone. :class:`GatewayHttpProtocol` adds, per connection:

- **a header deadline** (``header_timeout_seconds``, 20 s): from the connection opening, or the first
  byte of the next request on a kept-alive connection, to the end of the request's headers. Past it
  the client gets 408 and the connection is closed. Headers over :data:`MAX_HEADER_BYTES` get 431.
- **a whole-request deadline** (``request_timeout_seconds``, 1,800 s): from the same start to the last
  byte of the body. Past it the handler sees the client as gone, the client gets 408 if no answer
  has started, and the connection is closed. (A body that stops altogether meets the upload
  handler's ``body_idle_timeout_seconds`` first.)
- **a connection cap** (``max_connections``; half the process's open-file limit when unset): a
  connection opened past the cap closes the connection idle the longest (waiting for its headers,
  or kept alive between requests); a connection still running a request is never closed for it.
  When none is idle the new connection is answered 503 with ``Retry-After`` and closed.

Answers the protocol makes itself are in OpenAI's error envelope with an ``x-request-id``
(:mod:`batch_gateway.request_ids`), the malformed-framing 400 included (``Content-Length: abc``, a
negative length, both ``Content-Length`` and ``Transfer-Encoding``), where uvicorn answers plain
text. docs/limits.md lists them, and the cases where no answer can be given.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any, ClassVar

import httptools
import orjson
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from batch_gateway.request_ids import REQUEST_ID_HEADER, new_request_id
from batch_gateway.settings import GatewaySettings
from common.contracts.errors import ErrorType, error_envelope

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 16 * 1024
"""Bytes of a request line plus headers (16 KiB, as before with h11's ``max_incomplete_event_size``;
nginx's ``large_client_header_buffers`` default allows 4 × 8 KiB); 431 past it."""

CONNECTION_RETRY_AFTER_SECONDS = 1
"""``Retry-After`` of the 503 answered when every connection under the cap runs a request."""

KEEP_ALIVE_SECONDS = 5
"""How long a connection is kept open between requests (uvicorn's default)."""


def default_max_connections() -> int:
    """Half the process's soft open-file limit (``RLIMIT_NOFILE``): one descriptor per connection,
    the other half left for the database pool, Redis, the file store and logs."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, soft // 2)


class ConnectionRegistry:
    """The connections of one server: how many are open (closing ones not counted) and which are
    idle, oldest idle first. Used on the event loop only."""

    def __init__(self, limit: int):
        self.limit = limit
        self.open = 0
        self._idle: dict[GatewayHttpProtocol, None] = {}  # insertion order = idle since

    def opened(self, connection: GatewayHttpProtocol) -> None:
        """Count a new connection; it is idle until its first request's headers are complete."""
        self.open += 1
        self._idle[connection] = None

    def busy(self, connection: GatewayHttpProtocol) -> None:
        """``connection`` runs a request: never closed for the cap until it is idle again."""
        self._idle.pop(connection, None)

    def idle(self, connection: GatewayHttpProtocol) -> None:
        """``connection`` answered its requests and waits for the next: the newest idle one."""
        self._idle.pop(connection, None)
        self._idle[connection] = None

    def closed(self, connection: GatewayHttpProtocol) -> None:
        """``connection`` is closing or gone: no longer counted (call once per connection)."""
        self.open -= 1
        self._idle.pop(connection, None)

    def oldest_idle(self, other_than: GatewayHttpProtocol) -> GatewayHttpProtocol | None:
        """The connection idle the longest except ``other_than``, or None when none is idle."""
        return next((c for c in self._idle if c is not other_than), None)


def _error_response(status: int, message: str, error_type: str, code: str | None = None,
                    headers: tuple[tuple[bytes, bytes], ...] = ()) -> bytes:
    """A complete ``Connection: close`` HTTP/1.1 answer with OpenAI's envelope and a new request id."""
    body = orjson.dumps(error_envelope(message, error_type, None, code))
    lines = [STATUS_LINE[status],
             b"content-type: application/json\r\n",
             b"content-length: %d\r\n" % len(body),
             b"connection: close\r\n",
             REQUEST_ID_HEADER.encode() + b": " + new_request_id().encode() + b"\r\n",
             *(name + b": " + value + b"\r\n" for name, value in headers),
             b"\r\n", body]
    return b"".join(lines)


def _headers_too_large() -> bytes:
    return _error_response(431, f"The request line and headers are larger than {MAX_HEADER_BYTES} bytes.",
                           ErrorType.INVALID_REQUEST, "request_header_fields_too_large")


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's ``httptools`` protocol with the deadlines and the cap of the module docstring. Make
    a subclass per server with :meth:`configured`."""

    header_timeout: ClassVar[float] = 20.0
    request_timeout: ClassVar[float] = 1800.0
    registry: ClassVar[ConnectionRegistry] = ConnectionRegistry(1024)

    @classmethod
    def configured(cls, *, header_timeout: float, request_timeout: float,
                   max_connections: int) -> type[GatewayHttpProtocol]:
        """A subclass with these deadlines (seconds) and its own registry of at most
        ``max_connections`` connections."""
        return type("GatewayHttpProtocol", (cls,), {
            "header_timeout": header_timeout, "request_timeout": request_timeout,
            "registry": ConnectionRegistry(max_connections)})

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._awaiting_headers = True
        self._header_bytes = 0
        self._header_timer: asyncio.TimerHandle | None = None
        self._request_timer: asyncio.TimerHandle | None = None
        self._counted = False
        self._refusal: bytes | None = None  # set by a parser callback that stops the parse

    # -- connection life --

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.registry.opened(self)
        self._counted = True
        self._start_request_clock()
        if self.registry.open > self.registry.limit:
            victim = self.registry.oldest_idle(other_than=self)
            if victim is not None:
                log.debug("idle connection closed for a new one", extra={"action": "http_connection_evicted"})
                victim._close()
            else:
                log.warning("connection refused: every connection runs a request",
                            extra={"action": "http_connection_refused", "limit": self.registry.limit})
                self._answer_and_close(_error_response(
                    503, "The server has too many open connections. Please retry after a second.",
                    ErrorType.SERVER, "service_unavailable",
                    ((b"retry-after", str(CONNECTION_RETRY_AFTER_SECONDS).encode()),)))

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        self._uncount()
        super().connection_lost(exc)

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            self.registry.closed(self)

    def _close(self) -> None:
        self._cancel_timers()
        self._uncount()
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the handler's receive() answers http.disconnect
            self.cycle.message_event.set()
        if not self.transport.is_closing():
            self.transport.close()

    def _can_answer(self) -> bool:
        """Whether an answer written now answers the request being received: between requests
        (none running), or in one whose handler has not started its answer."""
        if self._awaiting_headers:
            return self.cycle is None or self.cycle.response_complete
        return self.cycle is not None and not self.cycle.response_started

    def _answer_and_close(self, response: bytes) -> None:
        """Write ``response`` when it can answer the request (:meth:`_can_answer`), then close."""
        if self._can_answer() and not self.transport.is_closing():
            self.transport.write(response)
        self._close()

    # -- deadlines --

    def _start_request_clock(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._header_deadline)
        if self._request_timer is None:
            self._request_timer = self.loop.call_later(self.request_timeout, self._request_deadline)

    def _cancel_timers(self) -> None:
        for timer in (self._header_timer, self._request_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._request_timer = None

    def _header_deadline(self) -> None:
        self._header_timer = None
        if not self._awaiting_headers or self.transport.is_closing():
            return
        log.info("request headers not received in time", extra={"action": "http_header_timeout",
                                                                  "timeout_s": self.header_timeout})
        if self.cycle is not None and not self.cycle.response_complete:  # a pipelined request trickles
            self.cycle.keep_alive = False  # close once the running request has its answer
            self.flow.pause_reading()
            return
        self._answer_and_close(_error_response(
            408, f"The request headers were not received within {self.header_timeout:g} seconds.",
            ErrorType.INVALID_REQUEST, "request_timeout"))

    def _request_deadline(self) -> None:
        self._request_timer = None
        if self.transport.is_closing():
            return
        log.info("request not received in time", extra={"action": "http_request_timeout",
                                                         "timeout_s": self.request_timeout})
        self._answer_and_close(_error_response(
            408, f"The request was not received within {self.request_timeout:g} seconds.",
            ErrorType.INVALID_REQUEST, "request_timeout"))

    # -- parsing --

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        if self._awaiting_headers:
            self._start_request_clock()
            self._header_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError as exc:
            if self._refusal is not None:  # a callback refused the request (headers too large)
                self._answer_and_close(self._refusal)
                return
            detail = str(exc).strip().rstrip(".") or "the request could not be parsed"
            log.info("malformed HTTP request", extra={"action": "http_malformed", "error": detail[:200]})
            self._answer_and_close(_error_response(
                400, f"Invalid HTTP request: {detail[:200]}.", ErrorType.INVALID_REQUEST, "invalid_http_request"))
            return
        if self._awaiting_headers and self._header_bytes > MAX_HEADER_BYTES:  # still coming
            self._answer_and_close(_headers_too_large())

    def send_400_response(self, msg: str) -> None:
        self._answer_and_close(_error_response(400, f"Invalid HTTP request: {msg.rstrip('.')}.",
                                               ErrorType.INVALID_REQUEST, "invalid_http_request"))

    def on_headers_complete(self) -> None:
        if len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers) > MAX_HEADER_BYTES:
            self._refusal = _headers_too_large()
            raise ValueError("headers too large")  # stops the parse; data_received answers
        self._awaiting_headers = False
        self._header_bytes = 0
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self.registry.busy(self)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        if self._request_timer is not None:
            self._request_timer.cancel()
            self._request_timer = None
        self._awaiting_headers = True  # the next request's clock starts with its first byte
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.pipeline and not self.transport.is_closing():
            self.registry.idle(self)


def uvicorn_config(app: Any, settings: GatewaySettings, *, host: str, port: int,
                   log_level: str = "warning") -> uvicorn.Config:
    """The uvicorn configuration the gateway is served with (``backfill gateway``): the
    :class:`GatewayHttpProtocol` of ``settings``, keep-alive :data:`KEEP_ALIVE_SECONDS`, a 10 s
    graceful shutdown, no uvicorn access log (:mod:`batch_gateway.request_ids` logs each request
    with its id) and the caller's logging set-up."""
    protocol = GatewayHttpProtocol.configured(
        header_timeout=settings.header_timeout_seconds, request_timeout=settings.request_timeout_seconds,
        max_connections=settings.max_connections or default_max_connections())
    return uvicorn.Config(app, host=host, port=port, http=protocol, log_level=log_level, log_config=None,
                          access_log=False, timeout_keep_alive=KEEP_ALIVE_SECONDS, timeout_graceful_shutdown=10)
