"""File bytes over their life: expiry hides a file, delete and purge remove bytes only when no
running batch reads them, a store that cannot write (disk full, while writing or at commit) answers
503 and registers nothing nor leaves a temporary file (RELIABILITY.md F14), and the sweep task
removes what killed writers left in ``tmp/``."""

from __future__ import annotations

import errno
import os
import time

import openai
import pytest
from sqlalchemy import func, select, update

from batch_gateway.app import create_app
from batch_gateway.store.files import LocalFileStore
from batch_gateway.store.models import File
from tests.conftest import SHARED_BATCHES, free_port, serve


def _stored_files(settings) -> list:
    root = settings.files_dir / "files"
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


def test_expired_file_is_gone_from_the_api_and_purged(gateway):
    from workers.tasks import purge_files

    client = gateway.client()
    kept = client.files.create(file=("a.txt", b"a"), purpose="user_data")
    old = client.files.create(file=("b.txt", b"b"), purpose="user_data",
                              expires_after={"anchor": "created_at", "seconds": 3600})
    with gateway.session() as session:
        session.execute(update(File).where(File.id == old.id).values(expires_at=File.created_at - 1))
        session.commit()
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(old.id)
    assert [f.id for f in client.files.list()] == [kept.id]
    assert len(_stored_files(gateway.settings)) == 2
    assert purge_files(gateway.celery.backfill) == 1
    assert len(_stored_files(gateway.settings)) == 1
    assert purge_files(gateway.celery.backfill) == 0
    assert client.files.content(kept.id).read() == b"a"


def test_deleting_a_running_batch_input_keeps_its_bytes_until_the_batch_ends(gateway):
    from workers.tasks import purge_files

    client = gateway.client()
    uploaded = client.files.create(file=(SHARED_BATCHES / "litellm-batch-small.jsonl").open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    gateway.wait_status(batch.id, ("in_progress",))
    assert client.files.delete(uploaded.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.content(uploaded.id)
    assert purge_files(gateway.celery.backfill) == 0
    assert len(_stored_files(gateway.settings)) == 1  # the batch still reads it

    client.batches.cancel(batch.id)
    assert purge_files(gateway.celery.backfill) == 1
    assert _stored_files(gateway.settings) == []


class FullDisk(LocalFileStore):
    """A store whose writes fail as a full disk does."""

    def begin(self, key):
        upload = super().begin(key)

        def write(chunk):
            raise OSError(errno.ENOSPC, "No space left on device")

        upload.write = write
        return upload


def test_disk_full_upload_answers_503_and_registers_nothing(gateway_settings):
    port = free_port()
    app = create_app(gateway_settings)
    with serve(app, port):
        app.state.store = FullDisk(gateway_settings.files_dir)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=gateway_settings.api_key,
                               max_retries=0)
        with pytest.raises(openai.InternalServerError) as failed:
            client.files.create(file=("in.jsonl", b"x" * 100_000), purpose="batch")
        assert failed.value.status_code == 503
        assert set(failed.value.body) == {"message", "type", "param", "code"}
        with app.state.sessionmaker() as session:
            assert session.execute(select(func.count()).select_from(File)).scalar_one() == 0
        assert list((gateway_settings.files_dir / "tmp").iterdir()) == []
        app.state.store = LocalFileStore(gateway_settings.files_dir)  # the API stays up
        assert client.files.create(file=("in.jsonl", b"{}"), purpose="user_data").bytes == 2


class FullAtClose(LocalFileStore):
    """A store whose disk fills up under the buffered tail of a write: every write is taken, the
    flush at commit and the close after it fail with ``ENOSPC``."""

    def begin(self, key):
        upload = super().begin(key)
        real = upload.handle

        class Handle:
            closed = property(lambda self: real.closed)
            write = real.write
            fileno = real.fileno

            def flush(self):
                raise OSError(errno.ENOSPC, "No space left on device")

            def close(self):
                real.close()
                raise OSError(errno.ENOSPC, "No space left on device")

        upload.handle = Handle()
        return upload


def test_disk_full_at_commit_answers_503_and_leaves_no_temporary_file(gateway_settings):
    port = free_port()
    app = create_app(gateway_settings)
    with serve(app, port):
        app.state.store = FullAtClose(gateway_settings.files_dir)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=gateway_settings.api_key,
                               max_retries=0)
        with pytest.raises(openai.InternalServerError) as failed:
            client.files.create(file=("in.jsonl", b"x" * 1000), purpose="batch")
        assert failed.value.status_code == 503
        assert list((gateway_settings.files_dir / "tmp").iterdir()) == []


def test_the_sweep_task_removes_orphans_of_killed_writes_only(gateway):
    from workers.tasks import sweep_temp_files

    ctx = gateway.celery.backfill
    tmp = ctx.store.tmp
    orphan, live = tmp / "killed-upload", tmp / "live-upload"
    orphan.write_bytes(b"half a file")
    live.write_bytes(b"being written")
    age = ctx.settings.temp_file_max_age_seconds + 60
    old = time.time() - age
    os.utime(orphan, (old, old))
    assert sweep_temp_files(ctx) == 1
    assert sorted(p.name for p in tmp.iterdir()) == ["live-upload"]
    live.unlink()
