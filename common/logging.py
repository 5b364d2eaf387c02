"""Log set-up shared by every ``backfill`` command: :func:`configure_logging`.

One handler on the root logger, either JSON lines (python-json-logger's orjson formatter) or plain
text for a person at a terminal. A JSON line carries ``time`` (ISO 8601, UTC), ``level``,
``logger`` and ``message``, then every ``extra=`` field of the call, e.g.::

    {"time": "2026-12-01T10:00:00.123+00:00", "level": "INFO", "logger": "workers.lifecycle",
     "message": "batch fed", "action": "feed", "batch_id": "batch_…", "tenant": "…", "requests": 100}

The stable keys are ``action`` (what happened: ``batch_created``, ``feed``, ``collect``,
``batch_completed``, ``dispatch``, ``result``, …), ``batch_id``, ``custom_id`` and ``tenant`` where
they apply, plus ``trace_id`` when an OpenTelemetry span is active (docs/observability.md lists
them per service). ``tenant`` is always the tenant's id (the fairness id the router sees, the
``metadata.tenant`` of queue messages); ``tenant_name`` is added where the name is known (the
gateway): :func:`tenant_fields` builds both.

Third-party lines come out the same way: Python warnings (``warnings.warn``, e.g. Celery's) go
through the ``py.warnings`` logger, and uvicorn's ``color_message`` extra (the message again with
ANSI colour codes) is dropped from every record.

The format is JSON when ``BACKFILL_LOG_FORMAT=json``, text when ``BACKFILL_LOG_FORMAT=text``, and
otherwise JSON unless the stream is a terminal (so ``backfill up``'s log files and every container
log are JSON).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

from pythonjsonlogger.orjson import OrjsonFormatter

FORMAT_ENV = "BACKFILL_LOG_FORMAT"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


DROPPED_FIELDS = ("color_message",)
"""Record attributes never written: uvicorn's copy of the message with ANSI colour codes."""


def tenant_fields(tenant_id: str | None, name: str | None = None) -> dict[str, str]:
    """The ``extra=`` fields naming a tenant: ``{"tenant": id, "tenant_name": name}``, each only
    when given (``tenant`` is always the id; see the module docstring)."""
    fields: dict[str, str] = {}
    if tenant_id:
        fields["tenant"] = tenant_id
    if name:
        fields["tenant_name"] = name
    return fields


class _DropFieldsFilter(logging.Filter):
    """Removes :data:`DROPPED_FIELDS` from every record the handler writes."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name in DROPPED_FIELDS:
            record.__dict__.pop(name, None)
        return True


class _TraceIdFilter(logging.Filter):
    """Adds ``trace_id`` (32 hex digits) to records made inside a recording OpenTelemetry span."""

    def filter(self, record: logging.LogRecord) -> bool:
        from opentelemetry import trace

        context = trace.get_current_span().get_span_context()
        if context.is_valid and not hasattr(record, "trace_id"):
            record.trace_id = trace.format_trace_id(context.trace_id)
        return True


def wants_json(stream: TextIO, environ: dict[str, str] | None = None) -> bool:
    """JSON or text for ``stream``: ``BACKFILL_LOG_FORMAT`` (``json`` / ``text``) when set, else JSON
    unless ``stream`` is a terminal. Raises ``ValueError`` for another ``BACKFILL_LOG_FORMAT``."""
    value = (os.environ if environ is None else environ).get(FORMAT_ENV, "").strip().lower()
    if value in ("json", "text"):
        return value == "json"
    if value:
        raise ValueError(f"{FORMAT_ENV} must be 'json' or 'text', not {value!r}")
    isatty = getattr(stream, "isatty", None)
    return not (isatty and isatty())


def configure_logging(level: str | int = "INFO", json: bool | None = None,
                      stream: TextIO | None = None) -> logging.Handler:
    """Send every log record at ``level`` or above to ``stream`` (default stderr), as JSON lines
    when ``json`` (None: :func:`wants_json`), replacing the root logger's handlers, and Python
    warnings through logging (``logging.captureWarnings``). Returns the handler. Raises
    ``ValueError`` for an unknown level name."""
    stream = stream or sys.stderr
    if json is None:
        json = wants_json(stream)
    handler = logging.StreamHandler(stream)
    if json:
        handler.setFormatter(OrjsonFormatter("%(levelname)s %(name)s %(message)s", timestamp="time",
                                             rename_fields={"levelname": "level", "name": "logger"}))
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    handler.addFilter(_DropFieldsFilter())
    handler.addFilter(_TraceIdFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    logging.captureWarnings(True)
    return handler
