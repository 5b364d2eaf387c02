"""OpenTelemetry trace context across the services (W3C ``traceparent``).

The path of one batch (docs/observability.md): the gateway's server span for
``POST /v1/batches`` continues the client's ``traceparent`` (or starts a trace); its own
``traceparent`` is stored with the batch (the payload of the ``batch.created`` event); the feed task
copies it into ``metadata.traceparent`` of every queue message of the batch; the processor sends
it as the ``traceparent`` header to the router. So the router (and any engine behind it that
reads the header) sees the trace id the client started.

Spans are made by an SDK :class:`~opentelemetry.sdk.trace.TracerProvider` per app (never the
process-global one) and exported only when asked: ``BACKFILL_TRACE_EXPORTER`` = ``console``
(spans as JSON on stdout) or ``otlp`` (OTLP/HTTP to ``OTEL_EXPORTER_OTLP_ENDPOINT``; needs the
``opentelemetry-exporter-otlp-proto-http`` package); unset or ``none`` exports nothing.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from fastapi import FastAPI

EXPORTER_ENV = "BACKFILL_TRACE_EXPORTER"
TRACEPARENT = "traceparent"
_TRACEPARENT_RE = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$")


def make_tracer_provider(service_name: str, exporter: str | None = None) -> TracerProvider:
    """A tracer provider for ``service_name`` (the ``service.name`` resource attribute).

    ``exporter``: ``none``, ``console`` or ``otlp`` (default: ``BACKFILL_TRACE_EXPORTER``, else
    ``none``). Raises ``ValueError`` for another name and ``ImportError`` for ``otlp`` when its
    package is not installed.
    """
    name = (exporter if exporter is not None else os.environ.get(EXPORTER_ENV, "none")).strip().lower() or "none"
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if name == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif name == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    elif name != "none":
        raise ValueError(f"{EXPORTER_ENV} must be none, console or otlp, not {name!r}")
    return provider


def current_traceparent() -> str | None:
    """The W3C ``traceparent`` of the active span (``00-<trace id>-<span id>-<flags>``), or None
    outside a valid span."""
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get(TRACEPARENT)


def trace_id_of(traceparent: str | None) -> str | None:
    """The 32-hex-digit trace id of a ``traceparent`` value, or None when it is not one."""
    match = _TRACEPARENT_RE.match((traceparent or "").strip().lower())
    return match.group(1) if match else None


def instrument_fastapi(app: FastAPI, service_name: str, exporter: str | None = None) -> TracerProvider:
    """Give every request of the FastAPI ``app`` a server span (opentelemetry-instrumentation-fastapi)
    that continues the caller's ``traceparent``; ``/health`` and ``/metrics`` are left out, and
    no per-message ``receive``/``send`` spans are made. Returns the provider
    (:func:`make_tracer_provider` with ``exporter``). Call before the app starts."""
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    from opentelemetry.metrics import NoOpMeterProvider

    provider = make_tracer_provider(service_name, exporter)
    FastAPIInstrumentor.instrument_app(app, tracer_provider=provider, meter_provider=NoOpMeterProvider(),
                                       excluded_urls="/health,/metrics", exclude_spans=["receive", "send"])
    return provider
