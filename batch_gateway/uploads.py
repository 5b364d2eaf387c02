"""Streaming ``multipart/form-data`` upload for ``POST /v1/files``.

The body is parsed as it arrives (``python-multipart``'s push parser): the ``file`` part's bytes go
straight to the file store while a counter enforces the byte cap, so an oversized upload is refused
with 413 as soon as it crosses the cap and nothing is ever held whole in memory. Small fields
(``purpose``, ``expires_after[…]``) are kept, each at most :data:`MAX_FIELD_BYTES`.
"""

from __future__ import annotations

import hashlib
import unicodedata
from dataclasses import dataclass, field

from python_multipart.multipart import MultipartParser, parse_options_header

from batch_gateway.errors import InvalidRequestError, PayloadTooLargeError
from batch_gateway.store.files import Upload

MAX_PARTS = 16
MAX_FIELD_BYTES = 4096
MAX_FILENAME_CHARS = 255
MAX_HEADERS_PER_PART = 8
MAX_HEADER_BYTES = 16 * 1024


def multipart_boundary(content_type: str | None) -> bytes:
    """The boundary of a ``multipart/form-data`` Content-Type.

    Raises :class:`~batch_gateway.errors.UnsupportedMediaTypeError` for another type and
    :class:`~batch_gateway.errors.InvalidRequestError` when the boundary is missing or too long.
    """
    from batch_gateway.errors import UnsupportedMediaTypeError

    kind, params = parse_options_header(content_type or "")
    if kind != b"multipart/form-data":
        raise UnsupportedMediaTypeError(
            "This endpoint expects a multipart/form-data body with 'file' and 'purpose' fields."
        )
    boundary = params.get(b"boundary", b"")
    if not boundary or len(boundary) > 200:
        raise InvalidRequestError("The multipart/form-data body has no valid boundary.")
    return boundary


def sanitize_filename(raw: bytes | str | None) -> str:
    """A file name safe to store and echo: the last path component, control characters (NUL, CR,
    LF, …) removed, NFC-normalised, at most 255 characters; ``"file"`` when nothing is left."""
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8", errors="replace")
    name = (raw or "").replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(c for c in unicodedata.normalize("NFC", name) if unicodedata.category(c)[0] != "C")
    name = name.strip().strip(".") or "file"
    return name[:MAX_FILENAME_CHARS]


@dataclass
class ParsedUpload:
    """What the parser saw: form fields, the file name, its size (bytes) and SHA-256."""

    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    size: int = 0
    sha256: str = ""
    has_file: bool = False


class UploadParser:
    """Feed body chunks with :meth:`feed`, then call :meth:`finish`.

    The ``file`` part is written to ``sink`` and capped at ``max_file_bytes``; any other part is a
    small text field. Raises :class:`PayloadTooLargeError` past the cap and
    :class:`InvalidRequestError` for malformed bodies (bad boundary use, too many parts, endless
    headers, a second file, an oversized field).
    """

    def __init__(self, boundary: bytes, sink: Upload, max_file_bytes: int):
        self.sink = sink
        self.max_file_bytes = max_file_bytes
        self.result = ParsedUpload()
        self._hash = hashlib.sha256()
        self._parts = 0
        self._header_name = b""
        self._header_value = b""
        self._headers: dict[bytes, bytes] = {}
        self._current: str | None = None  # "file" | field name | "" (ignored)
        self._buffer = bytearray()
        self._error: Exception | None = None
        self._ended = False
        self._parser = MultipartParser(
            boundary,
            {
                "on_part_begin": self._part_begin,
                "on_header_field": self._header_field,
                "on_header_value": self._header_value_cb,
                "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished,
                "on_part_data": self._part_data,
                "on_part_end": self._part_end,
                "on_end": self._end,
            },
            max_header_count=MAX_HEADERS_PER_PART,
            max_header_size=MAX_HEADER_BYTES,
        )

    # -- callbacks (errors are stored and re-raised after the parser returns) --

    def _part_begin(self) -> None:
        self._parts += 1
        if self._parts > MAX_PARTS:
            raise InvalidRequestError(f"The multipart body has more than {MAX_PARTS} parts.")
        self._headers = {}
        self._current = None
        self._buffer = bytearray()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]
        self._check_header()

    def _header_value_cb(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]
        self._check_header()

    def _check_header(self) -> None:
        if len(self._header_name) + len(self._header_value) > MAX_HEADER_BYTES:
            raise InvalidRequestError("A multipart part header is too long.")

    def _header_end(self) -> None:
        self._headers[self._header_name.strip().lower()] = self._header_value.strip()
        self._header_name = b""
        self._header_value = b""

    def _headers_finished(self) -> None:
        disposition, params = parse_options_header(self._headers.get(b"content-disposition", b""))
        if disposition != b"form-data" or b"name" not in params:
            raise InvalidRequestError("Each multipart part needs 'Content-Disposition: form-data; name=…'.")
        name = params[b"name"].decode("utf-8", errors="replace")
        if name == "file":
            if self.result.has_file:
                raise InvalidRequestError("Only one 'file' part may be uploaded.", param="file")
            self.result.has_file = True
            self.result.filename = sanitize_filename(params.get(b"filename"))
            self._current = "file"
        elif name in self.result.fields:
            raise InvalidRequestError(f"The field '{name[:64]}' was given twice.", param=name[:64])
        else:
            self._current = name

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if self._current == "file":
            self.result.size += len(chunk)
            if self.result.size > self.max_file_bytes:
                raise PayloadTooLargeError(
                    f"File is too large: the limit is {self.max_file_bytes} bytes.", param="file"
                )
            self._hash.update(chunk)
            self.sink.write(chunk)
        else:
            self._buffer += chunk
            if len(self._buffer) > MAX_FIELD_BYTES:
                raise InvalidRequestError("A form field is too long.", param=self._current)

    def _part_end(self) -> None:
        if self._current and self._current != "file":
            try:
                self.result.fields[self._current] = self._buffer.decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidRequestError("Form fields must be UTF-8 text.", param=self._current) from None

    def _end(self) -> None:
        self._ended = True

    # -- driving --

    def feed(self, chunk: bytes) -> None:
        """Parse the next body chunk. Raises as documented on the class."""
        try:
            self._parser.write(chunk)
        except (InvalidRequestError, PayloadTooLargeError):
            raise
        except OSError:
            raise
        except Exception as exc:  # python-multipart's MultipartParseError and friends
            raise InvalidRequestError(f"Malformed multipart body: {exc}") from None

    def finish(self) -> ParsedUpload:
        """Check the body ended properly; returns what was parsed."""
        try:
            self._parser.finalize()
        except Exception as exc:
            raise InvalidRequestError(f"Malformed multipart body: {exc}") from None
        if not self._ended:
            raise InvalidRequestError("The multipart body ended before its closing boundary.")
        self.result.sha256 = self._hash.hexdigest()
        return self.result
