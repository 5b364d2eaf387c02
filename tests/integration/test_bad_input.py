"""Regression tests for the bad-input classes of RELIABILITY.md that concern the HTTP API (1–7, 9, 10;
class 8, tenant isolation, is ``test_tenancy.py``), plus cancel and ``Idempotency-Key`` misuse.

Every refusal is checked for its exact status and OpenAI's envelope ``{"error": {"message", "type",
"param", "code"}}``; every refused upload for no ``files`` row and no byte under the file store (its
``tmp/`` included). The module's gateway runs with small limits (64 KiB batch files, 5 requests per
batch, a 1 s body idle timeout) so each class is cheap to reach. An autouse fixture fails any test
during which the gateway logged an unhandled error (a 500), even one no client saw.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import time
import uuid
from urllib.parse import quote, unquote

import openai
import pytest
from sqlalchemy import text

BATCH_CAP = 64 * 1024
MAX_REQUESTS = 5
IDLE_TIMEOUT = 1.0
#: Slack past the idle timeout for the 408 on a loaded machine (the test's socket gives up at 10 s).
LATE_S = 8.0
ENDPOINT = "/v1/chat/completions"
BOUNDARY = "bf-test-boundary"


@pytest.fixture
def gateway_settings(gateway_settings):
    """The shared settings with small limits (the ``gateway`` fixture consumes these)."""
    return gateway_settings.model_copy(update={
        "max_batch_file_bytes": BATCH_CAP,
        "max_requests_per_batch": MAX_REQUESTS,
        "body_idle_timeout_seconds": IDLE_TIMEOUT,
    })


@pytest.fixture(autouse=True)
def no_unhandled_errors(caplog):
    """Fail the test if the gateway hit its catch-all handler (a 500), whether or not a client saw it."""
    caplog.set_level(logging.ERROR)
    yield
    time.sleep(0.1)  # let a request the client already left finish on the server
    records = caplog.get_records("setup") + caplog.get_records("call") + caplog.records
    bad = [r for r in records
           if r.name in ("batch_gateway.app", "uvicorn.error") and r.levelno >= logging.ERROR]
    assert not bad, "the gateway logged unhandled errors: " + "; ".join(
        f"{r.name}: {r.getMessage()} {r.exc_info[1]!r}" if r.exc_info else f"{r.name}: {r.getMessage()}"
        for r in bad)


# --- helpers ------------------------------------------------------------------------------------


def assert_envelope(body, status: int, actual_status: int, *, param="any", code="any") -> dict:
    """``body`` is OpenAI's error envelope with exactly the four keys; returns ``body["error"]``."""
    assert actual_status == status, (actual_status, body)
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    if param != "any":
        assert error["param"] == param, error
    if code != "any":
        assert error["code"] == code, error
    return error


def check_response(response, status: int, **kw) -> dict:
    """An httpx response is ``status`` with the envelope."""
    assert response.status_code != 500, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    return assert_envelope(response.json(), status, response.status_code, **kw)


def check_sdk_error(exc: openai.APIStatusError, status: int, **kw) -> dict:
    """An ``openai`` SDK error is ``status`` with the envelope (the SDK keeps ``body["error"]``)."""
    assert exc.status_code == status, (exc.status_code, exc.body)
    return assert_envelope({"error": exc.body}, status, exc.status_code, **kw)


def multipart(*parts: tuple[bytes, bytes], boundary: str = BOUNDARY, close: bool = True) -> bytes:
    """A multipart body from ``(headers, data)`` pairs, headers already CRLF-joined."""
    b = boundary.encode()
    out = b"".join(b"--" + b + b"\r\n" + headers + b"\r\n\r\n" + data + b"\r\n" for headers, data in parts)
    return out + (b"--" + b + b"--\r\n" if close else b"")


def field(name: str, value: str | bytes) -> tuple[bytes, bytes]:
    data = value.encode() if isinstance(value, str) else value
    return f'Content-Disposition: form-data; name="{name}"'.encode(), data


def file_part(data: bytes, filename: bytes = b"input.jsonl") -> tuple[bytes, bytes]:
    return (b'Content-Disposition: form-data; name="file"; filename="' + filename + b'"\r\n'
            b"Content-Type: application/jsonl", data)


def post_multipart(http, body: bytes, boundary: str = BOUNDARY):
    return http.post("/v1/files", content=body,
                     headers={"content-type": f"multipart/form-data; boundary={boundary}"})


ANSWER = object()
"""A piece of :func:`raw_exchange`: wait until the server has begun to answer (or ``timeout``)."""


def raw_exchange(gateway, pieces, timeout: float = 10.0) -> tuple[int, dict, bytes, float]:
    """Send ``pieces`` (bytes, a float = pause that many seconds, or :data:`ANSWER` = wait for the
    answer to begin) on one socket; read one response.

    Returns ``(status, headers, body, seconds from the last piece sent to the response)``; status 0
    when the server closed without answering.
    """
    host, port = gateway.base_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        for piece in pieces:
            if piece is ANSWER:
                select.select([sock], [], [], timeout)
            elif isinstance(piece, float):
                time.sleep(piece)
            else:
                try:
                    sock.sendall(piece)
                except OSError:
                    break
        sent = time.monotonic()
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    return 0, {}, data, time.monotonic() - sent
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
            length = int(headers.get("content-length", "0"))
            while len(body) < length:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                body += chunk
        except ConnectionResetError:
            return 0, {}, data, time.monotonic() - sent
        return status, headers, body, time.monotonic() - sent


def upload_head(gateway, content_length: str | int | None, extra: str = "") -> bytes:
    head = (f"POST /v1/files HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {gateway.api_key}\r\n"
            f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n")
    if content_length is not None:
        head += f"Content-Length: {content_length}\r\n"
    return (head + extra + "\r\n").encode()


def stored_paths(gateway) -> set[str]:
    """Every file under the file store root (relative paths), ``tmp/`` included."""
    root = gateway.settings.files_dir
    return {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}


def file_rows(gateway) -> int:
    with gateway.session() as session:
        return session.execute(text("SELECT count(*) FROM files")).scalar_one()


def assert_nothing_stored(gateway, *, keep: set[str] = frozenset(), rows: int = 0, wait: float = 15.0):
    """No file row beyond ``rows`` and nothing on disk beyond ``keep`` (waiting up to ``wait`` s for
    a request still being torn down)."""
    deadline = time.monotonic() + wait
    while True:
        paths, count = stored_paths(gateway) - set(keep), file_rows(gateway)
        if (not paths and count == rows) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert paths == set(), paths
    assert count == rows


def line(custom_id="r1", *, model="m", url=ENDPOINT, method="POST", **body) -> bytes:
    obj = {"custom_id": custom_id, "method": method, "url": url,
           "body": {"model": model, "messages": [{"role": "user", "content": "hi"}], **body}}
    return json.dumps(obj).encode()


def test_a_line_carrying_priority_fails_validation_in_openai_s_words(gateway):
    """vLLM's ``priority`` is the router's alone (issue 26 item 14): a batch line's own is refused,
    as OpenAI refuses an argument it does not know, naming the line."""
    client = gateway.client()
    content = line("r1") + b"\n" + line("r2", priority=-1000) + b"\n"
    uploaded = client.files.create(file=("in.jsonl", content), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT, completion_window="24h")
    failed = gateway.wait_status(batch.id, ("failed", "in_progress"))
    assert failed.status == "failed"
    assert [(e.code, e.line, e.param, e.message) for e in failed.errors.data] == [
        ("invalid_request", 2, "body.priority", "Unrecognized request argument supplied: priority")]


def request_rows(gateway, batch_id: str) -> int:
    with gateway.session() as session:
        return session.execute(text("SELECT count(*) FROM batch_requests WHERE batch_id = :b"),
                               {"b": batch_id}).scalar_one()


def missing_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


# --- 1. oversized uploads, lying Content-Length, one huge line --------------------------------


def test_oversized_uploads_are_413_and_leave_nothing(gateway):
    client, http = gateway.client(), gateway.http()
    over = b"".join(line(f"r{i}") + b"\n" for i in range(2000))[: BATCH_CAP + 4096]
    assert len(over) > BATCH_CAP

    # Through the SDK: purpose first (as the SDK sends it), so the cap applies while streaming.
    with pytest.raises(openai.APIStatusError) as info:
        client.files.create(file=("big.jsonl", over), purpose="batch")
    check_sdk_error(info.value, 413, param="file")
    assert_nothing_stored(gateway)

    # One huge line, no newline at all.
    huge_line = b'{"custom_id": "' + b"x" * (BATCH_CAP * 2) + b'"}'
    with pytest.raises(openai.APIStatusError) as info:
        client.files.create(file=("line.jsonl", huge_line), purpose="batch")
    check_sdk_error(info.value, 413, param="file")
    assert_nothing_stored(gateway)

    # purpose after the file: the cap is only known at the end, still 413 and nothing kept.
    response = post_multipart(http, multipart(file_part(over), field("purpose", "batch")))
    check_response(response, 413, param="file")
    assert_nothing_stored(gateway)

    # Exactly at the cap is accepted; the batch cap does not apply to other purposes.
    at_cap = (b"x" * (BATCH_CAP - 1)) + b"\n"
    ok = client.files.create(file=("cap.jsonl", at_cap), purpose="batch")
    assert ok.bytes == BATCH_CAP
    other = client.files.create(file=("notes.txt", over), purpose="user_data")
    assert other.bytes == len(over)
    client.files.delete(ok.id)
    client.files.delete(other.id)
    assert_nothing_stored(gateway, rows=2)  # rows stay (soft delete), bytes are gone

    # A declared Content-Length over the largest cap is refused before any byte is read.
    status, headers, body, _ = raw_exchange(gateway, [upload_head(gateway, 10**12)])
    assert_envelope(json.loads(body), 413, status, param="file")
    assert_nothing_stored(gateway, rows=2)


def test_lying_content_length(gateway):
    body = multipart(field("purpose", "batch"), file_part(line() + b"\n"))

    # Declares fewer bytes than it sends: the body is cut at Content-Length, so the multipart body
    # has no closing boundary (the rest, sent once the answer has begun, is a separate, broken request).
    status, _, payload, _ = raw_exchange(gateway, [upload_head(gateway, 100), body[:100], ANSWER, body[100:]])
    error = assert_envelope(json.loads(payload), 400, status)
    assert "closing boundary" in error["message"]
    assert_nothing_stored(gateway)

    # Declares more than it sends, then stalls: 408 after the idle timeout.
    status, _, payload, elapsed = raw_exchange(gateway, [upload_head(gateway, len(body) + 500), body])
    assert_envelope(json.loads(payload), 408, status)
    assert IDLE_TIMEOUT * 0.8 <= elapsed < IDLE_TIMEOUT + LATE_S
    assert_nothing_stored(gateway)

    # No Content-Length at all (chunked): accepted, counted while streaming.
    chunked = upload_head(gateway, None, "Transfer-Encoding: chunked\r\n")
    status, _, payload, _ = raw_exchange(gateway, [chunked, b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"])
    assert status == 200 and json.loads(payload)["bytes"] == len(line()) + 1
    # A chunked body over the cap is 413 like any other.
    big = multipart(field("purpose", "batch"), file_part(b"x" * (BATCH_CAP + 10)))
    status, _, payload, _ = raw_exchange(gateway, [chunked, b"%x\r\n" % len(big) + big + b"\r\n0\r\n\r\n"])
    assert_envelope(json.loads(payload), 413, status, param="file")
    assert len([p for p in stored_paths(gateway) if not p.startswith("tmp")]) == 1
    assert_nothing_stored(gateway, keep=stored_paths(gateway) - {p for p in stored_paths(gateway)
                                                                  if p.startswith("tmp")}, rows=1)


def test_non_numeric_content_length_is_refused(gateway):
    """Refused by the HTTP layer (400, connection closed) before the app runs; nothing stored."""
    for value in ("abc", "-1", "1e3", "12 34"):
        status, headers, payload, _ = raw_exchange(
            gateway, [upload_head(gateway, value), multipart(field("purpose", "batch"))])
        assert status == 400, (value, status, payload)
    # Fewer bytes declared than sent in the same segment: the excess is a broken second request,
    # which the HTTP layer refuses at once (the truncated first one is refused by the app).
    body = multipart(field("purpose", "batch"), file_part(line() + b"\n"))
    status, _, payload, _ = raw_exchange(gateway, [upload_head(gateway, 100) + body])
    assert status == 400, (status, payload)
    assert_nothing_stored(gateway)


# --- 2. malformed multipart ---------------------------------------------------------------------


def test_malformed_multipart(gateway):
    http = gateway.http()
    good_file = file_part(line() + b"\n")
    purpose = field("purpose", "batch")
    headers = b"\r\n".join([b'Content-Disposition: form-data; name="purpose"']
                           + [b"X-Pad-%d: y" % i for i in range(100)])
    cases = {
        "no boundary": (None, "multipart/form-data", multipart(purpose, good_file), 400, None),
        "empty boundary": (None, "multipart/form-data; boundary=", multipart(purpose, good_file), 400, None),
        "boundary too long": ("b" * 300, None, multipart(purpose, good_file, boundary="b" * 300), 400, None),
        "wrong content type": (None, "application/octet-stream", line(), 415, None),
        "form urlencoded": (None, "application/x-www-form-urlencoded", b"purpose=batch", 415, None),
        "endless part headers": (None, None, multipart((headers, b"batch"), good_file), 400, None),
        "one huge part header": (None, None, multipart(
            (b'Content-Disposition: form-data; name="purpose"\r\nX-Big: ' + b"y" * 20000, b"batch"),
            good_file), 400, None),
        "too many parts": (None, None, multipart(purpose, good_file,
                                                 *[field(f"f{i}", "v") for i in range(30)]), 400, None),
        "part without a name": (None, None, multipart((b"Content-Disposition: form-data", b"x"),
                                                      purpose, good_file), 400, None),
        "oversized field": (None, None, multipart(field("purpose", "b" * 10000), good_file), 400, "purpose"),
        "missing purpose": (None, None, multipart(good_file), 400, "purpose"),
        "wrong purpose": (None, None, multipart(field("purpose", "batch_output"), good_file), 400, "purpose"),
        "purpose twice": (None, None, multipart(purpose, purpose, good_file), 400, "purpose"),
        "missing file": (None, None, multipart(purpose), 400, "file"),
        "two file parts": (None, None, multipart(purpose, good_file, good_file), 400, "file"),
        "truncated body": (None, None, multipart(purpose, good_file, close=False), 400, None),
        "truncated mid part": (None, None, multipart(purpose, good_file)[:-40], 400, None),
        "not multipart at all": (None, None, b"hello", 400, None),
        "empty body": (None, None, b"", 400, None),
    }
    for name, (boundary, content_type, body, status, param) in cases.items():
        ct = content_type or f"multipart/form-data; boundary={boundary or BOUNDARY}"
        response = http.post("/v1/files", content=body, headers={"content-type": ct})
        try:
            check_response(response, status, **({"param": param} if param else {}))
        except AssertionError as exc:
            raise AssertionError(f"case {name!r}: {exc}") from None
    assert_nothing_stored(gateway)

    # The SDK's own request with a purpose OpenAI does not take.
    with pytest.raises(openai.BadRequestError) as info:
        gateway.client().files.create(file=("a.jsonl", line()), purpose="evil")  # type: ignore[arg-type]
    check_sdk_error(info.value, 400, param="purpose")
    assert_nothing_stored(gateway)


# --- 3. hostile file names ----------------------------------------------------------------------


def test_hostile_filenames_are_sanitised_and_never_touch_the_disk(gateway):
    from batch_gateway.store.files import storage_key

    http, client = gateway.http(), gateway.client()
    cases = [
        (b"../../../../etc/passwd", "passwd"),
        (b"..", "file"),
        (b"/etc/shadow", "shadow"),
        (b"C:\\Windows\\system32\\evil.jsonl", "evil.jsonl"),
        (b"a\x00b.jsonl", "ab.jsonl"),
        (b"a\tb\x1b[31m.jsonl", "ab[31m.jsonl"),
        ("donn\u00e9es \u2713.jsonl".encode(), "donn\u00e9es \u2713.jsonl"),
        (b"n" * 10_000 + b".jsonl", "n" * 255),
        (b"", "file"),
    ]
    ids = []
    for raw, expected in cases:
        response = post_multipart(http, multipart(field("purpose", "batch"), file_part(line() + b"\n", raw)))
        assert response.status_code == 200, (raw[:40], response.text)
        obj = response.json()
        assert obj["filename"] == expected, (raw[:40], obj["filename"])
        ids.append(obj["id"])
        # Retrieve via the SDK, and the download's Content-Disposition round-trips the stored name.
        assert client.files.retrieve(obj["id"]).filename == expected
        download = http.get(f"/v1/files/{obj['id']}/content")
        assert download.status_code == 200 and download.content == line() + b"\n"
        disposition = download.headers["content-disposition"]
        assert "\r" not in disposition and "\n" not in disposition and "\x00" not in disposition
        assert disposition.isascii(), disposition
        encoded = disposition.split("filename*=UTF-8''", 1)[1]
        assert unquote(encoded) == expected

    # A CR/LF inside a part header breaks the header itself: refused, nothing stored.
    for raw in (b"a\rb.jsonl", b"a\nb.jsonl", b"a\r\nb.jsonl", b"a\r\nX-Injected: 1\r\n.jsonl"):
        response = post_multipart(http, multipart(field("purpose", "batch"), file_part(b"{}\n", raw)))
        if response.status_code == 200:  # acceptable only if sanitised
            assert not set(response.json()["filename"]) & {"\r", "\n"}
            ids.append(response.json()["id"])
        else:
            check_response(response, 400)
    # Through the SDK (httpx percent-escapes control characters in the name).
    sdk = client.files.create(file=("x\r\ny/../z.jsonl", line() + b"\n"), purpose="batch")
    assert "/" not in sdk.filename and "\r" not in sdk.filename and "\n" not in sdk.filename
    ids.append(sdk.id)

    # On disk: exactly one object per file, at the key derived from its id; no user name anywhere.
    assert stored_paths(gateway) == {storage_key(i) for i in ids}
    for path in stored_paths(gateway):
        assert "passwd" not in path and "shadow" not in path and "evil" not in path and "nnnn" not in path
    data_dir = gateway.settings.data_dir
    for dirpath, dirnames, filenames in os.walk(data_dir.parent):
        for name in dirnames + filenames:
            assert name not in ("passwd", "shadow", "evil.jsonl"), os.path.join(dirpath, name)
    assert file_rows(gateway) == len(ids)


# --- 4 and 5. JSONL content through the real worker ---------------------------------------------


def test_jsonl_content_classes_reach_the_right_batch_state(gateway):
    client = gateway.client()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    trap_url = f"http://127.0.0.1:{listener.getsockname()[1]}{ENDPOINT}"
    nested = (b'{"custom_id": "deep", "method": "POST", "url": "' + ENDPOINT.encode()
              + b'", "body": {"model": "m", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}}")
    l1, l2, l3 = line("r1"), line("r2"), line("r3")
    failing = {
        # name: (file bytes, code, line, param)
        "invalid utf-8": (l1 + b"\n" + l2.replace(b'"r2"', b'"r\xff\xfe2"') + b"\n", "invalid_json_line", 2, None),
        "truncated json": (l1 + b"\n" + l2[:-5] + b"\n", "invalid_json_line", 2, None),
        "non-object line": (l1 + b"\n[1, 2, 3]\n", "invalid_json_line", 2, None),
        "string line": (b'"just a string"\n' + l1 + b"\n", "invalid_json_line", 1, None),
        "huge number": (l1 + b"\n" + l2[:-2] + b', "n": 1' + b"0" * 5000 + b"}}\n", "invalid_json_line", 2, None),
        "huge exponent": (l1[:-2] + b', "t": 1e999999}}\n', "invalid_json_line", 1, None),
        "NaN": (l1[:-2] + b', "temperature": NaN}}\n', "invalid_json_line", 1, None),
        "Infinity": (l1[:-2] + b', "temperature": -Infinity}}\n', "invalid_json_line", 1, None),
        "deep nesting": (l1 + b"\n" + nested + b"\n", "invalid_json_line", 2, None),
        "duplicate custom_id": (l1 + b"\n" + l2 + b"\n" + l1 + b"\n", "duplicate_custom_id", 3, "custom_id"),
        "missing custom_id": (l1 + b"\n" + l2.replace(b'"custom_id": "r2", ', b"") + b"\n",
                              "invalid_request", 2, "custom_id"),
        "non-string custom_id": (l1.replace(b'"r1"', b"17") + b"\n", "invalid_request", 1, "custom_id"),
        "null custom_id": (l1.replace(b'"r1"', b"null") + b"\n", "invalid_request", 1, "custom_id"),
        "url != endpoint": (l1 + b"\n" + line("r2", url="/v1/embeddings") + b"\n", "url_mismatch", 2, "url"),
        "absolute url": (line("r1", url=trap_url) + b"\n", "url_mismatch", 1, "url"),
        "method GET": (line("r1", method="GET") + b"\n", "invalid_request", 1, "method"),
        "missing body": (b'{"custom_id": "a", "method": "POST", "url": "' + ENDPOINT.encode() + b'"}\n',
                         "invalid_request", 1, "body"),
        "two models": (l1 + b"\n" + line("r2", model="other") + b"\n", "model_mismatch", 2, "body.model"),
        "stream true": (line("r1", stream=True) + b"\n", "invalid_request", 1, "body.stream"),
        "priority": (l1 + b"\n" + line("r2", priority=-1000) + b"\n", "invalid_request", 2, "body.priority"),
        "empty file": (b"", "empty_file", None, None),
        "only blank lines": (b"\n\r\n   \n", "empty_file", None, None),
        "too many tasks": (b"".join(line(f"r{i}") + b"\n" for i in range(MAX_REQUESTS + 1)),
                           "too_many_tasks", MAX_REQUESTS + 1, None),
    }
    passing = {
        # name: (file bytes, request count)
        "BOM": (b"\xef\xbb\xbf" + l1 + b"\n" + l2 + b"\n", 2),
        "CRLF": (l1 + b"\r\n" + l2 + b"\r\n", 2),
        "blank lines": (b"\n" + l1 + b"\n\n   \n" + l2 + b"\n\n", 2),
        "no final newline": (l1 + b"\n" + l2 + b"\n" + l3, 3),
        "exactly the maximum": (b"".join(line(f"r{i}") + b"\n" for i in range(MAX_REQUESTS)), MAX_REQUESTS),
        "stream false": (line("r1", stream=False) + b"\n", 1),
    }
    batches = {}
    for name, (content, *_rest) in {**failing, **passing}.items():
        uploaded = client.files.create(file=(f"{name}.jsonl", content), purpose="batch")
        assert uploaded.bytes == len(content)
        batch = client.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT, completion_window="24h")
        assert batch.status == "validating"
        batches[name] = batch.id

    problems = []
    for name, (_, code, line_no, param) in failing.items():
        batch = gateway.wait_status(batches[name], ("failed", "in_progress"))
        if batch.status != "failed" or not batch.errors or not batch.errors.data:
            problems.append(f"{name}: {batch.status} {batch.errors}")
            continue
        error = batch.errors.data[0]
        if (error.code, error.line, error.param) != (code, line_no, param) or not error.message:
            problems.append(f"{name}: got {(error.code, error.line, error.param)}, want {(code, line_no, param)}")
        if batch.failed_at is None or batch.in_progress_at is not None or batch.request_counts.total != 0:
            problems.append(f"{name}: timestamps/counts {batch}")
        if request_rows(gateway, batch.id):
            problems.append(f"{name}: a failed batch wrote batch_requests rows")
    for name, (_, count) in passing.items():
        batch = gateway.wait_status(batches[name], ("failed", "in_progress"))
        if batch.status != "in_progress" or batch.errors is not None:
            problems.append(f"{name}: {batch.status} {batch.errors}")
            continue
        if batch.request_counts.total != count or request_rows(gateway, batch.id) != count:
            problems.append(f"{name}: {batch.request_counts} rows={request_rows(gateway, batch.id)}")
        if batch.model != "m":
            problems.append(f"{name}: model {batch.model}")
    assert not problems, "\n".join(problems)
    with pytest.raises(BlockingIOError):  # the absolute URL was never fetched
        listener.accept()
    listener.close()


def test_nul_characters_in_jsonl_fail_the_batch_instead_of_wedging_it(gateway):
    """``\\u0000`` is valid JSON but cannot be stored in PostgreSQL text: the batch must fail with an
    error naming the line, never stay ``validating`` because a write failed."""
    client = gateway.client()
    cases = {
        "custom_id": (line("r1") + b"\n" + line("a\u0000b") + b"\n", "invalid_request", 2, "custom_id"),
        "repeated custom_id": ((line("a\u0000b") + b"\n") * 2, "invalid_request", 1, "custom_id"),
        "model": (line("r1", model="m\u0000") + b"\n", "invalid_request", 1, "body.model"),
    }
    ids = {}
    for name, (content, *_) in cases.items():
        assert b"\\u0000" in content
        f = client.files.create(file=(f"{name}.jsonl", content), purpose="batch")
        ids[name] = client.batches.create(input_file_id=f.id, endpoint=ENDPOINT, completion_window="24h").id
    for name, (_, code, line_no, param) in cases.items():
        batch = gateway.wait_status(ids[name], ("failed", "in_progress"))
        assert batch.status == "failed", (name, batch.status)
        error = batch.errors.data[0]
        assert (error.code, error.line, error.param) == (code, line_no, param), (name, error)
        assert "\x00" not in error.message
        assert request_rows(gateway, ids[name]) == 0


# --- 5 and 6. hostile JSON bodies, metadata, limits, cursors, ids -------------------------------


def test_hostile_create_batch_bodies_are_400(gateway):
    http, client = gateway.http(), gateway.client()
    file_id = client.files.create(file=("ok.jsonl", line() + b"\n"), purpose="batch").id
    good = {"input_file_id": file_id, "endpoint": ENDPOINT, "completion_window": "24h"}

    def body(**over):
        return json.dumps({**good, **over}).encode()

    raw_cases = {
        "huge integer": body()[:-1] + b', "metadata": {"a": ' + b"9" * 5000 + b"}}",
        "huge integer as the whole body": b"1" + b"0" * 5000,
        "huge exponent": body()[:-1] + b', "x": 1e999999}',
        "NaN": body()[:-1] + b', "metadata": NaN}',
        "Infinity": body()[:-1] + b', "x": Infinity}',
        "deep nesting": b'{"metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "deep object nesting": b'{"a":' * 5000 + b"1" + b"}" * 5000,
        "invalid utf-8": body().replace(b"24h", b"24\xffh"),
        "not json": b"input_file_id=" + file_id.encode(),
        "empty": b"",
        "array": b"[]",
        "null": b"null",
        "string": b'"x"',
        "trailing garbage": body() + b"x",
        "unknown field": body(tools=[]),
        "missing input_file_id": json.dumps({"endpoint": ENDPOINT, "completion_window": "24h"}).encode(),
        "non-string input_file_id": body(input_file_id=12),
        "unknown file": body(input_file_id=missing_id("file-")),
        "NUL in input_file_id": body(input_file_id="file-\u0000"),
        "bad endpoint": body(endpoint="/v1/images/generations"),
        "bad window": body(completion_window="forever"),
        "window with a trailing newline": body(completion_window="24h\n"),
        "window too long": body(completion_window="9999999d"),
        "metadata 17 pairs": body(metadata={f"k{i}": "v" for i in range(17)}),
        "metadata 65-char key": body(metadata={"k" * 65: "v"}),
        "metadata 513-char value": body(metadata={"k": "v" * 513}),
        "metadata int value": body(metadata={"k": 1}),
        "metadata null value": body(metadata={"k": None}),
        "metadata list": body(metadata=["k", "v"]),
        "metadata NUL value": body(metadata={"k": "a\u0000b"}),
        "metadata NUL key": body(metadata={"a\u0000b": "v"}),
        "output_expires_after bad": body(output_expires_after={"anchor": "created_at", "seconds": 1}),
    }
    for name, payload in raw_cases.items():
        response = http.post("/v1/batches", content=payload, headers={"content-type": "application/json"})
        try:
            check_response(response, 400)
        except AssertionError as exc:
            raise AssertionError(f"case {name!r}: {exc}") from None

    # A body over max_json_body_bytes: 413.
    big = body(metadata={"k": "v"})[:-1] + b', "pad": "' + b"x" * (2 * 1024 * 1024) + b'"}'
    check_response(http.post("/v1/batches", content=big, headers={"content-type": "application/json"}), 413)

    # The same limits through the SDK, with the param named.
    for metadata in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": 1}):
        with pytest.raises(openai.BadRequestError) as info:
            client.batches.create(input_file_id=file_id, endpoint=ENDPOINT, completion_window="24h",
                                  metadata=metadata)
        check_sdk_error(info.value, 400, param="metadata" if not isinstance(metadata.get("k"), int) else "any")
    # At the limits is fine.
    limits = {f"k{i}": "v" for i in range(15)} | {"k" * 64: "v" * 512}
    ok = client.batches.create(input_file_id=file_id, endpoint=ENDPOINT, completion_window="24h",
                               metadata=limits)
    assert ok.metadata == limits
    with gateway.session() as session:
        assert session.execute(text("SELECT count(*) FROM batches")).scalar_one() == 1


def test_list_limits_cursors_and_odd_ids(gateway):
    http, client = gateway.http(), gateway.client()
    f = client.files.create(file=("ok.jsonl", line() + b"\n"), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint=ENDPOINT, completion_window="24h")

    for path in ("/v1/files", "/v1/batches"):
        for limit in ("0", "-1", str(10**30), "abc", "1.5", "", "1e3"):
            check_response(http.get(path, params={"limit": limit}), 400, param="limit")
        for after in ("", "x", "file-", "batch_", missing_id("file-"), missing_id("batch_"), "a" * 129,
                      "a" * 5000, "\u00e9\u2603", "'; DROP TABLE files; --", "a\u0000b", "..%2F..%2F"):
            try:
                check_response(http.get(path, params={"after": after}), 400, param="after")
            except AssertionError as exc:
                raise AssertionError(f"{path} after={after[:20]!r}: {exc}") from None
    check_response(http.get("/v1/files", params={"order": "sideways"}), 400, param="order")
    check_response(http.get("/v1/files", params={"purpose": "evil"}), 400, param="purpose")
    check_response(http.get("/v1/files", params={"purpose": "x" * 100}), 400, param="purpose")
    # The bounds themselves are fine.
    assert http.get("/v1/files", params={"limit": 10_000}).status_code == 200
    assert http.get("/v1/batches", params={"limit": 100}).status_code == 200
    check_response(http.get("/v1/batches", params={"limit": 101}), 400, param="limit")
    check_response(http.get("/v1/files", params={"limit": 10_001}), 400, param="limit")
    # Through the SDK.
    with pytest.raises(openai.BadRequestError) as info:
        client.batches.list(limit=0)
    check_sdk_error(info.value, 400, param="limit")
    with pytest.raises(openai.BadRequestError) as info:
        client.files.list(after="file-nope")
    check_sdk_error(info.value, 400, param="after")

    odd_ids = ["x" * 10_000, "\u00e9\u2603\U0001f600", "..%2F..%2Fetc%2Fpasswd", "..", "%2e%2e",
               "file-%00", "batch_%00", "a%0D%0Ab", "%ff%fe", "%C0%AF", "file-" + "0" * 24,
               "batch_" + "0" * 24, "' OR 1=1 --"]
    routes = [("GET", "/v1/files/{}"), ("GET", "/v1/files/{}/content"), ("DELETE", "/v1/files/{}"),
              ("GET", "/v1/batches/{}"), ("POST", "/v1/batches/{}/cancel")]
    for odd in odd_ids:
        for method, template in routes:
            encoded = odd if "%" in odd else quote(odd, safe="")
            response = http.request(method, template.format(encoded))
            try:
                check_response(response, 404)
            except AssertionError as exc:
                raise AssertionError(f"{method} {template} id={odd[:20]!r}: {exc}") from None
    # The objects are untouched.
    assert client.files.retrieve(f.id).id == f.id
    assert client.batches.retrieve(b.id).status in ("validating", "in_progress")


# --- 7. slow clients ----------------------------------------------------------------------------


def test_stalled_upload_is_408_and_leaves_nothing(gateway):
    body = multipart(field("purpose", "batch"), file_part(b"x" * 30_000))
    # Headers and part of the body, then silence.
    status, _, payload, elapsed = raw_exchange(gateway, [upload_head(gateway, len(body)), body[:20_000]])
    assert_envelope(json.loads(payload), 408, status)
    assert elapsed < IDLE_TIMEOUT + LATE_S
    assert_nothing_stored(gateway)
    # Headers only, no body byte at all.
    status, _, payload, _ = raw_exchange(gateway, [upload_head(gateway, len(body))])
    assert_envelope(json.loads(payload), 408, status)
    # A client that trickles slower than the timeout between chunks.
    status, _, payload, _ = raw_exchange(
        gateway, [upload_head(gateway, len(body)), body[:100], IDLE_TIMEOUT * 0.5, body[100:200]])
    assert_envelope(json.loads(payload), 408, status)
    assert_nothing_stored(gateway)


def test_client_that_hangs_up_mid_upload_leaves_nothing(gateway):
    body = multipart(field("purpose", "batch"), file_part(b"x" * 30_000))
    host, port = gateway.base_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(upload_head(gateway, len(body)) + body[:20_000])
        time.sleep(0.2)
    assert_nothing_stored(gateway)
    # The same for a JSON body on POST /v1/batches.
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall((f"POST /v1/batches HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {gateway.api_key}\r\n"
                      "Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"input_").encode())
        time.sleep(0.2)
    time.sleep(0.2)
    with gateway.session() as session:
        assert session.execute(text("SELECT count(*) FROM batches")).scalar_one() == 0
    # The gateway is still serving.
    assert gateway.http().get("/v1/files").status_code == 200


# --- 9. auth ------------------------------------------------------------------------------------


def test_auth_refusals(gateway):
    from batch_gateway.store import queries

    revoked = gateway.key("revoked-tenant")
    assert gateway.http("revoked-tenant").get("/v1/files").status_code == 200
    with gateway.session() as session:
        assert queries.revoke_api_key(session, revoked)
        session.commit()
    plain = gateway.http(None)
    good = gateway.api_key
    cases = {
        "missing header": ({}, None, 401),
        "empty header": ({"authorization": ""}, None, 401),
        "Basic scheme": ({"authorization": "Basic dXNlcjpwYXNz"}, None, 401),
        "Bearer without key": ({"authorization": "Bearer"}, None, 401),
        "key without scheme": ({"authorization": good}, None, 401),
        "unknown key": ({"authorization": "Bearer sk-unknown-0123456789abcdef"}, None, 401),
        "short unknown key": ({"authorization": "Bearer x"}, None, 401),
        "revoked key": ({"authorization": f"Bearer {revoked}"}, None, 401),
        "key in query": ({}, {"api_key": good}, 400),
        "key in query with a good header": ({"authorization": f"Bearer {good}"}, {"api_key": good}, 400),
        "access_token in query": ({}, {"access_token": good}, 400),
    }
    routes = [("GET", "/v1/files"), ("POST", "/v1/files"), ("GET", "/v1/files/file-x"),
              ("GET", "/v1/files/file-x/content"), ("DELETE", "/v1/files/file-x"),
              ("GET", "/v1/batches"), ("POST", "/v1/batches"), ("GET", "/v1/batches/batch_x"),
              ("POST", "/v1/batches/batch_x/cancel")]
    for name, (headers, params, status) in cases.items():
        for method, path in routes:
            response = plain.request(method, path, headers=headers, params=params)
            try:
                error = check_response(response, status)
            except AssertionError as exc:
                raise AssertionError(f"{name} {method} {path}: {exc}") from None
            if status == 401:
                assert error["type"] == "invalid_request_error"
                assert good not in error["message"] and revoked not in error["message"]
            else:
                assert error["code"] == "invalid_api_key"
    # The SDK sees AuthenticationError with the envelope.
    with pytest.raises(openai.AuthenticationError) as info:
        openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=revoked, max_retries=0).files.list()
    check_sdk_error(info.value, 401)
    assert_nothing_stored(gateway)


# --- 10. content-type confusion ----------------------------------------------------------------


def test_content_type_confusion_is_415(gateway):
    http = gateway.http()
    file_id = gateway.client().files.create(file=("ok.jsonl", line() + b"\n"), purpose="batch").id
    create = json.dumps({"input_file_id": file_id, "endpoint": ENDPOINT, "completion_window": "24h"}).encode()
    upload = multipart(field("purpose", "batch"), file_part(line() + b"\n"))
    cases = [
        ("/v1/files", "application/json", create),
        ("/v1/files", "text/plain", upload),
        ("/v1/files", None, upload),
        ("/v1/batches", f"multipart/form-data; boundary={BOUNDARY}", upload),
        ("/v1/batches", "application/x-www-form-urlencoded", b"input_file_id=" + file_id.encode()),
        ("/v1/batches", "text/plain", create),
        ("/v1/batches", None, create),
    ]
    for path, content_type, body in cases:
        headers = {"content-type": content_type} if content_type else {}
        response = http.post(path, content=body, headers=headers)
        if content_type is None:
            assert "content-type" not in response.request.headers
        try:
            check_response(response, 415)
        except AssertionError as exc:
            raise AssertionError(f"{path} {content_type}: {exc}") from None
    # JSON with a charset parameter is still JSON.
    response = http.post("/v1/batches", content=create, headers={"content-type": "application/json; charset=utf-8"})
    assert response.status_code == 200, response.text
    assert_nothing_stored(gateway, keep=stored_paths(gateway), rows=1)
    with gateway.session() as session:
        assert session.execute(text("SELECT count(*) FROM batches")).scalar_one() == 1


# --- cancel and Idempotency-Key -----------------------------------------------------------------


def test_cancel_of_ended_batches_and_cancel_twice(gateway):  # every ended status: test_http_edges.py
    client, http = gateway.client(), gateway.http()
    bad = client.files.create(file=("bad.jsonl", b"not json\n"), purpose="batch")
    failed = client.batches.create(input_file_id=bad.id, endpoint=ENDPOINT, completion_window="24h")
    failed = gateway.wait_status(failed.id, ("failed",))
    good = client.files.create(file=("good.jsonl", line() + b"\n"), purpose="batch")
    done = client.batches.create(input_file_id=good.id, endpoint=ENDPOINT, completion_window="24h")
    gateway.wait_status(done.id, ("in_progress",))
    with gateway.session() as session:  # no processor yet: finish it by hand
        session.execute(text("UPDATE batches SET status = 'completed', finalizing_at = created_at, "
                             "completed_at = created_at WHERE id = :b"), {"b": done.id})
        session.commit()
    done = client.batches.retrieve(done.id)

    for ended in (failed, done):
        with pytest.raises(openai.ConflictError) as info:
            client.batches.cancel(ended.id)
        error = check_sdk_error(info.value, 409)
        assert ended.status in error["message"]
        assert client.batches.retrieve(ended.id) == ended

    live = client.batches.create(input_file_id=good.id, endpoint=ENDPOINT, completion_window="24h")
    first = client.batches.cancel(live.id)
    assert first.status in ("cancelling", "cancelled") and first.cancelling_at is not None
    raw = http.post(f"/v1/batches/{live.id}/cancel")
    if first.status == "cancelling":  # a cancel in progress: answered unchanged
        assert raw.status_code == 200
    else:  # it has ended: refused like every ended batch (CANCEL_RULE)
        check_response(raw, 409)
        assert raw.headers["x-should-retry"] == "false"
    assert client.batches.retrieve(live.id).cancelling_at == first.cancelling_at


def test_idempotency_key(gateway):
    client, http = gateway.client(), gateway.http()
    f = client.files.create(file=("ok.jsonl", line() + b"\n"), purpose="batch")
    g = client.files.create(file=("ok2.jsonl", line() + b"\n"), purpose="batch")
    args = {"input_file_id": f.id, "endpoint": ENDPOINT, "completion_window": "24h", "metadata": {"a": "1"}}
    one = client.batches.create(**args, extra_headers={"Idempotency-Key": "k-1"})
    again = client.batches.create(**args, extra_headers={"Idempotency-Key": "k-1"})
    assert again.id == one.id
    # Key order in the JSON body does not matter.
    reordered = json.dumps(dict(reversed(list(args.items()))))
    response = http.post("/v1/batches", content=reordered,
                         headers={"content-type": "application/json", "idempotency-key": "k-1"})
    assert response.status_code == 200 and response.json()["id"] == one.id
    for change in ({"input_file_id": g.id}, {"metadata": {"a": "2"}}, {"metadata": None},
                   {"completion_window": "2h"}, {"endpoint": "/v1/embeddings"}):
        with pytest.raises(openai.ConflictError) as info:
            client.batches.create(**{**args, **change}, extra_headers={"Idempotency-Key": "k-1"})
        check_sdk_error(info.value, 409, code="idempotency_key_reused")
    other = client.batches.create(**args, extra_headers={"Idempotency-Key": "k-2"})
    plain = client.batches.create(**args)
    assert len({one.id, other.id, plain.id}) == 3
    # An over-long key is refused, not truncated.
    response = http.post("/v1/batches", content=json.dumps(args),
                         headers={"content-type": "application/json", "idempotency-key": "k" * 300})
    check_response(response, 400)
    with gateway.session() as session:
        assert session.execute(text("SELECT count(*) FROM batches")).scalar_one() == 3
