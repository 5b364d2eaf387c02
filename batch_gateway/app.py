"""The gateway's app factory: ``create_app(settings)``.

The lifespan owns every client (database engine, file store, task publisher and the thread that
hands outbox events to the broker) and puts them on ``app.state``; nothing is created at import.
Every error leaves as OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}``; a
database that cannot be reached (connection refused or lost, pool exhausted) is a 503 with
``Retry-After`` (:func:`database_unavailable`), never a 500. Every answer, errors included,
carries ``x-request-id`` and ``openai-processing-ms`` (:mod:`batch_gateway.request_ids`).
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Any

import psycopg
import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy import exc as sa_exc
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from async_processor.backends.redis_producer import RedisLaneProducer
from batch_gateway import admin
from batch_gateway.api import batches, files, operator, responses
from batch_gateway.errors import GatewayError, ServiceUnavailableError, error_body
from batch_gateway.metrics import install_metrics
from batch_gateway.request_ids import RequestIdMiddleware
from batch_gateway.settings import GatewaySettings
from batch_gateway.store import queries
from batch_gateway.store.db import make_engine, make_sessionmaker
from batch_gateway.store.files import build_file_store
from batch_gateway.store.outbox import OutboxSender, TaskPublisher
from common.contracts.errors import ErrorType, error_envelope, openai_type_for_status
from common.tracing import instrument_fastapi

log = logging.getLogger(__name__)

DATABASE_RETRY_AFTER_SECONDS = 5
"""``Retry-After`` of the 503 answered while Postgres cannot be reached: long enough for a restart
or a failover to progress, short next to a client's patience."""


def database_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the database could not be reached or the connection was lost
    (SQLAlchemy's ``OperationalError`` / ``InterfaceError`` / pool ``TimeoutError``, psycopg's
    ``OperationalError`` / ``InterfaceError``, a statement whose connection was invalidated)
    rather than a bug."""
    if isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError,
                        psycopg.OperationalError, psycopg.InterfaceError)):
        return True
    return isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated


class GatewayApp(FastAPI):
    """FastAPI with :class:`RequestIdMiddleware` around the whole application, Starlette's error
    middleware included (so the 500 answers it makes carry the request id too). It wraps
    ``__call__`` rather than the built middleware stack, whose outermost layer OpenTelemetry's
    instrumentation expects to be Starlette's own."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._with_request_ids = RequestIdMiddleware(self._serve)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().__call__(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._with_request_ids(scope, receive, send)


def response_lanes(settings: GatewaySettings) -> RedisLaneProducer:
    """The producer background responses are published with: the pool's lanes on the settings'
    Redis, each call bounded by ``broker_timeout_seconds``."""
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=settings.broker_timeout_seconds,
                                  socket_connect_timeout=settings.broker_timeout_seconds)
    return RedisLaneProducer(client, pool=settings.queue_pool)


def _request_id(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


def create_app(settings: GatewaySettings) -> FastAPI:
    """Build the gateway for ``settings``. Serving it (uvicorn) runs the lifespan, which connects
    to Postgres and the broker and registers ``settings.api_key`` for ``settings.default_tenant``."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine = make_engine(settings.database_url)
        app.state.settings = settings
        app.state.sessionmaker = make_sessionmaker(engine)
        app.state.store = build_file_store(settings)
        app.state.upload_slots = files.UploadSlots(settings.max_concurrent_uploads)
        app.state.tasks = TaskPublisher.for_redis(settings.redis_url, settings.task_queue,
                                                  timeout_seconds=settings.broker_timeout_seconds)
        app.state.outbox = OutboxSender(app.state.tasks, app.state.sessionmaker).start()
        app.state.response_lanes = response_lanes(settings)
        if settings.api_key:
            with app.state.sessionmaker() as session:
                queries.add_api_key(session, settings.default_tenant, settings.api_key)
                session.commit()
        try:
            yield
        finally:
            app.state.outbox.close(timeout_seconds=2 * settings.broker_timeout_seconds + 1)
            app.state.tasks.close()
            app.state.response_lanes.client.close()
            engine.dispose()

    logging.getLogger("httpx").setLevel(logging.WARNING)  # else one INFO line per admin router poll
    app = GatewayApp(title="backfill gateway", version="0.1.0", lifespan=lifespan)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(responses.router)
    app.include_router(operator.router)  # the operator's JSON over every tenant (admin key)
    admin.install(app)  # the dashboard at /admin
    install_metrics(app, settings.admin_key)  # GET /metrics (admin key when set), HTTP series
    instrument_fastapi(app, "backfill-gateway")  # server spans continuing the client's traceparent

    @app.get("/health", include_in_schema=False)
    def health() -> dict:
        """Liveness: ``{"status": "ok"}``."""
        return {"status": "ok"}

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        return JSONResponse(error_body(exc), status_code=exc.status, headers=exc.response_headers())

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first: dict[str, Any] = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "Invalid request."}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("query", "path", "header", "body")]
        param = ".".join(loc) or None
        message = f"Invalid value for '{param}': {first.get('msg', '')}." if param else first.get("msg", "")
        return JSONResponse(error_envelope(message, ErrorType.INVALID_REQUEST, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "Request failed."
        if exc.status_code in (404, 405):  # no such route (or not with this method): OpenAI's wording
            message = f"Invalid URL ({request.method} {request.url.path})"
        return JSONResponse(error_envelope(message, openai_type_for_status(exc.status_code)),
                              status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", extra={"action": "unhandled_error", "path": request.url.path,
                                               "request_id": _request_id(request)})
        return JSONResponse(error_envelope("The server had an error while processing your request.",
                                            ErrorType.SERVER), status_code=500)

    @app.exception_handler(sa_exc.DBAPIError)
    @app.exception_handler(sa_exc.TimeoutError)
    @app.exception_handler(psycopg.Error)
    async def database_error(request: Request, exc: Exception) -> JSONResponse:
        if not database_unavailable(exc):
            return await unexpected(request, exc)
        log.warning("database unavailable", extra={"action": "database_unavailable", "path": request.url.path,
                                                   "request_id": _request_id(request),
                                                   "error": str(exc).splitlines()[0] if str(exc) else type(exc).__name__})
        return await gateway_error(request, ServiceUnavailableError(
            "The server cannot reach its database at the moment. Please retry after a few seconds.",
            retry_after_seconds=DATABASE_RETRY_AFTER_SECONDS))

    return app
