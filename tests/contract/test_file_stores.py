"""One contract for every file store: the local directory and S3 (moto's server mode, in process).

Both must: round-trip small and multipart-sized objects, stream reads by offset and length, show an
object only once committed, leave nothing behind (no temporary file, no open multipart upload) after
an abort or a failure mid-write, keep the previous object when a rewrite fails, refuse unsafe keys,
take concurrent writers (last commit wins, never a mix), and sweep what a killed writer left behind
(temporary files, multipart uploads) once it is old. The S3-only tests at the end check the
wire: one PutObject for a small object, parts sent while writing for a large one, and the upload
aborted by the store itself when S3 fails.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import time

import pytest
from botocore.exceptions import EndpointConnectionError

from batch_gateway.store.files import LocalFileStore
from batch_gateway.store.files.s3 import MIN_PART_BYTES, S3FileStore
from tests.moto_s3 import aws_test_env, moto_s3_server, multipart_uploads, new_bucket, s3_client

PART = MIN_PART_BYTES  # S3's (and moto's) smallest part: the fastest multipart the service accepts
CHUNK = 64 * 1024


def payload(size: int, seed: str) -> bytes:
    """``size`` bytes that differ with ``seed`` and along the object (a misplaced part shows)."""
    block = b"".join(hashlib.sha256(f"{seed}:{i}".encode()).digest() for i in range(CHUNK // 32))
    return b"".join(block[i % 7:] + block[:i % 7] for i in range(size // CHUNK + 1))[:size]


def write_all_into(upload, data: bytes, chunk: int = CHUNK) -> None:
    for start in range(0, len(data), chunk):
        upload.write(data[start:start + chunk])


def write_all(store, key: str, data: bytes, chunk: int = CHUNK):
    """Begin ``key`` and write ``data`` in ``chunk``-byte pieces; returns the open upload."""
    upload = store.begin(key)
    write_all_into(upload, data, chunk)
    return upload


class Kit:
    """A store under test plus what the contract needs to look behind it."""

    def __init__(self, kind: str, store, leftovers, break_writes):
        self.kind = kind
        self.store = store
        self.leftovers = leftovers  # () -> list: temporary files / open multipart uploads
        self.break_writes = break_writes  # (upload) -> None: the store fails from now on


@pytest.fixture(scope="module")
def s3_endpoint():
    with moto_s3_server() as endpoint:
        yield endpoint


def _local_kit(tmp_path) -> Kit:
    store = LocalFileStore(tmp_path / "files")

    def break_writes(upload):
        class FullDisk:
            closed = False

            def write(self, chunk):
                raise OSError(errno.ENOSPC, "No space left on device")

            def close(self):
                upload_handle.close()

        upload_handle = upload.handle
        upload.handle = FullDisk()

    return Kit("local", store, lambda: list(store.tmp.iterdir()), break_writes)


def _s3_kit(endpoint: str) -> Kit:
    bucket = new_bucket(endpoint)
    store = S3FileStore(bucket, prefix="tenant-a/", part_bytes=PART, endpoint_url=endpoint)

    def break_writes(upload):
        def refuse(**_):
            raise EndpointConnectionError(endpoint_url=endpoint)
        for operation in ("UploadPart", "PutObject", "CompleteMultipartUpload"):
            store.client.meta.events.register(f"before-call.s3.{operation}", refuse)

    return Kit("s3", store, lambda: multipart_uploads(endpoint, bucket), break_writes)


@pytest.fixture(params=["local", "s3"])
def kit(request, tmp_path, monkeypatch) -> Kit:
    if request.param == "local":
        return _local_kit(tmp_path)
    aws_test_env(monkeypatch)
    return _s3_kit(request.getfixturevalue("s3_endpoint"))


def test_small_object_round_trip(kit):
    data = b'{"custom_id": "a"}\n' * 50
    write_all(kit.store, "files/ab/file-ab1", data, chunk=7).commit()
    assert kit.store.exists("files/ab/file-ab1")
    assert kit.store.size("files/ab/file-ab1") == len(data)
    assert b"".join(kit.store.read("files/ab/file-ab1")) == data
    assert kit.leftovers() == []


def test_empty_object_round_trip(kit):
    kit.store.begin("files/00/file-empty").commit()
    assert kit.store.exists("files/00/file-empty") and kit.store.size("files/00/file-empty") == 0
    assert b"".join(kit.store.read("files/00/file-empty")) == b""


def test_multipart_sized_object_round_trip(kit):
    data = payload(2 * PART + 123_457, "big")  # two full parts and a short last one
    write_all(kit.store, "files/bb/file-bb1", data).commit()
    assert kit.store.size("files/bb/file-bb1") == len(data)
    assert hashlib.sha256(b"".join(kit.store.read("files/bb/file-bb1"))).digest() == hashlib.sha256(data).digest()
    assert kit.leftovers() == []


def test_object_of_exactly_one_part(kit):
    data = payload(PART, "one")
    write_all(kit.store, "files/cc/file-cc1", data).commit()
    assert b"".join(kit.store.read("files/cc/file-cc1")) == data


def test_streamed_read_by_offset_and_length(kit):
    data = payload(300_000, "ranges")
    write_all(kit.store, "files/dd/file-dd1", data).commit()
    chunks = list(kit.store.read("files/dd/file-dd1", offset=1000, length=250_000, chunk_bytes=40_000))
    assert b"".join(chunks) == data[1000:251_000]
    assert len(chunks) >= 250_000 // 40_000 and max(map(len, chunks)) <= 40_000
    assert b"".join(kit.store.read("files/dd/file-dd1", offset=299_990)) == data[299_990:]
    assert b"".join(kit.store.read("files/dd/file-dd1", offset=5, length=1)) == data[5:6]
    assert b"".join(kit.store.read("files/dd/file-dd1", offset=300_000)) == b""  # at the end
    assert b"".join(kit.store.read("files/dd/file-dd1", offset=400_000, length=10)) == b""  # past it
    assert b"".join(kit.store.read("files/dd/file-dd1", offset=10, length=0)) == b""
    assert b"".join(kit.store.read("files/dd/file-dd1", offset=299_000, length=5000)) == data[299_000:]


def test_a_read_abandoned_midway_releases_the_object(kit):
    data = payload(200_000, "abandon")
    write_all(kit.store, "files/ee/file-ee1", data).commit()
    chunks = kit.store.read("files/ee/file-ee1", chunk_bytes=10_000)
    assert next(chunks) == data[:10_000]
    chunks.close()
    kit.store.delete("files/ee/file-ee1")
    assert not kit.store.exists("files/ee/file-ee1")


def test_missing_key_errors(kit):
    with pytest.raises(FileNotFoundError):
        kit.store.read("files/ff/file-nope")  # raised at the call, before any chunk is asked for
    with pytest.raises(FileNotFoundError):
        kit.store.read("files/ff/file-nope", offset=0, length=0)
    with pytest.raises(FileNotFoundError):
        kit.store.size("files/ff/file-nope")
    assert not kit.store.exists("files/ff/file-nope")
    kit.store.delete("files/ff/file-nope")  # ignored


def test_delete(kit):
    write_all(kit.store, "files/gg/file-gg1", b"bytes").commit()
    kit.store.delete("files/gg/file-gg1")
    assert not kit.store.exists("files/gg/file-gg1")
    with pytest.raises(FileNotFoundError):
        kit.store.read("files/gg/file-gg1")
    kit.store.delete("files/gg/file-gg1")


@pytest.mark.parametrize("key", ["", "../escape", "files/../../escape", "/abs"])
def test_unsafe_keys_are_refused(kit, key):
    with pytest.raises(ValueError):
        kit.store.begin(key)


def test_nothing_is_visible_before_commit(kit):
    data = payload(PART + 1000, "pending")
    upload = write_all(kit.store, "files/hh/file-hh1", data)
    assert not kit.store.exists("files/hh/file-hh1")
    with pytest.raises(FileNotFoundError):
        kit.store.read("files/hh/file-hh1")
    upload.commit()
    assert kit.store.size("files/hh/file-hh1") == len(data)


def test_abort_after_parts_leaves_nothing(kit):
    upload = write_all(kit.store, "files/ii/file-ii1", payload(PART + 50_000, "aborted"))
    upload.abort()
    assert not kit.store.exists("files/ii/file-ii1")
    assert kit.leftovers() == []
    upload.abort()  # twice is harmless
    with pytest.raises(ValueError):
        upload.write(b"more")


def test_abort_after_commit_keeps_the_object(kit):
    # the API aborts in its error path whatever happened before (commit included)
    upload = write_all(kit.store, "files/jj/file-jj1", b"kept")
    upload.commit()
    upload.abort()
    assert b"".join(kit.store.read("files/jj/file-jj1")) == b"kept"


def test_failure_mid_write_leaves_the_previous_object_and_no_parts(kit):
    write_all(kit.store, "files/kk/file-kk1", b"previous").commit()
    upload = write_all(kit.store, "files/kk/file-kk1", payload(PART + 10, "first part"))
    kit.break_writes(upload)
    with pytest.raises(OSError):  # S3 sends parts in the background: the error may come at commit
        write_all_into(upload, payload(PART, "second part"))
        upload.commit()
    upload.abort()  # what every caller does on an error
    assert b"".join(kit.store.read("files/kk/file-kk1")) == b"previous"
    assert kit.leftovers() == []


def test_concurrent_writers(kit):
    writers = 6
    datas = [payload(150_000 + i * 1000, f"writer {i}") for i in range(writers)]
    same = [payload(PART + 20_000, "same key A"), payload(PART + 30_000, "same key B")]
    barrier = threading.Barrier(writers + 2)
    errors = []
    uploads = {}

    def write(name, key, data):
        try:
            upload = kit.store.begin(key)
            barrier.wait()
            write_all_into(upload, data)
            uploads[name] = upload
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i, f"files/w{i}/file-w{i}", d)) for i, d in enumerate(datas)]
    threads += [threading.Thread(target=write, args=(name, "files/zz/file-same", d))
                for name, d in zip("AB", same)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert not kit.store.exists("files/zz/file-same")
    committers = [threading.Thread(target=uploads[i].commit) for i in range(writers)]
    for thread in committers:
        thread.start()
    uploads["A"].commit()
    uploads["B"].commit()  # the later commit wins, whole
    for thread in committers:
        thread.join()
    for i, data in enumerate(datas):
        assert b"".join(kit.store.read(f"files/w{i}/file-w{i}")) == data
    assert b"".join(kit.store.read("files/zz/file-same")) == same[1]
    assert kit.leftovers() == []


# --- S3 only: what goes over the wire --------------------------------------------------------


@pytest.fixture
def s3(s3_endpoint, monkeypatch):
    aws_test_env(monkeypatch)
    return _s3_kit(s3_endpoint)


def record_calls(store) -> list[str]:
    calls = []
    store.client.meta.events.register("before-call.s3", lambda model, **_: calls.append(model.name))
    return calls


def test_s3_small_object_is_one_put(s3):
    calls = record_calls(s3.store)
    write_all(s3.store, "files/ss/file-ss1", b"x" * (PART - 1)).commit()
    assert calls == ["PutObject"]


def test_s3_large_object_streams_its_parts_while_writing(s3):
    calls = record_calls(s3.store)
    upload = write_all(s3.store, "files/ll/file-ll1", payload(2 * PART + 10, "streamed"))
    # the first part was sent before the commit (the second may still be in flight)
    assert calls[:2] == ["CreateMultipartUpload", "UploadPart"]
    upload.commit()
    assert calls.count("UploadPart") == 3 and calls[-1] == "CompleteMultipartUpload"
    head = s3_client(s3.store.client.meta.endpoint_url).head_object(Bucket=s3.store.bucket,
                                                                    Key="tenant-a/files/ll/file-ll1")
    assert head["ETag"].endswith('-3"')  # S3 names a multipart object's ETag by its part count


def test_s3_failed_part_surfaces_at_a_later_write_and_aborts_without_the_caller(s3):
    upload = write_all(s3.store, "files/mm/file-mm1", payload(2 * PART + 10, "two parts"))
    assert len(s3.leftovers()) == 1  # the second part waited for the first, which began the upload
    s3.break_writes(upload)
    with pytest.raises(OSError) as failed:
        write_all_into(upload, payload(2 * PART, "refused"))  # the second boundary waits for a failed part
    assert failed.value.errno == errno.EIO
    assert s3.leftovers() == []  # aborted by the store; the caller has not called abort()
    assert not s3.store.exists("files/mm/file-mm1")
    with pytest.raises(ValueError):
        upload.commit()


def test_s3_failed_complete_aborts_and_publishes_nothing(s3):
    upload = write_all(s3.store, "files/nn/file-nn1", payload(PART + 10, "almost"))

    def refuse(**_):
        raise EndpointConnectionError(endpoint_url="s3")
    s3.store.client.meta.events.register("before-call.s3.CompleteMultipartUpload", refuse)
    with pytest.raises(OSError):
        upload.commit()
    assert not s3.store.exists("files/nn/file-nn1")
    assert s3.leftovers() == []


def test_s3_missing_bucket_is_an_os_error_not_a_missing_file(s3_endpoint, monkeypatch):
    aws_test_env(monkeypatch)
    store = S3FileStore("no-such-bucket-here", endpoint_url=s3_endpoint)
    with pytest.raises(OSError) as failed:
        write_all(store, "files/oo/file-oo1", b"x").commit()
    assert not isinstance(failed.value, FileNotFoundError)
    assert "NoSuchBucket" in str(failed.value)


def test_s3_keys_live_under_the_prefix(s3):
    write_all(s3.store, "files/pp/file-pp1", b"p").commit()
    listed = s3_client(s3.store.client.meta.endpoint_url).list_objects_v2(Bucket=s3.store.bucket)
    assert [o["Key"] for o in listed["Contents"]] == ["tenant-a/files/pp/file-pp1"]


def test_a_dead_writers_leftover_is_swept_and_a_live_one_kept(kit):
    live = write_all(kit.store, "files/qq/file-live", payload(PART + 10, "live"))  # parts sent: a leftover
    dead = write_all(kit.store, "files/qq/file-dead", payload(PART + 10, "dead"))  # its writer "killed"
    assert len(kit.leftovers()) == 2
    if kit.kind == "local":
        assert kit.store.sweep_temp() == 0  # both younger than the default hour
        old = dead.tmp.stat().st_mtime - 7200
        os.utime(dead.tmp, (old, old))
        assert kit.store.sweep_temp() == 1
        assert len(kit.leftovers()) == 1
        live.commit()  # the live upload was untouched by the sweep
        assert b"".join(kit.store.read("files/qq/file-live")) == payload(PART + 10, "live")
    else:  # moto dates every multipart upload 2010-11-10: both are old, unless the age is older still
        assert kit.store.sweep_temp(time.time()) == 0
        assert kit.store.sweep_temp() == 2
    assert not kit.store.exists("files/qq/file-dead")
    assert kit.leftovers() == []


# --- local only: the temporary directory ------------------------------------------------------


class _FailingHandle:
    """An open file whose last flush fails, as on a full disk (the real file is closed anyway)."""

    def __init__(self, handle):
        self.handle = handle
        self.closes = 0

    @property
    def closed(self) -> bool:
        return self.handle.closed

    def write(self, chunk):
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    def fileno(self):
        return self.handle.fileno()

    def close(self):
        self.closes += 1
        self.handle.close()
        raise OSError(errno.ENOSPC, "No space left on device")


def test_local_abort_unlinks_even_when_closing_fails_and_twice_is_harmless(tmp_path):
    store = LocalFileStore(tmp_path / "files")
    first, second = store.begin("files/aa/file-out"), store.begin("files/aa/file-err")
    for upload in (first, second):
        upload.handle.write(b"x" * 100)
        upload.handle = _FailingHandle(upload.handle)
    first.abort()  # must not raise: the finalizer aborts every upload in turn, the second too
    second.abort()
    first.abort()
    assert list(store.tmp.iterdir()) == []


def test_local_failed_commit_leaves_no_temporary_file(tmp_path):
    store = LocalFileStore(tmp_path / "files")
    upload = store.begin("files/ab/file-ab9")
    upload.handle = _FailingHandle(upload.handle)
    with pytest.raises(OSError) as failed:
        upload.commit()
    assert failed.value.errno == errno.ENOSPC
    assert list(store.tmp.iterdir()) == [] and not store.exists("files/ab/file-ab9")


def test_local_store_sweeps_stale_temporary_files_when_opened(tmp_path):
    LocalFileStore(tmp_path / "files")
    tmp = tmp_path / "files" / "tmp"
    orphan, fresh = tmp / "orphan-of-a-killed-upload", tmp / "in-progress"
    orphan.write_bytes(b"half an upload")
    fresh.write_bytes(b"being written")
    old = time.time() - 3601
    os.utime(orphan, (old, old))
    store = LocalFileStore(tmp_path / "files")
    assert sorted(p.name for p in store.tmp.iterdir()) == ["in-progress"]
    assert LocalFileStore(tmp_path / "files", temp_max_age_s=0.0).tmp.exists()
    assert list(tmp.iterdir()) == []
