"""The simulated engine's HTTP server: ``create_app(settings)`` builds a FastAPI app (settings on
``app.state.settings``) whose lifespan owns one :class:`~engine_twin.engine.SimEngine` (on
``app.state.engine``); the endpoints are the named handlers of :data:`routes`. No module-level app.

Endpoints (vLLM's): ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``,
``/v1/responses``, ``/tokenize``, ``/detokenize``, ``/reset_prefix_cache``; ``GET /v1/models``,
``/health``, ``/metrics``, ``/version``. Simulator only: ``POST /sim/fault`` (see :mod:`faults`) and
``GET /sim/state`` (running, waiting, KV usage, blocks per tier, event batches sent).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import random
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import orjson
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from common.chatml import render_chat
from engine_twin.engine import Outcome, SimEngine
from engine_twin.errors import BadRequestError, EngineSimError, InvalidJSONError
from engine_twin.protocol import (
    GenerationSpec,
    chat_logprobs,
    completion_logprobs,
    new_id,
    now,
    parse_chat,
    parse_completion,
    parse_response,
    resolve_model,
    usage_block,
)
from engine_twin.settings import EngineSimSettings

T = TypeVar("T")
logger = logging.getLogger(__name__)
SIM_VERSION = "0.0.0+backfill-sim"


def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        try:  # the error path only: take the stdlib's message, as vLLM's FastAPI validation reports it
            json.loads(raw)
            detail = "JSON decode error"
        except ValueError as exc:
            detail = getattr(exc, "msg", str(exc))
        raise InvalidJSONError(detail) from None
    if not isinstance(body, dict):
        raise BadRequestError("The request body must be a JSON object")
    return body


async def _disconnect(receive: Receive) -> None:
    """Return when ``receive`` yields ``http.disconnect``. Called only after the body has been read,
    so any ``http.request`` message it sees is an empty trailer and is dropped."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work`` while watching ``receive`` for the client's disconnect (vLLM's
    ``with_cancellation``).

    Returns ``work``'s result. On a disconnect the work is cancelled and awaited, so the engine's
    ``finally`` has aborted the request and freed its blocks before this raises
    :class:`starlette.requests.ClientDisconnect`. A watch that fails for any other reason is logged
    and the work runs to its end unwatched: only a real ``http.disconnect`` aborts a request.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and watcher.done() and not watcher.cancelled():
            if (error := watcher.exception()) is None:
                raise ClientDisconnect()  # the finally below cancels and awaits the work first
            logger.warning("disconnect watch failed (%r); the request runs to its end", error)
        return await task
    finally:
        watcher.cancel()
        if not task.done():  # this handler itself was cancelled (server shutdown): stop the work too
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _until_disconnect(request: Request, work: Awaitable[T], engine: SimEngine) -> T:
    """:func:`_unless_disconnected` on ``request``. At ``time_scale`` 0 the engine never sleeps, so a
    request lasts only as long as the steps before it, and the watch is skipped (``backfill bench
    engine-sim`` measures that path): a disconnect then does not abort a non-streamed request."""
    if engine.settings.time_scale == 0:
        return await work
    return await _unless_disconnected(request.receive, work)


class _ClientGone(Response):
    """The answer to a client that has gone: sent for form's sake. ASGI < 2.4 servers drop it; 2.4
    servers raise ``OSError`` on the send, which is swallowed (nothing is logged)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with contextlib.suppress(OSError):
            await super().__call__(scope, receive, send)


class EngineStream(StreamingResponse):
    """An SSE response that aborts its engine request as soon as the client goes away.

    Starlette's ``StreamingResponse`` watches for ``http.disconnect`` only under ASGI spec < 2.4 and
    never closes its body iterator; this one always races the body against :func:`_disconnect`
    (uvicorn's h11 and httptools alike) and always closes the iterator, so the engine's ``finally``
    frees the request's blocks at once. A client that goes away gets nothing more; no error is raised.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await _unless_disconnected(receive, self.stream_response(send))
        except (ClientDisconnect, OSError):  # OSError: an ASGI 2.4 server's send to a gone client
            pass
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


routes = APIRouter()
"""The simulator's endpoints, named handlers reading the engine from ``request.app.state.engine``."""


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start the engine for ``app.state.settings`` (on ``app.state.engine``) and its NIXL side
    channel; close both at shutdown."""
    engine = SimEngine(app.state.settings)
    app.state.engine = engine
    engine.start()
    try:
        await engine.start_side_channel()
        yield
    finally:
        await engine.aclose()


def create_app(settings: EngineSimSettings) -> FastAPI:
    """The simulator app for ``settings``; the engine lives from lifespan start to stop."""
    app = FastAPI(title="backfill engine simulator", lifespan=_lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.settings = settings
    app.exception_handler(EngineSimError)(_engine_error)
    app.exception_handler(ClientDisconnect)(_client_gone)
    app.include_router(routes)
    return app


async def _engine_error(request: Request, exc: EngineSimError) -> Response:
    """An :class:`EngineSimError` as vLLM's error body and status."""
    return _json(exc.body(), exc.status)


async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
    return _ClientGone(status_code=499)  # nginx's "client closed request"; nobody reads it


def _engine_of(request: Request) -> SimEngine:
    return request.app.state.engine


async def _generation(request: Request, parse: Callable[..., GenerationSpec]) -> tuple[SimEngine, GenerationSpec]:
    """The engine and the parsed generation request, after the fault injector's ``before_request``."""
    engine = _engine_of(request)
    spec = parse(engine.settings, engine.tokenizer, await _body(request))
    await engine.faults.before_request()
    return engine, spec


# ---- OpenAI endpoints ----------------------------------------------------------------------
@routes.post("/v1/chat/completions")
async def chat(request: Request) -> Response:
    """vLLM's ``POST /v1/chat/completions`` (streamed or not) on the twin."""
    engine, spec = await _generation(request, parse_chat)
    if spec.stream:
        return EngineStream(_guarded(_chat_stream(engine, spec)), media_type="text/event-stream")
    [out] = await _until_disconnect(request, engine.run(spec), engine)
    return _json(_chat_completion(engine, spec, out))


def _chat_completion(engine: SimEngine, spec: GenerationSpec, out: Outcome) -> dict[str, Any]:
    """The ``chat.completion`` object of a finished request (``n`` identical choices)."""
    pieces = engine.pieces(out.generated)
    text = "".join(pieces)
    choices = [{
        "index": i,
        "message": {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                    "audio": None, "function_call": None, "reasoning": None},
        "logprobs": chat_logprobs(pieces, spec.logprobs) if spec.logprobs is not None else None,
        "finish_reason": spec.finish_reason, "stop_reason": None, "token_ids": None, "routed_experts": None,
    } for i in range(spec.n)]
    return {
        "id": new_id("chatcmpl-"), "object": "chat.completion", "created": now(), "model": spec.model,
        "choices": choices, "service_tier": None, "system_fingerprint": None,
        "usage": usage_block(engine.settings, out.prompt_tokens, out.generated * spec.n, out.cached_tokens,
                             chat=True),
        "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None,
        "kv_transfer_params": out.kv_transfer_params,
        "ec_transfer_params": None, "metrics": None,
    }


@routes.post("/v1/completions")
async def completions(request: Request) -> Response:
    """vLLM's ``POST /v1/completions`` (streamed or not) on the twin."""
    engine, spec = await _generation(request, parse_completion)
    if spec.stream:
        if len(spec.prompts) > 1:
            raise BadRequestError("the simulator streams one prompt per request", "prompt")
        return EngineStream(_guarded(_completion_stream(engine, spec)), media_type="text/event-stream")
    outs: list[Outcome] = await _until_disconnect(request, engine.run(spec), engine)
    return _json(_text_completion(engine, spec, outs))


def _text_completion(engine: SimEngine, spec: GenerationSpec, outs: list[Outcome]) -> dict[str, Any]:
    """The ``text_completion`` object: ``n`` choices per prompt, in prompt order."""
    choices = []
    for p, out in enumerate(outs):
        pieces = engine.pieces(out.generated)
        echo = spec.echo_texts[p] if spec.echo_texts else ""
        for k in range(spec.n):
            choices.append({
                "index": p * spec.n + k, "text": echo + "".join(pieces),
                "logprobs": completion_logprobs(pieces, spec.logprobs, len(echo))
                if spec.logprobs is not None else None,
                "finish_reason": spec.finish_reason, "stop_reason": None, "token_ids": None,
                "prompt_logprobs": None, "prompt_token_ids": None, "routed_experts": None,
            })
    prompt_tokens = sum(o.prompt_tokens for o in outs)
    return {
        "id": new_id("cmpl-"), "object": "text_completion", "created": now(), "model": spec.model,
        "choices": choices, "service_tier": None, "system_fingerprint": None,
        "usage": usage_block(engine.settings, prompt_tokens, sum(o.generated for o in outs) * spec.n,
                             sum(o.cached_tokens for o in outs)),
        "kv_transfer_params": outs[0].kv_transfer_params if len(outs) == 1 else None,
        "ec_transfer_params": None, "metrics": None,
    }


@routes.post("/v1/responses")
async def responses(request: Request) -> Response:
    """vLLM's ``POST /v1/responses`` on the twin."""
    engine, spec = await _generation(request, parse_response)
    response_id = new_id("resp_")
    if spec.stream:
        return EngineStream(_responses_stream(engine, spec, response_id), media_type="text/event-stream")
    [out] = await _until_disconnect(request, engine.run(spec), engine)
    return _json(_response_object(engine, spec, response_id, out, "".join(engine.pieces(out.generated))))


@routes.post("/v1/embeddings")
async def embeddings(request: Request) -> Response:
    """vLLM's ``POST /v1/embeddings`` on the twin."""
    engine = _engine_of(request)
    s = engine.settings
    body = await _body(request)
    model = resolve_model(s, body)
    token_lists = _embedding_inputs(engine, body.get("input"))
    await engine.faults.before_request()
    dims = body.get("dimensions") or s.embedding_dim
    total = sum(len(t) for t in token_lists)
    delay = s.time_scale * engine.core.model.prefill_seconds(total)
    if delay > 0:
        await asyncio.sleep(delay)
    as_b64 = body.get("encoding_format") == "base64"
    data = []
    for i, tokens in enumerate(token_lists):
        vector = _embedding(tokens, dims)
        value: Any = base64.b64encode(struct.pack(f"<{dims}f", *vector)).decode() if as_b64 else vector
        data.append({"index": i, "object": "embedding", "embedding": value})
    engine.metrics.prompt_tokens.inc(total)
    return _json({"id": new_id("embd-"), "object": "list", "created": now(), "model": model, "data": data,
                  "usage": {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0,
                            "prompt_tokens_details": None}})


def _embedding_inputs(engine: SimEngine, inputs: Any) -> list[list[int]]:
    """The token lists of an embeddings ``input`` (a string, strings, token ids or lists of them).
    Raises BadRequestError for any other shape or an input past ``max_model_len``."""
    if isinstance(inputs, str):
        token_lists = [engine.tokenizer.encode(inputs)]
    elif isinstance(inputs, list) and inputs and all(isinstance(x, int) for x in inputs):
        token_lists = [inputs]
    elif isinstance(inputs, list) and inputs and all(isinstance(x, str) for x in inputs):
        token_lists = [engine.tokenizer.encode(x) for x in inputs]
    elif isinstance(inputs, list) and inputs and all(isinstance(x, list) for x in inputs):
        token_lists = inputs
    else:
        raise BadRequestError("input must be a non-empty string, list of strings or token ids", "input")
    limit = engine.settings.max_model_len
    for tokens in token_lists:
        if len(tokens) > limit:
            raise BadRequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(tokens)} tokens in the input for embedding generation. Please reduce the length "
                "of the input.", "input")
    return token_lists


@routes.get("/v1/models")
async def models(request: Request) -> Response:
    """vLLM's ``GET /v1/models``: the served model names."""
    s = _engine_of(request).settings
    created = now()
    return _json({"object": "list", "data": [{
        "id": name, "object": "model", "created": created, "owned_by": "vllm", "root": name,
        "parent": None, "max_model_len": s.max_model_len,
        "permission": [{"id": new_id("modelperm-"), "object": "model_permission", "created": created,
                        "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                        "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                        "organization": "*", "group": None, "is_blocking": False}],
    } for name in s.served_model_name]})


# ---- vLLM extras ---------------------------------------------------------------------------
@routes.get("/health")
async def health(request: Request) -> Response:
    """vLLM's ``GET /health``: 200 while the engine runs."""
    return Response(status_code=200 if _engine_of(request).faults.healthy else 503)


@routes.get("/version")
async def version() -> Response:
    """vLLM's ``GET /version``."""
    return _json({"version": SIM_VERSION})


@routes.get("/metrics")
async def metrics(request: Request) -> Response:
    """vLLM's ``GET /metrics`` series (Prometheus text)."""
    return Response(_engine_of(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _rendered(spec: GenerationSpec, prefix: str, prompt: list[int]) -> dict[str, Any]:
    """One rendered prompt, as vLLM's ``/render`` endpoints answer."""
    return {"request_id": new_id(prefix), "model": spec.model, "token_ids": prompt,
            "sampling_params": {"max_tokens": spec.max_tokens, "n": spec.n}, "priority": spec.priority}


@routes.post("/v1/completions/render")
async def completions_render(request: Request) -> Response:
    """vLLM's ``POST /v1/completions/render``: the prompt's tokens without generating."""
    engine = _engine_of(request)
    spec = parse_completion(engine.settings, engine.tokenizer, await _body(request))
    return _json([_rendered(spec, "cmpl-", p) for p in spec.prompts])


@routes.post("/v1/chat/completions/render")
async def chat_render(request: Request) -> Response:
    """vLLM's ``POST /v1/chat/completions/render``: the chat prompt's tokens without generating."""
    engine = _engine_of(request)
    spec = parse_chat(engine.settings, engine.tokenizer, await _body(request))
    return _json(_rendered(spec, "chatcmpl-", spec.prompts[0]))


@routes.post("/tokenize")
async def tokenize(request: Request) -> Response:
    """vLLM's ``POST /tokenize``."""
    engine = _engine_of(request)
    body = await _body(request)
    if body.get("model"):
        resolve_model(engine.settings, body)
    if "messages" in body:
        text = render_chat(body["messages"], bool(body.get("add_generation_prompt", True)))
        tokens = engine.tokenizer.encode(text, add_special_tokens=bool(body.get("add_special_tokens", False)))
    elif isinstance(body.get("prompt"), str):
        tokens = engine.tokenizer.encode(body["prompt"], bool(body.get("add_special_tokens", True)))
    else:
        raise BadRequestError("Either 'prompt' or 'messages' must be provided", "prompt")
    return _json({"count": len(tokens), "max_model_len": engine.settings.max_model_len, "tokens": tokens,
                  "token_strs": None})


@routes.post("/detokenize")
async def detokenize(request: Request) -> Response:
    """vLLM's ``POST /detokenize``."""
    engine = _engine_of(request)
    body = await _body(request)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise BadRequestError("tokens: Input should be a valid list of integers", "tokens")
    return _json({"prompt": engine.tokenizer.decode(tokens)})


@routes.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> Response:
    """vLLM's ``POST /reset_prefix_cache``: drop every cached block."""
    if not _engine_of(request).cache.clear():
        raise BadRequestError("Failed to reset prefix cache: requests are running")
    return Response(status_code=200)


# ---- simulator admin -----------------------------------------------------------------------
@routes.post("/sim/fault")
async def fault(request: Request) -> Response:
    """The twin's fault injection (``/sim/fault``, for fault tests)."""
    engine = _engine_of(request)
    body = await _body(request)
    engine.faults.set(str(body.get("mode", "none")), body.get("count"))
    if engine.faults.mode == "die":
        asyncio.get_running_loop().call_later(0.05, _die)
    return _json({"mode": engine.faults.mode, "remaining": engine.faults.remaining})


@routes.get("/sim/state")
async def state(request: Request) -> Response:
    """The twin's internal state (``/sim/state``, for tests)."""
    engine = _engine_of(request)
    core = engine.core
    return _json({
        "running": core.num_running, "waiting": core.num_waiting,
        "prefilling": sum(1 for r in core.running if r.num_computed_tokens < r.num_tokens - 1),
        "num_preemptions": core.num_preemptions, "steps": core.steps, "kv_usage": engine.cache.usage,
        "tiers": engine.cache.sizes(), "fault": engine.faults.mode,
        "kv_event_batches": engine.publisher.sent if engine.publisher else 0,
        "none_hash": engine.root_hash.hex(), "block_size": engine.settings.block_size,
        "kv_transfer": _kv_transfer_state(engine),
    })


def _kv_transfer_state(engine: SimEngine) -> dict[str, Any] | None:
    """NixlConnector's state for ``/sim/state``: role, engine id, side channel, held and loading requests."""
    s = engine.settings
    if s.kv_transfer_config is None or not s.nixl:
        return None
    core = engine.core
    return {"kv_connector": s.kv_transfer_config.kv_connector, "kv_role": s.kv_transfer_config.kv_role,
            "engine_id": engine.engine_id, "side_channel": f"{s.nixl_side_channel_host}:{s.side_channel_port}",
            "held_requests": len(core.held), "held_blocks": core.held_blocks, "loading_requests": len(core.transferring)}


async def _guarded(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A stream that ends with vLLM's in-stream error (``data: {"error": …}`` then ``[DONE]``) when the
    request fails after the 200 has gone out (a failed KV load under ``kv_load_failure_policy: fail``)."""
    try:
        async for chunk in chunks:
            yield chunk
    except EngineSimError as exc:
        yield _sse(exc.body())
        yield b"data: [DONE]\n\n"
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()


def _die() -> None:
    import os

    os._exit(1)


def _embedding(tokens: list[int], dims: int) -> list[float]:
    """A deterministic unit vector for ``tokens`` (seeded by their SHA-256)."""
    seed = int.from_bytes(hashlib.sha256(struct.pack(f"<{len(tokens)}q", *tokens)).digest()[:8], "big")
    rng = random.Random(seed)
    vector = [rng.gauss(0.0, 1.0) for _ in range(dims)]
    norm = sum(v * v for v in vector) ** 0.5 or 1.0
    return [v / norm for v in vector]


def _usage_chunk(engine: SimEngine, base: dict[str, Any], spec: GenerationSpec, generated: int,
                 cached: int) -> bytes:
    usage = usage_block(engine.settings, len(spec.prompts[0]), generated * spec.n, cached,
                        chat=spec.kind == "chat", streamed=True)
    return _sse({**base, "choices": [], "usage": usage, "system_fingerprint": None})


async def _chat_stream(engine: SimEngine, spec: GenerationSpec) -> AsyncIterator[bytes]:
    base = {"id": new_id("chatcmpl-"), "object": "chat.completion.chunk", "created": now(), "model": spec.model}
    first = True
    generated = cached = 0
    async for req, count in engine.stream(spec):
        generated, cached = count, req.cached_tokens
        if first:
            first = False
            for i in range(spec.n):
                yield _sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}],
                            "prompt_token_ids": None, "prompt_text": None})
        piece = engine.piece(count)
        done = count >= spec.max_tokens
        for i in range(spec.n):
            chunk = {**base, "choices": [{
                "index": i, "delta": {"content": piece},
                "logprobs": chat_logprobs([piece], spec.logprobs) if spec.logprobs is not None else None,
                "finish_reason": spec.finish_reason if done else None, "token_ids": None,
                **({"stop_reason": None} if done else {}),
            }]}
            if spec.continuous_usage:
                chunk["usage"] = usage_block(engine.settings, len(spec.prompts[0]), count, cached, chat=True,
                                             streamed=True)
            yield _sse(chunk)
    if spec.include_usage:
        yield _usage_chunk(engine, base, spec, generated, cached)
    yield b"data: [DONE]\n\n"


async def _completion_stream(engine: SimEngine, spec: GenerationSpec) -> AsyncIterator[bytes]:
    base = {"id": new_id("cmpl-"), "object": "text_completion", "created": now(), "model": spec.model}
    generated = cached = 0
    async for req, count in engine.stream(spec):
        generated, cached = count, req.cached_tokens
        piece = engine.piece(count)
        if count == 1 and spec.echo_texts:
            piece = spec.echo_texts[0] + piece
        done = count >= spec.max_tokens
        for i in range(spec.n):
            yield _sse({**base, "choices": [{
                "index": i, "text": piece,
                "logprobs": completion_logprobs([piece], spec.logprobs) if spec.logprobs is not None else None,
                "finish_reason": spec.finish_reason if done else None, "stop_reason": None,
                "prompt_token_ids": None, "token_ids": None,
            }]})
    if spec.include_usage:
        yield _usage_chunk(engine, base, spec, generated, cached)
    yield b"data: [DONE]\n\n"


def _response_status(spec: GenerationSpec) -> str:
    """``completed``, or ``incomplete`` when the output was cut by ``max_output_tokens`` (or the
    context left): OpenAI's rule. vLLM's non-harmony path (serving_responses.py) says ``completed``
    for both."""
    return "incomplete" if spec.finish_reason == "length" else "completed"


def _output_message(item_id: str, status: str, text: str | None, logprobs: list[Any] | None) -> dict[str, Any]:
    """A ``message`` output item: no content while ``text`` is None (``response.output_item.added``)."""
    content = [] if text is None else [_output_text(text, logprobs)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def _output_text(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _response_object(engine: SimEngine, spec: GenerationSpec, response_id: str, out: Outcome | None,
                     text: str, created_at: int | None = None) -> dict[str, Any]:
    """The ``response`` object: ``in_progress`` with no output while ``out`` is None, else final
    (status per :func:`_response_status`, ``incomplete_details.reason`` ``max_output_tokens`` when
    incomplete, usage in tokens)."""
    usage = None
    status = "in_progress" if out is None else _response_status(spec)
    output = []
    if out is not None:
        usage = {"input_tokens": out.prompt_tokens, "input_tokens_details": {"cached_tokens": out.cached_tokens},
                 "output_tokens": out.generated, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": out.prompt_tokens + out.generated}
        output = [_output_message(_item_id(response_id), status, text, None)]
    return {
        "id": response_id, "object": "response", "created_at": now() if created_at is None else created_at,
        "model": spec.model, "status": status, "output": output,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "temperature": 1.0, "top_p": 1.0,
        "max_output_tokens": spec.max_tokens, "usage": usage, "error": None, "instructions": None,
        "metadata": None, "text": {"format": {"type": "text"}},
    }


def _item_id(response_id: str) -> str:
    return f"msg_{response_id.removeprefix('resp_')}"


async def _responses_stream(engine: SimEngine, spec: GenerationSpec, response_id: str) -> AsyncIterator[bytes]:
    """The SSE events of a streamed response, as OpenAI's Responses API and vLLM send them, each with
    ``sequence_number`` (0, 1, …): ``response.created``, ``response.in_progress``,
    ``response.output_item.added`` (the message, ``in_progress``, no content),
    ``response.content_part.added`` (an empty ``output_text``), one ``response.output_text.delta``
    per token, ``response.output_text.done``, ``response.content_part.done``,
    ``response.output_item.done``, then ``response.completed``, or ``response.incomplete`` when the
    output was cut by ``max_output_tokens`` (OpenAI's event; vLLM sends ``response.completed``
    with the status inside)."""
    seq = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        seq += 1
        return b"event: " + kind.encode() + b"\n" + _sse({"type": kind, "sequence_number": seq - 1, **fields})

    created_at = now()
    initial = _response_object(engine, spec, response_id, None, "", created_at)
    yield event("response.created", response=initial)
    yield event("response.in_progress", response=initial)
    item_id = _item_id(response_id)
    at = {"item_id": item_id, "output_index": 0, "content_index": 0}
    yield event("response.output_item.added", output_index=0, item=_output_message(item_id, "in_progress", None, None))
    yield event("response.content_part.added", **at, part=_output_text("", []))
    cached = generated = 0
    async for req, count in engine.stream(spec):
        cached, generated = req.cached_tokens, count
        yield event("response.output_text.delta", **at, delta=engine.piece(count), logprobs=[])
    out = Outcome(len(spec.prompts[0]), cached, generated)
    text = "".join(engine.pieces(generated))
    status = _response_status(spec)
    yield event("response.output_text.done", **at, text=text, logprobs=[])
    yield event("response.content_part.done", **at, part=_output_text(text, []))
    yield event("response.output_item.done", output_index=0, item=_output_message(item_id, status, text, []))
    final = "response.completed" if status == "completed" else "response.incomplete"
    yield event(final, response=_response_object(engine, spec, response_id, out, text, created_at))
