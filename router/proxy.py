"""The router's HTTP transport: read the request, answer it, stream the engine's answer back.

:class:`Proxy` handles every inference POST; the decisions are the :class:`router.director.Director`'s.
One request:

1. read the body (≤ ``max_body_bytes``, else 413), parse it once (:mod:`router.parsing`; a bad
   body is a 4xx in OpenAI's envelope), keep its fairness id and objective only from a trusted
   caller (:mod:`router.trust`), tokenize it (:mod:`router.tokenizers`);
2. the director refuses it at once (no healthy endpoint, unknown model), admits it through flow
   control or refuses it (:class:`router.director.Rejected` → an error response in the envelope);
3. the director schedules it and drives :class:`_Exchange`, this module's part of a try: the body
   goes to the engine (with vLLM's ``priority`` when configured); the answer streams back chunk by
   chunk (SSE passed through as it comes); a failure mid-stream ends the client's stream with an
   error event; the client going away cancels the upstream request (aiohttp closes the
   connection, which vLLM treats as an abort);
   a flex request's answer says ``"service_tier": "flex"`` (:mod:`router.service_tier`);
4. the cached prompt tokens the engine reported (:mod:`router.usage`) go back to the director.

Prefill/decode disaggregation (a P/D profile handler in the scheduling config): for a chat or
completions request the director decides, the prefill leg runs first (:meth:`_Exchange.prefill`,
the bodies in :mod:`router.disagg`), then the decode leg is the try above with the prefill
answer's ``kv_transfer_params`` added; the client sees only the decode engine's answer.

An :class:`ExchangeHook` (``handle(request, hook)``; :mod:`router.responses` for ``/v1/responses``)
may replace the parsed request after the trust decision and rewrite the engine's answer.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Any, Protocol

import aiohttp
import orjson
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.web_protocol import RequestPayloadError

from common.contracts.errors import ErrorType, error_json, openai_type_for_status
from common.contracts.openai_request import requested_output_tokens
from router.decisions import PREFILL_CLIENT_ERROR
from router.director import (
    DROPPED_REASON,
    NO_ENDPOINT,
    Attempt,
    Director,
    Interruption,
    PrefillAnswer,
    Rejected,
)
from router.disagg import ClientUsage, decode_body, kv_transfer_params_of, prefill_body, single_sequence
from router.observer import RouterObserver
from router.parsing import (
    ParsedRequest,
    RequestError,
    engine_body,
    engine_priority,
    parse_request,
    with_engine_priority,
)
from router.scheduling.plugins.disagg import PDReason
from router.scheduling.types import LLMRequest
from router.service_tier import FlexAnswer, is_flex
from router.tokenizers import PromptTokenizer
from router.trust import HeaderTrust
from router.usage import SSE_TAIL_BYTES, cached_tokens_from_json, cached_tokens_from_sse_tail

log = logging.getLogger(__name__)

#: Request headers passed on to the engine (besides Content-Type, which is always JSON).
FORWARDED_HEADERS = ("authorization", "x-request-id", "traceparent", "tracestate", "x-session-id")
#: Response headers passed back from the engine.
RETURNED_HEADERS = ("content-type", "x-request-id")


class ExchangeHook(Protocol):
    """Per-request changes around the forward (one instance per request).

    Attributes:
        cached_tokens: the cached prompt tokens the hook read from the answer (None: unknown).
    """

    cached_tokens: int | None

    async def prepare(self, parsed: ParsedRequest, headers: Mapping[str, str]) -> ParsedRequest:
        """The request to schedule and forward instead of ``parsed`` (identity already decided).

        Raises:
            RequestError: the request is refused (its status and envelope are answered).
        """

    async def answer(self, status: int, data: bytes) -> bytes:
        """The body for the client of a non-streamed engine answer."""

    def stream(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The chunks for the client of a streamed engine answer."""


def error_response(status: int, message: str, *, code: str | None = None, err_type: str | None = None,
                   param: str | None = None, headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI error envelope ``{"error": {message, type, param, code}}`` with ``status``."""
    body = error_json(message, err_type or openai_type_for_status(status), param, code)
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


class Proxy:
    """The inference handler: HTTP in, :class:`Director` decisions, HTTP out.

    Args:
        director: admission, scheduling and the forward decisions.
        tokenizer: the prompt tokenizer backend.
        session: aiohttp session for forwarding (owned by the app).
        observer: where answers, first bytes and engine failures are reported.
        engine_priority: add vLLM's ``priority`` field (``-objective priority``) to forwarded bodies.
        max_body_bytes: 413 above this many body bytes.
        request_timeout_s: base of a forwarded request's timeout, seconds (0 = none): the whole
            request when it names no output budget, the longest silence of a stream.
        connect_timeout_s: connecting to an engine, seconds.
        request_timeout_per_token_s: added to ``request_timeout_s`` per output token a non-streamed
            request asks for (``max_tokens`` × ``n``), seconds (see :meth:`timeout_for`).
        trust: who may set the fairness id and objective (:mod:`router.trust`); default: nobody
            (every request is tenant ``anonymous`` in the default band).
    """

    def __init__(self, *, director: Director, tokenizer: PromptTokenizer, session: aiohttp.ClientSession,
                 observer: RouterObserver, engine_priority: bool = False, max_body_bytes: int = 32 * 1024 * 1024,
                 request_timeout_s: float = 600.0, connect_timeout_s: float = 2.0,
                 request_timeout_per_token_s: float = 0.25, trust: HeaderTrust | None = None) -> None:
        self.director = director
        self.trust = trust or HeaderTrust()
        self.tokenizer = tokenizer
        self.session = session
        self.observer = observer
        self.engine_priority = engine_priority
        self.max_body_bytes = max_body_bytes
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_per_token_s = request_timeout_per_token_s

    def timeout_for(self, parsed: ParsedRequest) -> aiohttp.ClientTimeout:
        """The forwarding timeout of ``parsed``: a stream lives while bytes come (at most
        ``request_timeout_s`` apart); any other request gets ``request_timeout_s`` plus
        ``request_timeout_per_token_s`` per output token asked for (``max_tokens`` × ``n``), so
        a long generation is not cut at a fixed bound. Connecting is always ``connect_timeout_s``."""
        base = self.request_timeout_s
        if not base:
            return aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s)
        if parsed.stream:
            return aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s, sock_read=base)
        tokens = requested_output_tokens(parsed.body, parsed.max_tokens or 0)
        return aiohttp.ClientTimeout(total=base + tokens * self.request_timeout_per_token_s,
                                     sock_connect=self.connect_timeout_s)

    # ---- entry point --------------------------------------------------------------------------------
    async def handle(self, request: web.Request, hook: ExchangeHook | None = None) -> web.StreamResponse:
        """Serve one inference request (any of the OpenAI POST paths), through ``hook`` if given."""
        received = time.monotonic()
        objective = "unknown"
        response: web.StreamResponse | None = None
        try:
            if request.content_length is not None and request.content_length > self.max_body_bytes:
                raise web.HTTPRequestEntityTooLarge(max_size=self.max_body_bytes, actual_size=request.content_length)
            body = await request.read()
            parsed = parse_request(request.path, body, request.headers)
            self._identify(request, parsed)
            if hook is not None:
                parsed = await hook.prepare(parsed, request.headers)
            objective = self.director.objective(parsed)
            response = await self._serve(request, parsed, objective, received, hook)
            return response
        except web.HTTPRequestEntityTooLarge:
            response = error_response(413, f"request body exceeds {self.max_body_bytes} bytes", code="body_too_large")
            return response
        except RequestError as exc:
            response = web.Response(status=exc.status, body=exc.envelope(), content_type="application/json")
            return response
        except (RequestPayloadError, BadHttpMessage) as exc:  # e.g. a Content-Encoding that does not decode
            response = error_response(400, f"the request body could not be read: {exc}", code="invalid_body")
            return response
        except Exception:  # a bug of ours: still an answer in the envelope, and a log line
            log.exception("request failed", extra={"action": "router.request_failed", "path": request.path})
            response = error_response(500, "the router failed to handle the request", code="internal_error")
            return response
        finally:
            self.observer.answered(objective, response.status if response is not None else 499)

    def _identify(self, request: web.Request, parsed: ParsedRequest) -> None:
        """Keep the fairness id and objective only from a trusted caller (:mod:`router.trust`);
        count each identity header an untrusted caller sent."""
        identity = self.trust.identify(request.headers, parsed.objective, parsed.fairness_id)
        parsed.objective, parsed.fairness_id = identity.objective, identity.fairness_id
        for header in identity.ignored:
            self.observer.untrusted_header(header)

    async def _serve(self, request: web.Request, parsed: ParsedRequest, objective: str,
                     received: float, hook: ExchangeHook | None = None) -> web.StreamResponse:
        director = self.director
        refused = director.precheck(parsed)
        if refused is not None:
            return rejected_response(refused)
        prompt = await self.tokenizer.prompt(parsed)
        llm_request = director.llm_request(parsed, prompt, objective)
        admitted = await director.admit(parsed, objective, received)
        if isinstance(admitted, Rejected):
            return rejected_response(admitted)
        try:
            exchange = _Exchange(self, request, parsed, self._body(parsed, llm_request), objective, received, hook)
            return await director.forward(llm_request, objective, admitted, exchange)
        finally:
            admitted.release()

    def _body(self, parsed: ParsedRequest, llm_request: LLMRequest) -> bytes:
        if self.engine_priority:
            return with_engine_priority(parsed, engine_priority(llm_request.priority))
        return engine_body(parsed)  # the original bytes unless the client sent a router-only field

    def headers(self, request: web.Request, parsed: ParsedRequest) -> dict[str, str]:
        """The headers forwarded to the engine."""
        headers = {"Content-Type": "application/json"}
        for name in FORWARDED_HEADERS:
            value = request.headers.get(name)
            if value is not None:
                headers[name] = value
        headers.setdefault("x-request-id", parsed.request_id)
        return headers


#: Request kinds that may be disaggregated (vLLM's NixlConnector flow serves both generation APIs).
DISAGGREGABLE_KINDS = ("chat", "completion")


class _Exchange:
    """The transport of one request across its tries (:class:`router.director.PDForwarder`):
    ``response`` is what the current try has written to the client, if anything.

    A disaggregated request (:mod:`router.disagg`): :meth:`prefill` sends the prefill leg and reads
    its ``kv_transfer_params``; :meth:`use_kv_transfer` makes the next :meth:`send` the decode leg
    (the original body plus those params), whose answer goes to the client as any other."""

    __slots__ = ("proxy", "request", "parsed", "body", "headers", "objective", "received", "response", "hook",
                 "disaggregable", "not_disaggregable_reason", "_send_body", "_client_usage", "_flex")

    def __init__(self, proxy: Proxy, request: web.Request, parsed: ParsedRequest, body: bytes, objective: str,
                 received: float, hook: ExchangeHook | None = None) -> None:
        self.proxy = proxy
        self.request = request
        self.parsed = parsed
        self.body = body
        self.headers = proxy.headers(request, parsed)
        self.objective = objective
        self.received = received
        self.response: web.StreamResponse | None = None
        self.hook = hook
        generation = parsed.kind in DISAGGREGABLE_KINDS and hook is None
        self.disaggregable = generation and single_sequence(parsed.body)
        self.not_disaggregable_reason = (PDReason.MULTIPLE_OUTPUTS if generation else PDReason.NOT_GENERATION).value
        self._send_body = body
        self._client_usage: ClientUsage | None = None
        self._flex = FlexAnswer() if is_flex(parsed) else None  # the answer says service_tier "flex"

    def use_kv_transfer(self, params: dict[str, Any] | None, prefill_cached_tokens: int | None = None) -> None:
        """The next :meth:`send` sends ``body`` plus ``kv_transfer_params`` = ``params`` (the
        decode leg), or ``body`` itself when None; with ``prefill_cached_tokens`` its answer's
        ``cached_tokens`` is rewritten to it (:class:`router.disagg.ClientUsage`)."""
        self._send_body = self.body if params is None else decode_body(orjson.loads(self.body), params)
        self._client_usage = (ClientUsage(prefill_cached_tokens)
                              if params is not None and prefill_cached_tokens is not None else None)

    async def prefill(self, attempt: Attempt) -> PrefillAnswer:
        """The prefill leg on ``attempt.endpoint`` (:func:`router.disagg.prefill_body` of the
        body, non-streamed): its ``kv_transfer_params``, or why there are none. Connection
        failures are reported to the pool (a health check follows), as for any try."""
        proxy, observer = self.proxy, self.proxy.observer
        name = attempt.endpoint.name
        timeout = aiohttp.ClientTimeout(
            total=(proxy.request_timeout_s + proxy.request_timeout_per_token_s) if proxy.request_timeout_s else None,
            sock_connect=proxy.connect_timeout_s)
        try:
            async with proxy.session.post(name + self.parsed.path, data=prefill_body(orjson.loads(self.body)),
                                          headers=self.headers, timeout=timeout) as upstream:
                data = await upstream.read()
                status = upstream.status
        except TimeoutError as exc:
            if isinstance(exc, aiohttp.ConnectionTimeoutError):
                attempt.engine_failed(f"{type(exc).__name__}: {exc}")
                return PrefillAnswer(None, "connect")
            observer.upstream_error("timeout")
            return PrefillAnswer(None, "timeout")
        except (aiohttp.ClientConnectionError, OSError) as exc:
            observer.upstream_error("connect")
            attempt.engine_failed(f"{type(exc).__name__}: {exc}")
            return PrefillAnswer(None, "connect")
        except aiohttp.ClientError as exc:
            observer.upstream_error("stream")
            attempt.engine_failed(f"{type(exc).__name__}: {exc}")
            return PrefillAnswer(None, "stream")
        if status != 200:
            client_fault = 400 <= status < 500 and status not in (408, 429)
            return PrefillAnswer(None, PREFILL_CLIENT_ERROR if client_fault else "status")
        params = kv_transfer_params_of(data)
        if params is None:
            return PrefillAnswer(None, "no_kv_transfer_params")
        return PrefillAnswer(params, cached_tokens=cached_tokens_from_json(data))

    def rejected(self, rejected: Rejected) -> web.StreamResponse:
        """The director's refusal as an error response."""
        return rejected_response(rejected)

    async def send(self, attempt: Attempt, retry: bool) -> web.StreamResponse | None:
        """One try on ``attempt.endpoint``; None means "nothing ran there, try another endpoint"."""
        proxy, observer = self.proxy, self.proxy.observer
        self.response = None
        name = attempt.endpoint.name
        try:
            upstream = await proxy.session.post(name + self.parsed.path, data=self._send_body, headers=self.headers,
                                                timeout=proxy.timeout_for(self.parsed))
        except TimeoutError as exc:
            if not isinstance(exc, aiohttp.ConnectionTimeoutError):
                # the engine had the request for the whole timeout: it is not run again elsewhere
                observer.upstream_error("timeout")
                return _timed_out(self.parsed)
            observer.upstream_error("connect")
            attempt.engine_failed(f"{type(exc).__name__}: {exc}")
            return None if retry else rejected_response(NO_ENDPOINT)  # nothing ran, may be retried
        except (aiohttp.ClientConnectionError, OSError) as exc:
            observer.upstream_error("connect")
            attempt.engine_failed(f"{type(exc).__name__}: {exc}")
            return None if retry else rejected_response(NO_ENDPOINT)  # refused: nothing ran, may be retried
        complete = False
        try:
            observer.first_byte(self.objective, time.monotonic() - self.received)
            attempt.cached_tokens = await self._relay(upstream, attempt)
            complete = True
        except _ClientGone:
            return self.response  # the client closed its connection: not the engine's fault
        except TimeoutError as exc:  # the whole-request bound, or a stream silent for too long
            observer.upstream_error("timeout")
            return await self._end(504, f"the inference endpoint did not answer within the request's "
                                   f"timeout ({type(exc).__name__})", "upstream_timeout")
        except (aiohttp.ClientError, OSError) as exc:
            observer.upstream_error("stream")
            attempt.engine_failed(f"{type(exc).__name__}: {exc}")
            return await self._end(502, f"the inference endpoint failed mid-response: {type(exc).__name__}",
                                   "upstream_failed")
        finally:
            if complete:
                upstream.release()  # keep-alive: back to the pool
            else:
                upstream.close()  # the engine sees the disconnect and aborts the request
        return self.response

    async def _relay(self, upstream: aiohttp.ClientResponse, attempt: Attempt) -> int | None:
        """Pass the engine's answer to the client (``self.response`` is set as soon as it exists);
        returns the cached prompt tokens the engine reported, if any. The first body chunk of a
        stream means the prefill is over (``attempt.chunk_sent()``).

        Raises:
            _ClientGone: writing to the client failed (it disconnected).
            aiohttp.ClientError, OSError: reading from the engine failed.
        """
        out_headers = {k: v for k in RETURNED_HEADERS if (v := upstream.headers.get(k)) is not None}
        content_type = upstream.headers.get("content-type", "")
        flex = self._flex if upstream.status == 200 else None
        if not content_type.startswith("text/event-stream"):
            data = await upstream.read()
            if flex is not None:  # before the hook: a stored response says what served it
                data = flex.answer(data)
            usage = self._client_usage
            if self.hook is not None:
                data = await self.hook.answer(upstream.status, data)
            elif usage is not None and upstream.status == 200:
                data = usage.answer(data)
                self.response = web.Response(status=upstream.status, body=data, headers=out_headers)
                return usage.engine_cached_tokens
            self.response = web.Response(status=upstream.status, body=data, headers=out_headers)
            return self.hook.cached_tokens if self.hook is not None else cached_tokens_from_json(data)
        response = self.response = web.StreamResponse(status=upstream.status, headers=out_headers)
        response.headers["Cache-Control"] = "no-cache"
        await _to_client(response.prepare(self.request))
        tail = b""
        chunks: AsyncIterator[bytes] = upstream.content.iter_any()
        if flex is not None:
            chunks = flex.stream(chunks)
        usage = self._client_usage if self.hook is None else None
        if self.hook is not None:
            chunks = self.hook.stream(chunks)
        elif usage is not None:
            chunks = usage.stream(chunks)
        async for chunk in chunks:
            attempt.chunk_sent()
            await _to_client(response.write(chunk))
            tail = (tail + chunk)[-SSE_TAIL_BYTES:]
        await _to_client(response.write_eof())
        if usage is not None:
            return usage.engine_cached_tokens
        return self.hook.cached_tokens if self.hook is not None else cached_tokens_from_sse_tail(tail)

    async def interrupted(self, attempt: Attempt, interruption: Interruption) -> web.StreamResponse:
        """End a request the director interrupted (eviction, endpoint down)."""
        return await self._end(interruption.status, interruption.message, interruption.code,
                               interruption.drop_reason)

    async def _end(self, status: int, message: str, code: str, reason: str | None = None) -> web.StreamResponse:
        """End a request that cannot finish: an error response when nothing was sent yet (429/503
        with ``Retry-After`` and the drop reason for evictions and lost endpoints), else an SSE
        ``error`` event closing the stream (no ``[DONE]``)."""
        response = self.response
        if response is None or not response.prepared:
            if reason is None:
                return error_response(status, message, code=code, err_type=ErrorType.SERVER)
            return error_response(status, message, code=code, headers={"Retry-After": "1", DROPPED_REASON: reason})
        event = error_json(message, ErrorType.SERVER if status >= 500 else ErrorType.RATE_LIMIT, code=code)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await response.write(b"data: " + event + b"\n\n")
            await response.write_eof()
        return response


def _timed_out(parsed: ParsedRequest) -> web.Response:
    """504 ``upstream_timeout``: no answer within the request's forwarding timeout."""
    return error_response(504, "the inference endpoint did not answer within the request's timeout "
                          f"(max_tokens {parsed.max_tokens})", code="upstream_timeout", err_type=ErrorType.SERVER)


def rejected_response(rejected: Rejected) -> web.Response:
    """A :class:`router.director.Rejected` as the error response it stands for."""
    return error_response(rejected.status, rejected.message, code=rejected.code, err_type=rejected.error_type,
                          param=rejected.param, headers=rejected.headers or None)


class _ClientGone(Exception):
    """Writing to the client failed: it closed the connection."""


async def _to_client(write: Awaitable[object]) -> None:
    """Await a write to the client, turning a reset connection into :class:`_ClientGone`."""
    try:
        await write
    except ConnectionResetError as exc:  # aiohttp's ClientConnectionResetError is one
        raise _ClientGone() from exc
