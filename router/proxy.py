"""The request path: parse → flow control → schedule → forward → learn (ROUTING.md "Request path").

:class:`Router` owns nothing it did not build itself; :func:`router.app.create_app` builds it with
the pool, scheduler, flow controller, tokenizer and KV index, and its handlers call
:meth:`Router.handle`. One request:

1. read the body (≤ ``max_body_bytes``, else 413), parse it once (:mod:`router.parsing`; a bad
   body is a 4xx in OpenAI's envelope), tokenize it (:mod:`router.tokenizers`);
2. no healthy endpoint → 503 at once with ``Retry-After`` (RELIABILITY.md F10: fast 503);
3. flow control admits it (waiting while the pool is saturated) or refuses it: 429 (503 when no
   engine exists) with ``Retry-After`` and ``x-llm-d-request-dropped-reason``;
4. the scheduler picks an endpoint among the healthy ones; the plugins learn (``pre_request``);
   in-flight counters rise;
5. the body goes to the engine (with vLLM's ``priority`` when configured); the answer streams back
   chunk by chunk; a connection failure before any byte reached the client retries once on
   another endpoint (nothing ran), a failure mid-stream ends the client's stream with an error
   event; the client going away cancels the upstream request (aiohttp closes the connection,
   which vLLM treats as an abort);
6. counters fall, ``response_complete`` hooks get ``usage.prompt_tokens_details.cached_tokens``
   when the engine reported it (always for JSON answers; for streams only when the client asked
   for ``stream_options.include_usage``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.web_protocol import RequestPayloadError

from common.contracts.errors import ErrorType, error_json, openai_type_for_status
from router.flow_control import FlowItem, RequestDropped
from router.metrics import RouterMetrics
from router.parsing import ParsedRequest, RequestError, engine_priority, parse_request, with_engine_priority
from router.pool import EndpointPool
from router.scheduling.errors import NoCandidatesError
from router.scheduling.scheduler import Scheduler, SchedulingResult
from router.scheduling.types import Endpoint, LLMRequest, PrefixMatchInfo
from router.tokenizers import PromptTokenizer, to_llm_request

log = logging.getLogger(__name__)

#: Request headers passed on to the engine (besides Content-Type, which is always JSON).
FORWARDED_HEADERS = ("authorization", "x-request-id", "traceparent", "tracestate", "x-session-id")
#: Response headers passed back from the engine.
RETURNED_HEADERS = ("content-type", "x-request-id")
#: Drop reason header (shared/contracts/queue-and-headers.md).
DROPPED_REASON = "x-llm-d-request-dropped-reason"


def error_response(status: int, message: str, *, code: str | None = None, err_type: str | None = None,
                   param: str | None = None, headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI error envelope ``{"error": {message, type, param, code}}`` with ``status``."""
    body = error_json(message, err_type or openai_type_for_status(status), param, code)
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


class DecisionRate:
    """Decisions per second over the last ``window_s`` seconds (for the admin page)."""

    def __init__(self, window_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._times: deque[float] = deque()

    def record(self) -> None:
        """Count one decision now."""
        now = self.clock()
        self._times.append(now)
        self._trim(now)

    def rate(self) -> float:
        """Decisions per second over the window."""
        self._trim(self.clock())
        return len(self._times) / self.window_s

    def _trim(self, now: float) -> None:
        cutoff = now - self.window_s
        while self._times and self._times[0] < cutoff:
            self._times.popleft()


class Router:
    """The proxy's state and request handler.

    Args:
        pool: the endpoint pool (health, metrics, candidates).
        scheduler: the scheduling profiles; ``profile`` picks one (None: the first).
        tokenizer: the prompt tokenizer backend.
        flow: the flow controller, or None to skip flow control.
        session: aiohttp session for forwarding (owned by the app).
        metrics: the Prometheus series.
        objective_priority: objective name → priority (llm-d convention, higher first); used when
            flow control is off, and for the engine's ``priority`` field.
        engine_priority: add vLLM's ``priority`` field (``-objective priority``) to forwarded bodies.
        max_body_bytes: 413 above this many body bytes.
        request_timeout_s: a whole forwarded request, seconds (0 = none).
    """

    def __init__(self, *, pool: EndpointPool, scheduler: Scheduler, profile: str | None,
                 tokenizer: PromptTokenizer, flow: Any | None, session: aiohttp.ClientSession,
                 metrics: RouterMetrics, objective_priority: dict[str, int], default_objective: str,
                 engine_priority: bool = False, max_body_bytes: int = 32 * 1024 * 1024,
                 request_timeout_s: float = 600.0, connect_timeout_s: float = 2.0) -> None:
        self.pool = pool
        self.scheduler = scheduler
        self.profile = profile
        self.tokenizer = tokenizer
        self.flow = flow
        self.session = session
        self.metrics = metrics
        self.objective_priority = objective_priority
        self.default_objective = default_objective
        self.engine_priority = engine_priority
        self.max_body_bytes = max_body_bytes
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s or None, sock_connect=connect_timeout_s)
        self.decisions = DecisionRate()
        self._attempts: dict[str, set[_Attempt]] = {}  # endpoint name → tries running there

    # ---- entry point --------------------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Serve one inference request (any of the OpenAI POST paths)."""
        received = time.monotonic()
        objective = "unknown"
        response: web.StreamResponse | None = None
        try:
            if request.content_length is not None and request.content_length > self.max_body_bytes:
                raise web.HTTPRequestEntityTooLarge(max_size=self.max_body_bytes, actual_size=request.content_length)
            body = await request.read()
            parsed = parse_request(request.path, body, request.headers)
            objective = self._objective(parsed)
            response = await self._serve(request, parsed, objective, received)
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
            status = response.status if response is not None else 499
            self.metrics.requests.labels(objective, str(status)).inc()

    def _objective(self, parsed: ParsedRequest) -> str:
        name = parsed.objective or self.default_objective
        return name if name in self.objective_priority else self.default_objective

    async def _serve(self, request: web.Request, parsed: ParsedRequest, objective: str,
                     received: float) -> web.StreamResponse:
        if not self.pool.candidates():
            return _no_endpoint()
        if not self.pool.candidates_for(parsed.model):
            return error_response(404, f"The model `{parsed.model}` does not exist.", code="model_not_found",
                                  param="model", err_type=ErrorType.VLLM_NOT_FOUND)
        prompt = await self.tokenizer.prompt(parsed)
        priority = self.objective_priority[objective]
        llm_request = to_llm_request(parsed, prompt, priority)
        llm_request.objective = objective
        admission = None
        if self.flow is not None:
            admission = await self._admit(parsed, objective, len(parsed.raw), received)
            if isinstance(admission, web.Response):
                return admission
        try:
            return await self._forward(request, parsed, llm_request, objective, admission, received)
        finally:
            if admission is not None:
                admission.release()

    async def _admit(self, parsed: ParsedRequest, objective: str, size: int, received: float) -> Any:
        deadline = received + parsed.slo_ttft_ms / 1000.0 if parsed.slo_ttft_ms is not None else None
        item = FlowItem(request_id=parsed.request_id, fairness_id=parsed.fairness_id or "",
                        objective=objective, byte_size=size, deadline=deadline)
        try:
            admission = await self.flow.admit(item)
        except asyncio.CancelledError:  # the client went away while its request waited
            self.metrics.shed.labels(objective, "rejected-context-cancelled").inc()
            raise
        except RequestDropped as exc:
            self.metrics.shed.labels(objective, exc.reason).inc()
            return web.Response(status=exc.status, body=orjson.dumps(exc.body()), headers=exc.headers(),
                                content_type="application/json")
        self.metrics.dispatched.labels(objective).inc()
        self.metrics.flow_wait.labels(objective).observe(time.monotonic() - received)
        return admission

    # ---- scheduling ----------------------------------------------------------------------------------
    def _decide(self, llm_request: LLMRequest, exclude: set[str]) -> SchedulingResult | None:
        candidates = self.pool.candidates_for(llm_request.model)
        if exclude:
            candidates = [ep for ep in candidates if ep.name not in exclude]
        started = time.perf_counter()
        try:
            result = self.scheduler.schedule(llm_request, candidates, self.profile)
        except NoCandidatesError:
            return None
        self.metrics.decision_total.observe(time.perf_counter() - started)
        self.decisions.record()
        self.metrics.prefix_lookups.inc()
        if any(_matched(result)):
            self.metrics.prefix_hits.inc()
        self.scheduler.pre_request(llm_request, result)
        return result

    # ---- forwarding ----------------------------------------------------------------------------------
    async def _forward(self, request: web.Request, parsed: ParsedRequest, llm_request: LLMRequest,
                       objective: str, admission: Any, received: float) -> web.StreamResponse:
        body = (with_engine_priority(parsed, engine_priority(llm_request.priority)) if self.engine_priority
                else parsed.raw)
        headers = {"Content-Type": "application/json"}
        for name in FORWARDED_HEADERS:
            value = request.headers.get(name)
            if value is not None:
                headers[name] = value
        headers.setdefault("x-request-id", parsed.request_id)
        tried: set[str] = set()
        task = asyncio.current_task()
        assert task is not None
        attempt: _Attempt | None = None

        def evict() -> None:
            if attempt is not None:
                attempt.interrupt(_EVICTED)

        if admission is not None:
            admission.on_evict(evict)
        for number in range(2):
            result = self._decide(llm_request, tried)
            if result is None:
                return _no_endpoint()
            tried.add(result.endpoint.name)
            attempt = _Attempt(task, result.endpoint, _uncached_tokens(result, llm_request))
            self._attempts.setdefault(result.endpoint.name, set()).add(attempt)
            retry = number == 0
            try:
                response = await self._try(request, parsed, body, headers, attempt, objective, received, retry)
            except asyncio.CancelledError:
                if attempt.reason is None:
                    raise  # the client went away: the upstream connection is closed, the engine aborts
                task.uncancel()
                if attempt.reason is _EVICTED:
                    self.metrics.shed.labels(objective, "evicted").inc()
                    return await self._interrupted(attempt, 429, "evicted to make room for higher-priority work; "
                                                   "retry later", "evicted")
                # the endpoint was declared down while this request ran on it
                self.metrics.upstream_errors.labels("endpoint_down").inc()
                if retry and not attempt.sent:
                    continue
                return await self._interrupted(attempt, 503, "the inference endpoint went down", "upstream_failed")
            finally:
                attempt.finish()
                self._attempts.get(result.endpoint.name, set()).discard(attempt)
                self.scheduler.response_complete(llm_request, result, attempt.cached_tokens)
            if response is not None:
                return response
        return _no_endpoint()

    async def _try(self, request: web.Request, parsed: ParsedRequest, body: bytes, headers: dict[str, str],
                       attempt: _Attempt, objective: str, received: float, retry: bool) -> web.StreamResponse | None:
        """One try on ``attempt.endpoint``; None means "nothing ran there, try another endpoint"."""
        name = attempt.endpoint.name
        try:
            upstream = await self.session.post(name + parsed.path, data=body, headers=headers, timeout=self.timeout)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as exc:
            self.metrics.upstream_errors.labels("connect").inc()
            self.pool.report_failure(name, f"{type(exc).__name__}: {exc}")
            return None if retry else _no_endpoint()  # refused: nothing ran, so the request may be retried
        complete = False
        try:
            self.metrics.first_byte.labels(objective).observe(time.monotonic() - received)
            attempt.cached_tokens = await self._relay(request, upstream, attempt)
            complete = True
        except _ClientGone:
            return attempt.response  # the client closed its connection: not the engine's fault
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            self.metrics.upstream_errors.labels("stream").inc()
            self.pool.report_failure(name, f"{type(exc).__name__}: {exc}")
            return await self._interrupted(attempt, 502, f"the inference endpoint failed mid-response: "
                                           f"{type(exc).__name__}", "upstream_failed")
        finally:
            if complete:
                upstream.release()  # keep-alive: back to the pool
            else:
                upstream.close()  # the engine sees the disconnect and aborts the request
        return attempt.response

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse, attempt: _Attempt) -> int | None:
        """Pass the engine's answer to the client (``attempt.response`` is set as soon as it
        exists); returns the cached prompt tokens the engine reported, if any. The first body
        chunk of a stream means the prefill is over (``attempt.prefill_done()``).

        Raises:
            _ClientGone: writing to the client failed (it disconnected).
            aiohttp.ClientError, OSError: reading from the engine failed.
        """
        out_headers = {k: v for k in RETURNED_HEADERS if (v := upstream.headers.get(k)) is not None}
        content_type = upstream.headers.get("content-type", "")
        if not content_type.startswith("text/event-stream"):
            data = await upstream.read()
            attempt.response = web.Response(status=upstream.status, body=data, headers=out_headers)
            return _cached_from_json(data)
        response = attempt.response = web.StreamResponse(status=upstream.status, headers=out_headers)
        response.headers["Cache-Control"] = "no-cache"
        await _to_client(response.prepare(request))
        tail = b""
        async for chunk in upstream.content.iter_any():
            attempt.prefill_done()
            attempt.sent = True
            await _to_client(response.write(chunk))
            tail = (tail + chunk)[-8192:]
        await _to_client(response.write_eof())
        return _cached_from_sse_tail(tail)

    async def _interrupted(self, attempt: _Attempt, status: int, message: str, code: str) -> web.StreamResponse:
        """End a request that cannot finish: an error response when nothing was sent yet (429/503
        with ``Retry-After`` and the drop reason for evictions and lost endpoints), else an SSE
        ``error`` event closing the stream (no ``[DONE]``)."""
        response = attempt.response
        if response is None or not response.prepared:
            if status == 502:
                return error_response(502, message, code=code, err_type=ErrorType.SERVER)
            reason = "evicted" if code == "evicted" else "rejected-capacity"
            return error_response(status, message, code=code, headers={"Retry-After": "1", DROPPED_REASON: reason})
        event = error_json(message, ErrorType.SERVER if status >= 500 else ErrorType.RATE_LIMIT, code=code)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await response.write(b"data: " + event + b"\n\n")
            await response.write_eof()
        return response

    def endpoint_down(self, name: str) -> None:
        """Pool hook: ``name`` left the candidate set. Its requests in flight are interrupted
        (their counters were reset by the pool, so they no longer count them)."""
        for attempt in list(self._attempts.pop(name, ())):
            attempt.orphan()
            attempt.interrupt(_ENDPOINT_DOWN)


_EVICTED = "evicted"
_ENDPOINT_DOWN = "endpoint_down"


class _ClientGone(Exception):
    """Writing to the client failed: it closed the connection."""


async def _to_client(write: Any) -> None:
    """Await a write to the client, turning a reset connection into :class:`_ClientGone`."""
    try:
        await write
    except ConnectionResetError as exc:  # aiohttp's ClientConnectionResetError is one
        raise _ClientGone() from exc


def _no_endpoint() -> web.Response:
    return error_response(503, "no healthy inference endpoint is available", code="no_healthy_endpoints",
                          headers={"Retry-After": "1", DROPPED_REASON: "rejected-capacity"})


class _Attempt:
    """One try of a request on one endpoint: its share of the endpoint's in-flight counters, what
    was sent to the client, and why it was interrupted (eviction, endpoint down), if it was.

    The endpoint's ``in_flight_uncached_tokens`` carries the tokens the router expects the engine
    still has to compute for it, removed when its first streamed chunk arrives (the prefill is
    over) or when it ends, so the counter is the endpoint's queued prefill work, which the
    load-aware plugins (``token-load-scorer``, ``prefix-cache-affinity-filter``) turn into a wait
    estimate.
    """

    __slots__ = ("task", "endpoint", "tokens", "counted", "reason", "sent", "response", "cached_tokens")

    def __init__(self, task: asyncio.Task, endpoint: Endpoint, uncached_tokens: int) -> None:
        self.task = task
        self.endpoint = endpoint
        self.tokens = uncached_tokens
        self.counted = True
        self.reason: str | None = None
        self.sent = False
        self.response: web.StreamResponse | None = None
        self.cached_tokens: int | None = None
        endpoint.in_flight_requests += 1
        endpoint.in_flight_uncached_tokens += uncached_tokens

    def prefill_done(self) -> None:
        """The prefill is over: remove the tokens (idempotent)."""
        if self.tokens and self.counted:
            ep = self.endpoint
            ep.in_flight_uncached_tokens = max(0, ep.in_flight_uncached_tokens - self.tokens)
        self.tokens = 0

    def finish(self) -> None:
        """The try ended: remove it from the endpoint's counters (once)."""
        self.prefill_done()
        if self.counted:
            self.endpoint.in_flight_requests = max(0, self.endpoint.in_flight_requests - 1)
            self.counted = False

    def orphan(self) -> None:
        """The pool reset the endpoint's counters: this try no longer counts there."""
        self.counted = False

    def interrupt(self, reason: str) -> None:
        """Cancel the request's task, remembering why (first reason wins)."""
        if self.reason is None:
            self.reason = reason
            self.task.cancel()


def _matched(result: SchedulingResult) -> list[float]:
    info = _prefix_info(result)
    return list(info.matched.values()) if info is not None else []


def _prefix_info(result: SchedulingResult) -> PrefixMatchInfo | None:
    return result.state.first(PrefixMatchInfo)  # the producers' output, whatever their names


def _uncached_tokens(result: SchedulingResult, request: LLMRequest) -> int:
    info = _prefix_info(result)
    if info is None:
        return request.prompt_tokens
    return info.uncached_tokens(result.endpoint.name, request.prompt_tokens)


def _cached_from_json(data: bytes) -> int | None:
    try:
        usage = orjson.loads(data).get("usage") or {}
        return (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    except (orjson.JSONDecodeError, AttributeError, TypeError):
        return None


def _cached_from_sse_tail(tail: bytes) -> int | None:
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            return _cached_from_json(line[6:])
    return None
