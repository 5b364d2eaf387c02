"""common.logging (uvicorn's color_message dropped, warnings as JSON, tenant fields) and
common.metrics (runtime collectors, no _created series)."""

from __future__ import annotations

import io
import json
import logging
import warnings

import pytest
from prometheus_client import Counter, Histogram, generate_latest

from common.logging import configure_logging, tenant_fields
from common.metrics import service_registry


@pytest.fixture
def json_lines():
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    buffer = io.StringIO()
    configure_logging("INFO", json=True, stream=buffer)
    try:
        yield lambda: [json.loads(line) for line in buffer.getvalue().splitlines()]
    finally:
        logging.captureWarnings(False)
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def test_uvicorn_color_message_is_dropped(json_lines):
    logging.getLogger("uvicorn.error").info("Uvicorn running on %s", "http://x",
                                            extra={"color_message": "Uvicorn running on \x1b[1m%s\x1b[0m"})
    [line] = json_lines()
    assert line["message"] == "Uvicorn running on http://x" and "color_message" not in line


def test_python_warnings_are_json_lines(json_lines):
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("You're running the worker with superuser privileges", UserWarning, stacklevel=1)
    [line] = json_lines()
    assert line["logger"] == "py.warnings" and line["level"] == "WARNING" and "superuser" in line["message"]


def test_tenant_fields_are_the_id_and_the_name():
    assert tenant_fields("t_1", "acme") == {"tenant": "t_1", "tenant_name": "acme"}
    assert tenant_fields("t_1") == {"tenant": "t_1"}
    assert tenant_fields(None) == {}


def test_service_registry_has_runtime_collectors_and_no_created_series():
    registry = service_registry()
    Counter("backfill_test_things", "Things.", ["kind"], registry=registry).labels("a").inc()
    Histogram("backfill_test_seconds", "Seconds.", registry=registry).observe(1.0)
    text = generate_latest(registry).decode()
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds",
                 "python_info", "python_gc_collections_total"):
        assert f"\n{name}" in text, name
    assert "backfill_test_things_total" in text and "_created" not in text
