"""common.logging (uvicorn's color_message dropped, warnings as JSON, tenant fields) and
common.metrics (runtime collectors, no _created series)."""

from __future__ import annotations

import io
import json
import logging
import re
import warnings
from pathlib import Path

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


def test_uvicorn_color_message_is_dropped(json_lines, monkeypatch):
    # an in-process uvicorn of an earlier test may have left its own log config on these loggers
    for name in ("uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        monkeypatch.setattr(logger, "handlers", [])
        monkeypatch.setattr(logger, "propagate", True)
        monkeypatch.setattr(logger, "disabled", False)
        monkeypatch.setattr(logger, "level", logging.NOTSET)
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


NAME_AS_TENANT = re.compile(r"""["']tenant["']\s*:\s*[\w.]*name\b""")
"""A log field ``"tenant"`` given a name (``tenant.name``, ``tenant_name``)."""


def tenant_name_logged_as_tenant() -> list[str]:
    """Log calls that put a tenant's *name* under ``"tenant"`` (the field is the id; the name goes
    under ``"tenant_name"``: :func:`common.logging.tenant_fields`)."""
    root = Path(__file__).resolve().parents[3]
    found = []
    for package in ("batch_gateway", "workers", "async_processor", "router", "backfill"):
        for path in (root / package).rglob("*.py"):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if NAME_AS_TENANT.search(line):
                    found.append(f"{path.relative_to(root)}:{number}")
    return found


def test_tenant_is_the_id_in_every_log_line():
    assert tenant_name_logged_as_tenant() == []


def test_tenant_check_sees_a_name_logged_as_tenant():
    assert NAME_AS_TENANT.search('extra={"action": "batch_created", "tenant": tenant.name})')
    assert NAME_AS_TENANT.search("'tenant': tenant_name,")
    assert not NAME_AS_TENANT.search('extra={"tenant": batch.tenant_id, "tenant_name": tenant.name}')
