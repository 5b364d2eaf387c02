"""The gateway's HTTP edges as OpenAI SDK users and hostile clients meet them (issue 17, items 3, 4,
5, 9, 10, 11): request ids on every answer, final refusals the SDK does not retry, one cancel rule
for every ended batch, deadlines and a connection cap against slow sockets, uploads that hold no
database connection, and malformed framing answered in OpenAI's envelope.

The request-id, refusal, cancel and upload tests use the shared ``gateway`` fixture (uvicorn in a
thread, a Celery worker). The slow-client and framing tests run ``backfill gateway`` itself in a
subprocess, the way it is deployed, with its open-file limit lowered so that descriptor exhaustion
is reachable with a couple of thousand sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import resource
import secrets
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from sqlalchemy import text

from backfill.up import free_port
from tests.waiting import wait_for

ENDPOINT = "/v1/chat/completions"
GENERATED_ID = re.compile(r"req_[0-9a-f]{32}")
KEY = "sk-edges-" + secrets.token_hex(8)


def _line(custom_id: str = "r1") -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": ENDPOINT,
                       "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}).encode() + b"\n"


def _envelope(body: dict) -> dict:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def _logged(caplog, method: str, path: str, request_id: str | None = None) -> list[logging.LogRecord]:
    """The gateway's ``http_request`` log records of ``method path`` (of ``request_id`` only, when
    given), once there is one: the server writes the line after the answer is sent, so the client
    may read the answer first."""
    def records() -> list[logging.LogRecord]:
        return [r for r in caplog.records if getattr(r, "action", None) == "http_request"
                and r.method == method and r.path == path and request_id in (None, r.request_id)]

    return wait_for(records, f"the gateway's log line of {method} {path}")


def _sdk(gateway, **kwargs) -> openai.OpenAI:
    """The SDK as users build it: default retries (2) unless ``max_retries`` is given."""
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=gateway.api_key, **kwargs)


# --- 3. request ids -----------------------------------------------------------------------------


def test_every_answer_carries_a_request_id_and_processing_time(gateway, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="batch_gateway.request_ids")
    client = gateway.client()
    raw = client.files.with_raw_response.create(file=("a.jsonl", _line()), purpose="batch")
    request_id = raw.headers["x-request-id"]
    assert GENERATED_ID.fullmatch(request_id)
    assert raw.headers["openai-processing-ms"].isdigit()
    assert raw.parse()._request_id == request_id  # what the SDK's users read
    assert client.files.list().data and client.files.retrieve(raw.parse().id)._request_id != request_id
    logged = _logged(caplog, "POST", "/v1/files")
    assert [(r.request_id, r.status) for r in logged] == [(request_id, 200)]

    with pytest.raises(openai.NotFoundError) as missing:  # an error the SDK raises carries it too
        client.batches.retrieve("batch_missing")
    assert GENERATED_ID.fullmatch(missing.value.request_id or "")

    http, anonymous = gateway.http(), gateway.http(None)
    answers = {
        404: http.get("/v1/no-such-route"),
        400: http.get("/v1/files", params={"limit": 0}),  # FastAPI's request validation (422 → 400)
        401: anonymous.get("/v1/files"),
    }

    def boom(*args, **kwargs):
        raise RuntimeError("a bug")

    from batch_gateway.store import queries
    monkeypatch.setattr(queries, "list_files", boom)
    with gateway.http() as own:  # a connection of its own: the server closes it after an unhandled error
        answers[500] = own.get("/v1/files")
    for status, response in answers.items():
        assert response.status_code == status, response.text
        _envelope(response.json())
        assert GENERATED_ID.fullmatch(response.headers["x-request-id"]), (status, response.headers)
        assert response.headers["openai-processing-ms"].isdigit()
    failed = answers[500].headers["x-request-id"]
    assert [r.status for r in _logged(caplog, "GET", "/v1/files", failed)] == [500]
    unhandled = [r for r in caplog.records if getattr(r, "action", None) == "unhandled_error"]
    assert [r.request_id for r in unhandled] == [failed]
    monkeypatch.undo()

    # A client's own sane id is echoed; anything else is replaced by a new one.
    assert http.get("/v1/files", headers={"X-Client-Request-Id": "trace-7f3a"}).headers["x-request-id"] == "trace-7f3a"
    assert http.get("/v1/files", headers={"x-request-id": "b7c1e8d2-1"}).headers["x-request-id"] == "b7c1e8d2-1"
    for bad in ("two words", "x" * 200, "", "a\tb"):
        echoed = http.get("/v1/files", headers={"X-Client-Request-Id": bad}).headers["x-request-id"]
        assert GENERATED_ID.fullmatch(echoed), (bad, echoed)


# --- 4. a quota refusal is final -----------------------------------------------------------------


def test_a_quota_refusal_is_final_for_the_default_sdk_client(gateway, caplog):
    caplog.set_level(logging.INFO, logger="batch_gateway.request_ids")
    client = _sdk(gateway)  # max_retries=2: the SDK retries a 429 unless told not to
    uploaded = client.files.create(file=("q.jsonl", _line()), purpose="batch")
    with gateway.session() as session:
        session.execute(text("UPDATE tenants SET enqueued_token_limit = 1 WHERE name = 'default'"))
        session.commit()
    with pytest.raises(openai.RateLimitError) as refused:
        client.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT, completion_window="24h")
    assert refused.value.body["code"] == "token_limit_exceeded"
    assert refused.value.response.headers["x-should-retry"] == "false"
    assert "retry-after" not in refused.value.response.headers
    assert len(_logged(caplog, "POST", "/v1/batches")) == 1  # the server saw one request: no retries


# --- 5. one cancel rule --------------------------------------------------------------------------


def _force_status(gateway, batch_id: str, status: str) -> None:
    column = {"completed": "completed_at", "failed": "failed_at", "expired": "expired_at",
              "cancelled": "cancelled_at", "cancelling": "cancelling_at"}[status]
    extra = ", finalizing_at = created_at" if status == "completed" else ""
    with gateway.session() as session:  # no processor runs here: end the batch by hand
        session.execute(text(f"UPDATE batches SET status = :s, {column} = created_at{extra} WHERE id = :b"),
                        {"s": status, "b": batch_id})
        session.commit()


@pytest.mark.parametrize("status", ["completed", "failed", "expired", "cancelled"])
def test_cancel_of_an_ended_batch_is_refused_alike(gateway, caplog, status):
    caplog.set_level(logging.INFO, logger="batch_gateway.request_ids")
    client = _sdk(gateway)  # default retries: the SDK retries a 409 unless told not to
    uploaded = client.files.create(file=("c.jsonl", _line()), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT, completion_window="24h")
    gateway.wait_status(batch.id, ("in_progress",))
    _force_status(gateway, batch.id, status)
    before = client.batches.retrieve(batch.id)
    with pytest.raises(openai.ConflictError) as refused:
        client.batches.cancel(batch.id)
    error = _envelope({"error": refused.value.body})
    assert error["message"] == f"Cannot cancel a batch with status '{status}'."
    assert error["type"] == "invalid_request_error"
    assert refused.value.response.headers["x-should-retry"] == "false"
    assert client.batches.retrieve(batch.id) == before
    assert len(_logged(caplog, "POST", f"/v1/batches/{batch.id}/cancel")) == 1


def test_cancel_acts_on_a_live_batch_and_answers_cancelling_unchanged(gateway):
    client = gateway.client()
    uploaded = client.files.create(file=("c.jsonl", _line()), purpose="batch")
    live = client.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT, completion_window="24h")
    gateway.wait_status(live.id, ("in_progress",))
    cancelled = client.batches.cancel(live.id)  # nothing handed out yet: cancelled at once, 200
    assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
    with pytest.raises(openai.ConflictError):  # and now it has ended, like any ended batch
        client.batches.cancel(live.id)

    running = client.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT, completion_window="24h")
    gateway.wait_status(running.id, ("in_progress",))
    _force_status(gateway, running.id, "cancelling")
    before = client.batches.retrieve(running.id)
    assert client.batches.cancel(running.id) == before  # a cancel in progress: the same object, 200


# --- 10. upload concurrency ----------------------------------------------------------------------


UPLOAD_BYTES = 100_000
UPLOAD_START = (b"--b\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
                b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"s.jsonl\"\r\n\r\n")
UPLOAD_END = b"\r\n--b--\r\n"


def _stalled_upload(base_url: str, api_key: str) -> socket.socket:
    """A socket that sent an upload's headers and the start of its body (of ``UPLOAD_BYTES``), then
    nothing; :func:`_finish_upload` sends the rest."""
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + api_key.encode()
                 + b"\r\nContent-Type: multipart/form-data; boundary=b\r\nContent-Length: "
                 + str(UPLOAD_BYTES).encode() + b"\r\n\r\n" + UPLOAD_START)
    return sock


def _wait_uploads_running(files_dir: Path, n: int) -> None:
    """Wait until ``n`` uploads are running their handler: past the credential check, each has its
    temporary file in the store's ``tmp/`` (opened before the first body byte is read)."""
    tmp = files_dir / "tmp"
    wait_for(lambda: tmp.is_dir() and len(list(tmp.iterdir())) >= n, f"{n} uploads in progress")


def _answered(sock: socket.socket) -> bool:
    """Whether the server has answered (or closed) ``sock``, without waiting."""
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) is not None
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.setblocking(True)


def _finish_upload(sock: socket.socket) -> None:
    sock.sendall(b"x" * (UPLOAD_BYTES - len(UPLOAD_START) - len(UPLOAD_END)) + UPLOAD_END)


def test_64_concurrent_uploads_all_succeed(gateway):
    async def upload_all() -> list[int]:
        client = openai.AsyncOpenAI(base_url=gateway.base_url + "/v1", api_key=gateway.api_key,
                                    max_retries=0, timeout=120)

        async def one(i: int) -> int:
            try:
                await client.files.create(file=(f"u{i}.jsonl", _line(f"u{i}")), purpose="batch")
                return 200
            except openai.APIStatusError as exc:
                return exc.status_code

        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await client.close()

    statuses = asyncio.run(upload_all())
    assert statuses == [200] * 64, sorted(statuses)
    with gateway.session() as session:
        assert session.execute(text("SELECT count(*) FROM files")).scalar_one() == 64


def test_no_database_connection_is_held_while_uploads_stream(gateway):
    stalled = [_stalled_upload(gateway.base_url, gateway.api_key) for _ in range(25)]  # > the pool's 10 + 10
    try:
        _wait_uploads_running(gateway.settings.files_dir, 25)  # each passed its credential check, waits for bytes
        listed = gateway.client(timeout=20).files.list()
        assert listed.data == []
    finally:
        for sock in stalled:
            sock.close()


class TestUploadCapacity:
    """A gateway taking 3 uploads at once."""

    @pytest.fixture
    def gateway_settings(self, gateway_settings):
        return gateway_settings.model_copy(update={"max_concurrent_uploads": 3})

    def test_uploads_past_capacity_get_503_with_retry_after(self, gateway):
        client = gateway.client()
        stalled: list[socket.socket] = []
        try:
            deadline = time.monotonic() + 15
            while True:
                # Three stalled uploads hold the slots; one that met a probe's slot is refused and replaced.
                stalled = [sock for sock in stalled if not _answered(sock)]
                stalled += [_stalled_upload(gateway.base_url, gateway.api_key) for _ in range(3 - len(stalled))]
                time.sleep(0.5)
                try:
                    client.files.create(file=("x.jsonl", _line()), purpose="batch")
                except openai.InternalServerError as exc:
                    refused = exc
                    break
                assert time.monotonic() < deadline, "a fourth upload was never refused"
            assert refused.status_code == 503
            error = _envelope({"error": refused.body})
            assert error["type"] == "server_error" and error["code"] == "service_unavailable"
            assert int(refused.response.headers["retry-after"]) > 0
        finally:
            for sock in stalled:
                sock.close()
        deadline = time.monotonic() + 10
        while True:  # the slots come back once the stalled uploads are gone
            try:
                assert client.files.create(file=("y.jsonl", _line()), purpose="batch").bytes > 0
                break
            except openai.InternalServerError:
                assert time.monotonic() < deadline, "the slots of closed uploads never came back"
                time.sleep(0.05)


# --- 9 and 11: the served gateway (``backfill gateway``) against slow and malformed clients ------


@contextlib.contextmanager
def gateway_process(database_url: str, redis_url: str, directory: Path, *, open_files: int = 4096,
                    **settings: str) -> Iterator[tuple[str, int]]:
    """``backfill gateway`` in a subprocess with at most ``open_files`` descriptors and the
    ``BACKFILL_GATEWAY_<NAME>`` ``settings``; yields ``(host, port)`` once ``/health`` answers."""
    port = free_port()
    environ = {**os.environ, "DATABASE_URL": database_url, "REDIS_URL": redis_url,
               "BACKFILL_DATA_DIR": str(directory / "data"), "BACKFILL_API_KEY": KEY,
               "BACKFILL_TASK_QUEUE": f"test-{secrets.token_hex(4)}", "BACKFILL_LOG_FORMAT": "text",
               **{f"BACKFILL_GATEWAY_{name.upper()}": value for name, value in settings.items()}}

    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

    with (directory / "gateway.log").open("wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "backfill", "gateway", "--port", str(port)],
                                env=environ, preexec_fn=limit_files, stdout=log_file, stderr=log_file)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, (directory / "gateway.log").read_text()
                time.sleep(0.2)
            yield "127.0.0.1", port
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def served(database_url, stores, tmp_path):
    """``served(**settings)``: a ``backfill gateway`` process on this test's database."""
    return lambda **kw: gateway_process(database_url, stores.redis_url, tmp_path, **kw)


def _raw(address: tuple[str, int], request: bytes, timeout: float = 10) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes; returns the answer's status, headers (lower-case) and body, read to EOF."""
    with socket.create_connection(address, timeout=timeout) as sock:
        sock.sendall(request)
        return _read_answer(sock)


def _read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in header_lines)
    return int(status_line.split()[1]), {k.lower(): v for k, v in headers.items()}, body


def _check_protocol_answer(status: int, headers: dict[str, str], body: bytes, expected: int) -> dict:
    assert status == expected, (status, headers, body)
    assert headers["content-type"] == "application/json", headers
    assert GENERATED_ID.fullmatch(headers["x-request-id"])
    return _envelope(json.loads(body))


def test_malformed_framing_is_answered_in_the_openai_envelope(served):
    with served() as address:
        head = b"POST /v1/batches HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        for framing in (b"Content-Length: abc\r\n", b"Content-Length: -5\r\n",
                        b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n"):
            error = _check_protocol_answer(*_raw(address, head + framing + b"\r\n{}"), 400)
            assert error["type"] == "invalid_request_error" and error["code"] == "invalid_http_request", framing
            assert error["message"].startswith("Invalid HTTP request"), error
        too_long = head + b"X-Padding: " + b"a" * 20_000 + b"\r\n\r\n"
        error = _check_protocol_answer(*_raw(address, too_long), 431)
        assert error["code"] == "request_header_fields_too_large"
        assert httpx.get(f"http://{address[0]}:{address[1]}/health").status_code == 200


def test_a_request_past_its_whole_request_deadline_gets_408(served):
    with served(request_timeout_seconds="3") as address, socket.create_connection(address, timeout=20) as sock:
        sock.sendall(b"POST /v1/batches HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n")
        sock.settimeout(0.5)
        answer = b""
        for _ in range(40):  # a body byte every half second: 20 s for the 100 bytes
            try:
                sock.sendall(b" ")
                answer = sock.recv(65536)
                break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
        sock.settimeout(10)
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert b'"code":"request_timeout"' in answer


class SlowClients:
    """``count`` sockets that sent a partial request and then trickle a header byte every second."""

    def __init__(self, address: tuple[str, int], count: int):
        self.sockets: list[socket.socket] = []
        for i in range(count):
            sock = socket.create_connection(address, timeout=10)
            sock.sendall(b"GET /v1/files HTTP/1.1\r\nHost: x\r\nX-Slow-" + str(i).encode() + b": ")
            self.sockets.append(sock)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._trickle, daemon=True)
        self._thread.start()

    def _trickle(self) -> None:
        while not self._stop.wait(1.0):
            for sock in self.sockets:
                with contextlib.suppress(OSError):
                    sock.send(b"a")

    def still_open(self, wait: float) -> list[int]:
        """Indexes of the sockets the server has not closed after ``wait`` more seconds (an answer
        followed by EOF, or a reset, counts as closed)."""
        selector = selectors.DefaultSelector()
        open_ = set(range(len(self.sockets)))
        for i, sock in enumerate(self.sockets):
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ, i)
        deadline = time.monotonic() + wait
        while open_ and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                try:
                    closed = key.fileobj.recv(65536) == b""  # type: ignore[union-attr]
                except (ConnectionResetError, BlockingIOError):
                    closed = True
                if closed:
                    open_.discard(key.data)
                    selector.unregister(key.fileobj)
        selector.close()
        return sorted(open_)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in self.sockets:
            sock.close()


def test_slow_sockets_do_not_starve_normal_requests(served):
    """1,500 slow sockets against a gateway with 1,024 descriptors: the cap (512) closes the idle
    ones first, normal requests keep answering, and the header deadline closes the rest."""
    with served(open_files=1024, header_timeout_seconds="4") as (host, port):
        slow = SlowClients((host, port), 1500)
        try:
            client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key=KEY, max_retries=0, timeout=10)
            for _ in range(10):
                assert client.files.list().data == []
                time.sleep(0.2)
            assert slow.still_open(wait=30) == []  # trickling a byte a second does not extend the deadline
            assert client.files.list().data == []
        finally:
            slow.close()


def test_the_connection_cap_closes_idle_connections_first(served, tmp_path):
    files_dir = tmp_path / "data" / "files"
    with served(max_connections="50", header_timeout_seconds="60") as address:
        older = SlowClients(address, 30)
        busy = _stalled_upload(f"http://{address[0]}:{address[1]}", KEY)  # a request in progress
        _wait_uploads_running(files_dir, 1)
        newer = SlowClients(address, 60)
        try:
            assert older.still_open(wait=15) == []  # the idle ones that waited longest went first
            assert len(newer.still_open(wait=0.5)) >= 40  # the newest idle ones stay, within the cap
            _finish_upload(busy)  # the rest of the body...
            status, body = _read_answer_until_complete(busy)
            assert status == 200, body  # ...and the running request was never closed for the cap
        finally:
            older.close()
            newer.close()
            busy.close()


def _read_answer_until_complete(sock: socket.socket) -> tuple[int, bytes]:
    """The status and body of one keep-alive answer (read up to its Content-Length)."""
    sock.settimeout(20)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), body


def test_a_connection_past_the_cap_with_none_idle_gets_503(served, tmp_path):
    files_dir = tmp_path / "data" / "files"
    with served(max_connections="3") as (host, port):
        base_url = f"http://{host}:{port}"
        busy = [_stalled_upload(base_url, KEY) for _ in range(3)]
        try:
            _wait_uploads_running(files_dir, 3)  # all three are running their request: none is idle
            status, headers, body = _raw((host, port), b"")  # answered as it connects, closed at once
            assert _check_protocol_answer(status, headers, body, 503)["code"] == "service_unavailable"
            assert int(headers["retry-after"]) > 0
        finally:
            for sock in busy:
                sock.close()
        deadline = time.monotonic() + 10
        while httpx.get(base_url + "/health").status_code != 200:  # the cap frees as connections close
            assert time.monotonic() < deadline
            time.sleep(0.1)
