"""Streaming multipart parsing and file-name sanitising (``batch_gateway.uploads``), no database."""

from __future__ import annotations

import pytest

from batch_gateway.errors import InvalidRequestError, PayloadTooLargeError, UnsupportedMediaTypeError
from batch_gateway.uploads import MAX_FILENAME_CHARS, UploadParser, multipart_boundary, sanitize_filename

HELLO_SHA256 = "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"


class Sink:
    """An in-memory :class:`~batch_gateway.store.files.Upload`."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.committed = self.aborted = False

    def write(self, chunk: bytes) -> None:
        self.data += chunk

    def commit(self) -> None:
        self.committed = True

    def abort(self) -> None:
        self.aborted = True


def part(name: str, value: bytes, filename: str | None = None) -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    return f"--b\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value + b"\r\n"


END = b"--b--\r\n"


def parse(body: bytes, max_file_bytes: int = 1000, chunk: int | None = None):
    sink = Sink()
    parser = UploadParser(b"b", sink, max_file_bytes)
    step = chunk or len(body)
    for i in range(0, len(body), step):
        parser.feed(body[i:i + step])
    return parser.finish(), sink


def test_boundary_of_a_multipart_content_type():
    assert multipart_boundary("multipart/form-data; boundary=abc123") == b"abc123"
    assert multipart_boundary('multipart/form-data; boundary="quoted"') == b"quoted"


@pytest.mark.parametrize(("content_type", "error", "status"), [
    ("application/json", UnsupportedMediaTypeError, 415),
    (None, UnsupportedMediaTypeError, 415),
    ("multipart/form-data", InvalidRequestError, 400),
    ("multipart/form-data; boundary=" + "x" * 201, InvalidRequestError, 400),
])
def test_boundary_refusals(content_type, error, status):
    with pytest.raises(error) as caught:
        multipart_boundary(content_type)
    assert caught.value.status == status


@pytest.mark.parametrize("chunk", [None, 1, 7])
def test_fields_and_file_are_parsed_however_the_body_is_chunked(chunk):
    body = part("purpose", b"batch") + part("file", b"hello", filename="../dir/in.jsonl") + END
    parsed, sink = parse(body, chunk=chunk)
    assert parsed.fields == {"purpose": "batch"}
    assert (parsed.filename, parsed.size, parsed.sha256, parsed.has_file) == ("in.jsonl", 5, HELLO_SHA256, True)
    assert bytes(sink.data) == b"hello"
    assert not sink.committed  # the caller commits


def test_a_body_without_a_file_part():
    parsed, sink = parse(part("purpose", b"batch") + END)
    assert (parsed.has_file, parsed.filename, parsed.size) == (False, None, 0)
    assert sink.data == b""


def test_a_file_over_the_cap_is_refused_as_it_crosses_it():
    with pytest.raises(PayloadTooLargeError) as caught:
        parse(part("file", b"hello", filename="a.jsonl") + END, max_file_bytes=4)
    assert caught.value.param == "file"
    parsed, _ = parse(part("file", b"hello", filename="a.jsonl") + END, max_file_bytes=5)
    assert parsed.size == 5


@pytest.mark.parametrize(("body", "message"), [
    (part("file", b"a", "x") + part("file", b"b", "y") + END, "Only one 'file' part"),
    (part("purpose", b"a") + part("purpose", b"b") + END, "was given twice"),
    (part("purpose", b"\xff\xfe") + END, "must be UTF-8"),
    (part("purpose", b"x" * 4097) + END, "too long"),
    (b"".join(part(f"f{i}", b"v") for i in range(17)) + END, "more than 16 parts"),
    (b'--b\r\nContent-Disposition: attachment; name="x"\r\n\r\nv\r\n' + END, "form-data; name"),
])
def test_malformed_bodies_are_invalid_requests(body, message):
    with pytest.raises(InvalidRequestError, match=message):
        parse(body)


def test_a_body_cut_before_its_closing_boundary_is_refused():
    with pytest.raises(InvalidRequestError, match="ended before its closing boundary"):
        parse(part("purpose", b"batch"))


@pytest.mark.parametrize(("raw", "name"), [
    (b"dir/sub/name.jsonl", "name.jsonl"),
    ("C:\\Users\\me\\b.txt", "b.txt"),
    ("a\x00b\r\nc\x7f.txt", "abc.txt"),
    (None, "file"),
    ("", "file"),
    ("...", "file"),
    ("dir/", "file"),
    ("  .hidden. ", "hidden"),
    ("e\u0301t\u00e9.jsonl", "\u00e9t\u00e9.jsonl"),  # NFC: e + combining acute -> é
    (b"\xff.txt", "\ufffd.txt"),
])
def test_sanitize_filename(raw, name):
    assert sanitize_filename(raw) == name


def test_sanitize_filename_caps_the_length():
    assert sanitize_filename("a" * 300 + ".jsonl") == "a" * MAX_FILENAME_CHARS
