"""Streaming validator for OpenAI batch input files (pure: bytes in, a report out, no I/O).

:func:`validate_batch_file` reads a batch input file as an iterable of arbitrary byte chunks (a line
may span chunks; a chunk boundary may split a CRLF, a UTF-8 BOM or a multi-byte character) and
checks every line the way OpenAI's Batch API does before a batch leaves ``validating``:

- the batch endpoint is one the platform serves (``served_endpoints``, default
  :data:`~common.contracts.openai_request.ROUTED_ENDPOINTS`): a ``/v1/moderations`` batch fails here
  with one ``invalid_request`` error, param ``endpoint``, instead of every line ending with a 404;

- each non-blank line is a JSON object (``invalid_json_line``);
- ``custom_id`` present, a non-empty string, unique in the file (``invalid_request`` /
  ``duplicate_custom_id``);
- ``method`` is ``"POST"``; ``url`` equals the batch endpoint (``invalid_request`` / ``url_mismatch``;
  an absolute URL is a mismatch and is never fetched);
- ``body`` is an object with a string ``model``; one model per file (``model_mismatch``);
  no ``"stream": true`` (``invalid_request``, param ``body.stream``); no ``priority``, vLLM's
  scheduling priority, which only the router sets (``invalid_request``, param ``body.priority``,
  OpenAI's message for an argument it does not know: "Unrecognized request argument supplied:
  priority");
- ``body.n``, when given, is an integer from 1 to :data:`MAX_N` (128, OpenAI's cap); each output
  token limit given (``max_tokens``, ``max_completion_tokens``, ``max_output_tokens``) is an integer
  of at least 1; and ``n`` × that limit is at most ``max_output_tokens`` (default
  :data:`DEFAULT_MAX_OUTPUT_TOKENS`, 1,048,576): ``invalid_request``, param ``body.<field>``;
- at most ``max_requests`` requests (``too_many_tasks``) and at least one (``empty_file``).

A UTF-8 BOM at the start is skipped; LF and CRLF both end a line; blank and whitespace-only lines are
skipped but still counted in line numbers; a missing final newline is fine.

Hostile input never raises and never costs unbounded memory or CPU: numbers that overflow a double
(e.g. > 4,300 digits), ``NaN``/``Infinity``, nesting deeper than orjson's 1,024 levels, invalid
UTF-8 and non-object lines become ``invalid_json_line``; a line longer than ``max_line_bytes`` becomes
``invalid_request`` and is counted, not buffered. Memory is O(longest accepted line + number of
requests): the file is never joined.

A string holding a lone UTF-16 surrogate escape (``"\\ud83d alone"``: valid JSON, but no Unicode
text) is read with U+FFFD REPLACEMENT CHARACTER in its place, the way a browser's ``TextEncoder``
or Go's ``encoding/json`` read it, so the line runs (:func:`loads_line`, which the feeder uses too);
a ``custom_id`` holding one is refused (``invalid_request``): the output file could not give it back
as written.

Error wording follows OpenAI where it is publicly known (``invalid_json_line``, and the
``duplicate_custom_id`` / ``model_mismatch`` texts OpenAI-compatible providers reproduce, e.g. Alibaba
Model Studio's error-code page); the other messages are ours.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from common.contracts.openai_request import ROUTED_ENDPOINTS
from common.json_types import json_type_name

__all__ = [
    "DEFAULT_MAX_LINE_BYTES",
    "DEFAULT_MAX_OUTPUT_TOKENS",
    "MAX_N",
    "PREFIX_KEY_BYTES",
    "LineError",
    "RequestLine",
    "ValidationReport",
    "loads_line",
    "prompt_bytes",
    "validate_batch_file",
]

#: Longest accepted line, in bytes (32 MiB). OpenAI documents no per-line cap below the 200 MB file
#: cap; 32 MiB admits a chat request carrying a 20 MB image as base64 (~27 MB), while one such line
#: parsed by orjson stays well inside the ≤ 150 MB memory-growth goal of the ingest benchmark
#: (``docs/benchmarks.md``).
DEFAULT_MAX_LINE_BYTES = 32 * 1024 * 1024

#: Largest ``n`` (choices per request): OpenAI's documented maximum for Chat Completions (the API
#: answers ``Expected a value <= 128`` above it).
MAX_N = 128

#: Largest ``n`` × output-token limit of one line (1,048,576 = 2**20 tokens): the full ``n`` of 128
#: with 8,192 tokens each, or one choice of a million tokens, beyond any model's output limit today.
#: At ~4 bytes a token that is ~4 MiB of text, inside the workers' 8 MiB response limit
#: (``BACKFILL_WORKER_MAX_RESPONSE_BYTES``); a line asking for more is refused before it runs
#: instead of tying an engine up for minutes.
DEFAULT_MAX_OUTPUT_TOKENS = 1 << 20

#: Fields of a request body that bound its output tokens, per choice (Chat Completions and
#: Completions ``max_tokens``, Chat Completions ``max_completion_tokens``, Responses
#: ``max_output_tokens``).
OUTPUT_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")

#: Length of :attr:`RequestLine.prefix_key`, in bytes of UTF-8 prompt text.
PREFIX_KEY_BYTES = 128

#: Bytes per token for :attr:`RequestLine.est_tokens`: OpenAI's rule of thumb that one token is about
#: four characters of English text ("What are tokens and how to count them?", OpenAI help center).
BYTES_PER_TOKEN = 4

_BOM = b"\xef\xbb\xbf"
_BLANK = b" \t\r"

_MSG_INVALID_JSON = "This line is not parseable as valid JSON."


@dataclass(slots=True, frozen=True)
class RequestLine:
    """One valid request line of a batch input file.

    ``line`` is 1-based (blank lines count); ``offset`` is the byte offset of the line's first byte in
    the file (after the BOM on line 1); ``length`` is the byte length of the line without its ``\\n`` or
    ``\\r\\n`` terminator, so ``file[offset:offset + length]`` is the line's JSON text. ``prefix_key``
    is the first 128 bytes of the UTF-8 prompt text (see :func:`prompt_bytes`), used to order work by
    ``(model, prefix)``; ``est_tokens`` is ``ceil(prompt bytes / 4)`` (OpenAI's ~4 chars/token rule).
    """

    custom_id: str
    line: int
    offset: int
    length: int
    prefix_key: bytes
    est_tokens: int


@dataclass(slots=True, frozen=True)
class LineError:
    """One entry of a failed batch's ``errors.data[]``: OpenAI's ``{code, message, param, line}``.

    ``code`` is one of ``invalid_json_line``, ``duplicate_custom_id``, ``url_mismatch``,
    ``model_mismatch``, ``empty_file``, ``too_many_tasks``, ``invalid_request`` (and, from the
    validate step, ``model_not_found``, ``token_limit_exceeded``, ``validation_error``). ``line`` is 1-based,
    or ``None`` for file-level errors (``empty_file``). ``param`` names the offending field
    (``custom_id``, ``method``, ``url``, ``body``, ``body.model``, ``body.stream``, ``body.n``,
    ``body.max_tokens``, ``body.max_completion_tokens``, ``body.max_output_tokens``) or is ``None``.
    """

    code: str
    message: str
    line: int | None
    param: str | None


@dataclass(slots=True)
class ValidationReport:
    """Result of :func:`validate_batch_file`.

    ``requests`` holds every request line in file order when the file is valid and is empty as soon as
    any error is found. ``errors`` is in line order, at most ``max_errors`` long; empty means valid.
    ``model`` is the first ``body.model`` seen (``None`` if none), on line ``model_line``. ``bytes_read`` counts the bytes
    consumed from ``chunks`` (all of them unless validation stopped early at ``too_many_tasks`` or at
    ``max_errors``). ``est_tokens`` is the sum of ``est_tokens`` over every line that passed its checks
    (kept even when ``requests`` is emptied by an error), the batch's enqueued-token estimate.
    """

    requests: list[RequestLine] = field(default_factory=list)
    errors: list[LineError] = field(default_factory=list)
    model: str | None = None
    model_line: int | None = None
    bytes_read: int = 0
    est_tokens: int = 0

    @property
    def ok(self) -> bool:
        """True when the file passed validation (no errors)."""
        return not self.errors


# --------------------------------------------------------------------------------------------------
# Parsing one line

# A backslash escape in a JSON string: a high surrogate (with the low one that may follow it), a
# lone low surrogate, or any other escape (consumed so ``\\\\ud83d`` is not read as an escape).
_ESCAPE = re.compile(rb"\\(?:u[dD][89abAB][0-9a-fA-F]{2}(\\u[dD][c-fC-F][0-9a-fA-F]{2})?|u[dD][c-fC-F][0-9a-fA-F]{2}|.)",
                     re.DOTALL)
_REPLACEMENT = rb"\ufffd"


def _replace_lone_surrogates(data: bytes | bytearray, replacement: bytes = _REPLACEMENT) -> bytes:
    """``data`` with each lone UTF-16 surrogate escape (``\\ud83d`` not followed by a low one, or a
    low one alone) replaced by ``replacement`` (``\\ufffd``); valid pairs and every other escape are
    kept."""
    def fix(match: re.Match[bytes]) -> bytes:
        text = match.group(0)
        if len(text) == 6 and text[1] == 0x75 and match.group(1) is None:  # a \\uDxxx alone
            return replacement
        return text

    return _ESCAPE.sub(fix, bytes(data))


def _parse(data: bytes | bytearray) -> tuple[Any, bool]:
    """``(value, replaced)``: the line parsed by :func:`loads_line`, and whether a lone surrogate
    was replaced."""
    try:
        return orjson.loads(data), False
    except orjson.JSONDecodeError:
        if b"\\u" not in data:
            raise
        fixed = _replace_lone_surrogates(data)
        if fixed == data:
            raise
        return orjson.loads(fixed), True


def loads_line(data: bytes | bytearray) -> Any:
    """Parse one JSON line with orjson; a line refused only for a lone surrogate escape is parsed
    again with U+FFFD in its place. Raises ``orjson.JSONDecodeError`` for anything else that is not
    JSON (orjson's limits: doubles only, no ``NaN``, nesting up to 1,024)."""
    return _parse(data)[0]


def _had_lone_surrogate(data: bytes | bytearray, custom_id: str) -> bool:
    """Whether ``custom_id`` (read with U+FFFD for lone surrogates) held one: parsed again with
    another replacement, it differs."""
    if "\ufffd" not in custom_id:
        return False
    other = orjson.loads(_replace_lone_surrogates(data, rb"\u0000"))
    return other.get("custom_id") != custom_id


# --------------------------------------------------------------------------------------------------
# Prompt text per endpoint


def _add_text(parts: list[str], value: Any) -> int:
    """Append ``value``'s text to ``parts``; return extra bytes for token-id lists (4 bytes per id)."""
    if isinstance(value, str):
        parts.append(value)
        return 0
    if isinstance(value, list):
        extra = 0
        for item in value:
            if isinstance(item, str):
                parts.append(item)
            elif isinstance(item, int):  # a list of token ids
                extra += BYTES_PER_TOKEN
            elif isinstance(item, list):  # a list of token-id lists
                extra += BYTES_PER_TOKEN * sum(1 for t in item if isinstance(t, int))
        return extra
    return 0


def _add_content(parts: list[str], content: Any) -> None:
    """Append a chat/responses message ``content``: a string, or the ``text`` of each content part."""
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str):
                    parts.append(text)
            elif isinstance(part, str):
                parts.append(part)


def _add_messages(parts: list[str], messages: Any) -> None:
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict):
                _add_content(parts, message.get("content"))


def prompt_bytes(endpoint: str, body: dict[str, Any]) -> tuple[bytes, int]:
    """Return ``(text, size)``: a request's prompt text as UTF-8 and its size in bytes.

    The prompt text per ``endpoint``, pieces joined with ``"\\n"``:

    - ``/v1/chat/completions``: each message's ``content`` in order (a string, or the ``text`` of
      each part of a list content; image/audio parts add nothing);
    - ``/v1/completions``: ``prompt`` (a string or a list of strings);
    - ``/v1/embeddings`` and ``/v1/moderations``: ``input`` (a string or a list of strings);
    - ``/v1/responses``: ``instructions`` then ``input`` (a string or a list of messages);
    - any other endpoint: the compact JSON of ``body``.

    Token-id lists (``[1, 2, 3]`` or lists of them) add no text but count 4 bytes per id to ``size``,
    so ``ceil(size / 4)`` gives back one token per id. Fields of the wrong type add nothing: the engine
    answers such a request with its own 400 later, as OpenAI does. Never raises.
    """
    parts: list[str] = []
    extra = 0
    if endpoint == "/v1/chat/completions":
        _add_messages(parts, body.get("messages"))
    elif endpoint == "/v1/completions":
        extra = _add_text(parts, body.get("prompt"))
    elif endpoint in ("/v1/embeddings", "/v1/moderations"):
        extra = _add_text(parts, body.get("input"))
    elif endpoint == "/v1/responses":
        instructions = body.get("instructions")
        if isinstance(instructions, str):
            parts.append(instructions)
        items = body.get("input")
        if isinstance(items, str):
            parts.append(items)
        elif isinstance(items, list):
            for item in items:
                if isinstance(item, dict):
                    _add_content(parts, item.get("content"))
                elif isinstance(item, str):
                    parts.append(item)
    else:
        try:
            text = orjson.dumps(body)
        except TypeError:  # nesting deeper than orjson serialises (254); loads allows 1,024
            text = b""
        return text, len(text)
    text = "\n".join(parts).encode("utf-8", "surrogatepass")
    return text, len(text) + extra


# --------------------------------------------------------------------------------------------------
# Line splitting


def _with_head(chunks: Iterable[bytes], size: int) -> Iterator[bytes]:
    """Yield ``chunks`` as bytes, the first one holding at least ``size`` bytes (unless the data is
    shorter), so a BOM split across tiny chunks is still seen whole."""
    head = b""
    it = iter(chunks)
    for chunk in it:
        head += bytes(chunk)
        if len(head) >= size:
            break
    if head:
        yield head
    for chunk in it:
        yield chunk if type(chunk) is bytes else bytes(chunk)


class _TooLong:
    """Marker for a line longer than ``max_line_bytes`` (its bytes were counted, not kept)."""

    __slots__ = ()


_TOO_LONG = _TooLong()


def _lines(
    chunks: Iterable[bytes], max_line_bytes: int, counter: list[int]
) -> Iterator[tuple[int, int, bytes | bytearray | _TooLong, int]]:
    """Yield ``(line_no, offset, data, length)`` for each line of the file.

    ``data`` is the line without its terminator (``\\n``, or ``\\r\\n``), or ``_TOO_LONG`` when the line
    exceeds ``max_line_bytes``; ``length`` is its byte length. ``counter[0]`` is kept equal to the
    bytes consumed so far.
    """
    line_no = 0
    base = 0  # file offset of chunk[0]
    pending = bytearray()  # the start of a line that spans chunks
    pending_len = 0  # bytes of the current line seen so far (kept or not)
    pending_offset = 0
    pending_last = 0  # last byte of the pending part (to drop a CR split from its LF)
    overflow = False
    limit = max_line_bytes + 1  # allow for the CR of a CRLF not seen yet
    first = True
    for chunk in _with_head(chunks, len(_BOM)):
        n = len(chunk)
        counter[0] += n
        pos = 0
        if first:
            first = False
            if chunk.startswith(_BOM):
                pos = len(_BOM)
        find = chunk.find
        while True:
            nl = find(b"\n", pos)
            if nl < 0:
                if pos < n:
                    if not pending_len:
                        pending_offset = base + pos
                    rest = n - pos
                    pending_len += rest
                    pending_last = chunk[n - 1]
                    if not overflow:
                        if pending_len > limit:
                            overflow = True
                            pending.clear()
                        else:
                            pending += chunk[pos:] if pos else chunk
                break
            line_no += 1
            if pending_len:
                offset = pending_offset
                total = pending_len + (nl - pos)
                last = chunk[nl - 1] if nl > pos else pending_last
                length = total - 1 if last == 13 else total
                if overflow or length > max_line_bytes:
                    yield line_no, offset, _TOO_LONG, length
                else:
                    pending += chunk[pos:nl]
                    if last == 13:
                        del pending[-1]
                    yield line_no, offset, pending, length
                pending = bytearray()
                pending_len = 0
                overflow = False
            else:
                end = nl - 1 if nl > pos and chunk[nl - 1] == 13 else nl
                length = end - pos
                if length > max_line_bytes:
                    yield line_no, base + pos, _TOO_LONG, length
                else:
                    yield line_no, base + pos, chunk[pos:end], length
            pos = nl + 1
        base += n
    if pending_len:  # last line without a final newline
        line_no += 1
        if overflow or pending_len > max_line_bytes:
            yield line_no, pending_offset, _TOO_LONG, pending_len
        else:
            yield line_no, pending_offset, pending, pending_len


# --------------------------------------------------------------------------------------------------
# Line checks


class _Checker:
    """Per-line checks and the state they share (seen custom_ids, the file's model)."""

    __slots__ = ("endpoint", "max_errors", "max_output_tokens", "report", "seen", "failed")

    def __init__(self, endpoint: str, max_errors: int, max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS) -> None:
        self.endpoint = endpoint
        self.max_errors = max_errors
        self.max_output_tokens = max_output_tokens
        self.report = ValidationReport()
        self.seen: set[str] = set()
        self.failed = False

    def error(self, code: str, message: str, line: int | None, param: str | None) -> None:
        report = self.report
        if not self.failed:
            self.failed = True
            report.requests = []  # a failed file runs nothing: free the rows early
        if len(report.errors) < self.max_errors:
            report.errors.append(LineError(code, message, line, param))

    @property
    def full(self) -> bool:
        return len(self.report.errors) >= self.max_errors

    def check(self, line_no: int, offset: int, data: bytes | bytearray, length: int) -> None:
        """Check one non-blank line; append a request or an error (at most one error per line)."""
        try:
            obj, replaced = _parse(data)
        except orjson.JSONDecodeError:
            self.error("invalid_json_line", _MSG_INVALID_JSON, line_no, None)
            return
        if type(obj) is not dict:
            self.error("invalid_json_line", _MSG_INVALID_JSON, line_no, None)
            return

        custom_id: Any = obj.get("custom_id")  # JSON values stay untyped until checked
        if problem := _wrong_type(custom_id, str, "custom_id"):
            self.error("invalid_request", problem, line_no, "custom_id")
            return
        if not custom_id:
            self.error("invalid_request", "Invalid 'custom_id': empty string. Expected a string with minimum "
                       "length 1, but got an empty string instead.", line_no, "custom_id")
            return
        if replaced and _had_lone_surrogate(data, custom_id):
            self.error("invalid_request", "Invalid value for 'custom_id': it holds a lone UTF-16 surrogate "
                       "escape, which is not Unicode text.", line_no, "custom_id")
            return
        seen = self.seen
        if custom_id in seen:
            self.error(
                "duplicate_custom_id",
                f"The custom_id '{_clip(custom_id)}' for this request is a duplicate of another request. "
                "The custom_id parameter must be unique for each request in a batch.",
                line_no,
                "custom_id",
            )
            return
        seen.add(custom_id)

        method = obj.get("method")
        if method != "POST":
            if method is None:
                message = "Missing required parameter: 'method'."
            else:
                message = f"Invalid value for 'method': {_show(method)}. Only 'POST' is supported."
            self.error("invalid_request", message, line_no, "method")
            return

        url = obj.get("url")
        if url is None:
            self.error("invalid_request", "Missing required parameter: 'url'.", line_no, "url")
            return
        if url != self.endpoint:
            self.error(
                "url_mismatch",
                f"The URL {_show(url)} of this request does not match the batch endpoint "
                f"'{self.endpoint}'. Every line's 'url' must equal the endpoint of the batch.",
                line_no,
                "url",
            )
            return

        body: Any = obj.get("body")
        if problem := _wrong_type(body, dict, "body"):
            self.error("invalid_request", problem, line_no, "body")
            return
        model = body.get("model")
        if problem := _wrong_type(model, str, "body.model"):
            self.error("invalid_request", problem, line_no, "body.model")
            return
        report = self.report
        if report.model is None:
            report.model, report.model_line = model, line_no
        elif model != report.model:
            self.error(
                "model_mismatch",
                f"The model '{_clip(model)}' for this request does not match the rest of the batch. "
                "Each batch must contain requests for a single model.",
                line_no,
                "body.model",
            )
            return
        if body.get("stream") is True:
            self.error(
                "invalid_request",
                "Streaming is not supported in batch requests: 'body.stream' must not be true.",
                line_no,
                "body.stream",
            )
            return
        if "priority" in body:  # vLLM's scheduling priority: the router's alone (router.parsing)
            self.error("invalid_request", "Unrecognized request argument supplied: priority", line_no,
                       "body.priority")
            return
        if limit := self._output_problem(body):
            self.error("invalid_request", limit[1], line_no, limit[0])
            return

        text, size = prompt_bytes(self.endpoint, body)
        est = -(-size // BYTES_PER_TOKEN)
        report.est_tokens += est
        if not self.failed:
            report.requests.append(
                RequestLine(custom_id, line_no, offset, length, text[:PREFIX_KEY_BYTES], est)
            )


    def _output_problem(self, body: dict[str, Any]) -> tuple[str, str] | None:
        """``(param, message)`` for a body whose ``n`` or output-token limits are out of bounds."""
        n = body.get("n")
        if n is not None:
            if problem := _not_integer(n, 1, MAX_N, "n"):
                return "body.n", problem
        else:
            n = 1
        for name in OUTPUT_TOKEN_FIELDS:
            tokens = body.get(name)
            if tokens is None:
                continue
            if problem := _not_integer(tokens, 1, None, name):
                return f"body.{name}", problem
            if n * tokens > self.max_output_tokens:
                return f"body.{name}", (
                    f"Invalid '{name}': n × {name} is {n * tokens:,} tokens, over the limit of "
                    f"{self.max_output_tokens:,} output tokens per request; lower 'n' or '{name}'.")
        return None


def _not_integer(value: Any, low: int, high: int | None, name: str) -> str | None:
    """OpenAI's message for an integer parameter ``name`` that is not an integer in
    ``[low, high]``, or None."""
    if type(value) is not int:
        return f"Invalid type for '{name}': expected an integer, but got {json_type_name(value)} instead."
    if value < low:
        return f"Invalid '{name}': integer below minimum value. Expected a value >= {low}, but got {value} instead."
    if high is not None and value > high:
        return (f"Invalid '{name}': integer above maximum value. Expected a value <= {high}, but got {value} "
                "instead.")
    return None


def _wrong_type(value: Any, expected: type, param: str) -> str | None:
    """Say what is wrong with a required field (missing, not of JSON type ``expected``, or a string
    holding NUL, which PostgreSQL text cannot store), or None."""
    if type(value) is expected:
        if isinstance(value, str) and "\x00" in value:
            return f"Invalid value for '{param}': NUL characters are not allowed."
        return None
    if value is None:
        return f"Missing required parameter: '{param}'."
    want = "an object" if expected is dict else "a string"
    return f"Invalid type for '{param}': expected {want}, but got {json_type_name(value)}."


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def _show(value: Any) -> str:
    """Quote a user value for a message, clipped so a hostile value cannot bloat the error."""
    if isinstance(value, str):
        return f"'{_clip(value)}'"
    return json_type_name(value)


def model_not_found(model: str, line: int | None, served: Iterable[str]) -> LineError:
    """The ``errors.data[]`` entry of a batch whose ``model`` (first seen on ``line``) no engine of
    the fleet serves; the message lists what is served (sorted, the first 20)."""
    names = sorted(served)
    shown = ", ".join(f"'{_clip(n)}'" for n in names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
    return LineError("model_not_found", f"The model '{_clip(model)}' does not exist or is not served by any engine "
                     f"of this deployment; models served now: {shown or 'none'}.", line, "body.model")


# --------------------------------------------------------------------------------------------------
# Entry point


def validate_batch_file(
    chunks: Iterable[bytes],
    *,
    endpoint: str,
    max_requests: int = 50_000,
    max_errors: int = 100,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS,
    served_endpoints: Collection[str] = ROUTED_ENDPOINTS,
) -> ValidationReport:
    """Validate a batch input file given as byte chunks; return a :class:`ValidationReport`.

    ``chunks``: any iterable of ``bytes`` (or bytes-like) pieces of the file, in order, of any sizes
    (e.g. 1 MiB reads). ``endpoint``: the batch's endpoint, e.g. ``"/v1/chat/completions"``; every
    line's ``url`` must equal it. ``max_requests``: OpenAI's 50,000 requests per batch; one more gives
    a single ``too_many_tasks`` error and stops reading. ``max_errors``: errors kept (OpenAI-style
    ``errors.data`` stays short); reading stops once that many are found. ``max_line_bytes``: longest
    accepted line without its terminator (default :data:`DEFAULT_MAX_LINE_BYTES`, 32 MiB); a longer
    line is an ``invalid_request`` error and is never buffered whole. ``max_output_tokens``: the most
    ``n`` × output-token limit one line may ask for (default :data:`DEFAULT_MAX_OUTPUT_TOKENS`).
    ``served_endpoints``: the endpoints the platform serves; for any other ``endpoint`` the report
    holds one ``invalid_request`` error (param ``endpoint``) and the file is not read.

    Each line gets at most one error, the first check it fails in the order listed in the module
    docstring. Never raises for any file content; only errors raised by ``chunks`` itself propagate.
    Memory: O(longest accepted line + number of requests).
    """
    if max_requests < 1 or max_errors < 1 or max_line_bytes < 1 or max_output_tokens < 1:
        raise ValueError("max_requests, max_errors, max_line_bytes and max_output_tokens must be positive")
    checker = _Checker(endpoint, max_errors, max_output_tokens)
    report = checker.report
    if endpoint not in served_endpoints:
        checker.error("invalid_request", f"This platform does not serve the endpoint {_show(endpoint)}: no engine "
                      "answers it. Supported endpoints are: " + ", ".join(f"'{e}'" for e in served_endpoints) + ".",
                      None, "endpoint")
        return report
    counter = [0]
    request_lines = 0
    for line_no, offset, data, length in _lines(chunks, max_line_bytes, counter):
        if isinstance(data, _TooLong):
            is_request = True
        else:
            # A request line starts with '{' in practice; anything else may be blank.
            is_request = bool(data) and (data[0] == 0x7B or bool(data.strip(_BLANK)))
        if not is_request:
            continue
        request_lines += 1
        if request_lines > max_requests:
            checker.error(
                "too_many_tasks",
                f"The batch input file has more than the maximum of {max_requests:,} requests "
                "allowed per batch.",
                line_no,
                None,
            )
            break
        if data is _TOO_LONG:
            checker.error(
                "invalid_request",
                f"This line is {length:,} bytes long; a batch request line may be at most "
                f"{max_line_bytes:,} bytes.",
                line_no,
                None,
            )
        else:
            checker.check(line_no, offset, data, length)  # type: ignore[arg-type]
        if checker.full:
            break
    else:
        if request_lines == 0:
            checker.error("empty_file", "The batch input file does not contain any requests.", None, None)
    report.bytes_read = counter[0]
    return report
